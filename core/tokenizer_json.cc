// core: the reader of HF tokenizers' tokenizer.json (and of tokenizer_config.json's BOS/EOS).
//
// What is read, as HF tokenizers serialises it (Llama-2/3, Mistral and Qwen2 use no more):
//   model           BPE: vocab; merges as "a b" strings or [a, b] pairs; unk_token, fuse_unk,
//                   byte_fallback, ignore_merges; dropout null or 0; continuing_subword_prefix
//                   and end_of_word_suffix null or ""
//   normalizer      null, NFC, Prepend, Replace, Sequence of these
//   pre_tokenizer   null, ByteLevel, Split, Metaspace, Sequence of these
//   decoder         null, ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, Sequence
//   post_processor  null, ByteLevel, TemplateProcessing (the special token before $A is the
//                   BOS; tokens after it are not added by the engine), Sequence of these
//   added_tokens    with HF's ids: those of the vocabulary for its tokens, then the next ids in
//                   order for the others (a file that says otherwise is refused)
// Anything else is refused with one line naming the key and what is supported. truncation and
// padding are ignored: the engine sizes its sequences itself.
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <unordered_set>

#include "core/error.h"
#include "core/tokenizer_pipeline.h"

namespace infinigen::tokenizer_detail {
namespace {

using nlohmann::json;

constexpr int kMaxSequenceDepth = 8;  // Sequence inside Sequence; real files nest one deep

// Names the file and the key path ("pre_tokenizer.pretokenizers[1].pattern") in messages.
class Reader {
 public:
  explicit Reader(std::string file) : file_(std::move(file)) {}

  // "<file>: <path>", what messages start with ("<file>" for the root).
  std::string at(const std::string& path) const {
    return path.empty() ? file_ : cat(file_, ": ", path);
  }

  template <typename... Parts>
  [[noreturn]] void fail_at(const std::string& path, Parts&&... parts) const {
    fail(at(path), ": ", std::forward<Parts>(parts)...);
  }

  const json& object_at(const json& parent, const char* key, const std::string& path) const {
    const auto it = parent.find(key);
    if (it == parent.end()) fail_at(path, "missing \"", key, "\"");
    if (!it->is_object()) fail_at(join(path, key), "expected an object, found ", brief(*it));
    return *it;
  }

  const json& array_at(const json& parent, const char* key, const std::string& path) const {
    const auto it = parent.find(key);
    if (it == parent.end()) fail_at(path, "missing \"", key, "\"");
    if (!it->is_array()) fail_at(join(path, key), "expected an array, found ", brief(*it));
    return *it;
  }

  std::string string_at(const json& parent, const char* key, const std::string& path) const {
    const auto it = parent.find(key);
    if (it == parent.end()) fail_at(path, "missing \"", key, "\"");
    if (!it->is_string()) fail_at(join(path, key), "expected a string, found ", brief(*it));
    return it->get<std::string>();
  }

  // Absent or null: none.
  std::optional<std::string> optional_string_at(const json& parent, const char* key,
                                                const std::string& path) const {
    const auto it = parent.find(key);
    if (it == parent.end() || it->is_null()) return std::nullopt;
    if (!it->is_string()) fail_at(join(path, key), "expected a string, found ", brief(*it));
    return it->get<std::string>();
  }

  // Absent or null: `fallback`.
  bool bool_at(const json& parent, const char* key, const std::string& path, bool fallback) const {
    const auto it = parent.find(key);
    if (it == parent.end() || it->is_null()) return fallback;
    if (!it->is_boolean()) fail_at(join(path, key), "expected true or false, found ", brief(*it));
    return it->get<bool>();
  }

  size_t size_at(const json& parent, const char* key, const std::string& path) const {
    const auto it = parent.find(key);
    if (it == parent.end()) fail_at(path, "missing \"", key, "\"");
    if (!it->is_number_unsigned()) {
      fail_at(join(path, key), "expected a non-negative integer, found ", brief(*it));
    }
    return static_cast<size_t>(std::min<uint64_t>(it->get<uint64_t>(), SIZE_MAX));
  }

  std::string type_of(const json& stage, const std::string& path) const {
    if (!stage.is_object()) fail_at(path, "expected an object, found ", brief(stage));
    return string_at(stage, "type", path);
  }

