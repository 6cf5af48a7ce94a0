// bench: passkey retrieval through the engine's generation.
#include "bench/passkey.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>
#include <random>

#include "bench/kv_fetched.h"
#include "core/error.h"
#include "core/resources.h"

namespace infinigen {
namespace {

constexpr std::string_view kKeyPlaceholder = "{key}";

// Common English nouns and adjectives, none of them a word of the built-in template.
constexpr std::string_view kKeyWords[] = {
    "apple",   "river",   "garden",  "window",  "silver",  "candle",  "forest",  "bridge",
    "orange",  "pencil",  "castle",  "rabbit",  "island",  "camera",  "dragon",  "planet",
    "violin",  "anchor",  "basket",  "blanket", "butter",  "carpet",  "cherry",  "cloud",
    "coffee",  "copper",  "cotton",  "desert",  "doctor",  "engine",  "falcon",  "farmer",
    "feather", "finger",  "flower",  "galaxy",  "guitar",  "hammer",  "harbor",  "helmet",
    "honey",   "jacket",  "jungle",  "kettle",  "kitten",  "ladder",  "lemon",   "letter",
    "lizard",  "magnet",  "marble",  "meadow",  "mirror",  "monkey",  "ocean",   "paper",
    "parrot",  "pepper",  "pillow",  "pirate",  "pocket",  "potato",  "puzzle",  "rocket",
    "saddle",  "salmon",  "shadow",  "sugar",   "summer",  "sunset",  "tiger",   "tomato",
    "tower",   "tunnel",  "turtle",  "valley",  "velvet",  "wagon",   "walnut",  "winter",
    "wizard",  "yellow",  "zebra",   "button",  "circle",  "dinner",  "bottle",  "canvas",
    "cactus",  "dolphin", "eagle",   "lantern", "orchard", "penguin", "thunder", "trumpet",
    "whistle", "compass", "diamond", "mountain"};

constexpr int64_t kDigits = 5;

bool holds_placeholder(const std::string& text) {
  return text.find(kKeyPlaceholder) != std::string::npos;
}

bool is_ascii_alphanumeric(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}

}  // namespace

const PasskeyTemplate& PasskeyTemplate::built_in() {
  static const PasskeyTemplate bundled = [] {
    const std::string_view path = "passkey/template.json";
    const std::optional<std::string_view> text = embedded_config(path);
    INFINIGEN_CHECK(text.has_value(), "configs/", path, " was not embedded in this build");
    const PasskeyTemplate parsed = from_json(*text, cat("configs/", path), PasskeyTemplate{});
    INFINIGEN_CHECK(!parsed.intro.empty() && !parsed.question.empty(), "configs/", path,
                    " must give \"intro\", \"needle\" and \"question\"");
    return parsed;
  }();
  return bundled;
}

PasskeyTemplate PasskeyTemplate::from_json(std::string_view text, const std::string& source,
                                           const PasskeyTemplate& base) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  INFINIGEN_CHECK(j.is_object(), source,
                  ": not a JSON object of \"intro\", \"needle\" and \"question\" strings");
  PasskeyTemplate result = base;
  for (const auto& [name, value] : j.items()) {
    std::string* field = name == "intro"      ? &result.intro
                         : name == "needle"   ? &result.needle
                         : name == "question" ? &result.question
                                              : nullptr;
    INFINIGEN_CHECK(field != nullptr, source, ": unknown field \"", name,
                    "\" (a template has \"intro\", \"needle\" and \"question\")");
    INFINIGEN_CHECK(value.is_string(), source, ": \"", name, "\" must be a string");
    *field = value.get<std::string>();
  }
  INFINIGEN_CHECK(holds_placeholder(result.needle), source,
                  ": \"needle\" must hold {key}, where the key goes");
  INFINIGEN_CHECK(!holds_placeholder(result.intro) && !holds_placeholder(result.question), source,
                  ": only \"needle\" may hold {key} (the intro and question would give it away)");
  return result;
}

