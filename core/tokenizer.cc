// core: byte-level BPE tokenizer, id-for-id compatible with HF tokenizers' ByteLevel + BPE.
#include "core/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "core/error.h"
#include "core/resources.h"

namespace infinigen {
namespace {

// Ids beyond this are rejected: id -> token is a dense table, and no real vocabulary comes near.
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;
constexpr int64_t kMaxUnusedIds = 65536;  // ids below the largest that name no token
// Pieces cached per tokenizer; like HF, the cache simply stops growing when full.
constexpr size_t kCacheCapacity = 10000;
constexpr size_t kMaxCachedPieceBytes = 256;
constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD
constexpr std::array<std::string_view, 4> kSpecialTokens = {"<s>", "<pad>", "</s>", "<unk>"};

// The GPT-2 pre-tokenisation pattern. `\s` is spelled out as the Unicode White_Space set because
// that is what HF's regex engines match; PCRE2's UCP `\s` would also match U+180E. `\p{L}` and
// `\p{N}` follow the Unicode version of the PCRE2 library, so characters assigned after it (new
// CJK or hieroglyph blocks) may split differently from HF; they still round-trip.
std::string gpt2_pattern() {
  const std::string ws =
      R"(\t\n\x{0B}\f\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F})"
      R"(\x{3000})";
  return "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" + ws + "\\p{L}\\p{N}]+|[" + ws +
         "]+(?![^" + ws + "])|[" + ws + "]+";
}

// One step of UTF-8 decoding: the length of the valid code point at p, or of the maximal invalid
// subpart there (the unit that Python's errors="replace" and Rust's from_utf8_lossy turn into
// one U+FFFD).
struct Utf8Step {
  size_t length;
  bool valid;
};

Utf8Step utf8_step(const unsigned char* p, size_t n) {
  const unsigned char lead = p[0];
  if (lead < 0x80) return {1, true};
  size_t need = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    need = 1;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    need = 2;
    if (lead == 0xE0) lo = 0xA0;  // overlong
    if (lead == 0xED) hi = 0x9F;  // surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    need = 3;
    if (lead == 0xF0) lo = 0x90;  // overlong
    if (lead == 0xF4) hi = 0x8F;  // above U+10FFFF
  } else {
    return {1, false};
  }
  size_t i = 1;
  for (; i <= need && i < n; ++i) {
    const unsigned char c = p[i];
    const bool ok = i == 1 ? (c >= lo && c <= hi) : (c >= 0x80 && c <= 0xBF);
    if (!ok) return {i, false};
  }
  return {i, i == need + 1};
}

// Appends `bytes` to `out` with each maximal invalid UTF-8 subpart replaced by U+FFFD.
void append_lossy(std::string_view bytes, std::string& out) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  size_t i = 0;
  while (i < bytes.size()) {
    const Utf8Step step = utf8_step(p + i, bytes.size() - i);
    if (step.valid) {
      out.append(bytes.substr(i, step.length));
    } else {
      out.append(kReplacement);
    }
    i += step.length;
  }
}

bool is_valid_utf8(std::string_view text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  for (size_t i = 0; i < text.size();) {
    const Utf8Step step = utf8_step(p + i, text.size() - i);
    if (!step.valid) return false;
    i += step.length;
  }
  return true;
}

void append_utf8(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    // bytes_to_unicode only produces code points below U+0800; the rest is for completeness.
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the other 68 bytes to U+0100... in
// byte order, so that every token is a printable string.
std::array<char32_t, 256> bytes_to_unicode() {
  std::array<char32_t, 256> table{};
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    table[b] = printable ? static_cast<char32_t>(b) : next++;
  }
  return table;
}

// JSON-quoted, so that odd tokens stay on one line in error messages.
std::string quoted(std::string_view token) {
  return nlohmann::json(std::string(token))
      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string read_file(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) fail(path.string(), ": no such file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path.string(), ": cannot open the file");
  std::ostringstream content;
  content << in.rdbuf();
  if (!in.good() && !in.eof()) fail(path.string(), ": cannot read the file");
  return content.str();
}

struct TransparentHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

struct Pcre2CodeDeleter {
  void operator()(pcre2_code* code) const { pcre2_code_free(code); }
};
struct Pcre2MatchDataDeleter {
  void operator()(pcre2_match_data* data) const { pcre2_match_data_free(data); }
};

struct MergeRule {
  uint32_t rank;
  int32_t new_id;
};

uint64_t pair_key(int32_t left, int32_t right) {
  return (uint64_t{static_cast<uint32_t>(left)} << 32) | static_cast<uint32_t>(right);
}

}  // namespace

