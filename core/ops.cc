// core: op dispatch. Each op checks shapes, records itself in the active trace (core/trace.h; a
// dry run stops there), then calls the kernel of its tensors' device: kernels/cpu here, or the
// CUDA entry point of the same name (core/ops_cuda.h), defined on kernels/cuda by ops_cuda.cc
// when the CUDA backend is compiled and refused by ops_no_cuda.cc otherwise.
#include "core/ops.h"

#include <algorithm>

#include "core/ops_cuda.h"
#include "core/trace.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/int4.h"
#include "kernels/cpu/layer_norm.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/rms_norm.h"
#include "kernels/cpu/rope.h"

namespace infinigen::ops {
namespace {

namespace cpu = kernels::cpu;

cpu::Element element(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return cpu::Element::F32;
    case DType::F16:
      return cpu::Element::F16;
    case DType::BF16:
      return cpu::Element::BF16;
    default:
      fail("tensor of ", dtype_name(dtype), " where a floating-point tensor is needed");
  }
}

// Every op runs on the device of its first tensor; all others must be there too.
Device common_device(const char* op, std::initializer_list<const Tensor*> tensors) {
  const Device device = (*tensors.begin())->device();
  for (const Tensor* t : tensors) {
    if (t->defined()) {
      INFINIGEN_CHECK(t->device() == device, op, ": tensors on different devices");
    }
  }
  return device;
}

void check_shape(const char* op, const Tensor& t, const Shape& expected) {
  INFINIGEN_CHECK(t.shape() == expected, op, ": got shape ", shape_string(t.shape()), ", expected ",
                  shape_string(expected));
}

}  // namespace

bool device_runs_transformer(Device device) {
  // Every op below has a CUDA kernel, checked against the CPU backend by
  // tests/kernels_cuda_test.cc on the emulated device in CI (and on a GPU when one is lent).
  (void)device;
  return true;
}

void embed(const std::vector<int32_t>& tokens, const std::vector<int32_t>& positions,
           const Tensor& tokens_table, const Tensor& positions_table, Tensor& out) {
  const Device device = common_device("embed", {&out, &tokens_table, &positions_table});
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t D = tokens_table.dim(1);
  const bool with_positions = positions_table.defined();
  check_shape("embed", out, {n, D});
  for (int64_t i = 0; i < n; ++i) {
    INFINIGEN_CHECK(tokens[i] >= 0 && tokens[i] < tokens_table.dim(0), "token id ", tokens[i],
                    " is outside the vocabulary of ", tokens_table.dim(0));
  }
  if (with_positions) {
    INFINIGEN_CHECK(positions.size() == tokens.size(), "embed: ", tokens.size(), " tokens but ",
                    positions.size(), " positions");
    INFINIGEN_CHECK(tokens_table.dtype() == positions_table.dtype(), "embed: table dtypes differ");
    check_shape("embed", positions_table, {positions_table.dim(0), D});
    for (int64_t i = 0; i < n; ++i) {
      INFINIGEN_CHECK(positions[i] >= 0 && positions[i] < positions_table.dim(0), "position ",
                      positions[i], " is outside the position table of ", positions_table.dim(0));
    }
  }
  if (traced("embed", {n, D})) return;
  if (device == Device::Cuda) {
    cuda::embed(tokens, with_positions ? positions : std::span<const int32_t>(), tokens_table,
                positions_table, out);
    return;
  }
  cpu::embed(tokens.data(), with_positions ? positions.data() : nullptr, n, tokens_table.raw(),
             with_positions ? positions_table.raw() : nullptr, element(tokens_table.dtype()), D,
             out.data<float>());
}

void layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps, Tensor& y) {
  const Device device = common_device("layer_norm", {&x, &gamma, &beta, &y});
  const int64_t D = x.dim(-1);
  check_shape("layer_norm", gamma, {D});
  check_shape("layer_norm", beta, {D});
  check_shape("layer_norm", y, x.shape());
  const int64_t rows = x.numel() / D;
  if (traced("layer_norm", {rows, D})) return;
  if (device == Device::Cuda) {
    cuda::layer_norm(x, gamma, beta, eps, y, rows, D);
    return;
  }
  cpu::layer_norm(x.data<float>(), gamma.data<float>(), beta.data<float>(), y.data<float>(), rows,
                  D, eps);
}

void rms_norm(const Tensor& x, const Tensor& gamma, float eps, Tensor& y) {
  const Device device = common_device("rms_norm", {&x, &gamma, &y});
  const int64_t D = x.dim(-1);
  check_shape("rms_norm", gamma, {D});
  check_shape("rms_norm", y, x.shape());
  const int64_t rows = x.numel() / D;
  if (traced("rms_norm", {rows, D})) return;
  if (device == Device::Cuda) {
    cuda::rms_norm(x, gamma, eps, y, rows, D);
    return;
  }
  cpu::rms_norm(x.data<float>(), gamma.data<float>(), y.data<float>(), rows, D, eps);
}

