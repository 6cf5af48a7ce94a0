// core: the text of YAML scalars, refusing lists, maps and empty nodes with one line.
#include "core/yaml_text.h"

#include "core/error.h"

namespace infinigen {
namespace {

// "line N" of a node, or nothing when yaml-cpp did not record where the node came from.
std::string where(const YAML::Node& node) {
  const YAML::Mark mark = node.Mark();
  if (mark.is_null()) return "";
  return cat(" (line ", mark.line + 1, ")");
}

}  // namespace

std::string yaml_key(const YAML::Node& key, std::string_view source) {
  INFINIGEN_CHECK(key.IsScalar(), source, where(key),
                  ": a key must be plain text, not a list, a map or empty");
  return key.Scalar();
}

std::string yaml_scalar_text(const YAML::Node& node, std::string_view what,
                             std::string_view source) {
  INFINIGEN_CHECK(node.IsScalar(), source, where(node), ": ", what,
                  " must be a single value, not a list, a map or empty");
  return node.Scalar();
}

}  // namespace infinigen
