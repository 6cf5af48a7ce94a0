// tests/fuzz: a --config YAML file, read as the CLI reads it for a subcommand with options of
// each kind (integer, real, string, flag, list) and every option of the offload table (numbers,
// whole numbers, choices, a switch) as `run` registers them.
#include <CLI/CLI.hpp>
#include <sstream>

#include "apps/infinigen/option_flags.h"
#include "apps/infinigen/yaml_config.h"
#include "offload/offload_options.h"
#include "tests/fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace infinigen;
  const std::string text(fuzz::as_text(data, size));
  fuzz::expect_clean([&] {
    CLI::App app("fuzz");
    cli::add_yaml_config_option(app);
    CLI::App* run = app.add_subcommand("run");
    int64_t batch = 0;
    bool stats = false;
    std::vector<std::string> texts;
    run->add_option("--batch", batch);
    run->add_flag("--stats", stats);
    run->add_option("--text", texts);
    OffloadOptions offload;
    cli::add_option_flags(*run, offload_option_table(), offload);
    const std::string config = fuzz::write_scratch("run.yaml", text);
    try {
      app.parse("--config " + config + " run");
    } catch (const CLI::ParseError& e) {
      // CLI11's own refusals (an unknown option, a value of the wrong type) are printed by
      // app.exit as one line, as in main.
      (void)e;
    }
  });
  return 0;
}