void rope(Tensor& x, const std::vector<int32_t>& positions, const Tensor& inv_freq) {
  const Device device = common_device("rope", {&x, &inv_freq});
  const int64_t rows = x.dim(0), width = x.dim(1), half = inv_freq.numel();
  INFINIGEN_CHECK(inv_freq.dtype() == DType::F32 && half > 0 && width % (2 * half) == 0,
                  "rope: ", inv_freq.numel(), " frequencies do not divide rows of width ", width);
  INFINIGEN_CHECK(static_cast<int64_t>(positions.size()) == rows, "rope: ", positions.size(),
                  " positions for ", rows, " rows");
  if (traced("rope", {rows, width})) return;
  const int64_t head_dim = 2 * half, heads = width / head_dim;
  if (device == Device::Cuda) {
    cuda::rope(x, positions, inv_freq, rows, heads, head_dim);
    return;
  }
  cpu::rope(x.data<float>(), positions.data(), inv_freq.data<float>(), rows, heads, head_dim);
}

void silu_mul(Tensor& gate, const Tensor& up) {
  const Device device = common_device("silu_mul", {&gate, &up});
  check_shape("silu_mul", up, gate.shape());
  if (traced("silu_mul", {gate.numel()})) return;
  if (device == Device::Cuda) {
    cuda::silu_mul(gate, up);
    return;
  }
  cpu::silu_mul(gate.data<float>(), up.data<float>(), gate.numel());
}

void linear(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y, bool relu) {
  const Device device = common_device("linear", {&x, &w, &bias, &y});
  const int64_t M = x.dim(0), K = x.dim(1), N = w.dim(0);
  check_shape("linear", w, {N, K});
  check_shape("linear", y, {M, N});
  if (bias.defined()) check_shape("linear", bias, {N});
  if (traced("linear", {M, N, K}, w.dtype())) return;
  if (device == Device::Cuda) {
    cuda::linear(x, w, bias, y, relu, M, N, K);
    return;
  }
  cpu::linear(x.data<float>(), w.raw(), element(w.dtype()),
              bias.defined() ? bias.data<float>() : nullptr, y.data<float>(), M, N, K, relu);
}

void add_inplace(Tensor& y, const Tensor& x) {
  const Device device = common_device("add", {&y, &x});
  check_shape("add", x, y.shape());
  if (traced("add", {y.numel()})) return;
  if (device == Device::Cuda) {
    cuda::add_inplace(y, x);
    return;
  }
  cpu::add_inplace(y.data<float>(), x.data<float>(), y.numel());
}

void scale_inplace(Tensor& y, float factor) {
  const Device device = common_device("scale", {&y});
  if (traced("scale", {y.numel()})) return;
  if (device == Device::Cuda) {
    cuda::scale_inplace(y, factor);
    return;
  }
  cpu::scale_inplace(y.data<float>(), factor, y.numel());
}

void attention_prefill(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                       int64_t batch, int64_t num_heads, const std::vector<int32_t>& first_valid) {
  const Device device = common_device("attention_prefill", {&q, &k, &v, &out});
  const int64_t n = q.dim(0) / batch, D = q.dim(1), d = D / num_heads;
  const int64_t kv_heads = k.dim(1) / d;
  INFINIGEN_CHECK(num_heads > 0 && D % num_heads == 0 && kv_heads > 0 && k.dim(1) == kv_heads * d &&
                      num_heads % kv_heads == 0,
                  "attention_prefill: ", num_heads, " query heads of width ", D,
                  " do not group over keys of width ", k.dim(1));
  check_shape("attention_prefill", out, q.shape());
  check_shape("attention_prefill", k, {q.dim(0), kv_heads * d});
  check_shape("attention_prefill", v, k.shape());
  INFINIGEN_CHECK(static_cast<int64_t>(first_valid.size()) == batch && n * batch == q.dim(0),
                  "attention_prefill: batch ", batch, " does not divide ", q.dim(0), " rows");
  if (traced("attention_prefill", {batch, num_heads, n, d, kv_heads})) return;
  if (device == Device::Cuda) {
    cuda::attention_prefill(q, k, v, out, batch, n, num_heads, kv_heads, d, first_valid);
    return;
  }
  cpu::attention_prefill(q.data<float>(), k.data<float>(), v.data<float>(), out.data<float>(),
                         batch, n, num_heads, kv_heads, d, first_valid.data());
}

void attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, Tensor& out,
                      int64_t length, const std::vector<int32_t>& first_valid,
                      const SharedPrefixes* shared) {
  const Device device = common_device("attention_decode", {&q, &k_cache, &v_cache, &out});
  const int64_t B = k_cache.dim(0), kv_heads = k_cache.dim(1), capacity = k_cache.dim(2);
  const int64_t d = k_cache.dim(3), H = q.dim(1) / d, n = B > 0 ? q.dim(0) / B : 0;
  INFINIGEN_CHECK(q.dim(1) == H * d && H % kv_heads == 0, "attention_decode: queries of width ",
                  q.dim(1), " do not group over ", kv_heads, " KV heads of size ", d);
  INFINIGEN_CHECK(n >= 1 && n <= length, "attention_decode: ", q.dim(0),
                  " query rows for a batch of ", B, " and ", length, " cache rows");
  check_shape("attention_decode", q, {B * n, H * d});
  check_shape("attention_decode", out, {B * n, H * d});
  check_shape("attention_decode", v_cache, k_cache.shape());
  INFINIGEN_CHECK(k_cache.dtype() == v_cache.dtype(), "attention_decode: K and V dtypes differ");
  INFINIGEN_CHECK(length <= capacity, "attention_decode: length ", length, " beyond capacity ",
                  capacity);
  // The kernels read first_valid[b] (and the prefix's rows) for every b: a short array would be
  // read past its end.
  INFINIGEN_CHECK(std::ssize(first_valid) == B, "attention_decode: ", first_valid.size(),
                  " first_valid entries for a batch of ", B);
  if (shared != nullptr && shared->empty()) shared = nullptr;
  const int64_t prefix_end = shared ? shared->rows() : 0;
  INFINIGEN_CHECK(!shared || (shared->batch() == B && prefix_end <= length),
                  "attention_decode: shared prefixes of ", shared ? shared->batch() : 0,
                  " sequences and ", prefix_end, " rows for a batch of ", B, " and ", length,
                  " rows");
  for (int32_t start : first_valid) {
    INFINIGEN_CHECK(start >= prefix_end, "attention_decode: a sequence's rows start at ", start,
                    ", inside the ", prefix_end, " rows of shared prefixes");
  }
  const auto sizes = [&]() -> std::array<int64_t, 5> {
    // Rows attention reads over the batch, each (sequence, KV head)'s once: its prefix's, then
    // its own from its first valid one; and the (query, row) pairs it scores.
    int64_t rows = 0, pairs = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t prefix = shared ? shared->prefix_length(b) : 0;
      const int64_t start = first_valid[static_cast<size_t>(b)];
      rows += prefix + length - std::min<int64_t>(length, start);
      for (int64_t t = std::max(length - n, start); t < length; ++t)
        pairs += prefix + t + 1 - start;
    }
    if (n == 1) return {B, H, rows, d, kv_heads};
    return {H, kv_heads, pairs, rows, d};
  };
  if (traced_lazily(n == 1 ? "attention_decode" : "attention_extend", sizes, k_cache.dtype())) {
    return;
  }
  if (device == Device::Cuda) {
    cuda::attention_decode(q, k_cache, v_cache, out, B, n, H, kv_heads, d, capacity, length,
                           first_valid, shared);
    return;
  }
  cpu::attention_decode(q.data<float>(), k_cache.raw(), v_cache.raw(), element(k_cache.dtype()),
                        out.data<float>(), B, n, H, kv_heads, d, capacity, length,
                        first_valid.data(), shared ? shared->begin().data() : nullptr,
                        shared ? shared->source().data() : nullptr, prefix_end);
}

void cache_store(const Tensor& rows, Tensor& cache, int64_t offset) {
  const Device device = common_device("cache_store", {&rows, &cache});
  const int64_t B = cache.dim(0), H = cache.dim(1), capacity = cache.dim(2), d = cache.dim(3);
  const int64_t n = rows.dim(0) / B;
  check_shape("cache_store", rows, {B * n, H * d});
  INFINIGEN_CHECK(offset + n <= capacity, "KV cache overflow: ", offset + n, " tokens, capacity ",
                  capacity);
  if (traced("cache_store", {B * n, H * d}, cache.dtype())) return;
  if (device == Device::Cuda) {
    cuda::cache_store(rows, cache, B, n, H, d, capacity, offset);
    return;
  }
  cpu::cache_store(rows.data<float>(), cache.raw(), element(cache.dtype()), B, n, H, d, capacity,
                   offset);
}

namespace {

// The h2o ops run on CUDA tensors only (core/ops.h): the CPU backend scores in offload/h2o_kv.cc.
void check_h2o_device(const char* op, Device device) {
  INFINIGEN_CHECK(device == Device::Cuda, op,
                  ": runs on CUDA tensors (the CPU backend's h2o scores in offload/h2o_kv.cc)");
}

void check_dtype(const char* op, const Tensor& t, DType dtype, const char* what) {
  INFINIGEN_CHECK(t.dtype() == dtype, op, ": ", what, " of ", dtype_name(t.dtype()), ", expected ",
                  dtype_name(dtype));
}

}  // namespace

