// core: the ops on CUDA tensors (core/ops_cuda.h), built with the CUDA backend only. Each launches
// its kernels/cuda kernel on the calling thread's current CUDA stream (current_cuda_stream) and
// allocates nothing: what it needs besides its tensors comes from that stream's scratch, kept
// from one op to the next (declared in core/ops.h with reserve_cuda_scratch):
//
// - UploadRing: host index arrays on their way to the kernels;
// - GemmScratch: linear's input rounded to 16 bits.
//
// One scratch per stream, never shared, so that work on two streams cannot overwrite each other's
// buffers; each buffer is reused in stream order, which orders every reuse after the kernels
// that read the previous contents.
#include "core/ops_cuda.h"

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "core/device.h"
#include "core/ops.h"
#include "core/stream.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/embedding.h"
#include "kernels/cuda/h2o.h"
#include "kernels/cuda/int4.h"
#include "kernels/cuda/layer_norm.h"
#include "kernels/cuda/linear.h"
#include "kernels/cuda/partial_build.h"
#include "kernels/cuda/rms_norm.h"
#include "kernels/cuda/rope.h"
#include "kernels/cuda/runtime.h"
#include "kernels/cuda/speculation.h"
#include "kernels/cuda/status.h"

namespace infinigen::ops {
namespace {

namespace gpu = kernels::cuda;

// Kernels return 0 on success, otherwise a CUDA or cuBLAS code, which becomes the engine's
// one-line Error here.
void check_cuda(const char* op, int code) {
  if (code != 0) fail(op, ": CUDA kernel failed: ", gpu::status_string(code));
}

// The same for the runtime calls (copies, events, synchronisation) behind the scratch.
void check_runtime(const char* what, int code) {
  if (code != 0) fail(what, ": ", gpu::error_string(code));
}

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

void check_head_dim(const char* op, int64_t d) {
  INFINIGEN_CHECK(d <= gpu::kMaxHeadDim, op, ": head size ", d, " is beyond the CUDA kernel's ",
                  gpu::kMaxHeadDim);
}

// Host index arrays (token ids, positions, first_valid, shared-prefix rows) on their way to the
// kernels of one stream: a pinned host ring and a device ring of the same size (capacity_ bytes
// each). An upload copies an op's arrays, one after another, into the next free part of the
// pinned ring, enqueues one copy of that part to the same offset of the device ring on the
// stream, and records the part's event after it. The kernels read the device part.
//
// Reuse: a pinned part is written again only once its event shows that the copy out of it has
// run; the host waits for it only when the ring has come round to a part whose copy the device
// has not reached yet (the host is capacity_ bytes, or kMaxParts ops, of uploads ahead). A device
// part needs no event: every later copy into it is queued on the same stream, after the kernels
// reading it. The events are created with the ring, none per upload.
//
// Parts are placed one after another and never straddle the end: a part that would is placed at
// offset 0, and the parts of the previous lap still in the tail it skips are retired first. So
// the parts in flight always run, oldest first, from the head round to the head, and those that
// a new part overlaps are the oldest ones.
class UploadRing {
 public:
  ~UploadRing() { release(); }

  // The arrays, concatenated, on the device (valid for work queued on `stream` from now on);
  // null when they are all empty.
  const int32_t* upload(std::initializer_list<std::span<const int32_t>> arrays, void* stream) {
    size_t bytes = 0;
    for (std::span<const int32_t> a : arrays) bytes += a.size_bytes();
    if (bytes == 0) return nullptr;
    const size_t part_bytes = round_up(bytes);
    if (part_bytes > capacity_) grow(std::max(part_bytes, 2 * capacity_), stream);
    if (head_ + part_bytes > capacity_) {
      retire_parts_over(head_, capacity_);
      head_ = 0;
      ++stats_.wraps;
    }
    retire_parts_over(head_, head_ + part_bytes);
    if (count_ == parts_.size()) retire_oldest();  // every event in use: the ring of small parts
    char* host = host_ + head_;
    for (std::span<const int32_t> a : arrays) {
      if (a.empty()) continue;  // an empty span's data() may be null
      std::memcpy(host, a.data(), a.size_bytes());
      host += a.size_bytes();
    }
    check_runtime("index upload",
                  gpu::copy_async(device_ + head_, host_ + head_, bytes, 0, stream));
    Part& part = parts_[(first_ + count_) % parts_.size()];
    check_runtime("index upload", gpu::event_record(part.event, stream));
    part.begin = head_;
    part.end = head_ + part_bytes;
    ++count_;
    ++stats_.uploads;
    const char* device = device_ + head_;
    head_ += part_bytes;
    return reinterpret_cast<const int32_t*>(device);
  }

