// core: HF's BPE model (vocabulary, merges by rank, unknown token, byte fallback) and the
// matcher of added tokens.
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <queue>

#include "core/error.h"
#include "core/tokenizer_pipeline.h"

namespace infinigen::tokenizer_detail {
namespace {

// Ids beyond this are rejected: id -> token is a dense table, and no real vocabulary comes near.
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;
constexpr int64_t kMaxUnusedIds = 65536;  // ids below the largest that name no token
constexpr size_t kCacheCapacity = 10000;
constexpr size_t kMaxCachedPieceBytes = 256;

}  // namespace

// ---- BPE model ----------------------------------------------------------------------------------

void BpeModel::load_vocabulary(const nlohmann::json& object, const std::string& where) {
  if (!object.is_object()) fail(where, ": expected a JSON object mapping tokens to ids");
  std::vector<std::pair<int64_t, std::string>> entries;
  entries.reserve(object.size());
  for (const auto& [token, value] : object.items()) {
    if (!value.is_number_integer()) {
      fail(where, ": the id of token ", quoted(token), " is not an integer: ", brief(value));
    }
    // is_number_integer covers unsigned values too, which get<int64_t> would wrap.
    if (value.is_number_unsigned() && value.get<uint64_t>() > uint64_t{kMaxTokenId}) {
      fail(where, ": the id of token ", quoted(token), " is out of range (0..", kMaxTokenId,
           "): ", brief(value));
    }
    const auto id = value.get<int64_t>();
    if (id < 0 || id > kMaxTokenId) {
      fail(where, ": the id of token ", quoted(token), " is out of range (0..", kMaxTokenId,
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
    fail(where, ": ids reach ", max_id, " but only ", entries.size(), " tokens are given (", unused,
         " ids unused; at most ", kMaxUnusedIds, " may be)");
  }
  tokens_.assign(static_cast<size_t>(max_id + 1), std::string());
  present_.assign(tokens_.size(), false);
  vocab_.reserve(entries.size());
  for (auto& [id, token] : entries) {
    if (present_[id]) {
      fail(where, ": tokens ", quoted(tokens_[id]), " and ", quoted(token), " both have id ", id);
    }
    present_[id] = true;
    vocab_.emplace(token, static_cast<int32_t>(id));
    tokens_[id] = std::move(token);
  }
}

std::optional<std::string> BpeModel::add_merge(std::string_view left, std::string_view right,
                                               uint32_t rank) {
  int32_t ids[2];
  const std::string_view parts[2] = {left, right};
  for (int i = 0; i < 2; ++i) {
    const auto it = vocab_.find(parts[i]);
    if (it == vocab_.end()) return cat("token ", quoted(parts[i]), " is not in the vocabulary");
    ids[i] = it->second;
  }
  std::string merged(left);
  merged += right;
  const auto it = vocab_.find(merged);
  if (it == vocab_.end()) return cat("merged token ", quoted(merged), " is not in the vocabulary");
  merges_[(uint64_t{static_cast<uint32_t>(ids[0])} << 32) | static_cast<uint32_t>(ids[1])] =
      MergeRule{rank, it->second};
  return std::nullopt;
}

void BpeModel::finish() {
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    const auto it = vocab_.find(std::string_view(name));
    byte_token_ids_[b] = it == vocab_.end() ? -1 : it->second;
  }
}

void BpeModel::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges) {
    const auto it = vocab_.find(word);
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() <= kMaxCachedPieceBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    const auto it = cache_.find(word);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  merge_word(word, out);
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() < kCacheCapacity) {
      cache_.emplace(std::string(word), std::vector<int32_t>(out.begin() + first, out.end()));
    }
  }
}