void h2o_decode(const Tensor& queries, const Tensor& keys, Tensor& scores, Tensor& tokens,
                Tensor& probs, Tensor& placed, const std::vector<int32_t>& first_row, int32_t token,
                int32_t recent_start) {
  const char* op = "h2o_decode";
  const Device device = common_device(op, {&queries, &keys, &scores, &tokens, &probs, &placed});
  check_h2o_device(op, device);
  INFINIGEN_CHECK(keys.rank() == 4, op, ": keys of shape ", shape_string(keys.shape()));
  const int64_t B = keys.dim(0), H_kv = keys.dim(1), rows = keys.dim(2), d = keys.dim(3);
  const int64_t H = d > 0 ? queries.dim(1) / d : 0;
  INFINIGEN_CHECK(H_kv > 0 && H * d == queries.dim(1) && H % H_kv == 0 && rows >= 2, op,
                  ": queries of width ", queries.dim(1), " do not group over ", H_kv,
                  " KV heads of size ", d, " (", rows, " rows)");
  check_shape(op, queries, {B, H * d});
  check_shape(op, scores, {B, H_kv, rows});
  check_shape(op, tokens, {B, H_kv, rows});
  check_shape(op, probs, {B, H_kv, rows});
  check_shape(op, placed, {B, H_kv});
  check_dtype(op, queries, DType::F32, "queries");
  check_dtype(op, scores, DType::F32, "scores");
  check_dtype(op, probs, DType::F32, "probabilities");
  check_dtype(op, tokens, DType::I32, "tokens");
  check_dtype(op, placed, DType::I32, "placed rows");
  INFINIGEN_CHECK(std::ssize(first_row) == B, op, ": ", first_row.size(),
                  " first rows for a batch of ", B);
  for (int32_t row : first_row) {
    INFINIGEN_CHECK(row >= 0 && row < rows, op, ": first row ", row, " outside [0, ", rows, ")");
  }
  if (dry_run()) return;
  cuda::h2o_decode(queries, keys, scores, tokens, probs, placed, first_row, B, H, H_kv, d, rows,
                   token, recent_start);
}

void h2o_prefill(const Tensor& queries, const Tensor& keys, const Tensor& values, Tensor& keys_out,
                 Tensor& values_out, Tensor& scores, Tensor& tokens, Tensor& row_stats,
                 Tensor& key_scores, Tensor& kept, const std::vector<int32_t>& first_valid,
                 int64_t slots, int64_t recent) {
  const char* op = "h2o_prefill";
  const Device device = common_device(op, {&queries, &keys, &values, &keys_out, &values_out,
                                           &scores, &tokens, &row_stats, &key_scores, &kept});
  check_h2o_device(op, device);
  INFINIGEN_CHECK(keys_out.rank() == 4, op, ": staging of shape ", shape_string(keys_out.shape()));
  const int64_t B = keys_out.dim(0), H_kv = keys_out.dim(1), rows = keys_out.dim(2);
  const int64_t d = keys_out.dim(3), n = B > 0 ? keys.dim(0) / B : 0;
  const int64_t H = d > 0 ? queries.dim(1) / d : 0;
  INFINIGEN_CHECK(H_kv > 0 && H * d == queries.dim(1) && H % H_kv == 0, op, ": queries of width ",
                  queries.dim(1), " do not group over ", H_kv, " KV heads of size ", d);
  INFINIGEN_CHECK(slots >= 1 && slots < rows && recent >= 0 && recent <= slots, op, ": ", slots,
                  " slots (", recent, " recent) in ", rows, " rows");
  check_shape(op, queries, {B * n, H * d});
  check_shape(op, keys, {B * n, H_kv * d});
  check_shape(op, values, {B * n, H_kv * d});
  check_shape(op, values_out, keys_out.shape());
  check_shape(op, scores, {B, H_kv, rows});
  check_shape(op, tokens, {B, H_kv, rows});
  check_shape(op, row_stats, {2, B, H, n});
  check_shape(op, key_scores, {B, H_kv, n});
  check_shape(op, kept, {B, H_kv, n});
  const std::initializer_list<const Tensor*> fp32 = {&queries, &keys,      &values,
                                                     &scores,  &row_stats, &key_scores};
  for (const Tensor* t : fp32) {
    check_dtype(op, *t, DType::F32, "a tensor");
  }
  check_dtype(op, values_out, keys_out.dtype(), "values");
  check_dtype(op, tokens, DType::I32, "tokens");
  check_dtype(op, kept, DType::I32, "keep flags");
  INFINIGEN_CHECK(std::ssize(first_valid) == B, op, ": ", first_valid.size(),
                  " first_valid entries for a batch of ", B);
  for (int32_t start : first_valid) {
    INFINIGEN_CHECK(start >= 0 && start < n, op, ": first valid token ", start, " of ", n);
  }
  if (dry_run()) return;
  cuda::h2o_prefill(queries, keys, values, keys_out, values_out, scores, tokens, row_stats,
                    key_scores, kept, first_valid, B, n, H, H_kv, d, rows, slots, recent);
}