  void reserve(size_t bytes, void* stream) {
    if (bytes > capacity_) grow(round_up(bytes), stream);
  }

  // Frees the rings; the stream's work must be done (no copy out of the pinned ring pending).
  void release() {
    for (Part& part : parts_) {
      if (part.event != nullptr) gpu::event_destroy(part.event);  // nothing to do on failure
    }
    parts_.clear();
    first_ = count_ = 0;
    if (host_ != nullptr) pinned_free(host_);
    if (device_ != nullptr) device_free(Device::Cuda, device_);
    host_ = device_ = nullptr;
    capacity_ = head_ = 0;
  }

  size_t capacity() const { return capacity_; }
  const CudaScratchStats& stats() const { return stats_; }

 private:
  static constexpr size_t kPartAlignment = 256;              // each part starts on a 256-byte line
  static constexpr size_t kInitialBytes = size_t{64} << 10;  // 256 parts
  // Parts in flight at most (events created with the ring): a larger ring holds larger parts,
  // not more of them.
  static constexpr size_t kMaxParts = 256;

  struct Part {
    size_t begin = 0, end = 0;  // bytes [begin, end) of both rings
    void* event = nullptr;      // recorded after the copy out of the pinned part; kept for reuse
  };

  static size_t round_up(size_t bytes) {
    return (bytes + kPartAlignment - 1) / kPartAlignment * kPartAlignment;
  }

  // Retires the parts in flight that overlap bytes [begin, end), which are the oldest ones, after
  // their copies have run (waiting for those the device has not reached yet).
  void retire_parts_over(size_t begin, size_t end) {
    while (count_ > 0) {
      const Part& oldest = parts_[first_];
      if (oldest.begin >= end || oldest.end <= begin) break;
      retire_oldest();
    }
  }

  void retire_oldest() {
    const Part& oldest = parts_[first_];
    int ready = 0;
    check_runtime("index upload", gpu::event_query(oldest.event, &ready));
    if (!ready) {
      ++stats_.host_waits;
      check_runtime("index upload", gpu::event_synchronize(oldest.event));
    }
    first_ = (first_ + 1) % parts_.size();
    --count_;
  }

  // Replaces the rings by larger ones once the stream has run everything that uses them.
  void grow(size_t bytes, void* stream) {
    bytes = std::max(bytes, kInitialBytes);
    check_runtime("index upload", gpu::stream_synchronize(stream));
    release();
    host_ = static_cast<char*>(pinned_alloc(bytes, "the CUDA ops' index upload ring"));
    device_ = static_cast<char*>(device_alloc(Device::Cuda, bytes));
    parts_.resize(std::min(bytes / kPartAlignment, kMaxParts));
    for (Part& part : parts_) check_runtime("index upload", gpu::event_create(&part.event));
    capacity_ = bytes;  // only now usable: a failure above leaves the ring to be grown again
    ++stats_.grows;
  }

  char* host_ = nullptr;    // (capacity_) bytes, pinned
  char* device_ = nullptr;  // (capacity_) bytes on the device
  size_t capacity_ = 0;
  size_t head_ = 0;  // where the next part starts (or 0, if it does not fit before the end)
  // The parts in flight, oldest first: parts_[first_], ... (count_ of them, circular).
  std::vector<Part> parts_;
  size_t first_ = 0, count_ = 0;
  CudaScratchStats stats_;
};

// Device memory into which linear rounds x for 16-bit weights (kernels/cuda/linear.h): as large
// as the largest request so far, reallocated (after the stream's work) only to grow.
// offload/memory_planner.cc counts it as device_scratch: cuda_linear_scratch_bytes of the widest
// prefill input (B * n rows), which is what it grows to in a run that was not reserved.
class GemmScratch {
 public:
  ~GemmScratch() { release(); }

  void* get(size_t bytes, void* stream, int64_t* grows) {
    if (bytes > bytes_) {
      check_runtime("linear scratch", gpu::stream_synchronize(stream));
      release();
      buffer_ = device_alloc(Device::Cuda, bytes);
      bytes_ = bytes;
      ++*grows;
    }
    return buffer_;
  }
  void release() {
    if (buffer_ != nullptr) device_free(Device::Cuda, buffer_);
    buffer_ = nullptr;
    bytes_ = 0;
  }
  size_t bytes() const { return bytes_; }
  const void* buffer() const { return buffer_; }

