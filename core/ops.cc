// core: op dispatch. Only the CPU backend implements the transformer ops today; CUDA kernels
// are added per op behind the same functions.
#include "core/ops.h"

#include "kernels/cpu/attention.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/layer_norm.h"
#include "kernels/cpu/linear.h"

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
  if (device != Device::Cpu) throw_op_not_on_device(op, device);
  return device;
}

void check_shape(const char* op, const Tensor& t, const Shape& expected) {
  INFINIGEN_CHECK(t.shape() == expected, op, ": got shape ", shape_string(t.shape()), ", expected ",
                  shape_string(expected));
}

}  // namespace

bool device_runs_transformer(Device device) {
  return device == Device::Cpu;
}

void embed(const std::vector<int32_t>& tokens, const std::vector<int32_t>& positions,
           const Tensor& tokens_table, const Tensor& positions_table, Tensor& out) {
  common_device("embed", {&out, &tokens_table, &positions_table});
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t D = tokens_table.dim(1);
  INFINIGEN_CHECK(positions.size() == tokens.size(), "embed: ", tokens.size(), " tokens but ",
                  positions.size(), " positions");
  INFINIGEN_CHECK(tokens_table.dtype() == positions_table.dtype(), "embed: table dtypes differ");
  check_shape("embed", out, {n, D});
  for (int64_t i = 0; i < n; ++i) {
    INFINIGEN_CHECK(tokens[i] >= 0 && tokens[i] < tokens_table.dim(0), "token id ", tokens[i],
                    " is outside the vocabulary of ", tokens_table.dim(0));
    INFINIGEN_CHECK(positions[i] >= 0 && positions[i] < positions_table.dim(0), "position ",
                    positions[i], " is outside the position table of ", positions_table.dim(0));
  }
  cpu::embed(tokens.data(), positions.data(), n, tokens_table.raw(), positions_table.raw(),
             element(tokens_table.dtype()), D, out.data<float>());
}

void layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps, Tensor& y) {
  common_device("layer_norm", {&x, &gamma, &beta, &y});
  const int64_t D = x.dim(-1);
  check_shape("layer_norm", gamma, {D});
  check_shape("layer_norm", beta, {D});
  check_shape("layer_norm", y, x.shape());
  cpu::layer_norm(x.data<float>(), gamma.data<float>(), beta.data<float>(), y.data<float>(),
                  x.numel() / D, D, eps);
}

void linear(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y, bool relu) {
  common_device("linear", {&x, &w, &bias, &y});
  const int64_t M = x.dim(0), K = x.dim(1), N = w.dim(0);
  check_shape("linear", w, {N, K});
  check_shape("linear", y, {M, N});
  if (bias.defined()) check_shape("linear", bias, {N});
  cpu::linear(x.data<float>(), w.raw(), element(w.dtype()),
              bias.defined() ? bias.data<float>() : nullptr, y.data<float>(), M, N, K, relu);
}

void add_inplace(Tensor& y, const Tensor& x) {
  common_device("add", {&y, &x});
  check_shape("add", x, y.shape());
  cpu::add_inplace(y.data<float>(), x.data<float>(), y.numel());
}

void scale_inplace(Tensor& y, float factor) {
  common_device("scale", {&y});
  cpu::scale_inplace(y.data<float>(), factor, y.numel());
}

void attention_prefill(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                       int64_t batch, int64_t num_heads, const std::vector<int32_t>& first_valid) {
  common_device("attention_prefill", {&q, &k, &v, &out});
  const int64_t n = q.dim(0) / batch, D = q.dim(1), d = D / num_heads;
  for (const Tensor* t : std::initializer_list<const Tensor*>{&k, &v, &out})
    check_shape("attention_prefill", *t, q.shape());
  INFINIGEN_CHECK(static_cast<int64_t>(first_valid.size()) == batch && n * batch == q.dim(0),
                  "attention_prefill: batch ", batch, " does not divide ", q.dim(0), " rows");
  cpu::attention_prefill(q.data<float>(), k.data<float>(), v.data<float>(), out.data<float>(),
                         batch, n, num_heads, d, first_valid.data());
}

void attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, Tensor& out,
                      int64_t length, const std::vector<int32_t>& first_valid) {
  common_device("attention_decode", {&q, &k_cache, &v_cache, &out});
  const int64_t B = k_cache.dim(0), H = k_cache.dim(1), capacity = k_cache.dim(2);
  const int64_t d = k_cache.dim(3);
  check_shape("attention_decode", q, {B, H * d});
  check_shape("attention_decode", out, {B, H * d});
  check_shape("attention_decode", v_cache, k_cache.shape());
  INFINIGEN_CHECK(k_cache.dtype() == v_cache.dtype(), "attention_decode: K and V dtypes differ");
  INFINIGEN_CHECK(length <= capacity, "attention_decode: length ", length, " beyond capacity ",
                  capacity);
  cpu::attention_decode(q.data<float>(), k_cache.raw(), v_cache.raw(), element(k_cache.dtype()),
                        out.data<float>(), B, H, d, capacity, length, first_valid.data());
}

void cache_store(const Tensor& rows, Tensor& cache, int64_t offset) {
  common_device("cache_store", {&rows, &cache});
  const int64_t B = cache.dim(0), H = cache.dim(1), capacity = cache.dim(2), d = cache.dim(3);
  const int64_t n = rows.dim(0) / B;
  check_shape("cache_store", rows, {B * n, H * d});
  INFINIGEN_CHECK(offset + n <= capacity, "KV cache overflow: ", offset + n, " tokens, capacity ",
                  capacity);
  cpu::cache_store(rows.data<float>(), cache.raw(), element(cache.dtype()), B, n, H, d, capacity,
                   offset);
}

}  // namespace infinigen::ops