  // A one-character string (HF's `char` fields).
  char32_t char_at(const json& parent, const char* key, const std::string& path) const {
    const std::string text = string_at(parent, key, path);
    const auto* p = reinterpret_cast<const unsigned char*>(text.data());
    if (text.empty() || utf8_step(p, text.size()).length != text.size()) {
      fail_at(join(path, key), "expected one character, found ", quoted(text));
    }
    return utf8_code_point(p, text.size());
  }

  // A Split / Replace pattern: {"String": literal} or {"Regex": onig pattern}.
  Regex pattern_at(const json& parent, const std::string& path) const {
    const json& pattern = object_at(parent, "pattern", path);
    const std::string where = join(path, "pattern");
    if (pattern.size() == 1 && pattern.contains("String")) {
      return Regex::literal(string_at(pattern, "String", where), at(where));
    }
    if (pattern.size() == 1 && pattern.contains("Regex")) {
      return Regex::pattern(string_at(pattern, "Regex", where), at(where));
    }
    fail_at(where, "expected {\"String\": ...} or {\"Regex\": ...}");
  }

  static std::string join(const std::string& path, const char* key) {
    return path.empty() ? std::string(key) : path + "." + key;
  }
  static std::string index(const std::string& path, size_t i) { return cat(path, "[", i, "]"); }