 private:
  void* buffer_ = nullptr;  // (bytes_) on the device
  size_t bytes_ = 0;
};

struct StreamScratch {
  std::mutex mutex;  // held for each op: ops on one stream from several threads take turns
  UploadRing uploads;
  GemmScratch gemm;
  int64_t gemm_grows = 0;
};

// The scratch of every stream ops have run on, by cudaStream_t. Never destroyed: device memory
// freed during static destruction could outlive the CUDA runtime.
struct Registry {
  std::mutex mutex;
  std::unordered_map<void*, std::unique_ptr<StreamScratch>> by_stream;
};
Registry& registry() {
  static auto* state = new Registry;
  return *state;
}

StreamScratch& scratch_of(void* stream) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  std::unique_ptr<StreamScratch>& scratch = r.by_stream[stream];
  if (!scratch) scratch = std::make_unique<StreamScratch>();
  return *scratch;
}

// The current stream and its scratch, held for the length of one op, so that a growth by
// another thread's op never frees a buffer between this op's taking it and launching on it.
class StreamLease {
 public:
  StreamLease()
      : stream_(current_cuda_stream()), scratch_(scratch_of(stream_)), lock_(scratch_.mutex) {}

  void* stream() const { return stream_; }
  const int32_t* upload(std::initializer_list<std::span<const int32_t>> arrays) {
    return scratch_.uploads.upload(arrays, stream_);
  }
  void* gemm_scratch(size_t bytes) {
    return scratch_.gemm.get(bytes, stream_, &scratch_.gemm_grows);
  }
  void reserve(size_t index_bytes, size_t gemm_bytes) {
    scratch_.uploads.reserve(index_bytes, stream_);
    if (gemm_bytes > 0) gemm_scratch(gemm_bytes);
  }

 private:
  void* stream_;
  StreamScratch& scratch_;
  std::lock_guard<std::mutex> lock_;
};

}  // namespace

namespace cuda {

void embed(std::span<const int32_t> tokens, std::span<const int32_t> positions,
           const Tensor& tokens_table, const Tensor& positions_table, Tensor& out) {
  StreamLease lease;
  // tokens (n), then positions (n) when there is a positions table
  const int32_t* indices = lease.upload({tokens, positions});
  const int64_t n = std::ssize(tokens);
  check_cuda(
      "embed",
      gpu::embed(indices, positions.empty() ? nullptr : indices + n, n, tokens_table.raw(),
                 positions_table.defined() ? positions_table.raw() : nullptr,
                 gpu_element(tokens_table.dtype()), out.dim(1), out.data<float>(), lease.stream()));
}

void layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps, Tensor& y,
                int64_t rows, int64_t D) {
  check_cuda("layer_norm", gpu::layer_norm(x.data<float>(), gamma.data<float>(), beta.data<float>(),
                                           y.data<float>(), rows, D, eps, current_cuda_stream()));
}

void rms_norm(const Tensor& x, const Tensor& gamma, float eps, Tensor& y, int64_t rows, int64_t D) {
  check_cuda("rms_norm", gpu::rms_norm(x.data<float>(), gamma.data<float>(), y.data<float>(), rows,
                                       D, eps, current_cuda_stream()));
}

void rope(Tensor& x, std::span<const int32_t> positions, const Tensor& inv_freq, int64_t rows,
          int64_t heads, int64_t head_dim) {
  StreamLease lease;
  check_cuda("rope", gpu::rope(x.data<float>(), lease.upload({positions}), inv_freq.data<float>(),
                               rows, heads, head_dim, lease.stream()));
}

void silu_mul(Tensor& gate, const Tensor& up) {
  check_cuda("silu_mul", gpu::silu_mul(gate.data<float>(), up.data<float>(), gate.numel(),
                                       current_cuda_stream()));
}

void linear(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y, bool relu, int64_t M,
            int64_t N, int64_t K) {
  StreamLease lease;
  const size_t scratch_bytes = cuda_linear_scratch_bytes(M, K, w.dtype());
  void* scratch = scratch_bytes > 0 ? lease.gemm_scratch(scratch_bytes) : nullptr;
  check_cuda("linear", gpu::linear(x.data<float>(), w.raw(), gpu_element(w.dtype()),
                                   bias.defined() ? bias.data<float>() : nullptr, y.data<float>(),
                                   M, N, K, relu, scratch, scratch_bytes, lease.stream()));
}

