// core: where attention keeps and finds its keys and values, the seam between the model and the
// offloading runtime.
//
// A forward pass of n new tokens per sequence calls, in order: begin_pass(n); for each layer l:
// begin_layer(l), observe(l, ...) with the layer's attention input and queries, append(l, k, v)
// with the new rows, and (decode only) view(l) for what attention reads; then end_pass(n). KvCache
// keeps every layer resident on the model's device; offload/ implements stores that pool KV in host
// memory and stage what each layer needs on the device.
#pragma once

#include <cstdint>
#include <vector>

#include "core/model_config.h"
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
  // (B): in sequence b, tokens before first_valid[b] are left padding.
  const std::vector<int32_t>& first_valid() const { return first_valid_; }
  void set_first_valid(std::vector<int32_t> first_valid);

  // Keys and values a decode step's attention reads for one layer: (B, H_kv, capacity, d) each,
  // rows [first_valid[b], length) valid, the token appended in this pass included.
  struct View {
    const Tensor* keys;
    const Tensor* values;
    int64_t length;
    // Left padding of the rows in `keys`/`values`; null means first_valid() (rows stored at
    // their token positions). Stores that stage a compact selection of rows set their own.
    const std::vector<int32_t>* first_valid = nullptr;
  };

  // What layer `layer` computes from, before its attention. Stores that speculate on the next
  // layer's attention (InfiniGen), score tokens (H2O) or record activations (skewing) use it;
  // the default ignores it.
  virtual void observe(int64_t layer, const AttentionInput& input) { (void)layer, (void)input; }

  virtual void begin_pass(int64_t n_new);
  virtual void begin_layer(int64_t layer) { (void)layer; }
  // New keys and values of `layer`: rows (B * n_new, H_kv * d) fp32 on the model's device (keys
  // rotated in a rotary model), for tokens [length(), length() + n_new) of every sequence.
  virtual void append(int64_t layer, const Tensor& keys, const Tensor& values) = 0;
  virtual View view(int64_t layer) = 0;
  virtual void end_pass(int64_t n_new);

 private:
  int64_t batch_;
  int64_t capacity_;
  int64_t length_ = 0;
  int64_t pass_tokens_ = 0;
  std::vector<int32_t> first_valid_;
};

// Every layer's keys and values resident on one device (the non-offloaded engine, and the `gpu`
// policy).
class KvCache : public KvStore {
 public:
  KvCache(const ModelConfig& config, int64_t batch, int64_t capacity, DType dtype, Device device);

  DType dtype() const { return dtype_; }
  void append(int64_t layer, const Tensor& keys, const Tensor& values) override;
  View view(int64_t layer) override;

 private:
  DType dtype_;
  std::vector<Tensor> keys_;    // per layer: (B, H_kv, capacity, d)
  std::vector<Tensor> values_;  // per layer: (B, H_kv, capacity, d)
};

}  // namespace infinigen
