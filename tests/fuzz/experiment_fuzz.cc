// tests/fuzz: an experiment file (configs/experiments/*.yaml) for `infinigen bench`.
#include "bench/experiment.h"
#include "tests/fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace infinigen;
  const std::string text(fuzz::as_text(data, size));
  fuzz::expect_clean([&] { (void)parse_experiment(text, "fuzz.yaml", "fuzz"); });
  return 0;
}
