// core: the prefixes groups of a batch share, and how they are found.
#include "core/shared_prefixes.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "core/error.h"

namespace infinigen {

SharedPrefixes::SharedPrefixes(std::vector<int32_t> groups, std::vector<int64_t> lengths)
    : group_(std::move(groups)), lengths_(std::move(lengths)) {
  int64_t rows = 0;
  for (int64_t g = 0; g < num_groups(); ++g) {
    INFINIGEN_CHECK(length(g) > 0, "shared prefix ", g + 1, " has ", length(g), " tokens");
    rows = std::max(rows, length(g));
  }
  index(rows);
}

void SharedPrefixes::index(int64_t rows) {
  rows_ = rows;
  const int64_t G = num_groups();
  leaders_ = std::vector<int32_t>(lengths_.size(), -1);
  for (int64_t b = 0; b < batch(); ++b) {
    const int32_t g = group(b);
    INFINIGEN_CHECK(g >= -1 && g < G, "sequence ", b + 1, " is in shared prefix group ", g, " of ",
                    G);
    if (g >= 0 && leaders_[static_cast<size_t>(g)] < 0) {
      leaders_[static_cast<size_t>(g)] = static_cast<int32_t>(b);
    }
  }
  leader_first_valid_.clear();
  for (int64_t g = 0; g < G; ++g) {
    INFINIGEN_CHECK(leaders_[static_cast<size_t>(g)] >= 0, "shared prefix ", g + 1,
                    " has no sequence");
    leader_first_valid_.push_back(static_cast<int32_t>(rows_ - length(g)));
  }
  begin_.clear();
  source_.clear();
  for (int64_t b = 0; b < batch(); ++b) {
    const int32_t g = group(b);
    begin_.push_back(static_cast<int32_t>(g < 0 ? rows_ : rows_ - length(g)));
    source_.push_back(g < 0 ? static_cast<int32_t>(b) : leaders_[static_cast<size_t>(g)]);
  }
}

SharedPrefixes SharedPrefixes::kept(const std::vector<int64_t>& keep) const {
  if (empty()) return {};
  SharedPrefixes out;
  std::vector<int32_t> renumbered(lengths_.size(), -1);  // old group -> new, -1: none kept
  for (int64_t b : keep) {
    const int32_t g = group(b);
    if (g >= 0 && renumbered[static_cast<size_t>(g)] < 0) {
      renumbered[static_cast<size_t>(g)] = static_cast<int32_t>(out.lengths_.size());
      out.lengths_.push_back(length(g));
    }
    out.group_.push_back(g < 0 ? -1 : renumbered[static_cast<size_t>(g)]);
  }
  out.index(rows_);
  return out;
}

int64_t SharedPrefixes::kept_tokens() const {
  return std::accumulate(lengths_.begin(), lengths_.end(), int64_t{0});
}

int64_t SharedPrefixes::member_tokens() const {
  int64_t tokens = 0;
  for (int64_t b = 0; b < batch(); ++b) tokens += prefix_length(b);
  return tokens;
}

SharedPrefixes find_shared_prefixes(const std::vector<std::vector<int32_t>>& prompts,
                                    int64_t granularity) {
  INFINIGEN_CHECK(granularity > 0, "a shared prefix's granularity must be positive, got ",
                  granularity);
  const int64_t B = std::ssize(prompts);
  if (B < 2) return {};
  // In sorted order, the sequences sharing a prefix are neighbours, and the prefix a run of them
  // shares is the shortest common prefix of neighbours in the run.
  std::vector<int32_t> order(static_cast<size_t>(B));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return prompts[a] < prompts[b]; });
  const auto own_limit = [&](int32_t b) {  // every prompt keeps a token of its own
    return std::max<int64_t>(std::ssize(prompts[b]) - 1, 0);
  };
  std::vector<int64_t> adjacent(static_cast<size_t>(B - 1));  // whole blocks of neighbours
  for (int64_t i = 0; i + 1 < B; ++i) {
    const auto& a = prompts[order[i]];
    const auto& c = prompts[order[i + 1]];
    const int64_t limit = std::min(own_limit(order[i]), own_limit(order[i + 1]));
    const int64_t common = std::mismatch(a.begin(), a.begin() + limit, c.begin()).first - a.begin();
    adjacent[static_cast<size_t>(i)] = common / granularity * granularity;
  }
  // best[j]: the most tokens saved over the first j sequences in sorted order, split into runs
  // (a run of m sequences sharing P tokens saves (m - 1) * P); from[j]: where its last run starts.
  std::vector<int64_t> best(static_cast<size_t>(B + 1), 0);
  std::vector<int64_t> from(static_cast<size_t>(B + 1), 0);
  for (int64_t j = 1; j <= B; ++j) {
    best[j] = best[j - 1];
    from[j] = j - 1;
    int64_t shared = std::numeric_limits<int64_t>::max();
    for (int64_t i = j - 2; i >= 0; --i) {
      shared = std::min(shared, adjacent[static_cast<size_t>(i)]);
      if (shared == 0) break;
      if (best[i] + (j - i - 1) * shared > best[j]) {
        best[j] = best[i] + (j - i - 1) * shared;
        from[j] = i;
      }
    }
  }
  struct Run {
    std::vector<int32_t> members;
    int64_t length = 0;
  };
  std::vector<Run> runs;
  for (int64_t j = B; j > 0; j = from[j]) {
    const int64_t i = from[j];
    if (j - i < 2) continue;
    Run run{{order.begin() + i, order.begin() + j},
            *std::min_element(adjacent.begin() + i, adjacent.begin() + j - 1)};
    std::sort(run.members.begin(), run.members.end());
    runs.push_back(std::move(run));
  }
  if (runs.empty()) return {};
  // Rows: the longest prefix, then the longest remainder after each sequence's prefix. Capping
  // every prefix at `cap` shortens the first and lengthens the second; the largest saving whose
  // rows stay within the longest prompt wins (cap 0: nothing shared, the unshared rows).
  int64_t longest = 0, top = 0;
  for (const auto& prompt : prompts) longest = std::max<int64_t>(longest, std::ssize(prompt));
  for (const Run& run : runs) top = std::max(top, run.length);
  int64_t chosen = 0, chosen_saving = 0;
  for (int64_t cap = top; cap > 0; cap -= granularity) {
    std::vector<int64_t> prefix(static_cast<size_t>(B), 0);
    int64_t saving = 0, region = 0;
    for (const Run& run : runs) {
      const int64_t length = std::min(run.length, cap);
      for (int32_t b : run.members) prefix[static_cast<size_t>(b)] = length;
      saving += (std::ssize(run.members) - 1) * length;
      region = std::max(region, length);
    }
    int64_t remainder = 0;
    for (int64_t b = 0; b < B; ++b) {
      remainder = std::max(remainder, std::ssize(prompts[b]) - prefix[static_cast<size_t>(b)]);
    }
    if (region + remainder <= longest && saving > chosen_saving) {
      chosen = cap;
      chosen_saving = saving;
    }
  }
  if (chosen == 0) return {};
  // Groups numbered by their leaders.
  std::sort(runs.begin(), runs.end(),
            [](const Run& a, const Run& b) { return a.members.front() < b.members.front(); });
  std::vector<int32_t> group(static_cast<size_t>(B), -1);
  std::vector<int64_t> lengths;
  for (const Run& run : runs) {
    for (int32_t b : run.members)
      group[static_cast<size_t>(b)] = static_cast<int32_t>(lengths.size());
    lengths.push_back(std::min(run.length, chosen));
  }
  return SharedPrefixes(std::move(group), std::move(lengths));
}

void share_leading_tokens(std::vector<std::vector<int32_t>>& prompts, int64_t length,
                          int64_t groups) {
  INFINIGEN_CHECK(groups >= 1 && groups <= std::ssize(prompts), "prompts in ", groups,
                  " groups sharing a prefix need 1 to ", prompts.size(), " groups");
  for (size_t b = 0; b < prompts.size(); ++b) {
    INFINIGEN_CHECK(length >= 0 && std::ssize(prompts[b]) >= length, "prompt ", b + 1, " of ",
                    prompts[b].size(), " tokens cannot share a prefix of ", length);
    const auto& leader = prompts[b % static_cast<size_t>(groups)];
    std::copy_n(leader.begin(), length, prompts[b].begin());
  }
}

}  // namespace infinigen