void h2o_store_placed(const Tensor& keys, const Tensor& values, const Tensor& placed,
                      void* pool_keys, void* pool_values) {
  const char* op = "h2o_store_placed";
  const Device device = common_device(op, {&keys, &values, &placed});
  check_h2o_device(op, device);
  INFINIGEN_CHECK(keys.rank() == 4 && keys.dim(2) >= 2, op, ": staging of shape ",
                  shape_string(keys.shape()));
  const int64_t B = keys.dim(0), H_kv = keys.dim(1), rows = keys.dim(2), d = keys.dim(3);
  check_shape(op, values, keys.shape());
  check_dtype(op, values, keys.dtype(), "values");
  check_shape(op, placed, {B, H_kv});
  check_dtype(op, placed, DType::I32, "placed rows");
  INFINIGEN_CHECK(pool_keys != nullptr && pool_values != nullptr, op, ": no pool");
  if (dry_run()) return;
  cuda::h2o_store_placed(keys, values, placed, pool_keys, pool_values, B, H_kv, rows,
                         d * static_cast<int64_t>(dtype_size(keys.dtype())));
}

namespace {

// The layer's tensors on one device, CUDA (the CPU backend speculates in PartialLayer), and its
// sizes: B, H_kv, capacity, r.
struct PartialShape {
  int64_t B, H_kv, capacity, r;
};
PartialShape check_partial(const char* op, const PartialTensors& layer,
                           std::initializer_list<const Tensor*> others) {
  std::vector<const Tensor*> tensors = {&layer.head_rows, &layer.needed_dims, &layer.columns,
                                        &layer.keys};
  if (layer.skew.defined()) tensors.push_back(&layer.skew);
  if (layer.inv_freq.defined()) tensors.push_back(&layer.inv_freq);
  for (const Tensor* t : others) {
    if (t->defined()) tensors.push_back(t);
  }
  for (const Tensor* t : tensors) {
    INFINIGEN_CHECK(t->device() == Device::Cuda, op,
                    ": runs on CUDA tensors (the CPU backend speculates in PartialLayer)");
  }
  const Tensor& keys = layer.keys;
  INFINIGEN_CHECK(keys.rank() == 4 && layer.columns.rank() == 2 &&
                      layer.columns.dim(0) == keys.dim(1) && layer.columns.dim(1) == keys.dim(3),
                  op, ": partial keys of shape ", shape_string(keys.shape()), " and columns of ",
                  shape_string(layer.columns.shape()));
  const int64_t H_kv = keys.dim(1), d = layer.head_dim;
  INFINIGEN_CHECK(layer.heads > 0 && layer.heads % H_kv == 0 && d > 0 && keys.dim(3) <= d, op,
                  ": ", layer.heads, " heads of ", d, " over ", H_kv, " KV heads");
  INFINIGEN_CHECK(keys.dtype() == DType::F32 || keys.dtype() == DType::F16, op,
                  ": partial keys of ", dtype_name(keys.dtype()));
  check_shape(op, layer.head_rows, {layer.heads + 1});
  check_dtype(op, layer.head_rows, DType::I32, "head rows");
  check_dtype(op, layer.needed_dims, DType::I32, "needed dimensions");
  check_dtype(op, layer.columns, DType::I32, "columns");
  if (layer.skew.defined()) check_shape(op, layer.skew, {H_kv, d, d});
  if (layer.inv_freq.defined()) check_shape(op, layer.inv_freq, {d / 2});
  return {keys.dim(0), H_kv, keys.dim(2), keys.dim(3)};
}

void check_shared(const char* op, const SharedPrefixes* shared, int64_t B, int64_t capacity) {
  INFINIGEN_CHECK(shared == nullptr || (shared->batch() == B && shared->rows() <= capacity), op,
                  ": shared prefixes do not fit a batch of ", B, " with ", capacity, " positions");
}

}  // namespace

