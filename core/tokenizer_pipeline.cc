// core: the stages of a HF tokenizers pipeline, id-for-id compatible with the tokenizers package.
#include "core/tokenizer_pipeline.h"

#include <unicode/bytestream.h>
#include <unicode/edits.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>

#include <algorithm>
#include <limits>
#include <utility>

#include "core/error.h"

namespace infinigen::tokenizer_detail {
namespace {

// HF's ByteLevel pre-tokenizer pattern (GPT-2's), in onig syntax like a tokenizer.json pattern.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the other 68 bytes to U+0100... in
// byte order, so that every token is a printable string.
struct ByteLevelAlphabet {
  std::array<std::string, 256> chars;  // UTF-8 of each byte's character
  std::array<int16_t, 512> bytes;      // inverse, by code point (all are below U+0200); -1: none
};

const ByteLevelAlphabet& byte_level_alphabet() {
  static const ByteLevelAlphabet alphabet = [] {
    ByteLevelAlphabet a{};
    a.bytes.fill(-1);
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const char32_t cp = printable ? static_cast<char32_t>(b) : next++;
      append_utf8(cp, a.chars[b]);
      a.bytes[cp] = static_cast<int16_t>(b);
    }
    return a;
  }();
  return alphabet;
}

// Rust regex's `\s` (HF's added-token lstrip/rstrip).
bool is_white_space(char32_t cp) {
  return u_isUWhiteSpace(static_cast<UChar32>(cp));
}

// Rust regex's `\w`, UTS #18's word characters (HF's added-token single_word).
bool is_word_character(char32_t cp) {
  const auto c = static_cast<UChar32>(cp);
  if (u_hasBinaryProperty(c, UCHAR_ALPHABETIC) || u_hasBinaryProperty(c, UCHAR_JOIN_CONTROL)) {
    return true;
  }
  const int8_t type = u_charType(c);
  return type == U_NON_SPACING_MARK || type == U_ENCLOSING_MARK ||
         type == U_COMBINING_SPACING_MARK || type == U_DECIMAL_DIGIT_NUMBER ||
         type == U_CONNECTOR_PUNCTUATION;
}

size_t utf8_length(char32_t cp) {
  return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
}

// The code point of the character starting at text[at], or none when invalid UTF-8 starts there.
std::optional<char32_t> code_point_at(std::string_view text, size_t at) {
  if (at >= text.size()) return std::nullopt;
  const auto* p = reinterpret_cast<const unsigned char*>(text.data()) + at;
  const Utf8Step step = utf8_step(p, text.size() - at);
  if (!step.valid) return std::nullopt;
  return utf8_code_point(p, step.length);
}

// The code point of the character ending at text[end], or none when it is not valid UTF-8.
std::optional<char32_t> code_point_before(std::string_view text, size_t end) {
  size_t begin = end;
  while (begin > 0 && end - begin < 4) {
    --begin;
    if ((static_cast<unsigned char>(text[begin]) & 0xC0) != 0x80) break;
  }
  if (begin == end) return std::nullopt;
  const auto* p = reinterpret_cast<const unsigned char*>(text.data()) + begin;
  const Utf8Step step = utf8_step(p, end - begin);
  if (!step.valid || step.length != end - begin) return std::nullopt;
  return utf8_code_point(p, step.length);
}

// ---- Splitting (HF's NormalizedString::split) ---------------------------------------------------

struct Span {
  size_t begin;
  size_t end;
  bool is_match;
};

// The whole of `text` as matched and unmatched spans (HF's Pattern::find_matches).
std::vector<Span> spans_of(std::string_view text, const std::vector<Regex::Match>& matches) {
  if (text.empty()) return {{0, 0, false}};
  std::vector<Span> spans;
  spans.reserve(matches.size() * 2 + 1);
  size_t previous = 0;
  for (const Regex::Match& m : matches) {
    if (previous != m.begin) spans.push_back({previous, m.begin, false});
    spans.push_back({m.begin, m.end, true});
    previous = m.end;
  }
  if (previous != text.size()) spans.push_back({previous, text.size(), false});
  return spans;
}

Piece slice(const Piece& piece, size_t begin, size_t end) {
  Piece out;
  out.text = piece.text.substr(begin, end - begin);
  out.origin.assign(piece.origin.begin() + static_cast<std::ptrdiff_t>(begin),
                    piece.origin.begin() + static_cast<std::ptrdiff_t>(end));
  return out;
}

// Appends the parts of `piece` that `behavior` makes of `spans`; empty parts are dropped, as
// HF's PreTokenizedString::split drops them. The folds are HF's, including Contiguous's way of
// merging a leading non-match.
void split_piece(const Piece& piece, std::vector<Span> spans, SplitBehavior behavior,
                 std::vector<Piece>& out) {
  std::vector<std::pair<Span, bool>> parts;  // span, removed
  switch (behavior) {
    case SplitBehavior::Isolated:
      for (const Span& s : spans) parts.push_back({s, false});
      break;
    case SplitBehavior::Removed:
      for (const Span& s : spans) parts.push_back({s, s.is_match});
      break;
    case SplitBehavior::Contiguous:
    case SplitBehavior::MergedWithPrevious: {
      // A span joins the part before it: for Contiguous when it matches as that part did, for
      // MergedWithPrevious when it is a match after a non-match.
      const bool contiguous = behavior == SplitBehavior::Contiguous;
      bool previous_match = false;
      for (const Span& s : spans) {
        const bool joins =
            contiguous ? s.is_match == previous_match : s.is_match && !previous_match;
        if (joins && !parts.empty()) {
          parts.back().first.end = s.end;
        } else {
          parts.push_back({s, false});
        }
        previous_match = s.is_match;
      }
      break;
    }
    case SplitBehavior::MergedWithNext: {
      bool next_match = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->is_match && !next_match && !parts.empty()) {
          parts.back().first.begin = it->begin;
        } else {
          parts.push_back({*it, false});
        }
        next_match = it->is_match;
      }
      std::reverse(parts.begin(), parts.end());
      break;
    }
  }
  for (const auto& [span, removed] : parts) {
    if (!removed && span.end > span.begin) out.push_back(slice(piece, span.begin, span.end));
  }
}

