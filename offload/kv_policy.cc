// offload: the registration list of the KV policies, and lookup by name.
#include "offload/kv_policy.h"

#include "offload/full_kv.h"
#include "offload/gpu_kv.h"
#include "offload/h2o_kv.h"
#include "offload/infinigen_kv.h"
#include "offload/int4_kv.h"

namespace infinigen {

const std::vector<const KvPolicy*>& kv_policies() {
  static const std::vector<const KvPolicy*> policies = {&infinigen_kv_policy(), &full_kv_policy(),
                                                        &int4_kv_policy(), &h2o_kv_policy(),
                                                        &gpu_kv_policy()};
  return policies;
}

const KvPolicy& kv_policy(std::string_view name) {
  std::string names;
  const std::vector<const KvPolicy*>& all = kv_policies();
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i]->name == name) return *all[i];
    names += (i == 0 ? "" : i + 1 == all.size() ? " or " : ", ") + all[i]->name;
  }
  fail(option("policy"), ": unknown policy '", name, "' (expected ", names, ")");
}

}  // namespace infinigen