std::string PasskeyTemplate::needle_with(const std::string& key) const {
  std::string text = needle;
  for (size_t at = text.find(kKeyPlaceholder); at != std::string::npos;
       at = text.find(kKeyPlaceholder, at + key.size())) {
    text.replace(at, kKeyPlaceholder.size(), key);
  }
  return text;
}

PasskeyKeyKind parse_passkey_key_kind(std::string_view text) {
  if (text == "digits") return PasskeyKeyKind::Digits;
  if (text == "word") return PasskeyKeyKind::Word;
  fail(option("key_kind"), " must be digits or word, got '", text, "'");
}

const char* passkey_key_kind_name(PasskeyKeyKind kind) {
  return kind == PasskeyKeyKind::Digits ? "digits" : "word";
}

int64_t longest_passkey_key(PasskeyKeyKind kind) {
  if (kind == PasskeyKeyKind::Digits) return kDigits;
  size_t longest = 0;
  for (std::string_view word : kKeyWords) longest = std::max(longest, word.size());
  return static_cast<int64_t>(longest);
}

PasskeyFiller passkey_filler(const Tokenizer& tokenizer, std::string_view text,
                             const std::string& name, size_t max_tokens) {
  PasskeyFiller filler{name, tokenizer.encode_bounded(text, max_tokens), {}};
  if (filler.ids.size() > max_tokens) filler.ids.resize(max_tokens);
  INFINIGEN_CHECK(!filler.ids.empty(), option("filler"), " ", name,
                  ": no text to fill the prompts with");
  filler.line_starts.push_back(0);
  for (size_t i = 1; i < filler.ids.size(); ++i) {
    if (tokenizer.decode({filler.ids[i - 1]}).ends_with('\n')) {
      filler.line_starts.push_back(static_cast<int64_t>(i));
    }
  }
  return filler;
}

std::string_view bundled_passkey_filler() {
  return *embedded_config("calibration.txt");
}

PasskeyDraw draw_passkey(PasskeyKeyKind kind, const PasskeyFiller& filler, uint64_t seed,
                         int64_t length, double depth, int64_t trial) {
  // std::seed_seq and std::mt19937_64 are specified exactly; the std distributions are not.
  std::seed_seq seeds{static_cast<uint32_t>(seed),
                      static_cast<uint32_t>(seed >> 32),
                      static_cast<uint32_t>(length),
                      static_cast<uint32_t>(length >> 32),
                      static_cast<uint32_t>(std::llround(depth * 1e6)),
                      static_cast<uint32_t>(trial)};
  std::mt19937_64 rng(seeds);
  PasskeyDraw draw;
  if (kind == PasskeyKeyKind::Digits) {
    draw.key = std::to_string(10000 + rng() % 90000);  // five digits, the first not 0
  } else {
    draw.key = std::string(kKeyWords[rng() % std::size(kKeyWords)]);
  }
  draw.filler_start = filler.line_starts[rng() % filler.line_starts.size()];
  return draw;
}