void speculate_logits(const Tensor& query_rows, const PartialTensors& layer,
                      const std::vector<int32_t>& rope_positions, const Tensor& position_tokens,
                      const std::vector<int32_t>& first_valid, const SharedPrefixes* shared,
                      int64_t used, Tensor& logits) {
  const char* op = "speculate_logits";
  const auto [B, H_kv, capacity, r] =
      check_partial(op, layer, {&query_rows, &position_tokens, &logits});
  (void)r;
  check_shape(op, query_rows, {B, layer.needed_dims.numel()});
  check_dtype(op, query_rows, DType::F32, "query rows");
  INFINIGEN_CHECK(used >= 0 && used <= capacity && logits.numel() >= B * H_kv * used, op, ": ",
                  used, " positions of ", capacity, " into logits of ", logits.numel());
  check_dtype(op, logits, DType::F32, "logits");
  if (position_tokens.defined()) {
    check_shape(op, position_tokens, {B, H_kv, capacity});
    check_dtype(op, position_tokens, DType::I32, "position tokens");
  }
  INFINIGEN_CHECK(std::ssize(first_valid) == B, op, ": ", first_valid.size(),
                  " first valid tokens for a batch of ", B);
  INFINIGEN_CHECK(!layer.inv_freq.defined() || std::ssize(rope_positions) == B, op, ": ",
                  rope_positions.size(), " rotary positions for a batch of ", B);
  check_shared(op, shared, B, capacity);
  if (dry_run()) return;
  cuda::speculate_logits(query_rows, layer, rope_positions, position_tokens, first_valid, shared,
                         B, H_kv, capacity, used, logits);
}

void select_top(const Tensor& logits, int64_t used, double alpha, int64_t max_num_kv,
                bool batch_mean, SelectionTensors& out) {
  const char* op = "select_top";
  const Device device = common_device(
      op, {&logits, &out.counts, &out.valid, &out.fetch, &out.summary, &out.tokens});
  INFINIGEN_CHECK(device == Device::Cuda, op,
                  ": runs on CUDA tensors (the CPU backend selects in PartialLayer)");
  INFINIGEN_CHECK(out.tokens.rank() == 3, op, ": tokens of shape ",
                  shape_string(out.tokens.shape()));
  const int64_t B = out.tokens.dim(0), H_kv = out.tokens.dim(1), fetch_cap = out.tokens.dim(2);
  INFINIGEN_CHECK(used >= 0 && logits.numel() >= B * H_kv * used && max_num_kv >= 1 &&
                      fetch_cap >= std::min(max_num_kv, used),
                  op, ": ", used, " positions, n' at most ", max_num_kv, ", ", fetch_cap,
                  " slots per row");
  check_dtype(op, logits, DType::F32, "logits");
  check_shape(op, out.counts, {B, H_kv});
  check_shape(op, out.valid, {B, H_kv});
  check_shape(op, out.fetch, {B});
  check_shape(op, out.summary, {2 + B});
  for (const Tensor* t : {&out.counts, &out.valid, &out.fetch, &out.summary, &out.tokens}) {
    check_dtype(op, *t, DType::I32, "selection");
  }
  if (dry_run()) return;
  cuda::select_top(logits, B, H_kv, used, alpha, max_num_kv, batch_mean, out);
}

void append_partial_keys(const Tensor& keys, PartialTensors& layer, int64_t position,
                         const Tensor& positions, const SharedPrefixes* shared) {
  const char* op = "append_partial_keys";
  const auto [B, H_kv, capacity, r] = check_partial(op, layer, {&keys, &positions});
  (void)r;
  check_shape(op, keys, {B, H_kv * layer.head_dim});
  check_dtype(op, keys, DType::F32, "keys");
  if (positions.defined()) {
    check_shape(op, positions, {B, H_kv});
    check_dtype(op, positions, DType::I32, "positions");
  } else {
    INFINIGEN_CHECK(position >= 0 && position < capacity, op, ": position ", position,
                    " outside the ", capacity, " of the partial key cache");
  }
  check_shared(op, shared, B, capacity);
  if (dry_run()) return;
  cuda::append_partial_keys(keys, layer, position, positions, shared, B, H_kv, capacity);
}

