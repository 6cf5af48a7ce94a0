// core: the registry of model families.
#include "core/model_family.h"

#include <algorithm>

#include "core/error.h"
#include "core/models/llama.h"
#include "core/models/opt.h"

namespace infinigen {

const std::vector<const ModelFamily*>& model_families() {
  static const std::vector<const ModelFamily*> families = {&opt_family(), &llama_family()};
  return families;
}

const ModelFamily& model_family(const std::string& name) {
  for (const ModelFamily* family : model_families()) {
    if (family->name == name) return *family;
  }
  fail("no model family '", name, "'");
}

const ModelFamily* model_family_of_type(const std::string& model_type) {
  for (const ModelFamily* family : model_families()) {
    const auto& types = family->model_types;
    if (std::find(types.begin(), types.end(), model_type) != types.end()) return family;
  }
  return nullptr;
}

}  // namespace infinigen