 private:
  std::string file_;
};

[[noreturn]] void unsupported(const Reader& reader, const std::string& path,
                              const std::string& type, const char* supported) {
  reader.fail_at(path + ".type", quoted(type), " is not supported (supported: ", supported, ")");
}

PrependScheme prepend_scheme_of(const Reader& reader, const json& stage, const std::string& path) {
  const auto scheme = reader.optional_string_at(stage, "prepend_scheme", path);
  PrependScheme result = PrependScheme::Always;  // HF's default
  if (scheme == "first") {
    result = PrependScheme::First;
  } else if (scheme == "never") {
    result = PrependScheme::Never;
  } else if (scheme && scheme != "always") {
    reader.fail_at(Reader::join(path, "prepend_scheme"), quoted(*scheme),
                   " is not one of \"first\", \"never\", \"always\"");
  }
  // Older files say add_prefix_space instead; HF refuses a file where the two disagree.
  const auto add_prefix_space = stage.find("add_prefix_space");
  if (add_prefix_space != stage.end() && add_prefix_space->is_boolean() &&
      !add_prefix_space->get<bool>()) {
    if (scheme && result != PrependScheme::Never) {
      reader.fail_at(path, "add_prefix_space false does not match prepend_scheme ",
                     quoted(*scheme));
    }
    result = PrependScheme::Never;
  }
  return result;
}

// The stages of a Sequence stage, its array `key`, each read by `read_stage(item, path, depth)`
// one level deeper; nesting past kMaxSequenceDepth is refused.
template <typename ReadStage>
void read_sequence(const Reader& reader, const json& stage, const std::string& path, int depth,
                   const char* key, ReadStage read_stage) {
  if (depth >= kMaxSequenceDepth) {
    reader.fail_at(path, "Sequences nested more than ", kMaxSequenceDepth, " deep");
  }
  const json& items = reader.array_at(stage, key, path);
  for (size_t i = 0; i < items.size(); ++i) {
    read_stage(items[i], Reader::index(Reader::join(path, key), i), depth + 1);
  }
}

// The same for the stages that `read` appends to `out` (normalizers, pre-tokenizers, decoders).
template <typename Stage>
void read_sequence(const Reader& reader, const json& stage, const std::string& path, int depth,
                   const char* key,
                   void (*read)(const Reader&, const json&, const std::string&, int,
                                std::vector<Stage>&),
                   std::vector<Stage>& out) {
  read_sequence(reader, stage, path, depth, key,
                [&](const json& item, const std::string& item_path, int item_depth) {
                  read(reader, item, item_path, item_depth, out);
                });
}

void read_model(const Reader& reader, const json& root, BpeModel& model) {
  const json& m = reader.object_at(root, "model", "");
  const std::string type = reader.type_of(m, "model");
  if (type != "BPE") unsupported(reader, "model", type, "BPE");
  if (const auto dropout = m.find("dropout"); dropout != m.end() && !dropout->is_null()) {
    if (!dropout->is_number() || dropout->get<double>() != 0.0) {
      reader.fail_at("model.dropout", "BPE dropout (", brief(*dropout),
                     ") is not supported: it makes encoding random");
    }
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const auto value = reader.optional_string_at(m, key, "model");
    if (value && !value->empty()) {
      reader.fail_at(Reader::join("model", key), quoted(*value),
                     " is not supported (only null or \"\")");
    }
  }
  model.load_vocabulary(reader.object_at(m, "vocab", "model"), reader.at("model.vocab"));
  const json& merges = reader.array_at(m, "merges", "model");
  for (size_t i = 0; i < merges.size(); ++i) {
    const json& merge = merges[i];
    std::string left, right;
    if (merge.is_string()) {
      const std::string& line = merge.get_ref<const std::string&>();
      const size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
        reader.fail_at(Reader::index("model.merges", i),
                       "expected two tokens separated by one space, found ", quoted(line));
      }
      left = line.substr(0, space);
      right = line.substr(space + 1);
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() &&
               merge[1].is_string()) {
      left = merge[0].get<std::string>();
      right = merge[1].get<std::string>();
    } else {
      reader.fail_at(Reader::index("model.merges", i), "expected \"a b\" or [\"a\", \"b\"], found ",
                     brief(merge));
    }
    if (const auto problem = model.add_merge(left, right, static_cast<uint32_t>(i))) {
      reader.fail_at(Reader::index("model.merges", i), *problem);
    }
  }
  if (const auto unk = reader.optional_string_at(m, "unk_token", "model")) {
    const auto it = model.vocab().find(*unk);
    if (it == model.vocab().end()) {
      reader.fail_at("model.unk_token", quoted(*unk), " is not in the vocabulary");
    }
    model.unk_id = it->second;
  }
  model.fuse_unk = reader.bool_at(m, "fuse_unk", "model", false);
  model.byte_fallback = reader.bool_at(m, "byte_fallback", "model", false);
  model.ignore_merges = reader.bool_at(m, "ignore_merges", "model", false);
}

void read_normalizer(const Reader& reader, const json& stage, const std::string& path, int depth,
                     std::vector<Normalizer>& out) {
  if (stage.is_null()) return;
  const std::string type = reader.type_of(stage, path);
  if (type == "NFC") {
    out.emplace_back(NfcNormalizer{});
  } else if (type == "Prepend") {
    out.emplace_back(PrependNormalizer{reader.string_at(stage, "prepend", path)});
  } else if (type == "Replace") {
    Regex pattern = reader.pattern_at(stage, path);
    out.emplace_back(
        ReplaceNormalizer{std::move(pattern), reader.string_at(stage, "content", path)});
  } else if (type == "Sequence") {
    read_sequence(reader, stage, path, depth, "normalizers", read_normalizer, out);
  } else {
    unsupported(reader, path, type, "NFC, Prepend, Replace, Sequence");
  }
}

SplitBehavior behavior_of(const Reader& reader, const json& stage, const std::string& path) {
  const std::string behavior = reader.string_at(stage, "behavior", path);
  static const std::unordered_map<std::string, SplitBehavior> kBehaviors = {
      {"Removed", SplitBehavior::Removed},
      {"Isolated", SplitBehavior::Isolated},
      {"MergedWithPrevious", SplitBehavior::MergedWithPrevious},
      {"MergedWithNext", SplitBehavior::MergedWithNext},
      {"Contiguous", SplitBehavior::Contiguous}};
  const auto it = kBehaviors.find(behavior);
  if (it == kBehaviors.end()) {
    reader.fail_at(path + ".behavior", quoted(behavior),
                   " is not one of Removed, Isolated, MergedWithPrevious, MergedWithNext, "
                   "Contiguous");
  }
  return it->second;
}

std::string replacement_of(const Reader& reader, const json& stage, const std::string& path) {
  std::string replacement;
  append_utf8(reader.char_at(stage, "replacement", path), replacement);
  return replacement;
}

void read_pre_tokenizer(const Reader& reader, const json& stage, const std::string& path, int depth,
                        std::vector<PreTokenizer>& out) {
  if (stage.is_null()) return;
  const std::string type = reader.type_of(stage, path);
  if (type == "ByteLevel") {
    const auto add_prefix_space = stage.find("add_prefix_space");
    if (add_prefix_space == stage.end()) reader.fail_at(path, "missing \"add_prefix_space\"");
    out.emplace_back(ByteLevelPreTokenizer{
        .add_prefix_space = reader.bool_at(stage, "add_prefix_space", path, false),
        .use_regex = reader.bool_at(stage, "use_regex", path, true)});
  } else if (type == "Split") {
    Regex pattern = reader.pattern_at(stage, path);
    out.emplace_back(SplitPreTokenizer{.pattern = std::move(pattern),
                                       .behavior = behavior_of(reader, stage, path),
                                       .invert = reader.bool_at(stage, "invert", path, false)});
  } else if (type == "Metaspace") {
    out.emplace_back(MetaspacePreTokenizer{.replacement = replacement_of(reader, stage, path),
                                           .prepend_scheme = prepend_scheme_of(reader, stage, path),
                                           .split = reader.bool_at(stage, "split", path, true)});
  } else if (type == "Sequence") {
    read_sequence(reader, stage, path, depth, "pretokenizers", read_pre_tokenizer, out);
  } else {
    unsupported(reader, path, type, "ByteLevel, Split, Metaspace, Sequence");
  }
}

void read_decoder(const Reader& reader, const json& stage, const std::string& path, int depth,
                  std::vector<Decoder>& out) {
  const std::string type = reader.type_of(stage, path);
  if (type == "ByteLevel") {
    out.emplace_back(ByteLevelDecoder{});
  } else if (type == "Metaspace") {
    out.emplace_back(MetaspaceDecoder{
        .replacement = replacement_of(reader, stage, path),
        .drop_in_first_token = prepend_scheme_of(reader, stage, path) != PrependScheme::Never});
  } else if (type == "Replace") {
    Regex pattern = reader.pattern_at(stage, path);
    out.emplace_back(ReplaceDecoder{std::move(pattern), reader.string_at(stage, "content", path)});
  } else if (type == "ByteFallback") {
    out.emplace_back(ByteFallbackDecoder{});
  } else if (type == "Fuse") {
    out.emplace_back(FuseDecoder{});
  } else if (type == "Strip") {
    out.emplace_back(StripDecoder{.content = reader.char_at(stage, "content", path),
                                  .start = reader.size_at(stage, "start", path),
                                  .stop = reader.size_at(stage, "stop", path)});
  } else if (type == "Sequence") {
    read_sequence(reader, stage, path, depth, "decoders", read_decoder, out);
  } else {
    unsupported(reader, path, type,
                "ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, Sequence");
  }
}

// The BOS of a TemplateProcessing: the special token its single-sequence template puts before
// $A. `bos` is set at most once over the post-processors of a Sequence.
void read_post_processor(const Reader& reader, const json& stage, const std::string& path,
                         int depth, const Pipeline& pipeline, std::optional<int32_t>& bos,
                         bool& seen_template) {
  if (stage.is_null()) return;
  const std::string type = reader.type_of(stage, path);
  if (type == "ByteLevel") return;  // offsets only
  if (type == "Sequence") {
    read_sequence(reader, stage, path, depth, "processors",
                  [&](const json& item, const std::string& item_path, int item_depth) {
                    read_post_processor(reader, item, item_path, item_depth, pipeline, bos,
                                        seen_template);
                  });
    return;
  }
  if (type != "TemplateProcessing") {
    unsupported(reader, path, type, "TemplateProcessing, ByteLevel, Sequence");
  }
  if (seen_template) reader.fail_at(path, "a second TemplateProcessing");
  seen_template = true;
  const json& single = reader.array_at(stage, "single", path);
  const json& special_tokens = reader.object_at(stage, "special_tokens", path);
  std::vector<std::string> before;  // special tokens before $A
  bool seen_sequence = false;
  for (size_t i = 0; i < single.size(); ++i) {
    const std::string where = Reader::index(path + ".single", i);
    const json& piece = single[i];
    if (piece.is_object() && piece.contains("Sequence")) {
      seen_sequence = true;
    } else if (piece.is_object() && piece.contains("SpecialToken")) {
      const json& token = reader.object_at(piece, "SpecialToken", where);
      if (!seen_sequence) before.push_back(reader.string_at(token, "id", where + ".SpecialToken"));
    } else {
      reader.fail_at(where, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
    }
  }
  if (!seen_sequence) reader.fail_at(path + ".single", "no $A in the template");
  if (before.empty()) return;
  if (before.size() > 1) {
    reader.fail_at(path + ".single", before.size(),
                   " special tokens before $A; the engine puts one BOS token first");
  }
  const std::string where = path + ".special_tokens";
  const auto it = special_tokens.find(before.front());
  if (it == special_tokens.end()) reader.fail_at(where, "no entry for ", quoted(before.front()));
  const json& ids = reader.array_at(*it, "ids", Reader::join(where, before.front().c_str()));
  if (ids.size() != 1 || !ids[0].is_number_integer()) {
    reader.fail_at(Reader::join(where, before.front().c_str()),
                   "expected one id for the BOS token, found ", brief(ids));
  }
  const auto id = ids[0].get<int64_t>();
  if (id < 0 || id >= static_cast<int64_t>(pipeline.id_present.size()) ||
      !pipeline.id_present[id]) {
    reader.fail_at(Reader::join(where, before.front().c_str()), "id ", id,
                   " of the BOS token names no token");
  }
  bos = static_cast<int32_t>(id);
}

// HF's AddedVocabulary::add_tokens over the file's list, which assigns the ids (the file's own
// ids are only checked, with a warning, by HF): a content already added or in the vocabulary
// keeps its id, every other one takes the next id from the vocabulary's size on.
void read_added_tokens(const Reader& reader, const json& root, Pipeline& pipeline,
                       std::unordered_set<std::string>& special_contents) {
  const auto list = root.find("added_tokens");
  if (list == root.end() || list->is_null()) return;
  if (!list->is_array()) reader.fail_at("added_tokens", "expected an array, found ", brief(*list));
  std::unordered_map<std::string, size_t> index_of;  // content -> index in pipeline.added
  int64_t next_id = static_cast<int64_t>(pipeline.model.vocab().size());
  for (size_t i = 0; i < list->size(); ++i) {
    const std::string path = Reader::index("added_tokens", i);
    const json& item = (*list)[i];
    if (!item.is_object()) reader.fail_at(path, "expected an object, found ", brief(item));
    AddedToken token;
    token.content = reader.string_at(item, "content", path);
    token.special = reader.bool_at(item, "special", path, false);
    token.lstrip = reader.bool_at(item, "lstrip", path, false);
    token.rstrip = reader.bool_at(item, "rstrip", path, false);
    token.single_word = reader.bool_at(item, "single_word", path, false);
    token.normalized = reader.bool_at(item, "normalized", path, !token.special);
    const auto id_it = item.find("id");
    if (id_it == item.end()) reader.fail_at(path, "missing \"id\"");
    if (!id_it->is_number_integer())
      reader.fail_at(path + ".id", "expected an integer, found ", brief(*id_it));
    const int64_t file_id =
        id_it->is_number_unsigned()
            ? static_cast<int64_t>(std::min<uint64_t>(id_it->get<uint64_t>(), INT64_MAX))
            : id_it->get<int64_t>();
    if (token.content.empty()) continue;  // HF ignores it

    const auto existing = index_of.find(token.content);
    const auto in_vocab = pipeline.model.vocab().find(token.content);
    int64_t id = 0;
    if (existing != index_of.end()) {
      id = pipeline.added[existing->second].id;
    } else if (in_vocab != pipeline.model.vocab().end()) {
      id = in_vocab->second;
    } else {
      id = next_id++;
    }
    if (file_id != id) {
      reader.fail_at(path, "token ", quoted(token.content), " has id ", file_id,
                     existing != index_of.end() || in_vocab != pipeline.model.vocab().end()
                         ? cat(", but the same token has id ", id)
                         : cat(", but a token outside the vocabulary gets the next free id, ", id,
                               " (the vocabulary has ", pipeline.model.vocab().size(),
                               " tokens, and added tokens follow in order)"));
    }
    if (in_vocab == pipeline.model.vocab().end() && pipeline.model.has_id(id)) {
      reader.fail_at(path, "token ", quoted(token.content), " gets id ", id,
                     ", which already names vocabulary token ",
                     quoted(pipeline.model.tokens()[static_cast<size_t>(id)]));
    }
    token.id = static_cast<int32_t>(id);
    token.pattern = token.content;
    if (token.normalized && !pipeline.normalizers.empty()) {
      Piece piece;
      piece.text = token.content;
      piece.origin.assign(token.content.size(), 0);
      pipeline.normalize(piece);
      token.pattern = std::move(piece.text);
      if (token.pattern.empty()) {
        reader.fail_at(path, "token ", quoted(token.content), " is empty once normalized");
      }
    }
    if (token.special) special_contents.insert(token.content);
    if (existing != index_of.end()) {
      pipeline.added[existing->second] = std::move(token);  // the later flags win, as in HF
    } else {
      index_of.emplace(token.content, pipeline.added.size());
      pipeline.added_ids.emplace(token.content, token.id);
      pipeline.added.push_back(std::move(token));
    }
  }
  // Two tokens matched by the same string cannot both be found in text (HF refuses to build).
  std::unordered_map<std::string, const AddedToken*> seen[2];
  for (const AddedToken& token : pipeline.added) {
    const auto [it, inserted] = seen[token.normalized].emplace(token.pattern, &token);
    if (!inserted) {
      reader.fail_at("added_tokens", "tokens ", quoted(it->second->content), " and ",
                     quoted(token.content), " are both matched by ", quoted(token.pattern));
    }
  }
}

// `text` (the contents of `file`) as a JSON object; anything else is an Error naming the file.
json parse_object(std::string_view text, const std::string& file) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    fail(file, ": malformed JSON: ", e.what());
  }
  if (!root.is_object()) fail(file, ": expected a JSON object, found ", brief(root));
  return root;
}

}  // namespace

