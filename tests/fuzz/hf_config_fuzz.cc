// tests/fuzz: a checkpoint's config.json as the loader reads it.
#include "core/model_config.h"
#include "tests/fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace infinigen;
  fuzz::write_scratch("config.json", fuzz::as_text(data, size));
  fuzz::expect_clean([&] {
    const ModelConfig config = load_hf_config(fuzz::scratch_directory().string());
    (void)config.weight_bytes();
  });
  return 0;
}
