// tests/fuzz: a sharded checkpoint's model.safetensors.index.json, next to one valid shard.
#include <filesystem>

#include "core/safetensors.h"
#include "tests/fuzz/fuzz_input.h"

namespace {

// A directory with one valid shard; the index is rewritten for each input.
const std::string& checkpoint_directory() {
  static const std::string dir = [] {
    const auto path = infinigen::fuzz::scratch_directory() / "sharded";
    std::filesystem::create_directories(path);
    infinigen::Tensor t = infinigen::Tensor::empty({2, 3}, infinigen::DType::F32);
    for (int64_t i = 0; i < 6; ++i) t.data<float>()[i] = static_cast<float>(i);
    infinigen::write_safetensors((path / "model-00001-of-00001.safetensors").string(),
                                 {{"decoder.weight", t}});
    return path.string();
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace infinigen;
  const std::string& dir = checkpoint_directory();
  const std::filesystem::path index = std::filesystem::path(dir) / "model.safetensors.index.json";
  std::ofstream(index, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  fuzz::expect_clean([&] {
    const SafetensorsCheckpoint checkpoint = SafetensorsCheckpoint::open(dir);
    for (const std::string& name : checkpoint.names()) (void)checkpoint.load(name);
  });
  return 0;
}