void load_tokenizer_json(std::string_view text, const std::string& file, Pipeline& pipeline) {
  const json root = parse_object(text, file);
  const Reader reader(file);
  if (const auto version = reader.optional_string_at(root, "version", "");
      version && *version != "1.0") {
    reader.fail_at("version", quoted(*version), " is not supported (only \"1.0\")");
  }
  read_model(reader, root, pipeline.model);
  if (const auto it = root.find("normalizer"); it != root.end()) {
    read_normalizer(reader, *it, "normalizer", 0, pipeline.normalizers);
  }
  if (const auto it = root.find("pre_tokenizer"); it != root.end()) {
    read_pre_tokenizer(reader, *it, "pre_tokenizer", 0, pipeline.pre_tokenizers);
  }
  if (const auto it = root.find("decoder"); it != root.end() && !it->is_null()) {
    pipeline.decoders.emplace();
    read_decoder(reader, *it, "decoder", 0, *pipeline.decoders);
  }
  std::unordered_set<std::string> special_contents;
  read_added_tokens(reader, root, pipeline, special_contents);
  pipeline.finish(special_contents);
  if (const auto it = root.find("post_processor"); it != root.end()) {
    bool seen_template = false;
    read_post_processor(reader, *it, "post_processor", 0, pipeline, pipeline.bos, seen_template);
  }
}

