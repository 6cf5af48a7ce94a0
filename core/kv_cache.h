// core: where attention keeps and finds its keys and values, the seam between the model and the
// offloading runtime.
//
// A forward pass of n new tokens per sequence calls, in order: begin_pass(n); for each layer l:
// begin_layer(l), observe(l, ...) with the layer's attention input and queries, append(l, k, v)
// with the new rows, and (when tokens were stored before the pass) view(l) for what attention
// reads; then end_pass(n). The first pass is the prefill (nothing stored); later ones are decode
// steps (n = 1) or extensions (n >= 1, attention over everything stored plus the pass's own
// rows, causal): a prompt's chunks after its first, the own tokens after a shared prefix, or a
// resumed conversation's new turn. A prompt's passes are one prompt (expect_prompt). KvCache
// keeps every layer resident on the model's device; offload/ implements stores that pool KV in host
// memory and stage what each layer needs on the device.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/compact_batch.h"
#include "core/model_config.h"
#include "core/shared_prefixes.h"
#include "core/tensor.h"

namespace infinigen {

// What a layer's attention computes from, before it runs: the input of its Q/K/V projections
// (B * n_new, D) (the normalised hidden state in a pre-norm model), its queries (B * n_new, H * d,
// rotated when the model is rotary, then scaled by 1/sqrt(d)), and the query projection that
// made them, weight (H * d, D) in HF layout and bias (H * d; undefined when the model has none).
// A rotary model also gives its rotation: the frequencies (d / 2, fp32, on the model's device;
// undefined otherwise, core/rope.h) and each new row's position (B * n_new), so that a query
// projected again from `x` can be rotated the same way, and InfiniGen's skew of the layer when
// the checkpoint has one beside it ((H_kv, d, d) fp32; undefined otherwise: OPT folds it into
// W_q and W_k, core/weights.h). Every tensor referred to stays valid until the layer's append
// returns.
struct AttentionInput {
  const Tensor& x;
  const Tensor& queries;
  const Tensor& q_weight;
  const Tensor& q_bias;
  const Tensor& rope_inv_freq;
  const std::vector<int32_t>& positions;
  const Tensor& skew;
};

class KvStore {
 public:
  KvStore(int64_t batch, int64_t capacity);
  virtual ~KvStore() = default;
  KvStore(const KvStore&) = delete;
  KvStore& operator=(const KvStore&) = delete;

  int64_t batch() const { return batch_; }
  int64_t capacity() const { return capacity_; }  // tokens per sequence, padding included
  int64_t length() const { return length_; }      // tokens stored (the same for every sequence)
  int64_t pass_tokens() const { return pass_tokens_; }  // tokens per sequence of the open pass
  // (B): in sequence b, tokens before first_valid[b] are left padding (or, after a shared
  // prefix, padding between the prefix and the sequence's own tokens).
  const std::vector<int32_t>& first_valid() const { return first_valid_; }
  void set_first_valid(std::vector<int32_t> first_valid);

  // Prompt prefixes that groups of the batch share (core/shared_prefixes.h), computed once per
  // group and kept once (a store keeps them in each group leader's rows, or in shared blocks):
  // rows [0, shared().rows()) hold them, and sequence b's own tokens are rows [first_valid[b],
  // length), first_valid[b] >= shared().rows(). Empty: nothing shared.
  const SharedPrefixes& shared() const { return shared_; }
  int64_t shared_rows() const { return shared_.rows(); }
  // Before the first pass, on a store that can_share_prefix(): the first pass computes the
  // groups' prefixes as a batch of their leaders; later passes are the sequences' own
  // (first_valid).
  void share_prefixes(SharedPrefixes shared, std::vector<int32_t> first_valid);
  virtual bool can_share_prefix() const { return false; }
  // Whether the open (or next) pass is the one that computes the shared prefixes.
  bool sharing_pass() const { return !shared_.empty() && length_ == 0; }
  // Sequences the open pass computes: the groups' leaders in the sharing pass, else batch().
  int64_t pass_batch() const { return sharing_pass() ? shared_.num_groups() : batch_; }
  // The store's sequence that the open pass's sequence i is: the leader of group i in the
  // sharing pass, else i.
  int64_t pass_sequence(int64_t i) const {
    return sharing_pass() ? shared_.leaders()[static_cast<size_t>(i)] : i;
  }
  // The left padding of the open pass's sequences (pass_batch()): where each leader's prefix
  // starts in the sharing pass, else first_valid().
  const std::vector<int32_t>& pass_first_valid() const {
    return sharing_pass() ? shared_.leader_first_valid() : first_valid_;
  }
  // Before a prompt's first pass (Model::prefill and Model::extend call it): the passes until
  // length() reaches `end` rows are one prompt, however many they are (a shared prefix's pass,
  // then the chunks of a prompt computed in several passes). Without it, the first pass and
  // the sharing pass before it are the prompt.
  void expect_prompt(int64_t end);
  // Whether the open pass computes part of a prompt (else it is a decode step), and whether it
  // is the prompt's last pass.
  bool prompt_pass() const { return length_ == 0 || length_ < prompt_end_; }
  bool last_prompt_pass() const { return prompt_pass() && pass_closes_step(); }
  // Whether the open pass starts, and whether it ends, one step of a run's statistics: a
  // prompt is one step however many passes it takes.
  bool pass_opens_step() const { return !prompt_open_; }
  bool pass_closes_step() const {
    return !sharing_pass() && length_ + pass_tokens_ >= prompt_end_;
  }

