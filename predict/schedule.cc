// predict: the runtime's schedule of a request.
#include "predict/schedule.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/error.h"
#include "core/weights.h"
#include "offload/h2o_kv.h"
#include "offload/int4_codec.h"
#include "offload/memory_planner.h"
#include "offload/weight_placement.h"
#include "predict/op_costs.h"

namespace infinigen {

const char* lane_name(Lane lane) {
  switch (lane) {
    case Lane::Compute:
      return "compute";
    case Lane::Load:
      return "load";
    case Lane::Store:
      return "store";
    case Lane::Gather:
      return "gather";
  }
  return "?";
}

namespace {

// The policies whose schedule is written out below.
enum class Policy { Gpu, Full, Infinigen, Int4, H2o };
Policy schedule_policy(const std::string& name) {
  for (const auto& [known, policy] :
       {std::pair{"gpu", Policy::Gpu}, std::pair{"full", Policy::Full},
        std::pair{"infinigen", Policy::Infinigen}, std::pair{"int4", Policy::Int4},
        std::pair{"h2o", Policy::H2o}}) {
    if (name == known) return policy;
  }
  fail("cost model: policy ", name, " is not modelled");
}

// Builds the schedule in the order the runtime issues work: compute ops in program order, each
// transfer at the point of the compute stream where the runtime enqueues it, and host waits as
// dependencies of the next compute op.
class ScheduleBuilder {
 public:
  explicit ScheduleBuilder(const CostModelInput& in)
      : in_(in),
        c_(in.config),
        policy_(schedule_policy(in.options.policy)),
        B_(in.batch),
        H_(c_.num_heads),
        d_(c_.head_dim()),
        D_(c_.hidden_size),
        F_(c_.ffn_dim),
        L_(c_.num_layers),
        kv_(dtype_size(in.kv_dtype)),
        w_(dtype_size(c_.dtype)),
        capacity_(in.prompt_len + in.gen_len),
        stored_(static_cast<size_t>(c_.num_layers), -1),
        loaded_(static_cast<size_t>(c_.num_layers), -1) {
    INFINIGEN_CHECK(in.batch >= 1 && in.prompt_len >= 1 && in.gen_len >= 1,
                    "cost model: batch, prompt length and generation length must be >= 1");
    INFINIGEN_CHECK(in.options.kv_pool_limit == 0, "cost model: ", option("kv_pool_limit"),
                    " is not modelled (the pool holds every token)");
    INFINIGEN_CHECK(in.options.kv_block_tokens >= 1, "cost model: kv_block_tokens must be >= 1");
    const SpeculationOptions& spec = in.options.speculation;
    dense_layers_ = spec.dense_layers;
    r_ = partial_columns(spec.partial_ratio, d_);
    partial_key_bytes_ = static_cast<double>(dtype_size(spec.partial_key_dtype));
    max_num_kv_ = spec.fetch_cap(capacity_);
    slots_ = h2o_slots(in.options.h2o_budget, capacity_);
    // Streamed weights: the host-resident tensors of a layer (every layer places alike), as
    // loaded: matrices in the checkpoint dtype, biases and LayerNorm parameters widened to fp32.
    const std::vector<WeightHome> homes = place_weights(c_, in.options.weights_gpu_percent);
    const WeightLayout layout = weight_layout(c_);
    for (size_t i = 0; i < layout.layer.size(); ++i) {  // layer 0's tensors
      if (homes[layout.first.size() + i].on_device) continue;
      const Shape& shape = layout.layer[i].shape;
      const size_t element = shape.size() == 1 ? 4 : w_;
      weight_bytes_ += static_cast<uint64_t>(shape_numel(shape)) * element;
      weight_chunks_ += 1;
    }
    if (policy_ == Policy::Infinigen) {
      INFINIGEN_CHECK(!in.fetched_fraction.empty() || !in.fetched_rows.empty(),
                      "cost model: policy infinigen needs the fetched share per layer "
                      "(fetched_fraction) measured by a run");
      for (const std::vector<uint64_t>& step : in.fetched_rows) {
        INFINIGEN_CHECK(static_cast<int64_t>(step.size()) == L_, "cost model: fetched_rows has ",
                        step.size(), " layers per step, the model ", L_);
      }
      for (double f : in.fetched_fraction) {
        INFINIGEN_CHECK(f >= 0 && f <= 1, "cost model: fetched_fraction ", f,
                        " is not a share in [0, 1]");
      }
    }
  }

