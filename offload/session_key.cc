// offload: a session's key, from the model, the policy and its options.
#include "offload/session_key.h"

#include <sstream>

#include "core/error.h"
#include "core/file_io.h"
#include "core/safetensors.h"
#include "offload/kv_policy.h"

namespace infinigen {

SessionKey session_key(const ModelSource& source, const OffloadOptions& options, DType kv_dtype,
                       Device device) {
  const KvPolicy& policy = kv_policy(options.policy);
  if (!policy.resumable) {
    std::string resumable;  // the policies that can, as help texts list them
    for (const KvPolicy* p : kv_policies()) {
      if (p->resumable) resumable += (resumable.empty() ? "" : ", ") + p->name;
    }
    fail(option("policy"), " ", policy.name,
         " cannot keep a session (its store is not saved yet); use one of ", resumable);
  }
  INFINIGEN_CHECK(device == Device::Cpu || policy.host_token_rows, "a session on ",
                  option("device"), " cuda needs a policy whose rows it can read in host memory; ",
                  policy.name, " keeps them on the device");
  const ModelConfig& c = source.config;
  std::ostringstream text;
  text << "family=" << c.family << " layers=" << c.num_layers << " hidden=" << c.hidden_size
       << " heads=" << c.num_heads << " kv_heads=" << c.kv_heads() << " head_dim=" << c.head_dim()
       << " ffn=" << c.ffn_dim << " vocab=" << c.vocab_size << " positions=" << c.max_positions
       << " dtype=" << dtype_name(c.dtype) << "\n";
  if (source.directory.empty()) {
    text << "synthetic seed=" << source.seed << "\n";
  } else {
    const SafetensorsCheckpoint checkpoint = SafetensorsCheckpoint::open(source.directory);
    for (const std::string& name : checkpoint.names()) {
      const SafetensorsEntry& entry = checkpoint.entry(name);
      text << name << " " << dtype_name(entry.dtype) << " " << shape_string(entry.shape) << "\n";
    }
  }
  SessionKey key;
  key.model = c.name;
  key.identity = hex32(crc32_of(text.str()));
  key.policy = policy.name;
  key.kv_dtype = kv_dtype;
  for (const std::string& name : policy.session_options) {
    const auto* spec = find_option(offload_option_table(), name);
    key.options.emplace_back(name, spec->format(options));
    key.option_defaults.push_back(spec->format(OffloadOptions{}));
  }
  key.num_layers = c.num_layers;
  key.kv_heads = c.kv_heads();
  return key;
}

}  // namespace infinigen