PasskeyPrompt passkey_prompt(const Tokenizer& tokenizer, std::optional<int32_t> bos,
                             const PasskeyTemplate& text, const PasskeyFiller& filler,
                             int64_t length, double depth, const PasskeyDraw& draw) {
  const std::vector<int32_t> intro = tokenizer.encode(text.intro);
  const std::vector<int32_t> needle = tokenizer.encode(text.needle_with(draw.key));
  const std::vector<int32_t> question = tokenizer.encode(text.question);
  const int64_t fixed =
      (bos ? 1 : 0) + std::ssize(intro) + std::ssize(needle) + std::ssize(question);
  INFINIGEN_CHECK(length >= fixed, option("lengths"), " ", length,
                  " cannot hold the prompt without filler: ", fixed,
                  " tokens (BOS, intro, needle and question)");
  const int64_t filler_tokens = length - fixed;
  const int64_t cut = std::llround(depth * static_cast<double>(filler_tokens));

  PasskeyPrompt prompt;
  prompt.key = draw.key;
  prompt.answer_tokens = std::ssize(tokenizer.encode(" " + draw.key));
  std::vector<int32_t>& ids = prompt.ids;
  ids.reserve(static_cast<size_t>(length));
  if (bos) ids.push_back(*bos);
  ids.insert(ids.end(), intro.begin(), intro.end());
  const size_t n = filler.ids.size();
  auto add_filler = [&](int64_t from, int64_t to) {
    for (int64_t i = from; i < to; ++i) {
      ids.push_back(filler.ids[static_cast<size_t>(draw.filler_start + i) % n]);
    }
  };
  add_filler(0, cut);
  prompt.needle_begin = std::ssize(ids);
  ids.insert(ids.end(), needle.begin(), needle.end());
  prompt.needle_end = std::ssize(ids);
  add_filler(cut, filler_tokens);
  ids.insert(ids.end(), question.begin(), question.end());
  return prompt;
}

bool passkey_answer_correct(std::string_view generated, std::string_view key) {
  const size_t start = generated.find_first_not_of(" \t\r\n");
  if (start == std::string_view::npos) return false;
  const std::string_view answer = generated.substr(start);
  if (!answer.starts_with(key)) return false;
  return answer.size() == key.size() || !is_ascii_alphanumeric(answer[key.size()]);
}

Interval wilson_interval(int64_t correct, int64_t trials, double z) {
  if (trials <= 0) return {0.0, 1.0};
  const double n = static_cast<double>(trials), p = static_cast<double>(correct) / n;
  const double z2 = z * z;
  const double center = (p + z2 / (2 * n)) / (1 + z2 / n);
  const double half = z * std::sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n);
  // At 0 and at all correct the bounds are 0 and 1 exactly (not a rounding error away).
  return {correct == 0 ? 0.0 : center - half, correct == trials ? 1.0 : center + half};
}

int64_t PasskeyOptions::dropped(int64_t length, int64_t max_positions) const {
  return PastContextOptions::dropped(length, generated_bound(), max_positions);
}

int64_t PasskeyOptions::generated_bound() const {
  // The key's bytes and its leading space, one more for a tokenizer that prepends a space marker.
  return longest_passkey_key(key_kind) + 2 + kExtraTokens;
}

std::vector<int64_t> PasskeyOptions::lengths_or_default(int64_t max_positions) const {
  if (!lengths.empty()) return lengths;
  const int64_t longest = max_positions - generated_bound();
  std::vector<int64_t> spread;
  for (const int64_t eighths : {1, 2, 4, 6}) {
    const int64_t length = max_positions * eighths / 8;
    if (length < longest) spread.push_back(length);
  }
  spread.push_back(longest / 8 * 8);  // the longest that fits, rounded down to 8 tokens
  spread.erase(std::unique(spread.begin(), spread.end()), spread.end());
  return spread;
}