struct Tokenizer::Impl {
  std::unordered_map<std::string, int32_t, TransparentHash, std::equal_to<>> vocab;
  std::vector<std::string> tokens;  // by id; holes in the id range are empty and not `present`
  std::vector<bool> present;
  std::vector<bool> special;
  std::unordered_map<uint64_t, MergeRule> merges;
  std::array<int32_t, 256> byte_ids{};  // id of each byte's single-character token, or -1
  std::unordered_map<char32_t, unsigned char> char_bytes;  // inverse of bytes_to_unicode
  std::unique_ptr<pcre2_code, Pcre2CodeDeleter> pattern;

  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>, TransparentHash, std::equal_to<>>
      cache;

  void load_vocab(std::string_view json_text, const std::string& source);
  void load_merges(std::string_view text, const std::string& source);
  void compile_pattern();
  std::vector<std::string_view> pre_tokenize(std::string_view text) const;
  void bpe(std::string_view piece, std::vector<int32_t>& out) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  void append_token_bytes(int32_t id, std::string& bytes) const;
};

void Tokenizer::Impl::load_vocab(std::string_view json_text, const std::string& source) {
  const std::string file = source + "/vocab.json";
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    fail(file, ": malformed JSON: ", e.what());
  }
  if (!root.is_object()) fail(file, ": expected a JSON object mapping tokens to ids");

  std::vector<std::pair<int64_t, std::string>> entries;
  entries.reserve(root.size());
  for (const auto& [token, value] : root.items()) {
    if (!value.is_number_integer()) {
      fail(file, ": the id of token ", quoted(token), " is not an integer: ", value.dump());
    }
    // is_number_integer covers unsigned values too, which get_to<int64_t> would wrap.
    if (value.is_number_unsigned() && value.get<uint64_t>() > uint64_t{kMaxTokenId}) {
      fail(file, ": the id of token ", quoted(token), " is out of range (0..", kMaxTokenId,
           "): ", value.dump());
    }
    const int64_t id = value.get<int64_t>();
    if (id < 0 || id > kMaxTokenId) {
      fail(file, ": the id of token ", quoted(token), " is out of range (0..", kMaxTokenId,
           "): ", id);
    }
    entries.emplace_back(id, token);
  }
  int64_t max_id = -1;
  for (const auto& entry : entries) max_id = std::max(max_id, entry.first);
  // Tables are indexed by id: a few tokens with ids in the millions would cost millions of
  // entries (found by fuzzing). Vocabularies number their tokens densely; a few gaps are fine.
  const int64_t unused = max_id + 1 - static_cast<int64_t>(entries.size());
  if (unused > kMaxUnusedIds) {
    fail(file, ": ids reach ", max_id, " but only ", entries.size(), " tokens are given (",
         unused, " ids unused; at most ", kMaxUnusedIds, " may be)");
  }
  tokens.assign(static_cast<size_t>(max_id + 1), std::string());
  present.assign(tokens.size(), false);
  special.assign(tokens.size(), false);
  for (auto& [id, token] : entries) {
    if (present[id]) {
      fail(file, ": tokens ", quoted(tokens[id]), " and ", quoted(token), " both have id ", id);
    }
    present[id] = true;
    vocab.emplace(token, static_cast<int32_t>(id));
    tokens[id] = std::move(token);
  }
  for (const std::string_view name : kSpecialTokens) {
    const auto it = vocab.find(name);
    if (it != vocab.end()) special[it->second] = true;
  }

  const std::array<char32_t, 256> table = bytes_to_unicode();
  for (int b = 0; b < 256; ++b) {
    std::string ch;
    append_utf8(table[b], ch);
    const auto it = vocab.find(ch);
    // A byte whose token is missing is dropped from the input, as HF's BPE does without unk.
    byte_ids[b] = it == vocab.end() ? -1 : it->second;
    char_bytes.emplace(table[b], static_cast<unsigned char>(b));
  }
}