  Schedule build() {
    prefill();
    for (int64_t step = 1; step < in_.gen_len; ++step) decode(step);
    s_.steps = in_.gen_len;
    return std::move(s_);
  }

 private:
  bool offloads_kv() const { return policy_ != Policy::Gpu; }
  bool dense(int64_t layer) const { return layer < dense_layers_; }
  bool speculated(int64_t layer) const { return policy_ == Policy::Infinigen && !dense(layer); }
  double f(int64_t v) const { return static_cast<double>(v); }

  int32_t add(ScheduledOp op) {
    s_.ops.push_back(std::move(op));
    return static_cast<int32_t>(s_.ops.size() - 1);
  }

  // A compute op; the host waits recorded since the previous one become its dependencies.
  int32_t compute(OpClass cls, const char* name, int64_t layer, double flops, double bytes) {
    ScheduledOp op;
    op.lane = Lane::Compute;
    op.op_class = cls;
    op.name = name;
    op.step = step_;
    op.layer = layer;
    op.flops = flops;
    op.device_bytes = bytes;
    op.deps = std::move(waits_);
    waits_.clear();
    last_compute_ = add(std::move(op));
    return last_compute_;
  }
  void wait(int32_t op) {
    if (op >= 0) waits_.push_back(op);
  }
  void linear(const char* name, int64_t layer, int64_t M, int64_t N, int64_t K, size_t wbytes) {
    const int32_t op =
        compute(OpClass::Gemm, name, layer, linear_flops(M, N, K), linear_bytes(M, N, K, wbytes));
    ScheduledOp& gemm = s_.ops[static_cast<size_t>(op)];
    gemm.rows = M;
    gemm.out_features = N;
    gemm.in_features = K;
    gemm.weight_bytes =
        static_cast<double>(N) * static_cast<double>(K) * static_cast<double>(wbytes);
  }

  // A transfer enqueued now (after the last compute op), ordered after `after` on its stream.
  int32_t transfer(Lane lane, const char* name, int64_t layer, uint64_t bytes, double copy_bytes,
                   double row_bytes, int64_t chunks, bool weights, int32_t after) {
    ScheduledOp op;
    op.lane = lane;
    op.op_class = OpClass::Transfer;
    op.name = name;
    op.step = step_;
    op.layer = layer;
    (lane == Lane::Load ? op.h2d_bytes : op.d2h_bytes) = bytes;
    op.weights = weights;
    op.copy_bytes = copy_bytes;
    op.row_bytes = row_bytes;
    op.chunks = chunks;
    if (last_compute_ >= 0) op.deps.push_back(last_compute_);
    if (after >= 0) op.deps.push_back(after);
    return add(std::move(op));
  }

  // Contiguous-run transfer of a KV range: one chunk per (K/V, sequence, head, block) run.
  int64_t range_chunks(int64_t tokens) const {
    const int64_t bt = in_.options.kv_block_tokens;
    return 2 * B_ * H_ * ((tokens + bt - 1) / bt);
  }

  // StreamedLayers::layer(l): a layer not prefetched loads on first use; the host waits for the
  // layer's weights, then prefetches the next layer (after the last one, layer 0 of the next
  // pass) into the other buffer when it has the other parity.
  void layer_weights(int64_t layer) {
    if (weight_chunks_ == 0) return;
    const size_t p = static_cast<size_t>(layer % 2);
    if (staged_layer_[p] != layer) issue_weights(layer);
    wait(weights_loaded_[p]);
    const int64_t next = (layer + 1) % L_;
    if (static_cast<size_t>(next % 2) != p && staged_layer_[1 - p] != next) {
      // Enqueued once the host has seen this layer's weights arrive.
      const int32_t seen = weights_loaded_[p];
      issue_weights(next);
      s_.ops.back().deps.push_back(seen);
    }
  }
  void issue_weights(int64_t layer) {
    const size_t p = static_cast<size_t>(layer % 2);
    staged_layer_[p] = layer;
    weights_loaded_[p] = transfer(Lane::Load, "weights", layer, weight_bytes_,
                                  static_cast<double>(weight_bytes_), 0, weight_chunks_, true, -1);
  }