// HF's NormalizedString::replace: each match becomes `content`, aligned to the match's last byte.
void replace_matches(Piece& piece, const std::vector<Regex::Match>& matches,
                     std::string_view content) {
  if (matches.empty()) return;
  Piece out;
  out.text.reserve(piece.text.size() + matches.size() * content.size());
  out.origin.reserve(out.text.capacity());
  size_t last = 0;
  for (const Regex::Match& m : matches) {
    out.text.append(piece.text, last, m.begin - last);
    out.origin.insert(out.origin.end(), piece.origin.begin() + static_cast<std::ptrdiff_t>(last),
                      piece.origin.begin() + static_cast<std::ptrdiff_t>(m.begin));
    const uint32_t origin = m.end > 0 ? piece.origin[m.end - 1] : 0;
    out.text.append(content);
    out.origin.insert(out.origin.end(), content.size(), origin);
    last = m.end;
  }
  out.text.append(piece.text, last);
  out.origin.insert(out.origin.end(), piece.origin.begin() + static_cast<std::ptrdiff_t>(last),
                    piece.origin.end());
  piece.text = std::move(out.text);
  piece.origin = std::move(out.origin);
}

// HF's NormalizedString::prepend (the new text takes the first character's alignment).
void prepend(Piece& piece, std::string_view text) {
  if (piece.text.empty()) return;
  piece.text.insert(0, text);
  piece.origin.insert(piece.origin.begin(), text.size(), piece.origin.front());
}

[[noreturn]] void fail_icu(const char* what, UErrorCode status) {
  fail("tokenizer: Unicode NFC normalization failed (", what, "): ", u_errorName(status));
}

