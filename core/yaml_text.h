// core: the text of YAML nodes that must be plain scalars (mapping keys, list elements), for the
// hand-written readers of YAML files (experiments, hardware profiles, --config). yaml-cpp throws
// its own "bad conversion" for a key that is a list, a map or empty; these refuse such a node
// with one line naming the file and the line instead.
#pragma once

#include <yaml-cpp/yaml.h>

#include <string>
#include <string_view>

namespace infinigen {

// The text of a mapping key. `source` names the file in the error.
std::string yaml_key(const YAML::Node& key, std::string_view source);

// The text of a scalar node; `what` says what it is in the error ("option 'batch'").
std::string yaml_scalar_text(const YAML::Node& node, std::string_view what,
                             std::string_view source);

}  // namespace infinigen