  // Policy infinigen: (sequence, head, token) rows decode step `step_` loads for `layer`.
  uint64_t fetched_rows(int64_t layer, int64_t n) const {
    const size_t step = static_cast<size_t>(step_ - 1);
    if (step < in_.fetched_rows.size()) return in_.fetched_rows[step][static_cast<size_t>(layer)];
    const std::vector<double>& share = in_.fetched_fraction;
    double fraction = 0;
    if (static_cast<int64_t>(share.size()) == L_) {
      fraction = share[static_cast<size_t>(layer)];
    } else {
      // Relative depth among the speculated layers: the measured model's first dense_layers
      // entries are its dense layers (everything loaded), which say nothing about how much a
      // speculated layer of this model fetches.
      const int64_t measured_dense = std::min<int64_t>(dense_layers_, share.size() - 1);
      const int64_t measured = static_cast<int64_t>(share.size()) - measured_dense;
      const double depth = (f(layer - dense_layers_) + 0.5) / f(L_ - dense_layers_);
      const int64_t at = std::min<int64_t>(
          measured - 1, static_cast<int64_t>(depth * static_cast<double>(measured)));
      fraction = share[static_cast<size_t>(measured_dense + at)];
    }
    const int64_t per_row = std::clamp<int64_t>(static_cast<int64_t>(std::floor(fraction * f(n))),
                                                1, std::min(max_num_kv_, n));
    return static_cast<uint64_t>(per_row * B_ * H_);
  }

  int64_t h2o_count(int64_t tokens) const { return std::min(tokens, slots_); }

  // The load of `layer`'s KV for this decode step (n tokens in the pool).
  void issue_kv_load(int64_t layer, int64_t n) {
    const size_t l = static_cast<size_t>(layer);
    uint64_t bytes = 0;
    double copy = 0, rows = 0;
    int64_t chunks = 0;
    switch (policy_) {
      case Policy::Full:
      case Policy::Infinigen:
        if (speculated(layer)) {
          const uint64_t fetched = fetched_rows(layer, n);
          bytes = 2 * fetched * static_cast<uint64_t>(d_) * kv_;
          rows = static_cast<double>(bytes);
          chunks = 2 * static_cast<int64_t>(fetched);
          fetch_per_row_[l] = static_cast<double>(fetched) / f(B_ * H_);
        } else {
          bytes = static_cast<uint64_t>(2 * B_ * H_ * n * d_) * kv_;
          copy = static_cast<double>(bytes);
          chunks = range_chunks(n);
        }
        break;
      case Policy::Int4:
        bytes = static_cast<uint64_t>(2 * B_ * H_ * n) * int4_row_bytes(d_);
        copy = static_cast<double>(bytes);
        chunks = 4 * B_ * H_;  // codes and meta per (K/V, sequence, head)
        break;
      case Policy::H2o:
        bytes = static_cast<uint64_t>(2 * B_ * H_ * h2o_count(n) * d_) * kv_;
        copy = static_cast<double>(bytes);
        chunks = 2 * B_ * H_;
        break;
      case Policy::Gpu:
        return;
    }
    // The pool must hold the previous step's token of this layer before it is read.
    loaded_[l] =
        transfer(Lane::Load, "kv_load", layer, bytes, copy, rows, chunks, false, stored_[l]);
  }

  void kv_store(int64_t layer, uint64_t bytes, int64_t chunks, int32_t after) {
    stored_[static_cast<size_t>(layer)] = transfer(
        Lane::Store, "kv_store", layer, bytes, static_cast<double>(bytes), 0, chunks, false, after);
  }