void Tokenizer::Impl::load_merges(std::string_view text, const std::string& source) {
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
           parts.size(), " parts: ", quoted(line));
    }
    int32_t ids[2];
    for (int i = 0; i < 2; ++i) {
      const auto it = vocab.find(parts[i]);
      if (it == vocab.end()) {
        fail(file, ":", line_number, ": token ", quoted(parts[i]), " is not in the vocabulary");
      }
      ids[i] = it->second;
    }
    std::string merged(parts[0]);
    merged += parts[1];
    const auto it = vocab.find(merged);
    if (it == vocab.end()) {
      fail(file, ":", line_number, ": merged token ", quoted(merged), " is not in the vocabulary");
    }
    // A repeated pair keeps its last rank, as in GPT-2's dict and HF's HashMap.
    merges[pair_key(ids[0], ids[1])] = MergeRule{rank++, it->second};
  }
}

void Tokenizer::Impl::compile_pattern() {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  const std::string source = gpt2_pattern();
  pattern.reset(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(source.data()), source.size(),
                              PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, nullptr));
  if (!pattern) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    fail("tokenizer: cannot compile the pre-tokenisation pattern at offset ", error_offset, ": ",
         reinterpret_cast<const char*>(message));
  }
}

// Splits `text` into the pieces that BPE sees. Invalid UTF-8 is matched as if each maximal
// invalid subpart were U+FFFD (what a lossy decode would hand HF), but the pieces keep the
// original bytes, so encode loses nothing.
std::vector<std::string_view> Tokenizer::Impl::pre_tokenize(std::string_view text) const {
  std::vector<std::string_view> pieces;
  if (text.empty()) return pieces;

  std::string sanitized;
  std::vector<size_t> original_offset;  // by byte offset in `sanitized`
  std::string_view subject = text;
  if (!is_valid_utf8(text)) {
    const auto* p = reinterpret_cast<const unsigned char*>(text.data());
    sanitized.reserve(text.size() + 16);
    original_offset.reserve(text.size() + 17);
    for (size_t i = 0; i < text.size();) {
      const Utf8Step step = utf8_step(p + i, text.size() - i);
      if (step.valid) {
        for (size_t k = 0; k < step.length; ++k) original_offset.push_back(i + k);
        sanitized.append(text.substr(i, step.length));
      } else {
        for (size_t k = 0; k < kReplacement.size(); ++k) original_offset.push_back(i);
        sanitized.append(kReplacement);
      }
      i += step.length;
    }
    original_offset.push_back(text.size());
    subject = sanitized;
  }
  const auto to_original = [&](size_t offset) {
    return original_offset.empty() ? offset : original_offset[offset];
  };
  const auto add_piece = [&](size_t begin, size_t end) {
    const size_t b = to_original(begin), e = to_original(end);
    if (e > b) pieces.push_back(text.substr(b, e - b));
  };

  std::unique_ptr<pcre2_match_data, Pcre2MatchDataDeleter> match(
      pcre2_match_data_create_from_pattern(pattern.get(), nullptr));
  if (!match) fail("tokenizer: out of memory for a pattern match");
  const auto* data = reinterpret_cast<PCRE2_SPTR>(subject.data());
  size_t offset = 0;
  while (offset < subject.size()) {
    // The subject is valid UTF-8 by construction, so PCRE2 need not check it again per match.
    const int rc = pcre2_match(pattern.get(), data, subject.size(), offset, PCRE2_NO_UTF_CHECK,
                               match.get(), nullptr);
    if (rc < 0) break;  // no match, or a resource limit: the rest becomes one piece below
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match.get());
    const size_t begin = ovector[0], end = ovector[1];
    if (end <= begin) break;   // the pattern never matches empty; do not loop if it did
    add_piece(offset, begin);  // text the pattern skipped stays its own piece, as in HF
    add_piece(begin, end);
    offset = end;
  }
  add_piece(offset, subject.size());
  return pieces;
}