  // Writes the open pass's new rows (pass_batch() * n_new, H_kv * d) into `cache` (B, H_kv,
  // capacity, d) at rows [length(), length() + n_new) of the pass's sequences: every sequence's,
  // or in the sharing pass each group leader's.
  void store_pass_rows(const Tensor& rows, Tensor& cache) const;

  // Keys and values a decode step's attention reads for one layer: (B, H_kv, capacity, d) each,
  // rows [first_valid[b], length) valid, the token appended in this pass included, after the
  // rows of its shared prefix, [shared->begin(b), shared->rows()) of sequence shared->source(b).
  struct View {
    const Tensor* keys;
    const Tensor* values;
    int64_t length;
    // Left padding of the rows in `keys`/`values`; null means first_valid() (rows stored at
    // their token positions). Stores that stage a compact selection of rows set their own.
    const std::vector<int32_t>* first_valid = nullptr;
    const SharedPrefixes* shared = nullptr;  // null: nothing shared
  };

  // What layer `layer` computes from, before its attention. Stores that speculate on the next
  // layer's attention (InfiniGen), score tokens (H2O) or record activations (skewing) use it;
  // the default ignores it.
  virtual void observe(int64_t layer, const AttentionInput& input) { (void)layer, (void)input; }

  // Dropping sequences that ended (a batch whose sequences end at different steps): between
  // passes, once the prompt's are done, keeps only the sequences `keep` (old indices, ascending,
  // at least one), renumbered 0, 1, ... in that order, so that every later pass computes,
  // speculates and loads over them alone. Their rows, pool blocks and the policy's state are
  // kept; what the dropped ones held is no longer read (whether its memory is freed is the
  // store's to say). A group of a shared prefix whose leader is dropped is led by its lowest
  // kept member from then on (SharedPrefixes::kept): a store that keeps the prefix in its
  // leader's rows copies it there (moves). One-line Error unless can_drop_sequences().
  void drop_sequences(const std::vector<int64_t>& keep);
  virtual bool can_drop_sequences() const { return false; }
  // A group whose leader a drop removes: its prefix, rows [row0, row1) of sequence `from`, goes to
  // the same rows of sequence `to` (old indices).
  struct LeaderMove {
    int64_t from = 0;
    int64_t to = 0;
    int64_t row0 = 0;
    int64_t row1 = 0;
  };

  // Restore what a resumed conversation needs first (layer 0, or layer + 1), then start.
  void begin_pass(int64_t n_new);
  void begin_layer(int64_t layer);
  // New keys and values of `layer`: rows (B * n_new, H_kv * d) fp32 on the model's device (keys
  // rotated in a rotary model), for tokens [length(), length() + n_new) of every sequence.
  virtual void append(int64_t layer, const Tensor& keys, const Tensor& values) = 0;
  virtual View view(int64_t layer) = 0;
  virtual void end_pass(int64_t n_new);

  // Continuing a conversation (offload/session.h), before the first pass: `length` tokens per
  // sequence are stored already, sequence b's real ones from first_valid[b]. `restore(l, store)`
  // for each of the model's `num_layers` layers writes layer l's stored rows and state (through the
  // accessors below); it is called once per layer, in order, just before a pass needs the layer
  // (before begin_pass runs for layer 0, before begin_layer(l - 1) runs for layer l), so reading a
  // session overlaps the pass.
  using LayerRestorer = std::function<void(int64_t layer, KvStore& store)>;
  virtual void resume(int64_t length, std::vector<int32_t> first_valid, int64_t num_layers,
                      LayerRestorer restore);

