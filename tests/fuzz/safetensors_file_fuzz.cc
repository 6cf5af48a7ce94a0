// tests/fuzz: a .safetensors file (8-byte header length, JSON header, data), opened and every
// tensor read back.
#include "core/safetensors.h"
#include "tests/fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace infinigen;
  const std::string path = fuzz::write_scratch("model.safetensors", fuzz::as_text(data, size));
  fuzz::expect_clean([&] {
    const auto file = SafetensorsFile::open(path);
    size_t sum = 0;
    for (const SafetensorsEntry& entry : file->entries()) {
      const auto* bytes = static_cast<const unsigned char*>(file->bytes(entry));
      for (size_t i = 0; i < entry.nbytes; ++i) sum += bytes[i];  // every byte must be mapped
    }
    return sum;
  });
  return 0;
}