  void prefill() {
    step_ = 0;
    const int64_t P = in_.prompt_len, rows = B_ * P;
    compute(OpClass::Elementwise, "embed", -1, 0, 12.0 * f(rows * D_));
    for (int64_t l = 0; l < L_; ++l) {
      layer_weights(l);
      compute(OpClass::Elementwise, "layer_norm", l, 0, layer_norm_bytes(rows, D_));
      linear("q_proj", l, rows, D_, D_, w_);
      compute(OpClass::Elementwise, "scale", l, 0, 8.0 * f(rows * D_));
      linear("k_proj", l, rows, D_, D_, w_);
      linear("v_proj", l, rows, D_, D_, w_);
      const double kv_rows = 2.0 * f(rows * D_) * static_cast<double>(4 + kv_);
      switch (policy_) {
        case Policy::Gpu:
          compute(OpClass::Elementwise, "kv_append", l, 0, kv_rows);
          break;
        case Policy::Full:
        case Policy::Infinigen: {
          if (l >= 2) wait(stored_[static_cast<size_t>(l - 2)]);  // the staging buffer's reader
          compute(OpClass::Elementwise, "kv_append", l, 0, kv_rows);
          kv_store(l, static_cast<uint64_t>(2 * rows * D_) * kv_, range_chunks(P), -1);
          if (speculated(l)) {  // partial columns, weights and key cache
            compute(OpClass::Elementwise, "partial_build", l, 0,
                    8.0 * f(rows * D_) + 4.0 * f(rows * H_ * r_) + 4.0 * f(H_ * r_ * D_));
          }
          break;
        }
        case Policy::Int4:
          if (l >= 2) wait(stored_[static_cast<size_t>(l - 2)]);
          compute(OpClass::Codec, "int4_quantize", l, 0, 2.0 * f(rows * D_) * 2.0);
          kv_store(l, static_cast<uint64_t>(2 * rows * H_) * int4_row_bytes(d_), 4 * B_ * H_, -1);
          break;
        case Policy::H2o: {
          // Every valid query's causal softmax over the valid keys: a d-long dot and an exp per
          // visible pair.
          const double pairs = f(P) * f(P + 1) / 2.0;
          compute(OpClass::Scoring, "h2o_scores", l, f(B_ * H_) * pairs * f(2 * d_ + 4), 0);
          const int64_t kept = h2o_count(P);
          wait(staging_read_[static_cast<size_t>(l % 2)]);
          compute(OpClass::Elementwise, "kv_append", l, 0, 2.0 * f(B_ * H_ * kept * d_) * 6.0);
          kv_store(l, static_cast<uint64_t>(2 * B_ * H_ * kept * d_) * kv_, 2 * B_ * H_, -1);
          staging_read_[static_cast<size_t>(l % 2)] = stored_[static_cast<size_t>(l)];
          break;
        }
      }
      compute(OpClass::AttentionPrefill, "attention", l, attention_prefill_flops(B_, H_, P, d_),
              4.0 * 4.0 * f(rows * D_));
      block_tail(l, rows);
    }
    s_.prefill_end.push_back(last_compute_);
    // end_pass: the prefill's stores read the staging buffers the first decode loads overwrite.
    if (offloads_kv()) {
      for (int32_t stored : stored_) wait(stored);
    }
    compute(OpClass::Elementwise, "last_rows", -1, 0, 8.0 * f(B_ * D_));
    lm_head_and_sample();
  }

  void decode(int64_t step) {
    step_ = step;
    const int64_t n = in_.prompt_len + step - 1;  // tokens in the pool when the step starts
    fetch_per_row_.assign(static_cast<size_t>(L_), 0.0);
    if (offloads_kv()) issue_kv_load(0, n);  // begin_pass
    compute(OpClass::Elementwise, "embed", -1, 0, 12.0 * f(B_ * D_));
    for (int64_t l = 0; l < L_; ++l) {
      const size_t p = static_cast<size_t>(l % 2);
      // begin_layer: the next layer's load into the other buffer (speculated layers load from
      // observe instead).
      if (offloads_kv() && l + 1 < L_ && !speculated(l + 1)) issue_kv_load(l + 1, n);
      layer_weights(l);
      compute(OpClass::Elementwise, "layer_norm", l, 0, layer_norm_bytes(B_, D_));
      linear("q_proj", l, B_, D_, D_, w_);
      compute(OpClass::Elementwise, "scale", l, 0, 8.0 * f(B_ * D_));
      linear("k_proj", l, B_, D_, D_, w_);
      linear("v_proj", l, B_, D_, D_, w_);
      // observe: speculation of the next layer's attention, then its load.
      if (l + 1 < L_ && speculated(l + 1)) {
        linear("partial_query", l, B_, H_ * r_, D_, 4);
        compute(OpClass::Speculation, "speculate", l, 0, partial_key_bytes_ * f(B_ * H_ * n * r_));
        issue_kv_load(l + 1, n);
      }
      const double row_writes = 2.0 * f(B_ * D_) * static_cast<double>(4 + kv_);
      double rows_read = f(n + 1);  // attention's KV rows per (sequence, head)
      switch (policy_) {
        case Policy::Gpu:
          compute(OpClass::Elementwise, "kv_append", l, 0, row_writes);
          break;
        case Policy::Full:
        case Policy::Infinigen:
          // The new row joins the staging buffer, then (once the store of the previous layer of
          // this parity has read the store buffer) the store buffer, and goes to the pool.
          compute(OpClass::Elementwise, "kv_append", l, 0, row_writes);
          wait(store_buffer_read_[p]);
          compute(OpClass::Elementwise, "kv_store_buffer", l, 0, row_writes);
          kv_store(l, static_cast<uint64_t>(2 * B_ * D_) * kv_, 2 * B_ * H_, -1);
          store_buffer_read_[p] = stored_[static_cast<size_t>(l)];
          if (speculated(l)) {
            compute(OpClass::Elementwise, "partial_append", l, 0, 8.0 * f(B_ * H_ * r_));
            rows_read = fetch_per_row_[static_cast<size_t>(l)] + 1;
          }
          break;
        case Policy::Int4:
          wait(store_buffer_read_[p]);
          compute(OpClass::Codec, "int4_quantize", l, 0, 4.0 * f(B_ * D_));
          kv_store(l, static_cast<uint64_t>(2 * B_ * H_) * int4_row_bytes(d_), 4 * B_ * H_, -1);
          store_buffer_read_[p] = stored_[static_cast<size_t>(l)];
          compute(OpClass::Codec, "int4_dequantize_new", l, 0, 4.0 * f(B_ * D_));
          break;
        case Policy::H2o: {
          const int64_t count = h2o_count(n);
          rows_read = f(count + 1);
          // The new token into staging row `slots` once the store that last read it is done,
          // the new query's softmax over the kept entries and the victim search, then the row
          // to the pool after this step's load of the layer (which may read the victim's old
          // row).
          wait(staging_read_[p]);
          compute(OpClass::Elementwise, "kv_append", l, 0, row_writes);
          compute(OpClass::Scoring, "h2o_scores", l, f(B_ * H_ * (count + 1) * (2 * d_ + 6)), 0);
          kv_store(l, static_cast<uint64_t>(2 * B_ * D_) * kv_, 2 * B_ * H_,
                   loaded_[static_cast<size_t>(l)]);
          staging_read_[p] = stored_[static_cast<size_t>(l)];
          break;
        }
      }
      // view: the host waits for this layer's load.
      if (offloads_kv()) wait(loaded_[static_cast<size_t>(l)]);
      if (policy_ == Policy::Int4) {
        compute(OpClass::Codec, "int4_dequantize", l, 0, 4.0 * f(B_ * H_ * n * d_));
      }
      compute(OpClass::AttentionDecode, "attention", l,
              attention_decode_flops(B_, H_, 1, d_) * rows_read,
              attention_decode_bytes(B_, H_, 1, d_, kv_) * rows_read);
      block_tail(l, B_);
    }
    lm_head_and_sample();
  }