void PasskeyOptions::validate(int64_t max_positions) const {
  for (const double depth : depths) {
    INFINIGEN_CHECK(depth >= 0.0 && depth <= 1.0, option("depths"),
                    " are fractions of the filler in [0, 1], got ", depth);
  }
  INFINIGEN_CHECK(!depths.empty(), option("depths"), " is empty");
  for (size_t i = 0; i < depths.size(); ++i) {
    INFINIGEN_CHECK(std::find(depths.begin(), depths.begin() + static_cast<std::ptrdiff_t>(i),
                              depths[i]) == depths.begin() + static_cast<std::ptrdiff_t>(i),
                    option("depths"), " lists ", depths[i], " twice");
  }
  for (size_t i = 0; i < lengths.size(); ++i) {
    INFINIGEN_CHECK(std::find(lengths.begin(), lengths.begin() + static_cast<std::ptrdiff_t>(i),
                              lengths[i]) == lengths.begin() + static_cast<std::ptrdiff_t>(i),
                    option("lengths"), " lists ", lengths[i], " twice");
  }
  INFINIGEN_CHECK(trials >= 1, option("trials"), " must be at least 1, got ", trials);
  INFINIGEN_CHECK(batch >= 1, option("batch"), " must be at least 1, got ", batch);
  past.validate();
  const int64_t longest = max_positions - generated_bound();
  const int64_t longest_past = past.longest_prompt(generated_bound(), max_positions);
  for (const int64_t length : lengths_or_default(max_positions)) {
    INFINIGEN_CHECK(length >= 1, option("lengths"), " must be at least 1 token, got ", length);
    INFINIGEN_CHECK(length <= longest || past.mode != PastContext::Refuse, option("lengths"), " ",
                    length, " leaves no room for the answer in the model's context of ",
                    max_positions, " positions (", generated_bound(), " generated tokens: at most ",
                    longest, "; ", option("past_context"), " runs longer ones)");
    INFINIGEN_CHECK(length <= longest_past, option("lengths"), " ", length, " would drop ",
                    dropped(length, max_positions), " tokens after the kept ", past.keep_prefix,
                    ", more than its first turn (half of it) holds: at most ", longest_past);
  }
}

std::vector<PasskeyCell> passkey_cells(const Tokenizer& tokenizer, std::optional<int32_t> bos,
                                       const PasskeyTemplate& text, const PasskeyFiller& filler,
                                       const PasskeyOptions& options, int64_t max_positions) {
  options.validate(max_positions);
  std::vector<PasskeyCell> cells;
  for (const int64_t length : options.lengths_or_default(max_positions)) {
    for (const double depth : options.depths) {
      PasskeyCell cell{length, depth, {}};
      for (int64_t trial = 0; trial < options.trials; ++trial) {
        const PasskeyDraw draw =
            draw_passkey(options.key_kind, filler, options.seed, length, depth, trial);
        cell.prompts.push_back(passkey_prompt(tokenizer, bos, text, filler, length, depth, draw));
      }
      cells.push_back(std::move(cell));
    }
  }
  return cells;
}

