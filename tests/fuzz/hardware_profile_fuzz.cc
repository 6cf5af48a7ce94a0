// tests/fuzz: a hardware profile (configs/hardware/*.yaml) for the cost model.
#include "predict/hardware_profile.h"
#include "tests/fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace infinigen;
  const std::string text(fuzz::as_text(data, size));
  fuzz::expect_clean([&] {
    const HardwareProfile profile = parse_hardware_profile(text, "fuzz.yaml");
    (void)hardware_profile_yaml(profile);
  });
  return 0;
}
