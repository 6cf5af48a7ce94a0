// tests/fuzz: a tokenizer.json, an optional tokenizer_config.json and a text (the input split at
// its first two NUL bytes), then encoding and decoding the text and fixed ones through it.
#include <algorithm>
#include <array>

#include "core/tokenizer.h"
#include "tests/fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace infinigen;
  std::string_view rest = fuzz::as_text(data, size);
  std::array<std::string_view, 3> parts;  // tokenizer.json, tokenizer_config.json, text
  for (size_t i = 0; i < parts.size(); ++i) {
    const size_t split =
        i + 1 < parts.size() ? std::min(rest.find('\0'), rest.size()) : rest.size();
    parts[i] = rest.substr(0, split);
    rest = split < rest.size() ? rest.substr(split + 1) : std::string_view();
  }
  const std::optional<std::string_view> config =
      parts[1].empty() ? std::nullopt : std::optional(parts[1]);
  fuzz::expect_clean([&] {
    const Tokenizer tokenizer = Tokenizer::from_json(parts[0], config, "fuzz");
    for (std::string_view text :
         {parts[2],
          std::string_view("The Python interpreter, 1611 \xC3\x84\xC3\x96 \xff\xfe  \r\n"),
          std::string_view("<s>It's 12345 caf\x65\xCC\x81 \xE2\x96\x81 x")}) {
      std::vector<int32_t> ids = tokenizer.encode(text);
      ids.push_back(-1);  // out of range: rendered, not read
      ids.push_back(1 << 30);
      ids.push_back(tokenizer.vocab_size() - 1);
      (void)tokenizer.decode(ids);
      (void)tokenizer.decode(ids, false);
    }
    (void)tokenizer.bos_id();
    (void)tokenizer.eos_id();
  });
  return 0;
}
