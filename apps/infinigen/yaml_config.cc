// apps/infinigen: YAML configuration files for CLI11 (yaml-cpp).
#include "apps/infinigen/yaml_config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <memory>
#include <sstream>

#include "core/error.h"
#include "core/yaml_text.h"

namespace infinigen::cli {

std::string YamlConfig::to_config(const CLI::App* app, bool default_also, bool, std::string) const {
  YAML::Emitter out;
  out << YAML::BeginMap;
  for (const CLI::Option* option : app->get_options()) {
    if (option->get_lnames().empty() || option->get_configurable() == false) continue;
    std::string value = option->as<std::string>();
    if (value.empty() && default_also) value = option->get_default_str();
    if (value.empty()) continue;
    out << YAML::Key << option->get_lnames().front() << YAML::Value << value;
  }
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::vector<CLI::ConfigItem> YamlConfig::from_config(std::istream& input) const {
  YAML::Node root;
  try {
    root = YAML::Load(input);
  } catch (const YAML::Exception& e) {
    fail("--config: not valid YAML (", e.what(), ")");
  }
  std::vector<CLI::ConfigItem> parsed;
  if (root.IsNull()) return parsed;
  std::vector<std::string> parents;
  for (const CLI::App* sub : root_->get_subcommands()) parents.push_back(sub->get_name());
  INFINIGEN_CHECK(root.IsMap(), "--config: expected a mapping of option names to values");
  for (const auto& entry : root) {
    CLI::ConfigItem item;
    item.parents = parents;
    // Keys as in experiment files (kv_pool_limit) or as flags without dashes (kv-pool-limit).
    item.name = yaml_key(entry.first, "--config");
    std::replace(item.name.begin(), item.name.end(), '_', '-');
    const YAML::Node& value = entry.second;
    const std::string what = "option '" + item.name + "'";
    if (value.IsSequence()) {
      for (const auto& element : value)
        item.inputs.push_back(yaml_scalar_text(element, "each value of " + what, "--config"));
    } else if (value.IsScalar()) {
      item.inputs.push_back(value.Scalar());
    } else {
      fail("--config: option '", item.name, "' must be a value or a list of values");
    }
    parsed.push_back(std::move(item));
  }
  return parsed;
}

void add_yaml_config_option(CLI::App& app) {
  app.config_formatter(std::make_shared<YamlConfig>(&app));
  app.allow_config_extras(CLI::config_extras_mode::error);
  app.set_config("--config", "", "Read options from a YAML file (command line wins)")
      ->check(CLI::ExistingFile);
}

}  // namespace infinigen::cli