  // What a session saves of a store: per layer, named streams of rows per (sequence, KV head,
  // token), `width` elements of `dtype` each ("keys" and "values" of every store that can be
  // saved but int4, which saves its codes and scales; InfiniGen adds "partial_keys"), and named
  // tensors of layer state (InfiniGen's partial columns and query weights). A store whose policy
  // cannot be saved lists no streams.
  struct TokenStream {
    std::string name;
    DType dtype = DType::F16;
    int64_t width = 0;
  };
  using LayerState = std::vector<std::pair<std::string, Tensor>>;
  virtual std::vector<TokenStream> token_streams(int64_t layer) const {
    (void)layer;
    return {};
  }
  // Row of token t (a row index of the store, padding included) of (layer, stream, b, h), in
  // host memory; valid while the store lives and, for tokens already stored, unchanged by later
  // passes.
  virtual const void* token_row(int64_t layer, size_t stream, int64_t b, int64_t h,
                                int64_t t) const;
  void* mutable_token_row(int64_t layer, size_t stream, int64_t b, int64_t h, int64_t t) {
    return const_cast<void*>(std::as_const(*this).token_row(layer, stream, b, h, t));
  }
  virtual LayerState layer_state(int64_t layer) const {
    (void)layer;
    return {};
  }
  // Whether the store is saved as its layers' state alone, at the end of every turn (H2O, whose
  // passes evict), rather than as token rows with state saved once (its first turn's).
  virtual bool saves_state_each_turn() const { return false; }
  virtual void restore_layer_state(int64_t layer, const LayerState& state);
  // After a session moved rows [from, from + count) of sequence b to earlier positions and
  // rotated their keys there (a conversation that overflowed the context, offload/session.h):
  // recomputes what the store derives from those keys (InfiniGen's partial keys).
  virtual void rederive_rows(int64_t layer, int64_t b, int64_t from, int64_t count) {
    (void)layer, (void)b, (void)from, (void)count;
  }
  // Waits until every row a pass stored is readable through token_row.
  virtual void finish_stores() {}
  // Allocates every row the store can hold now, so that token_row's addresses of stored rows can
  // be read from another thread while later passes run.
  virtual void allocate_all() {}

 protected:
  virtual void start_pass(int64_t n_new);
  virtual void start_layer(int64_t layer) { (void)layer; }
  // The store's part of drop_sequences, called before batch(), first_valid() and shared() change
  // (they still describe the old batch).
  virtual void keep_sequences(const std::vector<int64_t>& keep,
                              const std::vector<LeaderMove>& moves) {
    (void)keep, (void)moves;
  }
  // Whether this pass extends stored tokens by the rows of a prompt (a chunk after the first,
  // the own tokens after a shared prefix, a resumed conversation's turn), or by more than one.
  bool extending() const { return length_ > 0 && (prompt_pass() || pass_tokens_ > 1); }
  // Whether the store continues a conversation (resume): its first pass extends a history.
  bool resumed() const { return num_restored_layers_ > 0; }
  // Whether sequence b's row t holds one of its tokens (not padding).
  bool holds_token(int64_t b, int64_t t) const {
    return t >= first_valid_[static_cast<size_t>(b)] || (t >= 0 && shared_.in_prefix(b, t));
  }

 private:
  // Restores layers up to `layer` that a resume has not restored yet.
  void restore_through(int64_t layer);
  LayerRestorer restore_;
  int64_t restored_ = 0;  // layers restored so far
  int64_t num_restored_layers_ = 0;
  int64_t batch_;
  int64_t capacity_;
  int64_t length_ = 0;
  int64_t pass_tokens_ = 0;
  SharedPrefixes shared_;
  int64_t prompt_end_ = 0;    // expect_prompt's end; passes before it are the prompt's
  bool prompt_open_ = false;  // a prompt's passes have begun and its last has not ended
  int64_t passes_ = 0;        // passes ended so far
  std::vector<int32_t> first_valid_;
};

// Compacting a batch (KvStore::drop_sequences) in a buffer t whose first dimension is the batch
// (B, ...): first each move's rows [row0, row1) of the second-to-last dimension, per index of the
// dimensions between (t (B, H, rows, w)), from sequence `from` to `to`; then sequence keep[i]'s
// slab to slab i; then t narrowed to (keep.size(), ...) in place (its memory kept). Copies on
// t's device, ordered after the work enqueued on the current stream. (Host vectors:
// core/compact_batch.h.)
void compact_batch(Tensor& t, const std::vector<int64_t>& keep,
                   const std::vector<KvStore::LeaderMove>& moves = {});

// Every layer's keys and values resident on one device (the non-offloaded engine, and the `gpu`
// policy).
class KvCache : public KvStore {
 public:
  KvCache(const ModelConfig& config, int64_t batch, int64_t capacity, DType dtype, Device device);

  DType dtype() const { return dtype_; }
  bool can_share_prefix() const override { return true; }
  void append(int64_t layer, const Tensor& keys, const Tensor& values) override;
  View view(int64_t layer) override;
  bool can_drop_sequences() const override { return true; }
  std::vector<TokenStream> token_streams(int64_t layer) const override;
  const void* token_row(int64_t layer, size_t stream, int64_t b, int64_t h,
                        int64_t t) const override;

 protected:
  void keep_sequences(const std::vector<int64_t>& keep,
                      const std::vector<LeaderMove>& moves) override;

 private:
  DType dtype_;
  std::vector<Tensor> keys_;    // per layer: (B, H_kv, capacity, d)
  std::vector<Tensor> values_;  // per layer: (B, H_kv, capacity, d)
};

}  // namespace infinigen
