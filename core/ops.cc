// core: op dispatch. Each op checks shapes, records itself in the active trace (core/trace.h; a
// dry run stops there), then calls the kernel of its tensors' device: kernels/cpu always,
// kernels/cuda when the CUDA backend is compiled in.
#include "core/ops.h"

#include <algorithm>

#include "core/trace.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/layer_norm.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/rms_norm.h"
#include "kernels/cpu/rope.h"

#ifdef INFINIGEN_CUDA
#include "kernels/cuda/attention.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/embedding.h"
#include "kernels/cuda/layer_norm.h"
#include "kernels/cuda/linear.h"
#include "kernels/cuda/rms_norm.h"
#include "kernels/cuda/rope.h"
#include "kernels/cuda/status.h"
#endif

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
#ifndef INFINIGEN_CUDA
  if (device != Device::Cpu) throw_op_not_on_device(op, device);
#endif
  return device;
}

#ifdef INFINIGEN_CUDA
namespace gpu = kernels::cuda;

gpu::Element gpu_element(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return gpu::Element::F32;
    case DType::F16:
      return gpu::Element::F16;
    case DType::BF16:
      return gpu::Element::BF16;
    default:
      fail("tensor of ", dtype_name(dtype), " where a floating-point tensor is needed");
  }
}

// Kernels return 0 on success, otherwise a CUDA or cuBLAS code, which becomes the engine's
// one-line Error here.
void check_cuda(const char* op, int code) {
  if (code != 0) fail(op, ": CUDA kernel failed: ", gpu::status_string(code));
}

// A host index array (token ids, positions, first_valid) copied to the device. The copy is
// synchronous and on the default stream, the stream every CUDA op runs on until the op
// interface takes streams, so the kernel that reads it is ordered after it; freeing it at the
// end of the op waits for that kernel (cudaFree synchronises). A per-step device copy kept by the
// caller would remove both waits, once ops take streams.
Tensor indices_on_cuda(const std::vector<int32_t>& values) {
  const Tensor host =
      Tensor::view(const_cast<int32_t*>(values.data()), {static_cast<int64_t>(values.size())},
                   DType::I32, Device::Cpu, nullptr);
  return host.to(Device::Cuda);
}

// The default stream, as the kernels take it.
void* const kDefaultStream = nullptr;
#endif

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
  const void* position_rows = with_positions ? positions_table.raw() : nullptr;
  if (device == Device::Cuda) {
#ifdef INFINIGEN_CUDA
    const Tensor tokens_d = indices_on_cuda(tokens);
    const Tensor positions_d = with_positions ? indices_on_cuda(positions) : Tensor();
    check_cuda(
        "embed",
        gpu::embed(tokens_d.data<int32_t>(), with_positions ? positions_d.data<int32_t>() : nullptr,
                   n, tokens_table.raw(), position_rows, gpu_element(tokens_table.dtype()), D,
                   out.data<float>(), kDefaultStream));
#endif
    return;
  }
  cpu::embed(tokens.data(), with_positions ? positions.data() : nullptr, n, tokens_table.raw(),
             position_rows, element(tokens_table.dtype()), D, out.data<float>());
}

void layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps, Tensor& y) {
  const Device device = common_device("layer_norm", {&x, &gamma, &beta, &y});
  const int64_t D = x.dim(-1);
  check_shape("layer_norm", gamma, {D});
  check_shape("layer_norm", beta, {D});
  check_shape("layer_norm", y, x.shape());
  if (traced("layer_norm", {x.numel() / D, D})) return;
  if (device == Device::Cuda) {
#ifdef INFINIGEN_CUDA
    check_cuda("layer_norm",
               gpu::layer_norm(x.data<float>(), gamma.data<float>(), beta.data<float>(),
                               y.data<float>(), x.numel() / D, D, eps, kDefaultStream));
#endif
    return;
  }
  cpu::layer_norm(x.data<float>(), gamma.data<float>(), beta.data<float>(), y.data<float>(),
                  x.numel() / D, D, eps);
}

void rms_norm(const Tensor& x, const Tensor& gamma, float eps, Tensor& y) {
  const Device device = common_device("rms_norm", {&x, &gamma, &y});
  const int64_t D = x.dim(-1);
  check_shape("rms_norm", gamma, {D});
  check_shape("rms_norm", y, x.shape());
  if (traced("rms_norm", {x.numel() / D, D})) return;
  if (device == Device::Cuda) {
#ifdef INFINIGEN_CUDA
    check_cuda("rms_norm", gpu::rms_norm(x.data<float>(), gamma.data<float>(), y.data<float>(),
                                         x.numel() / D, D, eps, kDefaultStream));
#endif
    return;
  }
  cpu::rms_norm(x.data<float>(), gamma.data<float>(), y.data<float>(), x.numel() / D, D, eps);
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
#ifdef INFINIGEN_CUDA
    const Tensor positions_d = indices_on_cuda(positions);
    check_cuda("rope", gpu::rope(x.data<float>(), positions_d.data<int32_t>(),
                                 inv_freq.data<float>(), rows, heads, head_dim, kDefaultStream));
#endif
    return;
  }
  cpu::rope(x.data<float>(), positions.data(), inv_freq.data<float>(), rows, heads, head_dim);
}

