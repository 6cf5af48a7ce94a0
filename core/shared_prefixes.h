// core: prompt prefixes that groups of a batch's sequences share, computed and kept once per
// group (vLLM's prefix sharing; docs/sessions.md).
//
// Row layout, the same in every KV store: rows [0, rows()) of every sequence hold the groups'
// prefixes, each left-padded to the end of that region. Group g's prefix of length(g) tokens is
// rows [rows() - length(g), rows()) of its leader (its lowest-numbered sequence), and every
// member reads it there: sequence b's prefix is rows [begin(b), rows()) of sequence source(b).
// A sequence's own tokens are its rows [first_valid[b], length) with first_valid[b] >= rows();
// the rows between are padding, as are rows [0, rows()) of a sequence in no group (begin(b) ==
// rows(), nothing shared) and the rows of a member other than the leader below rows().
// Token positions count a sequence's prefix, then its own tokens.
//
// The sharing pass computes the groups' prefixes as a batch of num_groups() leaders, left-padded
// to rows() like any batch; the pass after it computes every sequence's own tokens. Prefix
// lengths are whole KV blocks (find_shared_prefixes), so a group's prefix fills whole blocks of a
// paged pool, and rows [0, rows()) are only ever shared blocks or padding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace infinigen {

class SharedPrefixes {
 public:
  SharedPrefixes() = default;  // nothing shared
  // `groups`: (B) each sequence's group, -1 for none; `lengths`: (G) each group's prefix tokens.
  // One-line Error unless every group has a member and a positive length, and every group index
  // is below G.
  SharedPrefixes(std::vector<int32_t> groups, std::vector<int64_t> lengths);

  bool empty() const { return rows_ == 0; }
  int64_t batch() const { return static_cast<int64_t>(group_.size()); }
  int64_t rows() const { return rows_; }  // the longest prefix: the region the prefixes fill
  int64_t num_groups() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t length(int64_t g) const { return lengths_[static_cast<size_t>(g)]; }
  const std::vector<int64_t>& lengths() const { return lengths_; }
  // (B): each sequence's group, -1 for none.
  const std::vector<int32_t>& groups() const { return group_; }
  int32_t group(int64_t b) const { return group_[static_cast<size_t>(b)]; }
  // (G): each group's leader, its lowest-numbered sequence: the sharing pass's batch, in order.
  const std::vector<int32_t>& leaders() const { return leaders_; }
  // (B): where sequence b's prefix starts (rows() when it has none), and the sequence whose rows
  // hold it (b itself when it has none).
  const std::vector<int32_t>& begin() const { return begin_; }
  const std::vector<int32_t>& source() const { return source_; }
  int64_t begin(int64_t b) const { return begin_[static_cast<size_t>(b)]; }
  int32_t source(int64_t b) const { return source_[static_cast<size_t>(b)]; }
  // Tokens of sequence b's prefix (0 when it has none).
  int64_t prefix_length(int64_t b) const { return empty() ? 0 : rows_ - begin(b); }
  // Whether row t of sequence b is one of its prefix rows (read from source(b)).
  bool in_prefix(int64_t b, int64_t t) const { return t < rows_ && t >= begin(b); }
  // (G): the sharing pass's left padding: where each leader's prefix starts.
  const std::vector<int32_t>& leader_first_valid() const { return leader_first_valid_; }
  // Tokens the prefixes hold, each kept once: the sum of the lengths.
  int64_t kept_tokens() const;
  // Tokens the prefixes stand for, once per member: the sum of prefix_length over the batch.
  int64_t member_tokens() const;

  // The prefixes of the sequences `keep` (old indices, ascending), renumbered 0.. in that order
  // (a batch that dropped its other sequences, KvStore::drop_sequences): the groups with a kept
  // member, each led by its lowest kept member, and rows() unchanged (the row layout stays).
  SharedPrefixes kept(const std::vector<int64_t>& keep) const;

  bool operator==(const SharedPrefixes& other) const {
    return group_ == other.group_ && lengths_ == other.lengths_;
  }

 private:
  // Leaders, where prefixes begin and their sources, for the prefix region of `rows` rows.
  void index(int64_t rows);

  std::vector<int32_t> group_;
  std::vector<int64_t> lengths_;
  int64_t rows_ = 0;
  std::vector<int32_t> leaders_;
  std::vector<int32_t> begin_;
  std::vector<int32_t> source_;
  std::vector<int32_t> leader_first_valid_;
};

// The prefixes worth sharing among `prompts` (token ids per sequence), in whole multiples of
// `granularity` tokens (a KV block), each prompt keeping at least one token of its own:
// sequences are grouped by their common leading blocks so that the tokens kept once save the
// most (every member but the leader stops storing its group's prefix), on the condition that the
// batch then needs no more rows than unshared (the longest prefix plus the longest remainder
// stays within the longest prompt), so that sharing never costs compute, memory or transfers.
// Nothing shared for a single prompt or when no two prompts share a whole block.
SharedPrefixes find_shared_prefixes(const std::vector<std::vector<int32_t>>& prompts,
                                    int64_t granularity);

// Benchmark prompts that share prefixes: sequence b's first `length` tokens become those of
// sequence b % groups, so that groups' leaders 0, 1, ..., groups - 1 keep their own. One-line
// Error unless 1 <= groups <= the batch and every prompt is at least `length` long.
void share_leading_tokens(std::vector<std::vector<int32_t>>& prompts, int64_t length,
                          int64_t groups);

}  // namespace infinigen
