// core: the text utilities of the tokenizers: UTF-8, messages, files, and regular expressions
// written for Oniguruma (what tokenizer.json patterns are) run by PCRE2.
#include "core/tokenizer_pipeline.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"

namespace infinigen::tokenizer_detail {
namespace {

// Unicode White_Space, what `\s` means to HF's regex engines, as the inside of a PCRE2 class.
constexpr std::string_view kWhiteSpaceClass =
    R"(\t\n\x{0B}\f\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F})"
    R"(\x{205F}\x{3000})";
constexpr std::string_view kHexDigitClass = "0-9A-Fa-f";  // onig's `\h`

// ---- Pattern translation: onig syntax to PCRE2 --------------------------------------------------

// One character class starting at p[at] == '['; appends its translation and returns the offset
// past it. Inside a class `\s` and `\h` become their sets; `\S` and `\H` (complements) cannot
// join a PCRE2 class, so such a class becomes a group: [X\S] = (?:[X]|[^ws]) and
// [^X\S] = (?:(?![X])[ws]).
size_t translate_class(std::string_view p, size_t at, std::string& out) {
  size_t j = at + 1;
  const bool negated = j < p.size() && p[j] == '^';
  if (negated) ++j;
  std::string items;
  std::vector<std::string_view> complements;
  if (j < p.size() && p[j] == ']') {  // a leading ']' is a literal
    items += "\\]";
    ++j;
  }
  while (j < p.size() && p[j] != ']') {
    if (p[j] == '\\' && j + 1 < p.size()) {
      const char e = p[j + 1];
      if (e == 's') {
        items += kWhiteSpaceClass;
      } else if (e == 'h') {
        items += kHexDigitClass;
      } else if (e == 'S') {
        complements.push_back(kWhiteSpaceClass);
      } else if (e == 'H') {
        complements.push_back(kHexDigitClass);
      } else {
        items += p.substr(j, 2);
      }
      j += 2;
      continue;
    }
    if (p[j] == '[' && j + 1 < p.size() && p[j + 1] == ':') {  // POSIX [:name:]
      const size_t end = p.find(":]", j + 2);
      if (end != std::string_view::npos) {
        items += p.substr(j, end + 2 - j);
        j = end + 2;
        continue;
      }
    }
    items += p[j++];
  }
  if (j >= p.size()) {  // unterminated: PCRE2 reports it
    out += p.substr(at);
    return p.size();
  }
  ++j;
  if (complements.empty()) {
    out += negated ? "[^" : "[";
    out += items;
    out += ']';
  } else if (!negated) {
    out += "(?:";
    if (!items.empty()) out.append("[").append(items).append("]|");
    for (size_t i = 0; i < complements.size(); ++i) {
      out.append(i ? "|[^" : "[^").append(complements[i]).append("]");
    }
    out += ')';
  } else {
    out += "(?:";
    if (!items.empty()) out.append("(?![").append(items).append("])");
    for (size_t i = 0; i + 1 < complements.size(); ++i) {
      out.append("(?=[").append(complements[i]).append("])");
    }
    out.append("[").append(complements.back()).append("])");
  }
  return j;
}

std::string translate_pattern(std::string_view p) {
  std::string out;
  size_t i = 0;
  while (i < p.size()) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      if (e == 'Q') {  // literal text up to \E
        const size_t end = p.find("\\E", i + 2);
        const size_t stop = end == std::string_view::npos ? p.size() : end + 2;
        out += p.substr(i, stop - i);
        i = stop;
        continue;
      }
      if (e == 's') {
        out.append("[").append(kWhiteSpaceClass).append("]");
      } else if (e == 'S') {
        out.append("[^").append(kWhiteSpaceClass).append("]");
      } else if (e == 'h') {
        out.append("[").append(kHexDigitClass).append("]");
      } else if (e == 'H') {
        out.append("[^").append(kHexDigitClass).append("]");
      } else if (e == 'c' && i + 2 < p.size()) {  // \cX: X is not syntax
        out += p.substr(i, 3);
        ++i;
      } else {
        out += p.substr(i, 2);
      }
      i += 2;
      continue;
    }
    if (c == '[') {
      i = translate_class(p, i, out);
      continue;
    }
    out += c;
    ++i;
  }
  return out;
}

struct Pcre2CodeDeleter {
  void operator()(pcre2_code* code) const { pcre2_code_free(code); }
};
struct Pcre2MatchDataDeleter {
  void operator()(pcre2_match_data* data) const { pcre2_match_data_free(data); }
};
struct Pcre2CompileContextDeleter {
  void operator()(pcre2_compile_context* context) const { pcre2_compile_context_free(context); }
};

}  // namespace