PasskeyResult measure_passkey(const ModelSource& model, const std::vector<PasskeyCell>& cells,
                              const PasskeyOptions& options, const OffloadOptions& offload,
                              Device device, DType kv_dtype,
                              const std::function<void(int64_t, int64_t)>& progress) {
  INFINIGEN_CHECK(model.tokenizer.has_value(), model.description,
                  " has no tokenizer to read its answers with");
  const ModelConfig& config = model.config;
  PasskeyResult result;
  KvFetchedTally tally(config.num_layers, offload.speculation.dense_layers);
  // The prompts of one length, whatever their depth, share batches (no padding).
  struct Trial {
    size_t cell;
    size_t prompt;
  };
  std::vector<std::vector<Trial>> by_length;
  int64_t total = 0;
  for (size_t c = 0; c < cells.size(); ++c) {
    result.cells.push_back({cells[c].length, cells[c].depth, 0, 0});
    if (c == 0 || cells[c].length != cells[c - 1].length) by_length.emplace_back();
    for (size_t p = 0; p < cells[c].prompts.size(); ++p) by_length.back().push_back({c, p});
    total += std::ssize(cells[c].prompts);
  }

  // Per layer: the needle's shares summed over the trials, and the trials recorded.
  std::vector<double> needle_share(static_cast<size_t>(config.num_layers), 0.0);
  std::vector<int64_t> needle_trials(static_cast<size_t>(config.num_layers), 0);
  const auto start = std::chrono::steady_clock::now();
  int64_t done = 0;
  for (const std::vector<Trial>& trials : by_length) {
    for (size_t first = 0; first < trials.size(); first += static_cast<size_t>(options.batch)) {
      const size_t last = std::min(trials.size(), first + static_cast<size_t>(options.batch));
      GenerationRequest request;
      request.kv_dtype = kv_dtype;
      request.sampling.temperature = 0.0f;  // greedy
      // Each prompt generates its own answer's tokens and kExtraTokens more, whatever its batch.
      request.gen_len = 1;
      for (size_t i = first; i < last; ++i) {
        const PasskeyPrompt& prompt = cells[trials[i].cell].prompts[trials[i].prompt];
        request.prompts.push_back(prompt.ids);
        request.sequence_gen_len.push_back(prompt.answer_tokens + PasskeyOptions::kExtraTokens);
        request.gen_len = std::max(request.gen_len, request.sequence_gen_len.back());
      }
      const int64_t B = std::ssize(request.prompts);
      const ProgressCallback steps_done = [&](int64_t step, int64_t steps) {
        if (progress) progress(done + B * step / std::max<int64_t>(steps, 1), total);
      };
      // Past the context, the tokens [keep_prefix, keep_prefix + dropped) of every prompt go.
      const int64_t length = std::ssize(request.prompts[0]);
      const int64_t dropped = options.dropped(length, config.max_positions);
      const OffloadRun run =
          dropped > 0 ? run_past_context(model, request, options.past, options.generated_bound(),
                                         dropped, offload, device, steps_done)
                      : run_offloaded(model, request, offload, device, steps_done);
      for (int64_t b = 0; b < B; ++b) {
        const Trial& trial = trials[first + static_cast<size_t>(b)];
        const PasskeyPrompt& prompt = cells[trial.cell].prompts[trial.prompt];
        std::vector<int32_t> tokens = run.result.tokens[b];
        tokens.resize(
            std::min<size_t>(tokens.size(), static_cast<size_t>(request.sequence_gen_len[b])));
        const std::string answer = model.tokenizer->decode(tokens);
        PasskeyCellScore& cell = result.cells[trial.cell];
        const bool correct = passkey_answer_correct(answer, prompt.key);
        cell.trials += 1;
        cell.correct += correct ? 1 : 0;
        if (!correct && result.misses.size() < PasskeyResult::kMissesKept) {
          result.misses.push_back({cell.length, cell.depth, prompt.key, answer});
        }
        // The needle's tokens where the run had them (moved back by what was dropped before
        // them); not counted when it was dropped.
        const int64_t keep = options.past.keep_prefix;
        const int64_t moved = prompt.needle_begin >= keep + dropped ? dropped : 0;
        const bool needle_kept = dropped == 0 || moved > 0 || prompt.needle_end <= keep;
        const std::vector<FirstSelection>& selections = run.stats.first_selection();
        for (size_t l = 0; l < selections.size() && needle_kept; ++l) {
          if (selections[l].tokens.empty()) continue;
          int64_t fetched = 0;
          for (int64_t j = prompt.needle_begin; j < prompt.needle_end; ++j) {
            fetched += selections[l].selected(b, static_cast<int32_t>(j - moved)) ? 1 : 0;
          }
          needle_share[l] += static_cast<double>(fetched) /
                             static_cast<double>(prompt.needle_end - prompt.needle_begin);
          needle_trials[l] += 1;
        }
      }
      tally.add(run.stats, B, config.kv_heads(), length - dropped);
      done += B;
      if (progress) progress(done, total);
    }
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const PasskeyCellScore& cell : result.cells) {
    result.trials += cell.trials;
    result.correct += cell.correct;
  }
  result.fetched = tally.fetched();
  result.speculated_fetched = tally.speculated_fetched();
  result.mean_recall = tally.mean_recall();
  if (std::any_of(needle_trials.begin(), needle_trials.end(), [](int64_t n) { return n > 0; })) {
    for (size_t l = 0; l < needle_share.size(); ++l) {
      result.needle_fetched.push_back(
          needle_trials[l] > 0 ? needle_share[l] / static_cast<double>(needle_trials[l]) : -1.0);
    }
  }
  return result;
}

}  // namespace infinigen
