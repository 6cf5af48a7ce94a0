// tests/fuzz: a byte-level BPE tokenizer's vocab.json and merges.txt (the input split at its
// first NUL byte), then encoding and decoding through it.
#include <algorithm>

#include "core/tokenizer.h"
#include "tests/fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace infinigen;
  const std::string_view input = fuzz::as_text(data, size);
  const size_t split = std::min(input.find('\0'), input.size());
  const std::string_view vocab = input.substr(0, split);
  const std::string_view merges = split < input.size() ? input.substr(split + 1) : "";
  fuzz::expect_clean([&] {
    const Tokenizer tokenizer = Tokenizer::from_strings(vocab, merges, "fuzz");
    for (std::string_view text : {std::string_view("The Python interpreter, 1611 ÄÖ \xff\xfe"),
                                  merges.substr(0, 256)}) {
      std::vector<int32_t> ids = tokenizer.encode(text);
      ids.push_back(-1);  // out of range: rendered, not read
      ids.push_back(1 << 30);
      (void)tokenizer.decode(ids);
      (void)tokenizer.decode(ids, false);
    }
  });
  return 0;
}