void partial_column_scores(const Tensor& queries, const Tensor& keys, const Tensor& skew,
                           int64_t heads, const std::vector<int64_t>& sequences,
                           const std::vector<int32_t>& first_valid, int64_t first_row,
                           bool with_keys, Tensor& scores) {
  const char* op = "partial_column_scores";
  const Device device = common_device(op, {&queries, &keys, &scores});
  INFINIGEN_CHECK(device == Device::Cuda && (!skew.defined() || skew.device() == device), op,
                  ": runs on CUDA tensors (the CPU backend adds up in PartialLayer)");
  const int64_t P = std::ssize(sequences);
  INFINIGEN_CHECK(P > 0 && std::ssize(first_valid) == P && queries.rank() == 2 &&
                      queries.dim(0) % P == 0 && heads > 0 && queries.dim(1) % heads == 0,
                  op, ": queries of shape ", shape_string(queries.shape()), " for ", P,
                  " sequences of ", heads, " heads");
  const int64_t d = queries.dim(1) / heads;
  INFINIGEN_CHECK(keys.rank() == 2 && keys.dim(0) == queries.dim(0) && keys.dim(1) % d == 0 &&
                      keys.dim(1) > 0 && heads % (keys.dim(1) / d) == 0,
                  op, ": keys of shape ", shape_string(keys.shape()), " for queries of ",
                  shape_string(queries.shape()));
  const int64_t H_kv = keys.dim(1) / d;
  check_dtype(op, queries, DType::F32, "queries");
  check_dtype(op, keys, DType::F32, "keys");
  check_dtype(op, scores, DType::I64, "scores (doubles)");
  INFINIGEN_CHECK(scores.rank() == 2 && scores.dim(1) == H_kv * d, op, ": scores of shape ",
                  shape_string(scores.shape()));
  for (int64_t b : sequences) {
    INFINIGEN_CHECK(b >= 0 && b < scores.dim(0), op, ": sequence ", b, " of ", scores.dim(0));
  }
  if (skew.defined()) {
    check_shape(op, skew, {H_kv, d, d});
    check_dtype(op, skew, DType::F32, "skew");
  }
  if (dry_run()) return;
  const std::vector<int32_t> rows(sequences.begin(), sequences.end());
  cuda::partial_column_scores(queries, keys, skew, heads, H_kv, rows, first_valid, first_row,
                              with_keys, scores);
}

void gather_rows(const Tensor& src, const std::vector<int32_t>& rows, Tensor& dst) {
  const char* op = "gather_rows";
  const Device device = common_device(op, {&src, &dst});
  INFINIGEN_CHECK(device == Device::Cuda, op, ": runs on CUDA tensors");
  INFINIGEN_CHECK(src.rank() == 2, op, ": source of shape ", shape_string(src.shape()));
  check_shape(op, dst, {std::ssize(rows), src.dim(1)});
  check_dtype(op, dst, src.dtype(), "rows");
  for (int32_t row : rows) {
    INFINIGEN_CHECK(row >= 0 && row < src.dim(0), op, ": row ", row, " of ", src.dim(0));
  }
  if (dry_run()) return;
  cuda::gather_rows(src, rows, dst);
}

void prompt_partial_keys(const Tensor& fresh, int64_t past, const PoolKeyBlocks& pool,
                         PartialTensors& layer, const std::vector<int32_t>& first_valid,
                         const SharedPrefixes* shared) {
  const char* op = "prompt_partial_keys";
  const auto [B, H_kv, capacity, r] = check_partial(op, layer, {&fresh});
  (void)r;
  INFINIGEN_CHECK(std::ssize(first_valid) == B, op, ": ", first_valid.size(),
                  " first valid tokens for a batch of ", B);
  int64_t n = 0;
  if (fresh.defined()) {
    check_dtype(op, fresh, DType::F32, "keys");
    INFINIGEN_CHECK(
        fresh.rank() == 2 && fresh.dim(1) == H_kv * layer.head_dim && fresh.dim(0) % B == 0, op,
        ": keys of shape ", shape_string(fresh.shape()), " for a batch of ", B);
    n = fresh.dim(0) / B;
  }
  INFINIGEN_CHECK(past >= 0 && past + n <= capacity, op, ": tokens [0, ", past + n,
                  ") in a partial key cache of ", capacity);
  INFINIGEN_CHECK(past == 0 || (pool.blocks != nullptr && pool.block_tokens > 0 &&
                                pool.max_blocks * pool.block_tokens >= past),
                  op, ": ", past, " earlier tokens and no pool blocks to read them from");
  check_shared(op, shared, B, capacity);
  if (dry_run()) return;
  cuda::prompt_partial_keys(fresh, past, n, pool, layer, first_valid, shared, B, H_kv, capacity);
}

int64_t int4_group_size(int64_t d) {
  constexpr int64_t group = cpu::kInt4GroupSize;
  INFINIGEN_CHECK(d > 0 && d % 2 == 0 && (d < group || d % group == 0),
                  "int4 KV needs head_dim even and below ", group, " or a multiple of ", group,
                  " (got ", d, ")");
  return cpu::int4_group_size(d);
}

int64_t int4_groups(int64_t d) {
  return d / int4_group_size(d);
}

size_t int4_code_bytes(int64_t d) {
  int4_group_size(d);  // validates d
  return static_cast<size_t>(d / 2);
}

size_t int4_meta_bytes(int64_t d) {
  return static_cast<size_t>(int4_groups(d)) * 2 * sizeof(f16);
}