// HF's BPE::merge_word: each character is its token, or its bytes' "<0xNN>" tokens with byte
// fallback, or the unknown token (consecutive ones fused with fuse_unk), or nothing. A maximal
// invalid UTF-8 subpart (which HF never sees) counts as one character that no token spells.
void BpeModel::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  std::vector<int32_t> symbols;
  symbols.reserve(word.size());
  bool unk_pending = false;  // an unknown character waits for the next known one or the end
  const auto* p = reinterpret_cast<const unsigned char*>(word.data());
  for (size_t i = 0; i < word.size();) {
    const size_t length = utf8_step(p + i, word.size() - i).length;
    const std::string_view character = word.substr(i, length);
    i += length;
    const auto it = vocab_.find(character);
    if (it != vocab_.end()) {
      if (unk_pending) symbols.push_back(*unk_id);
      unk_pending = false;
      symbols.push_back(it->second);
      continue;
    }
    if (byte_fallback) {
      const bool all_bytes = std::all_of(character.begin(), character.end(), [&](char c) {
        return byte_token_ids_[static_cast<unsigned char>(c)] >= 0;
      });
      if (all_bytes) {
        // HF adds these before a pending unknown token, which follows them.
        for (const char c : character) {
          symbols.push_back(byte_token_ids_[static_cast<unsigned char>(c)]);
        }
        continue;
      }
    }
    if (unk_id) {
      if (unk_pending && !fuse_unk) symbols.push_back(*unk_id);
      unk_pending = true;
    }
  }
  if (unk_pending) symbols.push_back(*unk_id);
  merge_all(symbols, out);
}

// HF's merge loop (Word::merge_all), including its tie-breaking: the pair of lowest rank is
// merged first, the leftmost one among equal ranks.
void BpeModel::merge_all(std::vector<int32_t>& ids, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    bool alive;
  };
  const auto n = static_cast<int32_t>(ids.size());
  std::vector<Symbol> symbols(ids.size());
  for (int32_t i = 0; i < n; ++i) symbols[i] = {ids[i], i - 1, i + 1 < n ? i + 1 : -1, true};

  struct Candidate {
    uint32_t rank;
    int32_t pos;
    int32_t new_id;
  };
  const auto later = [](const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(later)> queue(later);
  const auto rule = [&](int32_t left, int32_t right) {
    return merges_.find((uint64_t{static_cast<uint32_t>(left)} << 32) |
                        static_cast<uint32_t>(right));
  };
  const auto push_pair = [&](int32_t pos) {
    const int32_t next = symbols[pos].next;
    if (next < 0) return;
    const auto it = rule(symbols[pos].id, symbols[next].id);
    if (it != merges_.end()) queue.push({it->second.rank, pos, it->second.new_id});
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
    const auto it = rule(left.id, right.id);
    if (it == merges_.end() || it->second.new_id != top.new_id) continue;

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

// ---- Added tokens -------------------------------------------------------------------------------

void AddedTokenMatcher::add(std::string_view pattern, size_t token) {
  uint32_t node = 0;
  for (const char c : pattern) {
    const auto byte = static_cast<unsigned char>(c);
    auto& next = nodes_[node].next;
    const auto it =
        std::lower_bound(next.begin(), next.end(), byte,
                         [](const auto& edge, unsigned char b) { return edge.first < b; });
    if (it != next.end() && it->first == byte) {
      node = it->second;
      continue;
    }
    const auto child = static_cast<uint32_t>(nodes_.size());
    next.insert(it, {byte, child});
    nodes_.emplace_back();
    node = child;
  }
  nodes_[node].token = static_cast<int64_t>(token);
}

std::optional<std::pair<size_t, size_t>> AddedTokenMatcher::longest_at(std::string_view text,
                                                                       size_t at) const {
  std::optional<std::pair<size_t, size_t>> best;
  uint32_t node = 0;
  for (size_t i = at; i < text.size(); ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    const auto& next = nodes_[node].next;
    const auto it =
        std::lower_bound(next.begin(), next.end(), byte,
                         [](const auto& edge, unsigned char b) { return edge.first < b; });
    if (it == next.end() || it->first != byte) break;
    node = it->second;
    if (nodes_[node].token >= 0) best = {{i + 1 - at, static_cast<size_t>(nodes_[node].token)}};
  }
  return best;
}

}  // namespace infinigen::tokenizer_detail