void add_inplace(Tensor& y, const Tensor& x) {
  check_cuda("add",
             gpu::add_inplace(y.data<float>(), x.data<float>(), y.numel(), current_cuda_stream()));
}

void scale_inplace(Tensor& y, float factor) {
  check_cuda("scale",
             gpu::scale_inplace(y.data<float>(), factor, y.numel(), current_cuda_stream()));
}

void attention_prefill(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, int64_t B,
                       int64_t n, int64_t H, int64_t H_kv, int64_t d,
                       std::span<const int32_t> first_valid) {
  check_head_dim("attention_prefill", d);
  StreamLease lease;
  check_cuda(
      "attention_prefill",
      gpu::attention_prefill(q.data<float>(), k.data<float>(), v.data<float>(), out.data<float>(),
                             B, n, H, H_kv, d, lease.upload({first_valid}), lease.stream()));
}

void attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, Tensor& out,
                      int64_t B, int64_t n, int64_t H, int64_t H_kv, int64_t d, int64_t capacity,
                      int64_t length, std::span<const int32_t> first_valid,
                      const SharedPrefixes* shared) {
  check_head_dim("attention_decode", d);
  StreamLease lease;
  // (3, B): first_valid, then the prefixes' first rows and source sequences when shared.
  const int32_t* rows = shared ? lease.upload({first_valid, shared->begin(), shared->source()})
                               : lease.upload({first_valid});
  check_cuda("attention_decode",
             gpu::attention_decode(q.data<float>(), k_cache.raw(), v_cache.raw(),
                                   gpu_element(k_cache.dtype()), out.data<float>(), B, n, H, H_kv,
                                   d, capacity, length, rows, shared ? rows + B : nullptr,
                                   shared ? rows + 2 * B : nullptr, shared ? shared->rows() : 0,
                                   lease.stream()));
}

void cache_store(const Tensor& rows, Tensor& cache, int64_t B, int64_t n, int64_t H, int64_t d,
                 int64_t capacity, int64_t offset) {
  check_cuda("cache_store",
             gpu::cache_store(rows.data<float>(), cache.raw(), gpu_element(cache.dtype()), B, n, H,
                              d, capacity, offset, current_cuda_stream()));
}

void h2o_decode(const Tensor& queries, const Tensor& keys, Tensor& scores, Tensor& tokens,
                Tensor& probs, Tensor& placed, std::span<const int32_t> first_row, int64_t B,
                int64_t H, int64_t H_kv, int64_t d, int64_t rows, int32_t token,
                int32_t recent_start) {
  StreamLease lease;
  const int32_t* first = lease.upload({first_row});
  check_cuda("h2o_decode",
             gpu::h2o_decode(queries.data<float>(), keys.raw(), gpu_element(keys.dtype()),
                             scores.data<float>(), tokens.data<int32_t>(), probs.data<float>(),
                             placed.data<int32_t>(), first, B, H, H_kv, d, rows, token,
                             recent_start, lease.stream()));
}

void h2o_prefill(const Tensor& queries, const Tensor& keys, const Tensor& values, Tensor& keys_out,
                 Tensor& values_out, Tensor& scores, Tensor& tokens, Tensor& row_stats,
                 Tensor& key_scores, Tensor& kept, std::span<const int32_t> first_valid, int64_t B,
                 int64_t n, int64_t H, int64_t H_kv, int64_t d, int64_t rows, int64_t slots,
                 int64_t recent) {
  StreamLease lease;
  const int32_t* starts = lease.upload({first_valid});
  check_cuda("h2o_prefill",
             gpu::h2o_prefill(queries.data<float>(), keys.data<float>(), values.data<float>(),
                              gpu_element(keys_out.dtype()), keys_out.raw(), values_out.raw(),
                              scores.data<float>(), tokens.data<int32_t>(), row_stats.data<float>(),
                              key_scores.data<float>(), kept.data<int32_t>(), starts, B, n, H, H_kv,
                              d, rows, slots, recent, lease.stream()));
}

void h2o_store_placed(const Tensor& keys, const Tensor& values, const Tensor& placed,
                      void* pool_keys, void* pool_values, int64_t B, int64_t H_kv, int64_t rows,
                      int64_t row_bytes) {
  // No lease: nothing to upload, and a lease would give the store stream a scratch of its own.
  check_cuda("h2o_store_placed",
             gpu::h2o_store_placed(pool_keys, pool_values, keys.raw(), values.raw(),
                                   placed.data<int32_t>(), B, H_kv, rows, row_bytes,
                                   current_cuda_stream()));
}

