// speculate: a speculated layer on the CUDA device.
#include "speculate/device_partial.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "core/device.h"
#include "core/error.h"
#include "core/trace.h"

namespace infinigen {
namespace {

Tensor device_ints(const std::vector<int32_t>& values) {
  Tensor t = Tensor::empty({std::ssize(values)}, DType::I32, Device::Cuda);
  if (!values.empty()) device_copy(t.raw(), Device::Cuda, values.data(), Device::Cpu, t.nbytes());
  return t;
}

}  // namespace

void DevicePartialLayer::upload(const PartialLayer& layer, bool keys_on_host) {
  adopt(layer, keys_on_host);
  const std::vector<char>& keys = layer.key_bytes();
  INFINIGEN_CHECK(keys.size() == tensors_.keys.nbytes(),
                  "speculation: no partial key cache to upload (", keys.size(), " bytes)");
  if (keys_on_host) {
    std::memcpy(tensors_.keys.raw(), keys.data(), keys.size());
  } else {
    device_copy(tensors_.keys.raw(), Device::Cuda, keys.data(), Device::Cpu, keys.size());
  }
}

void DevicePartialLayer::write_prompt_keys(const Tensor& fresh, int64_t past,
                                           const ops::PoolKeyBlocks& pool,
                                           const std::vector<int32_t>& first_valid) {
  ops::prompt_partial_keys(fresh, past, pool, tensors_, first_valid, shared());
}

void DevicePartialLayer::adopt(const PartialLayer& layer, bool keys_on_host) {
  const int64_t B = layer.batch(), H = layer.num_heads(), r = layer.r();
  const int64_t H_kv = std::ssize(layer.columns()) / r, group = H / H_kv;
  // The weights where choose_columns gathered them (the device, unless W_q was on the host).
  weight_ =
      layer.weight().device() == Device::Cuda ? layer.weight() : layer.weight().to(Device::Cuda);
  bias_ = layer.bias().to(Device::Cuda);
  for (const auto& [name, tensor] : layer.state()) {
    if (name == "partial_skew") tensors_.skew = tensor.to(Device::Cuda);
    if (name == "partial_inv_freq") tensors_.inv_freq = tensor.to(Device::Cuda);
  }
  // Query head h owns columns [head_rows[h], head_rows[h + 1]) of the query rows, the needed
  // dimensions of its KV head in order (PartialLayer::head_rows and needed_rows).
  std::vector<int32_t> head_rows, needed;
  for (int64_t h = 0; h < H; ++h) {
    head_rows.push_back(static_cast<int32_t>(needed.size()));
    const std::vector<int32_t>& dims = layer.needed_rows(h / group);
    needed.insert(needed.end(), dims.begin(), dims.end());
  }
  head_rows.push_back(static_cast<int32_t>(needed.size()));
  INFINIGEN_CHECK(static_cast<int64_t>(needed.size()) == weight_.dim(0),
                  "speculation: ", weight_.dim(0), " partial query rows for ", needed.size(),
                  " needed dimensions");
  tensors_.head_rows = device_ints(head_rows);
  tensors_.needed_dims = device_ints(needed);
  tensors_.columns = device_ints(layer.columns()).reshape({H_kv, r});
  const Shape key_shape = {B, H_kv, layer.capacity(), r};
  tensors_.keys = keys_on_host ? Tensor::pinned(key_shape, layer.key_dtype(),
                                                "a layer's partial key cache", Device::Cuda)
                               : Tensor::empty(key_shape, layer.key_dtype(), Device::Cuda);
  keys_on_host_ = keys_on_host;
  tensors_.heads = H;
  tensors_.head_dim = layer.head_dim();
  query_rows_ = Tensor::empty({B, weight_.dim(0)}, DType::F32, Device::Cuda);
  shared_ = layer.shared();
}

void DevicePartialLayer::speculate(const Tensor& x, const std::vector<int32_t>& rope_positions,
                                   int64_t used, const std::vector<int32_t>& first_valid,
                                   const Tensor& position_tokens,
                                   const SpeculationOptions& options, Tensor& logits,
                                   ops::SelectionTensors& out) const {
  const Tensor& keys = tensors_.keys;
  ops::linear(x, weight_, bias_, query_rows_);
  // Recorded as the CPU's speculation records itself, so a trace prices both alike.
  traced("speculate", {keys.dim(0), keys.dim(1), used, keys.dim(3), tensors_.heads},
         keys.dtype());
  ops::speculate_logits(query_rows_, tensors_, rope_positions, position_tokens, first_valid,
                        shared(), used, logits);
  ops::select_top(logits, used, options.alpha, options.max_num_kv,
                  options.fetch_rule == FetchRule::Batch, out);
}

void DevicePartialLayer::append(const Tensor& keys, int64_t position, const Tensor& positions) {
  traced("partial_append", {batch(), kv_heads(), tensors_.keys.dim(3)}, tensors_.keys.dtype());
  ops::append_partial_keys(keys, tensors_, position, positions, shared());
}

void DevicePartialLayer::keep_sequences(const std::vector<int64_t>& keep,
                                        const std::vector<KvStore::LeaderMove>& moves,
                                        const SharedPrefixes& shared) {
  if (!tensors_.keys.defined()) return;  // not uploaded: a dense layer
  if (keys_on_host_) {
    // Host memory, which the host compacts itself.
    Tensor keys = Tensor::view(tensors_.keys.raw(), tensors_.keys.shape(), tensors_.keys.dtype(),
                               Device::Cpu, nullptr);
    compact_batch(keys, keep, moves);
    tensors_.keys = tensors_.keys.slice_rows(0, std::ssize(keep));
  } else {
    compact_batch(tensors_.keys, keep, moves);
  }
  query_rows_ = query_rows_.slice_rows(0, std::ssize(keep));
  if (!shared_.empty()) shared_ = shared;
}

ops::SelectionTensors device_selection(int64_t batch, int64_t kv_heads, int64_t fetch_cap) {
  const auto ints = [](Shape shape) { return Tensor::empty(std::move(shape), DType::I32, Device::Cuda); };
  return {ints({batch, kv_heads}), ints({batch, kv_heads}), ints({batch}), ints({2 + batch}),
          ints({batch, kv_heads, fetch_cap})};
}

}  // namespace infinigen
