// tests/fuzz: a session's manifest.json (offload/session.h), opened as `run --resume` opens it and
// as `session compact` does.
// The input's checksum field is set to the checksum of the rest whenever the input is a JSON
// object, so that fuzzing reaches the checks behind it instead of stopping at a mismatch.
#include <zlib.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "offload/session.h"
#include "tests/fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace infinigen;
  std::string text(fuzz::as_text(data, size));
  try {
    nlohmann::json manifest = nlohmann::json::parse(text);
    if (manifest.is_object()) {
      manifest.erase("checksum");
      const std::string rest = manifest.dump();
      char crc[9];
      std::snprintf(crc, sizeof crc, "%08lx",
                    crc32(0L, reinterpret_cast<const Bytef*>(rest.data()),
                          static_cast<uInt>(rest.size())));
      manifest["checksum"] = crc;
      text = manifest.dump(1);
    }
  } catch (const nlohmann::json::exception&) {
    // Not JSON (or not dumpable): opened as it is.
  }
  fuzz::write_scratch("manifest.json", text);
  SessionKey key;
  key.model = "fuzz";
  key.identity = "00000000";
  key.policy = "full";
  key.num_layers = 2;
  key.kv_heads = 2;
  fuzz::expect_clean([&] { (void)DiskSession::open(fuzz::scratch_directory(), key); });
  // As `infinigen session compact` opens it, whatever its key.
  fuzz::expect_clean([&] { (void)read_saved_session(fuzz::scratch_directory()); });
  return 0;
}
