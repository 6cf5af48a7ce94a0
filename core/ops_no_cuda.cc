// core: the CUDA entry points of the ops (core/ops_cuda.h) in a build without the CUDA backend.
// No CUDA tensor can be made in such a build, so these are reached only through a tensor viewing
// memory it claims is a device's; each refuses with the op's name.
#include "core/device.h"
#include "core/ops.h"
#include "core/ops_cuda.h"

namespace infinigen::ops {
namespace cuda {

void embed(std::span<const int32_t>, std::span<const int32_t>, const Tensor&, const Tensor&,
           Tensor&) {
  throw_op_not_on_device("embed", Device::Cuda);
}
void layer_norm(const Tensor&, const Tensor&, const Tensor&, float, Tensor&, int64_t, int64_t) {
  throw_op_not_on_device("layer_norm", Device::Cuda);
}
void rms_norm(const Tensor&, const Tensor&, float, Tensor&, int64_t, int64_t) {
  throw_op_not_on_device("rms_norm", Device::Cuda);
}
void rope(Tensor&, std::span<const int32_t>, const Tensor&, int64_t, int64_t, int64_t) {
  throw_op_not_on_device("rope", Device::Cuda);
}
void silu_mul(Tensor&, const Tensor&) {
  throw_op_not_on_device("silu_mul", Device::Cuda);
}
void linear(const Tensor&, const Tensor&, const Tensor&, Tensor&, bool, int64_t, int64_t, int64_t) {
  throw_op_not_on_device("linear", Device::Cuda);
}
void add_inplace(Tensor&, const Tensor&) {
  throw_op_not_on_device("add", Device::Cuda);
}
void scale_inplace(Tensor&, float) {
  throw_op_not_on_device("scale", Device::Cuda);
}
void attention_prefill(const Tensor&, const Tensor&, const Tensor&, Tensor&, int64_t, int64_t,
                       int64_t, int64_t, int64_t, std::span<const int32_t>) {
  throw_op_not_on_device("attention_prefill", Device::Cuda);
}
void attention_decode(const Tensor&, const Tensor&, const Tensor&, Tensor&, int64_t, int64_t,
                      int64_t, int64_t, int64_t, int64_t, int64_t, std::span<const int32_t>,
                      const SharedPrefixes*) {
  throw_op_not_on_device("attention_decode", Device::Cuda);
}
void cache_store(const Tensor&, Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t) {
  throw_op_not_on_device("cache_store", Device::Cuda);
}
void int4_quantize(const Tensor&, const Tensor&, const Int4Rows&, int64_t) {
  throw_op_not_on_device("int4_quantize", Device::Cuda);
}
void int4_dequantize(const Int4Rows&, int64_t, int64_t, std::span<const int32_t>, int64_t, Tensor&,
                     Tensor&) {
  throw_op_not_on_device("int4_dequantize", Device::Cuda);
}

void h2o_decode(const Tensor&, const Tensor&, Tensor&, Tensor&, Tensor&, Tensor&,
                std::span<const int32_t>, int64_t, int64_t, int64_t, int64_t, int64_t, int32_t,
                int32_t) {
  throw_op_not_on_device("h2o_decode", Device::Cuda);
}
void h2o_prefill(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, Tensor&, Tensor&,
                 Tensor&, Tensor&, Tensor&, std::span<const int32_t>, int64_t, int64_t, int64_t,
                 int64_t, int64_t, int64_t, int64_t, int64_t) {
  throw_op_not_on_device("h2o_prefill", Device::Cuda);
}
void h2o_store_placed(const Tensor&, const Tensor&, const Tensor&, void*, void*, int64_t, int64_t,
                      int64_t, int64_t) {
  throw_op_not_on_device("h2o_store_placed", Device::Cuda);
}

void speculate_logits(const Tensor&, const PartialTensors&, std::span<const int32_t>,
                      const Tensor&, std::span<const int32_t>, const SharedPrefixes*, int64_t,
                      int64_t, int64_t, int64_t, Tensor&) {
  throw_op_not_on_device("speculate_logits", Device::Cuda);
}
void select_top(const Tensor&, int64_t, int64_t, int64_t, double, int64_t, bool,
                SelectionTensors&) {
  throw_op_not_on_device("select_top", Device::Cuda);
}
void append_partial_keys(const Tensor&, PartialTensors&, int64_t, const Tensor&,
                         const SharedPrefixes*, int64_t, int64_t, int64_t) {
  throw_op_not_on_device("append_partial_keys", Device::Cuda);
}

void partial_column_scores(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t,
                           std::span<const int32_t>, std::span<const int32_t>, int64_t, bool,
                           Tensor&) {
  throw_op_not_on_device("partial_column_scores", Device::Cuda);
}
void gather_rows(const Tensor&, std::span<const int32_t>, Tensor&) {
  throw_op_not_on_device("gather_rows", Device::Cuda);
}
void prompt_partial_keys(const Tensor&, int64_t, int64_t, const PoolKeyBlocks&, PartialTensors&,
                         std::span<const int32_t>, const SharedPrefixes*, int64_t, int64_t,
                         int64_t) {
  throw_op_not_on_device("prompt_partial_keys", Device::Cuda);
}

}  // namespace cuda

void reserve_cuda_scratch(size_t, size_t) {
  throw_cuda_not_compiled();
}

void release_cuda_scratch(void*) {}

CudaScratchStats cuda_scratch_stats(void*) {
  return {};
}

}  // namespace infinigen::ops