void apply_tokenizer_config(std::string_view text, const std::string& file, Pipeline& pipeline,
                            bool bos_token_sets_bos) {
  const json root = parse_object(text, file);
  // A key naming a token: absent (not `given`), null (given, no id) or the token's content.
  struct NamedToken {
    bool given = false;
    std::optional<int32_t> id;
  };
  const auto token_of = [&](const char* key) {
    NamedToken named;
    const auto it = root.find(key);
    if (it == root.end()) return named;
    named.given = true;
    if (it->is_null()) return named;
    const json* content = &*it;
    if (it->is_object()) {  // an AddedToken: {"__type": "AddedToken", "content": ...}
      const auto c = it->find("content");
      if (c == it->end()) fail(file, ": ", key, ": missing \"content\"");
      content = &*c;
    }
    if (!content->is_string())
      fail(file, ": ", key, ": expected a string, found ", brief(*content));
    const std::string& name = content->get_ref<const std::string&>();
    named.id = pipeline.token_to_id(name);
    if (!named.id) fail(file, ": ", key, " ", quoted(name), " is not a token of the tokenizer");
    return named;
  };
  if (const NamedToken eos = token_of("eos_token"); eos.given) pipeline.eos = eos.id;
  const NamedToken named_bos = token_of("bos_token");
  const auto add_bos = root.find("add_bos_token");
  if (add_bos != root.end() && !add_bos->is_null()) {
    if (!add_bos->is_boolean()) {
      fail(file, ": add_bos_token: expected true or false, found ", brief(*add_bos));
    }
    if (!add_bos->get<bool>()) {
      pipeline.bos.reset();
    } else {
      if (named_bos.id) pipeline.bos = named_bos.id;
      if (!pipeline.bos) fail(file, ": add_bos_token is true but no bos_token names a token");
    }
  } else if (bos_token_sets_bos && named_bos.given) {
    pipeline.bos = named_bos.id;
  }
}

}  // namespace infinigen::tokenizer_detail