// NFC through ICU, one valid UTF-8 run at a time (invalid bytes, which HF never sees, are kept).
// A changed span of ICU's fine edits takes the origin of its first source byte.
void normalize_nfc(Piece& piece) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(status);
  if (U_FAILURE(status)) fail_icu("no NFC data", status);
  if (is_valid_utf8(piece.text)) {
    const bool normalized = nfc->isNormalizedUTF8(piece.text, status);
    if (U_FAILURE(status)) fail_icu("check", status);
    if (normalized) return;
  }
  Piece out;
  out.text.reserve(piece.text.size() + 8);
  out.origin.reserve(piece.text.size() + 8);
  const auto* p = reinterpret_cast<const unsigned char*>(piece.text.data());
  const size_t n = piece.text.size();
  size_t i = 0;
  while (i < n) {
    size_t run_end = i;
    while (run_end < n) {
      const Utf8Step step = utf8_step(p + run_end, n - run_end);
      if (!step.valid) break;
      run_end += step.length;
    }
    if (run_end > i) {
      std::string normalized;
      icu::StringByteSink<std::string> sink(&normalized);
      icu::Edits edits;
      nfc->normalizeUTF8(0,
                         icu::StringPiece(piece.text.data() + i, static_cast<int32_t>(run_end - i)),
                         sink, &edits, status);
      if (U_FAILURE(status)) fail_icu("normalize", status);
      icu::Edits::Iterator edit = edits.getFineIterator();
      while (edit.next(status)) {
        const size_t source = i + static_cast<size_t>(edit.sourceIndex());
        const auto destination = static_cast<size_t>(edit.destinationIndex());
        const auto new_length = static_cast<size_t>(edit.newLength());
        out.text.append(normalized, destination, new_length);
        if (edit.hasChange()) {
          const uint32_t origin = piece.origin[std::min(source, run_end - 1)];
          out.origin.insert(out.origin.end(), new_length, origin);
        } else {
          out.origin.insert(
              out.origin.end(), piece.origin.begin() + static_cast<std::ptrdiff_t>(source),
              piece.origin.begin() + static_cast<std::ptrdiff_t>(source + new_length));
        }
      }
      if (U_FAILURE(status)) fail_icu("edits", status);
      i = run_end;
      continue;
    }
    const Utf8Step step = utf8_step(p + i, n - i);
    out.text.append(piece.text, i, step.length);
    out.origin.insert(out.origin.end(), piece.origin.begin() + static_cast<std::ptrdiff_t>(i),
                      piece.origin.begin() + static_cast<std::ptrdiff_t>(i + step.length));
    i += step.length;
  }
  piece.text = std::move(out.text);
  piece.origin = std::move(out.origin);
}

const Regex& gpt2_regex() {
  static const Regex regex = Regex::pattern(kGpt2Pattern, "tokenizer: the GPT-2 pattern");
  return regex;
}

// The spans of each occurrence of `text` in `subject` (a char pattern in HF: one match each).
std::vector<Regex::Match> occurrences(std::string_view subject, std::string_view text) {
  std::vector<Regex::Match> matches;
  if (text.empty()) return matches;
  for (size_t at = subject.find(text); at != std::string_view::npos;
       at = subject.find(text, at + text.size())) {
    matches.push_back({at, at + text.size()});
  }
  return matches;
}

void pre_tokenize(const SplitPreTokenizer& split, const Piece& piece, std::vector<Piece>& out) {
  std::vector<Span> spans = spans_of(piece.text, split.pattern.find_all(piece.text));
  if (split.invert) {
    for (Span& s : spans) s.is_match = !s.is_match;
  }
  split_piece(piece, std::move(spans), split.behavior, out);
}

void pre_tokenize(const ByteLevelPreTokenizer& byte_level, Piece piece, std::vector<Piece>& out) {
  if (byte_level.add_prefix_space && !piece.text.starts_with(' ')) prepend(piece, " ");
  std::vector<Piece> parts;
  if (byte_level.use_regex) {
    split_piece(piece, spans_of(piece.text, gpt2_regex().find_all(piece.text)),
                SplitBehavior::Isolated, parts);
  } else {
    parts.push_back(std::move(piece));
  }
  const ByteLevelAlphabet& alphabet = byte_level_alphabet();
  for (Piece& part : parts) {
    Piece mapped;
    mapped.text.reserve(part.text.size() * 2);
    mapped.origin.reserve(part.text.size() * 2);
    for (size_t i = 0; i < part.text.size(); ++i) {
      const std::string& ch = alphabet.chars[static_cast<unsigned char>(part.text[i])];
      mapped.text += ch;
      mapped.origin.insert(mapped.origin.end(), ch.size(), part.origin[i]);
    }
    out.push_back(std::move(mapped));
  }
}