// ---- UTF-8 --------------------------------------------------------------------------------------

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

char32_t utf8_code_point(const unsigned char* p, size_t length) {
  if (length == 1) return p[0];
  char32_t cp = p[0] & (0xFF >> (length + 1));
  for (size_t k = 1; k < length; ++k) cp = (cp << 6) | (p[k] & 0x3F);
  return cp;
}

void append_utf8(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

void append_lossy(std::string_view bytes, std::string& out) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  size_t i = 0;
  while (i < bytes.size()) {
    const Utf8Step step = utf8_step(p + i, bytes.size() - i);
    if (step.valid) {
      out.append(bytes.substr(i, step.length));
    } else {
      out.append(kReplacementCharacter);
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

std::string brief(const nlohmann::json& value) {
  if (value.is_object()) return "an object";
  if (value.is_array()) return "an array";
  std::string text = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
}

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

// ---- Regex --------------------------------------------------------------------------------------

struct Regex::Compiled {
  std::unique_ptr<pcre2_code, Pcre2CodeDeleter> code;
};

Regex Regex::pattern(std::string_view pattern, const std::string& what) {
  return compile(translate_pattern(pattern), pattern, PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE,
                 what);
}

Regex Regex::literal(std::string_view text, const std::string& what) {
  return compile(text, text, PCRE2_UTF | PCRE2_LITERAL, what);
}

Regex Regex::compile(std::string_view source, std::string_view written, uint32_t options,
                     const std::string& what) {
  std::unique_ptr<pcre2_compile_context, Pcre2CompileContextDeleter> context(
      pcre2_compile_context_create(nullptr));
  if (!context) fail(what, ": out of memory for a pattern");
  pcre2_set_newline(context.get(), PCRE2_NEWLINE_LF);
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(source.data()), source.size(),
                                   options, &error_code, &error_offset, context.get());
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    // The offset is into `source`: worth giving only where the translation left it as written.
    fail(what, ": cannot compile the pattern ", quoted(written), ": ",
         reinterpret_cast<const char*>(message),
         source == written ? cat(" (at offset ", error_offset, ")") : std::string());
  }
  auto compiled = std::make_shared<Compiled>();
  compiled->code.reset(code);
  Regex regex;
  regex.compiled_ = std::move(compiled);
  return regex;
}

std::vector<Regex::Match> Regex::find_all(std::string_view text) const {
  std::vector<Match> matches;
  if (text.empty()) return matches;

  // Invalid UTF-8 is matched as U+FFFD (what a lossy decode would hand HF); offsets map back.
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
        for (size_t k = 0; k < kReplacementCharacter.size(); ++k) original_offset.push_back(i);
        sanitized.append(kReplacementCharacter);
      }
      i += step.length;
    }
    original_offset.push_back(text.size());
    subject = sanitized;
  }
  const auto to_original = [&](size_t offset) {
    return original_offset.empty() ? offset : original_offset[offset];
  };

  std::unique_ptr<pcre2_match_data, Pcre2MatchDataDeleter> match(
      pcre2_match_data_create_from_pattern(compiled_->code.get(), nullptr));
  if (!match) fail("tokenizer: out of memory for a pattern match");
  const auto* data = reinterpret_cast<PCRE2_SPTR>(subject.data());
  const auto* bytes = reinterpret_cast<const unsigned char*>(subject.data());
  size_t search_from = 0;
  std::optional<size_t> last_match_end;
  while (search_from <= subject.size()) {
    // The subject is valid UTF-8 by construction, so PCRE2 need not check it again per match.
    const int rc = pcre2_match(compiled_->code.get(), data, subject.size(), search_from,
                               PCRE2_NO_UTF_CHECK, match.get(), nullptr);
    if (rc < 0) break;  // no match, or a resource limit: the rest stays unmatched
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match.get());
    const size_t begin = ovector[0], end = ovector[1];
    if (end < begin) break;  // \K past the end: not a pattern tokenizers use
    if (begin == end && last_match_end == end) {
      if (search_from >= subject.size()) break;
      search_from += utf8_step(bytes + search_from, subject.size() - search_from).length;
      continue;
    }
    search_from = end;
    last_match_end = end;
    matches.push_back({to_original(begin), to_original(end)});
  }
  return matches;
}

}  // namespace infinigen::tokenizer_detail
