// core: the Tokenizer, and its GPT-2 / OPT form read from vocab.json + merges.txt.
#include "core/tokenizer.h"

#include <array>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <unordered_set>
#include <utility>

#include "core/error.h"
#include "core/resources.h"
#include "core/tokenizer_pipeline.h"

namespace infinigen {
namespace {

using tokenizer_detail::Pipeline;

// Ids that decode() skips in the vocab.json form, which has no added-token list to say so.
const std::unordered_set<std::string> kSpecialTokens = {"<s>", "<pad>", "</s>", "<unk>"};

// What the engine puts first in the vocab.json form: OPT's BOS, which is also its EOS.
constexpr std::string_view kGpt2BosEos = "</s>";

void load_vocab(std::string_view json_text, const std::string& source, Pipeline& pipeline) {
  const std::string file = source + "/vocab.json";
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    fail(file, ": malformed JSON: ", e.what());
  }
  pipeline.model.load_vocabulary(root, file);
}

void load_merges(std::string_view text, const std::string& source, Pipeline& pipeline) {
  const std::string file = source + "/merges.txt";
  size_t line_number = 0;
  size_t begin = 0;
  uint32_t rank = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(begin, end - begin);
    begin = end + 1;
    ++line_number;
    if (line.ends_with('\r')) line.remove_suffix(1);
    if (line.empty()) continue;
    if (line_number == 1 && line.starts_with("#version")) continue;

    std::vector<std::string_view> parts;
    size_t start = 0;
    while (true) {
      const size_t space = line.find(' ', start);
      parts.push_back(line.substr(start, space - start));
      if (space == std::string_view::npos) break;
      start = space + 1;
    }
    if (parts.size() != 2) {
      fail(file, ":", line_number, ": expected two tokens separated by one space, found ",
           parts.size(), " parts: ", tokenizer_detail::quoted(line));
    }
    if (const auto problem = pipeline.model.add_merge(parts[0], parts[1], rank++)) {
      fail(file, ":", line_number, ": ", *problem);
    }
  }
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_strings(std::string_view vocab_json, std::string_view merges_txt,
                                  const std::string& source) {
  auto impl = std::make_unique<Impl>();
  Pipeline& pipeline = impl->pipeline;
  load_vocab(vocab_json, source, pipeline);
  load_merges(merges_txt, source, pipeline);
  pipeline.pre_tokenizers.emplace_back(
      tokenizer_detail::ByteLevelPreTokenizer{.add_prefix_space = false, .use_regex = true});
  pipeline.decoders = std::vector<tokenizer_detail::Decoder>{tokenizer_detail::ByteLevelDecoder{}};
  pipeline.finish(kSpecialTokens);
  pipeline.bos = pipeline.eos = pipeline.token_to_id(kGpt2BosEos);
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_json(std::string_view tokenizer_json,
                               std::optional<std::string_view> tokenizer_config_json,
                               const std::string& source) {
  auto impl = std::make_unique<Impl>();
  tokenizer_detail::load_tokenizer_json(tokenizer_json, source + "/tokenizer.json", impl->pipeline);
  if (tokenizer_config_json) {
    tokenizer_detail::apply_tokenizer_config(*tokenizer_config_json,
                                             source + "/tokenizer_config.json", impl->pipeline,
                                             /*bos_token_sets_bos=*/false);
  }
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_directory(const std::string& directory) {
  std::error_code ec;
  if (!std::filesystem::is_directory(directory, ec)) {
    fail(directory,
         ": no such tokenizer directory (expected tokenizer.json, or vocab.json and merges.txt, "
         "in it)");
  }
  std::string source = directory;
  while (source.size() > 1 && source.back() == '/') source.pop_back();
  const std::filesystem::path dir(source);
  std::optional<std::string> config;
  if (std::filesystem::exists(dir / "tokenizer_config.json", ec)) {
    config = tokenizer_detail::read_file(dir / "tokenizer_config.json");
  }
  if (std::filesystem::exists(dir / "tokenizer.json", ec)) {
    const std::string json = tokenizer_detail::read_file(dir / "tokenizer.json");
    return from_json(json, config, source);
  }
  const std::string vocab_json = tokenizer_detail::read_file(dir / "vocab.json");
  const std::string merges_txt = tokenizer_detail::read_file(dir / "merges.txt");
  Tokenizer tokenizer = from_strings(vocab_json, merges_txt, source);
  if (config) {
    tokenizer_detail::apply_tokenizer_config(*config, source + "/tokenizer_config.json",
                                             tokenizer.impl_->pipeline,
                                             /*bos_token_sets_bos=*/true);
  }
  return tokenizer;
}

Tokenizer Tokenizer::bundled() {
  const auto vocab_json = embedded_config("tokenizer/vocab.json");
  const auto merges_txt = embedded_config("tokenizer/merges.txt");
  if (!vocab_json || !merges_txt) {
    fail("configs/tokenizer: vocab.json and merges.txt were not embedded at build time");
  }
  return from_strings(*vocab_json, *merges_txt, "configs/tokenizer");
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  return impl_->pipeline.encode(text);
}

std::vector<int32_t> Tokenizer::encode_bounded(std::string_view text, size_t limit) const {
  // The cut may split a word, whose tokens in the head can differ from the whole text's: the
  // head counts only when it passes `limit` by more than a word's tokens could.
  constexpr size_t kCutMargin = 64;
  const size_t head_bytes = (limit + kCutMargin + 1) * kBoundedBytesPerToken;
  if (text.size() > head_bytes) {
    std::vector<int32_t> head = encode(text.substr(0, head_bytes));
    if (head.size() > limit + kCutMargin) return head;
  }
  return encode(text);
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  return impl_->pipeline.decode(ids, skip_special);
}

int32_t Tokenizer::vocab_size() const {
  return static_cast<int32_t>(impl_->pipeline.id_strings.size());
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  return impl_->pipeline.token_to_id(token);
}

std::optional<int32_t> Tokenizer::bos_id() const {
  return impl_->pipeline.bos;
}

std::optional<int32_t> Tokenizer::eos_id() const {
  return impl_->pipeline.eos;
}

}  // namespace infinigen