void int4_quantize(const Tensor& keys, const Tensor& values, const Int4Rows& dst, int64_t n) {
  check_cuda("int4_quantize",
             gpu::int4_quantize(keys.data<float>(), values.data<float>(), dst.batch, n, dst.heads,
                                dst.head_dim, dst.codes, reinterpret_cast<uint16_t*>(dst.meta),
                                dst.rows, current_cuda_stream()));
}

void int4_dequantize(const Int4Rows& src, int64_t t0, int64_t t1,
                     std::span<const int32_t> first_valid, int64_t row0, Tensor& keys,
                     Tensor& values) {
  StreamLease lease;
  check_cuda(
      "int4_dequantize",
      gpu::int4_dequantize(src.codes, reinterpret_cast<const uint16_t*>(src.meta), src.rows,
                           src.batch, src.heads, src.head_dim, t0, t1, lease.upload({first_valid}),
                           row0, static_cast<uint16_t*>(keys.raw()),
                           static_cast<uint16_t*>(values.raw()), keys.dim(2), lease.stream()));
}

void speculate_logits(const Tensor& query_rows, const PartialTensors& layer,
                      std::span<const int32_t> rope_positions, const Tensor& position_tokens,
                      std::span<const int32_t> first_valid, const SharedPrefixes* shared, int64_t B,
                      int64_t H_kv, int64_t capacity, int64_t used, Tensor& logits) {
  StreamLease lease;
  // (B) first_valid, then (B) rotary positions when rotated, then the prefixes' first rows and
  // source sequences (B each) when shared.
  using Ints = std::span<const int32_t>;
  const bool rotated = layer.inv_freq.defined();
  const int32_t* rows = lease.upload({first_valid, rotated ? rope_positions : Ints{},
                                      shared ? Ints(shared->begin()) : Ints{},
                                      shared ? Ints(shared->source()) : Ints{}});
  const int32_t* after_positions = rows + B + (rotated ? B : 0);
  check_cuda(
      "speculate_logits",
      gpu::speculate_logits(
          query_rows.data<float>(), query_rows.dim(1), layer.head_rows.data<int32_t>(),
          layer.needed_dims.data<int32_t>(), layer.columns.data<int32_t>(),
          layer.skew.defined() ? layer.skew.data<float>() : nullptr,
          rotated ? layer.inv_freq.data<float>() : nullptr, rotated ? rows + B : nullptr,
          layer.keys.raw(), gpu_element(layer.keys.dtype()),
          position_tokens.defined() ? position_tokens.data<int32_t>() : nullptr, rows,
          shared ? after_positions : nullptr, shared ? after_positions + B : nullptr,
          shared ? shared->rows() : 0, logits.data<float>(), B, layer.heads, H_kv, layer.head_dim,
          layer.keys.dim(3), capacity, used, lease.stream()));
}

void select_top(const Tensor& logits, int64_t B, int64_t H_kv, int64_t used, double alpha,
                int64_t max_num_kv, bool batch_mean, SelectionTensors& out) {
  int32_t* summary = out.summary.data<int32_t>();
  check_cuda("select_top",
             gpu::select_top(logits.data<float>(), B, H_kv, used, alpha, max_num_kv,
                             batch_mean ? gpu::FetchMean::Batch : gpu::FetchMean::Sequence,
                             out.counts.data<int32_t>(), out.valid.data<int32_t>(),
                             out.fetch.data<int32_t>(), summary + 2,
                             reinterpret_cast<double*>(summary), out.tokens.data<int32_t>(),
                             out.tokens.dim(2), current_cuda_stream()));
}

void append_partial_keys(const Tensor& keys, PartialTensors& layer, int64_t position,
                         const Tensor& positions, const SharedPrefixes* shared, int64_t B,
                         int64_t H_kv, int64_t capacity) {
  // A lease only for the shared prefixes' rows: with nothing to upload, none is made.
  std::optional<StreamLease> lease;
  const int32_t* prefixes = nullptr;
  if (shared != nullptr) {
    lease.emplace();
    prefixes = lease->upload({shared->begin(), shared->source()});
  }
  check_cuda("append_partial_keys",
             gpu::append_partial_keys(
                 keys.data<float>(), layer.columns.data<int32_t>(),
                 layer.skew.defined() ? layer.skew.data<float>() : nullptr, layer.keys.raw(),
                 gpu_element(layer.keys.dtype()), B, H_kv, layer.head_dim, layer.keys.dim(3),
                 capacity, position, positions.defined() ? positions.data<int32_t>() : nullptr,
                 prefixes, prefixes ? prefixes + B : nullptr, shared ? shared->rows() : 0,
                 lease ? lease->stream() : current_cuda_stream()));
}

