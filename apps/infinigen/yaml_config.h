// apps/infinigen: --config FILE.yaml for CLI11. Top-level keys are long option names of the
// chosen subcommand without dashes (`batch: 8`, `prompt-len: 512`); lists give repeated values.
// Flags on the command line win over the file.
//
// The option lives on the root app (subcommands fall through to it): CLI11 reads config files
// only for the root, after the whole command line is parsed, so the formatter can route every
// key to the subcommand that was chosen.
#pragma once

#include <CLI/CLI.hpp>
#include <istream>
#include <string>
#include <vector>

namespace infinigen::cli {

class YamlConfig : public CLI::Config {
 public:
  explicit YamlConfig(const CLI::App* root) : root_(root) {}
  std::string to_config(const CLI::App* app, bool default_also, bool write_description,
                        std::string prefix) const override;
  std::vector<CLI::ConfigItem> from_config(std::istream& input) const override;

 private:
  const CLI::App* root_;
};

// Adds `--config FILE.yaml` to the root app `app`.
void add_yaml_config_option(CLI::App& app);

}  // namespace infinigen::cli