void pre_tokenize(const MetaspacePreTokenizer& metaspace, Piece piece, std::vector<Piece>& out) {
  replace_matches(piece, occurrences(piece.text, " "), metaspace.replacement);
  const bool starts_with_replacement = piece.text.starts_with(metaspace.replacement);
  if ((metaspace.prepend_scheme == PrependScheme::Always && !starts_with_replacement) ||
      (metaspace.prepend_scheme == PrependScheme::First && !starts_with_replacement &&
       !piece.origin.empty() && piece.origin.front() == 0)) {
    prepend(piece, metaspace.replacement);
  }
  if (!metaspace.split) {
    if (!piece.text.empty()) out.push_back(std::move(piece));
    return;
  }
  split_piece(piece, spans_of(piece.text, occurrences(piece.text, metaspace.replacement)),
              SplitBehavior::MergedWithNext, out);
}

// ---- Decoders (HF's decode_chain of each) -------------------------------------------------------

std::vector<std::string> decode_step(const ByteLevelDecoder&, std::vector<std::string> tokens) {
  const ByteLevelAlphabet& alphabet = byte_level_alphabet();
  std::string bytes;
  for (const std::string& token : tokens) {
    // A token with a character outside the alphabet (an added token such as "<unk>" is fine,
    // "€" is not) contributes its own UTF-8 spelling.
    const size_t start = bytes.size();
    const auto* p = reinterpret_cast<const unsigned char*>(token.data());
    for (size_t i = 0; i < token.size();) {
      const Utf8Step step = utf8_step(p + i, token.size() - i);
      const char32_t cp = step.valid ? utf8_code_point(p + i, step.length) : 0x10FFFF;
      const int16_t byte = cp < alphabet.bytes.size() ? alphabet.bytes[cp] : -1;
      if (byte < 0) {
        bytes.resize(start);
        bytes += token;
        break;
      }
      bytes.push_back(static_cast<char>(byte));
      i += step.length;
    }
  }
  std::string text;
  append_lossy(bytes, text);
  return {std::move(text)};
}

std::vector<std::string> decode_step(const MetaspaceDecoder& metaspace,
                                     std::vector<std::string> tokens) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    std::string out;
    std::string_view rest = tokens[i];
    for (size_t at = rest.find(metaspace.replacement); at != std::string_view::npos;
         at = rest.find(metaspace.replacement)) {
      out.append(rest.substr(0, at));
      if (i != 0 || !metaspace.drop_in_first_token) out += ' ';
      rest.remove_prefix(at + metaspace.replacement.size());
    }
    out.append(rest);
    tokens[i] = std::move(out);
  }
  return tokens;
}

std::vector<std::string> decode_step(const ReplaceDecoder& replace,
                                     std::vector<std::string> tokens) {
  for (std::string& token : tokens) {
    Piece piece;
    piece.text = std::move(token);
    piece.origin.resize(piece.text.size());
    replace_matches(piece, replace.pattern.find_all(piece.text), replace.content);
    token = std::move(piece.text);
  }
  return tokens;
}

// "<0xNN>" -> NN, as HF reads it (u8::from_str_radix, which also takes a leading '+').
std::optional<unsigned char> byte_of_token(std::string_view token) {
  if (token.size() != 6 || !token.starts_with("<0x") || token.back() != '>') return std::nullopt;
  const auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (token[3] == '+') {
    const int low = digit(token[4]);
    if (low < 0) return std::nullopt;
    return static_cast<unsigned char>(low);
  }
  const int high = digit(token[3]), low = digit(token[4]);
  if (high < 0 || low < 0) return std::nullopt;
  return static_cast<unsigned char>(high * 16 + low);
}