// HF's BPE merge loop (tokenizers' Word::merge_all), including its tie-breaking: the pair of
// lowest rank is merged first, the leftmost one among equal ranks.
void Tokenizer::Impl::bpe(std::string_view piece, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    bool alive;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(piece.size());
  for (const char c : piece) {
    const int32_t id = byte_ids[static_cast<unsigned char>(c)];
    if (id >= 0) symbols.push_back({id, 0, 0, true});
  }
  const auto n = static_cast<int32_t>(symbols.size());
  for (int32_t i = 0; i < n; ++i) {
    symbols[i].prev = i - 1;
    symbols[i].next = i + 1 < n ? i + 1 : -1;
  }

  struct Candidate {
    uint32_t rank;
    int32_t pos;
    int32_t new_id;
  };
  const auto later = [](const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(later)> queue(later);
  const auto push_pair = [&](int32_t pos) {
    const int32_t next = symbols[pos].next;
    if (next < 0) return;
    const auto it = merges.find(pair_key(symbols[pos].id, symbols[next].id));
    if (it != merges.end()) queue.push({it->second.rank, pos, it->second.new_id});
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_pair(i);

  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    const int32_t right_pos = left.next;
    const Symbol right = symbols[right_pos];
    // Entries go stale when a neighbour merged; HF checks the merge result only, so do we.
    const auto it = merges.find(pair_key(left.id, right.id));
    if (it == merges.end() || it->second.new_id != top.new_id) continue;

    left.id = top.new_id;
    left.next = right.next;
    symbols[right_pos].alive = false;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    if (left.prev >= 0) push_pair(left.prev);
    push_pair(top.pos);
  }
  for (const Symbol& symbol : symbols) {
    if (symbol.alive) out.push_back(symbol.id);
  }
}

void Tokenizer::Impl::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  const bool cacheable = piece.size() <= kMaxCachedPieceBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex);
    const auto it = cache.find(piece);
    if (it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  bpe(piece, out);
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex);
    if (cache.size() < kCacheCapacity) {
      cache.emplace(std::string(piece), std::vector<int32_t>(out.begin() + first, out.end()));
    }
  }
}

// The bytes a token stands for. Like HF's ByteLevel decoder, a token with a character outside
// the byte alphabet (an added token such as "<unk>" is fine, "€" is not) contributes its own
// UTF-8 spelling.
void Tokenizer::Impl::append_token_bytes(int32_t id, std::string& bytes) const {
  const std::string& token = tokens[id];
  const size_t start = bytes.size();
  const auto* p = reinterpret_cast<const unsigned char*>(token.data());
  for (size_t i = 0; i < token.size();) {
    const Utf8Step step = utf8_step(p + i, token.size() - i);
    char32_t cp = 0;
    if (step.valid) {
      if (step.length == 1) {
        cp = p[i];
      } else {
        cp = p[i] & (0xFF >> (step.length + 1));
        for (size_t k = 1; k < step.length; ++k) cp = (cp << 6) | (p[i + k] & 0x3F);
      }
    }
    const auto it = step.valid ? char_bytes.find(cp) : char_bytes.end();
    if (it == char_bytes.end()) {
      bytes.resize(start);
      bytes.append(token);
      return;
    }
    bytes.push_back(static_cast<char>(it->second));
    i += step.length;
  }
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_strings(std::string_view vocab_json, std::string_view merges_txt,
                                  const std::string& source) {
  auto impl = std::make_unique<Impl>();
  impl->load_vocab(vocab_json, source);
  impl->load_merges(merges_txt, source);
  impl->compile_pattern();
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_directory(const std::string& directory) {
  std::error_code ec;
  if (!std::filesystem::is_directory(directory, ec)) {
    fail(directory, ": no such tokenizer directory (expected vocab.json and merges.txt in it)");
  }
  std::string source = directory;
  while (source.size() > 1 && source.back() == '/') source.pop_back();
  const std::filesystem::path dir(source);
  const std::string vocab_json = read_file(dir / "vocab.json");
  const std::string merges_txt = read_file(dir / "merges.txt");
  return from_strings(vocab_json, merges_txt, source);
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
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 1);
  for (const std::string_view piece : impl_->pre_tokenize(text)) impl_->encode_piece(piece, ids);
  return ids;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string text;
  std::string bytes;  // pending token bytes, decoded together so that split characters rejoin
  for (const int32_t id : ids) {
    const bool known = id >= 0 && static_cast<size_t>(id) < impl_->tokens.size() &&
                       impl_->present[static_cast<size_t>(id)];
    if (!known) {
      append_lossy(bytes, text);
      bytes.clear();
      text += cat("<id ", id, ">");
      continue;
    }
    if (skip_special && impl_->special[static_cast<size_t>(id)]) continue;
    impl_->append_token_bytes(id, bytes);
  }
  append_lossy(bytes, text);
  return text;
}

int32_t Tokenizer::vocab_size() const {
  return static_cast<int32_t>(impl_->tokens.size());
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  const auto it = impl_->vocab.find(token);
  if (it == impl_->vocab.end()) return std::nullopt;
  return it->second;
}

}  // namespace infinigen