void silu_mul(Tensor& gate, const Tensor& up) {
  const Device device = common_device("silu_mul", {&gate, &up});
  check_shape("silu_mul", up, gate.shape());
  if (traced("silu_mul", {gate.numel()})) return;
  if (device == Device::Cuda) {
#ifdef INFINIGEN_CUDA
    check_cuda("silu_mul",
               gpu::silu_mul(gate.data<float>(), up.data<float>(), gate.numel(), kDefaultStream));
#endif
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
  const float* bias_data = bias.defined() ? bias.data<float>() : nullptr;
  if (device == Device::Cuda) {
#ifdef INFINIGEN_CUDA
    check_cuda("linear", gpu::linear(x.data<float>(), w.raw(), gpu_element(w.dtype()), bias_data,
                                     y.data<float>(), M, N, K, relu, kDefaultStream));
#endif
    return;
  }
  cpu::linear(x.data<float>(), w.raw(), element(w.dtype()), bias_data, y.data<float>(), M, N, K,
              relu);
}

void add_inplace(Tensor& y, const Tensor& x) {
  const Device device = common_device("add", {&y, &x});
  check_shape("add", x, y.shape());
  if (traced("add", {y.numel()})) return;
  if (device == Device::Cuda) {
#ifdef INFINIGEN_CUDA
    check_cuda("add",
               gpu::add_inplace(y.data<float>(), x.data<float>(), y.numel(), kDefaultStream));
#endif
    return;
  }
  cpu::add_inplace(y.data<float>(), x.data<float>(), y.numel());
}

void scale_inplace(Tensor& y, float factor) {
  const Device device = common_device("scale", {&y});
  if (traced("scale", {y.numel()})) return;
  if (device == Device::Cuda) {
#ifdef INFINIGEN_CUDA
    check_cuda("scale", gpu::scale_inplace(y.data<float>(), factor, y.numel(), kDefaultStream));
#endif
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
#ifdef INFINIGEN_CUDA
    INFINIGEN_CHECK(d <= gpu::kMaxHeadDim, "attention_prefill: head size ", d,
                    " is beyond the CUDA kernel's ", gpu::kMaxHeadDim);
    const Tensor first_valid_d = indices_on_cuda(first_valid);
    check_cuda("attention_prefill",
               gpu::attention_prefill(q.data<float>(), k.data<float>(), v.data<float>(),
                                      out.data<float>(), batch, n, num_heads, kv_heads, d,
                                      first_valid_d.data<int32_t>(), kDefaultStream));
#endif
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
  if (active_trace() != nullptr) {
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
    if (n == 1 ? traced("attention_decode", {B, H, rows, d, kv_heads}, k_cache.dtype())
               : traced("attention_extend", {H, kv_heads, pairs, rows, d}, k_cache.dtype())) {
      return;
    }
  }
  const int32_t* prefix_begin = shared ? shared->begin().data() : nullptr;
  const int32_t* prefix_source = shared ? shared->source().data() : nullptr;
  if (device == Device::Cuda) {
#ifdef INFINIGEN_CUDA
    INFINIGEN_CHECK(d <= gpu::kMaxHeadDim, "attention_decode: head size ", d,
                    " is beyond the CUDA kernel's ", gpu::kMaxHeadDim);
    // first_valid, then the prefixes' first rows and sources: (3, B) in one copy.
    std::vector<int32_t> rows(first_valid);
    if (shared) {
      rows.insert(rows.end(), shared->begin().begin(), shared->begin().end());
      rows.insert(rows.end(), shared->source().begin(), shared->source().end());
    }
    const Tensor rows_d = indices_on_cuda(rows);
    const int32_t* first_valid_d = rows_d.data<int32_t>();
    check_cuda("attention_decode",
               gpu::attention_decode(
                   q.data<float>(), k_cache.raw(), v_cache.raw(), gpu_element(k_cache.dtype()),
                   out.data<float>(), B, n, H, kv_heads, d, capacity, length, first_valid_d,
                   shared ? first_valid_d + B : nullptr, shared ? first_valid_d + 2 * B : nullptr,
                   prefix_end, kDefaultStream));
#endif
    return;
  }
  cpu::attention_decode(q.data<float>(), k_cache.raw(), v_cache.raw(), element(k_cache.dtype()),
                        out.data<float>(), B, n, H, kv_heads, d, capacity, length,
                        first_valid.data(), prefix_begin, prefix_source, prefix_end);
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
#ifdef INFINIGEN_CUDA
    check_cuda("cache_store",
               gpu::cache_store(rows.data<float>(), cache.raw(), gpu_element(cache.dtype()), B, n,
                                H, d, capacity, offset, kDefaultStream));
#endif
    return;
  }
  cpu::cache_store(rows.data<float>(), cache.raw(), element(cache.dtype()), B, n, H, d, capacity,
                   offset);
}

}  // namespace infinigen::ops