void partial_column_scores(const Tensor& queries, const Tensor& keys, const Tensor& skew,
                           int64_t heads, int64_t kv_heads, std::span<const int32_t> sequences,
                           std::span<const int32_t> first_valid, int64_t first_row, bool with_keys,
                           Tensor& scores) {
  StreamLease lease;
  const int64_t P = std::ssize(sequences);
  // (P) the pass's sequences, then (P) their first valid rows.
  const int32_t* rows = lease.upload({sequences, first_valid});
  check_cuda("partial_column_scores",
             gpu::partial_column_scores(
                 queries.data<float>(), with_keys ? keys.data<float>() : nullptr,
                 skew.defined() ? skew.data<float>() : nullptr, rows, rows + P, first_row, P,
                 queries.dim(0) / P, heads, kv_heads, queries.dim(1) / heads, with_keys,
                 reinterpret_cast<double*>(scores.raw()), lease.stream()));
}

void gather_rows(const Tensor& src, std::span<const int32_t> rows, Tensor& dst) {
  StreamLease lease;
  const int64_t row_bytes = src.dim(1) * static_cast<int64_t>(dtype_size(src.dtype()));
  check_cuda("gather_rows", gpu::gather_rows(src.raw(), row_bytes, lease.upload({rows}),
                                             std::ssize(rows), dst.raw(), lease.stream()));
}

void prompt_partial_keys(const Tensor& fresh, int64_t past, int64_t n, const PoolKeyBlocks& pool,
                         PartialTensors& layer, std::span<const int32_t> first_valid,
                         const SharedPrefixes* shared, int64_t B, int64_t H_kv, int64_t capacity) {
  StreamLease lease;
  // (B) first_valid, then the prefixes' first rows and source sequences (B each) when shared.
  using Ints = std::span<const int32_t>;
  const int32_t* rows = lease.upload({first_valid, shared ? Ints(shared->begin()) : Ints{},
                                      shared ? Ints(shared->source()) : Ints{}});
  check_cuda("prompt_partial_keys",
             gpu::prompt_partial_keys(
                 n > 0 ? fresh.data<float>() : nullptr, past, n, pool.blocks, pool.max_blocks,
                 pool.block_tokens, gpu_element(pool.dtype), layer.columns.data<int32_t>(),
                 layer.skew.defined() ? layer.skew.data<float>() : nullptr, layer.keys.raw(),
                 gpu_element(layer.keys.dtype()), rows, shared ? rows + B : nullptr,
                 shared ? rows + 2 * B : nullptr, shared ? shared->rows() : 0, B, H_kv,
                 layer.head_dim, layer.keys.dim(3), capacity, lease.stream()));
}

}  // namespace cuda

void reserve_cuda_scratch(size_t index_bytes, size_t gemm_bytes) {
  StreamLease lease;
  lease.reserve(index_bytes, gemm_bytes);
}

void release_cuda_scratch(void* stream) {
  std::unique_ptr<StreamScratch> scratch;
  {
    Registry& r = registry();
    std::lock_guard lock(r.mutex);
    const auto found = r.by_stream.find(stream);
    if (found == r.by_stream.end()) return;
    scratch = std::move(found->second);
    r.by_stream.erase(found);
  }
  std::lock_guard lock(scratch->mutex);
  check_runtime("releasing the CUDA ops' scratch", gpu::stream_synchronize(stream));
  scratch->uploads.release();
  scratch->gemm.release();
}

CudaScratchStats cuda_scratch_stats(void* stream) {
  Registry& r = registry();
  std::lock_guard registry_lock(r.mutex);
  const auto found = r.by_stream.find(stream);
  if (found == r.by_stream.end()) return {};
  StreamScratch& scratch = *found->second;
  std::lock_guard lock(scratch.mutex);
  CudaScratchStats stats = scratch.uploads.stats();
  stats.upload_bytes = scratch.uploads.capacity();
  stats.gemm_bytes = scratch.gemm.bytes();
  stats.gemm = scratch.gemm.buffer();
  stats.grows += scratch.gemm_grows;
  return stats;
}

}  // namespace infinigen::ops