std::vector<std::string> decode_step(const ByteFallbackDecoder&, std::vector<std::string> tokens) {
  std::vector<std::string> out;
  std::string bytes;
  const auto flush = [&] {
    if (bytes.empty()) return;
    if (is_valid_utf8(bytes)) {
      out.push_back(bytes);
    } else {
      // HF replaces the whole run, one U+FFFD per byte, when any of it is invalid.
      for (size_t i = 0; i < bytes.size(); ++i) out.emplace_back(kReplacementCharacter);
    }
    bytes.clear();
  };
  for (std::string& token : tokens) {
    if (const auto byte = byte_of_token(token)) {
      bytes.push_back(static_cast<char>(*byte));
      continue;
    }
    flush();
    out.push_back(std::move(token));
  }
  flush();
  return out;
}

std::vector<std::string> decode_step(const FuseDecoder&, std::vector<std::string> tokens) {
  std::string joined;
  for (const std::string& token : tokens) joined += token;
  return {std::move(joined)};
}

std::vector<std::string> decode_step(const StripDecoder& strip, std::vector<std::string> tokens) {
  for (std::string& token : tokens) {
    // Character boundaries of the token (decoder inputs are valid UTF-8: tokens come from JSON).
    std::vector<size_t> starts;
    const auto* p = reinterpret_cast<const unsigned char*>(token.data());
    for (size_t i = 0; i < token.size(); i += utf8_step(p + i, token.size() - i).length) {
      starts.push_back(i);
    }
    const size_t count = starts.size();
    const auto is_content = [&](size_t k) {
      return code_point_at(token, starts[k]) == strip.content;
    };
    size_t start_cut = 0;
    for (size_t k = 0; k < std::min(strip.start, count) && is_content(k); ++k) start_cut = k + 1;
    size_t stop_cut = count;
    for (size_t i = 0; i < std::min(strip.stop, count) && is_content(count - i - 1); ++i) {
      stop_cut = count - i - 1;
    }
    // HF panics when the cuts cross; an empty token is what is left.
    if (stop_cut <= start_cut) {
      token.clear();
      continue;
    }
    const size_t begin = starts[start_cut];
    const size_t end = stop_cut < count ? starts[stop_cut] : token.size();
    token = token.substr(begin, end - begin);
  }
  return tokens;
}

}  // namespace

// ---- Pipeline -----------------------------------------------------------------------------------

void Pipeline::finish(const std::unordered_set<std::string>& special_contents) {
  model.finish();
  size_t size = model.tokens().size();
  for (const AddedToken& token : added) size = std::max(size, static_cast<size_t>(token.id) + 1);
  id_strings.assign(size, std::string());
  id_present.assign(size, false);
  id_special.assign(size, false);
  for (size_t id = 0; id < model.tokens().size(); ++id) {
    if (!model.has_id(static_cast<int64_t>(id))) continue;
    id_strings[id] = model.tokens()[id];
    id_present[id] = true;
  }
  for (size_t i = 0; i < added.size(); ++i) {
    const AddedToken& token = added[i];
    // HF decodes a normalized added token as its normalized content.
    id_strings[token.id] = token.pattern;
    id_present[token.id] = true;
    (token.normalized ? normalized_matcher : raw_matcher).add(token.pattern, i);
  }
  for (size_t id = 0; id < size; ++id) {
    id_special[id] = id_present[id] && special_contents.contains(id_strings[id]);
  }
}

std::optional<int32_t> Pipeline::token_to_id(std::string_view token) const {
  const auto added_it = added_ids.find(token);
  if (added_it != added_ids.end()) return added_it->second;
  const auto it = model.vocab().find(token);
  if (it == model.vocab().end()) return std::nullopt;
  return it->second;
}

void Pipeline::normalize(Piece& piece) const {
  for (const Normalizer& normalizer : normalizers) {
    std::visit(
        [&](const auto& n) {
          using N = std::decay_t<decltype(n)>;
          if constexpr (std::is_same_v<N, NfcNormalizer>) {
            normalize_nfc(piece);
          } else if constexpr (std::is_same_v<N, PrependNormalizer>) {
            prepend(piece, n.prepend);
          } else {
            replace_matches(piece, n.pattern.find_all(piece.text), n.content);
          }
        },
        normalizer);
  }
}