size_t int4_row_bytes(int64_t d) {
  return int4_code_bytes(d) + int4_meta_bytes(d);
}

namespace {

// `rows` is on `device` and holds B sequences of H heads of rows of d.
void check_int4_rows(const char* op, const Int4Rows& rows, Device device, int64_t B, int64_t H,
                     int64_t d) {
  int4_group_size(rows.head_dim);  // validates d
  INFINIGEN_CHECK(rows.device == device, op, ": codes on ", device_name(rows.device), ", rows on ",
                  device_name(device));
  INFINIGEN_CHECK(rows.batch == B && rows.heads == H && rows.head_dim == d, op, ": codes of ",
                  rows.batch, " sequences, ", rows.heads, " heads of ", rows.head_dim,
                  " for rows of ", B, " sequences, ", H, " heads of ", d);
}

}  // namespace

void int4_quantize(const Tensor& keys, const Tensor& values, const Int4Rows& dst) {
  const Device device = common_device("int4_quantize", {&keys, &values});
  const int64_t B = dst.batch, H = dst.heads, d = dst.head_dim;
  const int64_t n = B > 0 ? keys.dim(0) / B : 0;
  check_int4_rows("int4_quantize", dst, device, B, H, d);
  check_shape("int4_quantize", keys, {B * n, H * d});
  check_shape("int4_quantize", values, {B * n, H * d});
  INFINIGEN_CHECK(keys.dtype() == DType::F32 && values.dtype() == DType::F32,
                  "int4_quantize: expected fp32 rows, got ", dtype_name(keys.dtype()), " and ",
                  dtype_name(values.dtype()));
  INFINIGEN_CHECK(n <= dst.rows, "int4_quantize: ", n, " tokens into ", dst.rows, " rows");
  if (traced("int4_quantize", {2 * B * n * H, d})) return;
  if (device == Device::Cuda) {
    cuda::int4_quantize(keys, values, dst, n);
    return;
  }
  cpu::int4_quantize(keys.data<float>(), values.data<float>(), B, n, H, d, dst.codes,
                     reinterpret_cast<uint16_t*>(dst.meta), dst.rows);
}

void int4_dequantize(const Int4Rows& src, int64_t t0, int64_t t1,
                     const std::vector<int32_t>& first_valid, int64_t row0, Tensor& keys,
                     Tensor& values) {
  const Device device = common_device("int4_dequantize", {&keys, &values});
  const int64_t B = keys.dim(0), H = keys.dim(1), capacity = keys.dim(2), d = keys.dim(3);
  check_int4_rows("int4_dequantize", src, device, B, H, d);
  check_shape("int4_dequantize", values, keys.shape());
  INFINIGEN_CHECK(keys.dtype() == DType::F16 && values.dtype() == DType::F16,
                  "int4_dequantize: expected fp16 staging, got ", dtype_name(keys.dtype()), " and ",
                  dtype_name(values.dtype()));
  INFINIGEN_CHECK(
      0 <= t0 && t0 <= t1 && t1 <= src.rows && row0 >= 0 && row0 + (t1 - t0) <= capacity,
      "int4_dequantize: rows [", t0, ", ", t1, ") of ", src.rows, " to row ", row0, " of ",
      capacity);
  INFINIGEN_CHECK(std::ssize(first_valid) == B, "int4_dequantize: ", first_valid.size(),
                  " first_valid entries for a batch of ", B);
  const auto sizes = [&]() -> std::array<int64_t, 5> {
    // Rows decoded, K and V over the batch: each sequence's from its first valid one.
    int64_t rows = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t first = std::max(t0, first_valid[static_cast<size_t>(b)] - row0 + t0);
      rows += 2 * H * (t1 - std::min(t1, first));
    }
    return {rows, d};
  };
  if (traced_lazily("int4_dequantize", sizes)) return;
  if (device == Device::Cuda) {
    cuda::int4_dequantize(src, t0, t1, first_valid, row0, keys, values);
    return;
  }
  cpu::int4_dequantize(src.codes, reinterpret_cast<const uint16_t*>(src.meta), src.rows, B, H, d,
                       t0, t1, first_valid.data(), row0, static_cast<uint16_t*>(keys.raw()),
                       static_cast<uint16_t*>(values.raw()), capacity);
}

size_t cuda_linear_scratch_bytes(int64_t rows, int64_t K, DType weights) {
  // kernels/cuda/linear.h: x (rows, K) rounded to the weights' 16-bit type; fp32 weights are
  // multiplied as they are.
  if (weights == DType::F32 || rows <= 0 || K <= 0) return 0;
  return static_cast<size_t>(rows) * static_cast<size_t>(K) * dtype_size(weights);
}

}  // namespace infinigen::ops