  // Output projection, residual, the FFN block and its residual.
  void block_tail(int64_t l, int64_t rows) {
    linear("out_proj", l, rows, D_, D_, w_);
    compute(OpClass::Elementwise, "residual", l, 0, 12.0 * f(rows * D_));
    compute(OpClass::Elementwise, "layer_norm", l, 0, layer_norm_bytes(rows, D_));
    linear("fc1", l, rows, F_, D_, w_);
    linear("fc2", l, rows, D_, F_, w_);
    compute(OpClass::Elementwise, "residual", l, 0, 12.0 * f(rows * D_));
  }

  void lm_head_and_sample() {
    compute(OpClass::Elementwise, "final_norm", -1, 0, layer_norm_bytes(B_, D_));
    linear("lm_head", -1, B_, c_.vocab_size, D_, w_);
    s_.step_end.push_back(
        compute(OpClass::Elementwise, "sample", -1, 0, 4.0 * f(B_ * c_.vocab_size)));
  }

  const CostModelInput& in_;
  const ModelConfig& c_;
  Policy policy_;
  int64_t B_, H_, d_, D_, F_, L_;
  size_t kv_, w_;
  int64_t capacity_;
  int64_t dense_layers_ = 0, r_ = 1, max_num_kv_ = 1, slots_ = 2;
  double partial_key_bytes_ = 4.0;  // bytes per element of the partial key cache
  uint64_t weight_bytes_ = 0;
  int64_t weight_chunks_ = 0;

  Schedule s_;
  int64_t step_ = 0;
  int32_t last_compute_ = -1;
  std::vector<int32_t> waits_;
  std::vector<int32_t> stored_;  // per layer: latest store into the pool
  std::vector<int32_t> loaded_;  // per layer: this step's load
  std::vector<double> fetch_per_row_;
  int32_t store_buffer_read_[2] = {-1, -1};
  int32_t staging_read_[2] = {-1, -1};
  int64_t staged_layer_[2] = {-1, -1};
  int32_t weights_loaded_[2] = {-1, -1};
};

}  // namespace

Schedule run_schedule(const CostModelInput& input) {
  return ScheduleBuilder(input).build();
}

}  // namespace infinigen