// HF's AddedVocabulary::find_matches + split_with_indices over one piece.
void Pipeline::split_added(Piece piece, const AddedTokenMatcher& matcher,
                           std::vector<Piece>& out) const {
  if (piece.text.empty()) return;
  if (matcher.empty()) {
    out.push_back(std::move(piece));
    return;
  }
  const std::string_view s = piece.text;
  size_t start_offset = 0;
  for (size_t search = 0; search < s.size();) {
    const auto found = matcher.longest_at(s, search);
    if (!found) {
      ++search;
      continue;
    }
    const AddedToken& token = added[found->second];
    size_t start = search, stop = search + found->first;
    search = stop;  // the automaton goes on after the match, whatever becomes of it
    if (token.single_word) {
      const auto before = code_point_before(s, start);
      const auto after = code_point_at(s, stop);
      const bool space_before = start == 0 || !before || !is_word_character(*before);
      const bool space_after = stop == s.size() || !after || !is_word_character(*after);
      if (!space_before || !space_after) continue;
    }
    if (token.lstrip) {
      size_t left = start;
      for (auto cp = code_point_before(s, left); cp && is_white_space(*cp);
           cp = code_point_before(s, left)) {
        left -= utf8_length(*cp);
      }
      start = std::max(left, start_offset);
    }
    if (token.rstrip) {
      for (auto cp = code_point_at(s, stop); cp && is_white_space(*cp);
           cp = code_point_at(s, stop)) {
        stop += utf8_length(*cp);
      }
    }
    if (start_offset < start) out.push_back(slice(piece, start_offset, start));
    Piece added_piece;
    added_piece.added_id = token.id;
    out.push_back(std::move(added_piece));
    start_offset = stop;
  }
  if (start_offset < s.size()) out.push_back(slice(piece, start_offset, s.size()));
}

std::vector<int32_t> Pipeline::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  if (text.empty()) return ids;
  if (text.size() >= std::numeric_limits<uint32_t>::max()) {
    fail("tokenizer: a text of ", text.size(), " bytes is too long to encode (at most 4 GiB)");
  }
  Piece root;
  root.text = std::string(text);
  root.origin.resize(text.size());
  for (size_t i = 0; i < text.size(); ++i) root.origin[i] = static_cast<uint32_t>(i);

  std::vector<Piece> raw;
  split_added(std::move(root), raw_matcher, raw);
  std::vector<Piece> pieces;
  for (Piece& piece : raw) {
    if (piece.added_id >= 0) {
      pieces.push_back(std::move(piece));
      continue;
    }
    normalize(piece);
    split_added(std::move(piece), normalized_matcher, pieces);
  }
  for (const PreTokenizer& stage : pre_tokenizers) {
    std::vector<Piece> next;
    next.reserve(pieces.size());
    for (Piece& piece : pieces) {
      if (piece.added_id >= 0) {
        next.push_back(std::move(piece));
        continue;
      }
      std::visit([&](const auto& p) { pre_tokenize(p, std::move(piece), next); }, stage);
    }
    pieces = std::move(next);
  }
  ids.reserve(text.size() / 3 + 1);
  for (const Piece& piece : pieces) {
    if (piece.added_id >= 0) {
      ids.push_back(piece.added_id);
    } else {
      model.tokenize(piece.text, ids);
    }
  }
  return ids;
}

void Pipeline::decode_tokens(std::vector<std::string>& tokens, std::string& out) const {
  if (!decoders) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i) out += ' ';
      out += tokens[i];
    }
    tokens.clear();
    return;
  }
  for (const Decoder& decoder : *decoders) {
    tokens = std::visit([&](const auto& d) { return decode_step(d, std::move(tokens)); }, decoder);
  }
  for (const std::string& token : tokens) out += token;
  tokens.clear();
}

std::string Pipeline::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string text;
  std::vector<std::string> tokens;  // pending, decoded together so that split characters rejoin
  for (const int32_t id : ids) {
    const bool known = id >= 0 && static_cast<size_t>(id) < id_present.size() && id_present[id];
    if (!known) {
      decode_tokens(tokens, text);
      text += cat("<id ", id, ">");
      continue;
    }
    if (skip_special && id_special[id]) continue;
    tokens.push_back(id_strings[id]);
  }
  decode_tokens(tokens, text);
  return text;
}

}  // namespace infinigen::tokenizer_detail
