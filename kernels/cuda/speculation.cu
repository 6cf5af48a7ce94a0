// kernels/cuda: InfiniGen's speculation. The logits kernel gives a block to a run of positions of
// one (sequence, KV head): the block first builds the group's partial queries in shared memory
// (each head's needed rows scattered into a zero query, rotated, skewed, its columns, scaled),
// then each thread scores its positions with the CPU's order of arithmetic (a sequential sum over
// the r columns per head, the maximum over the group). Selection is three launches: per-row
// counts, the fetch sizes (one block), and per row a radix select of the take[b]-th largest
// value followed by one pass in position order that writes the winners ascending.
#include <cfloat>
#include <cmath>
#include <cstring>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/speculation.h"

namespace infinigen::kernels::cuda {
namespace {

using detail::kFullMask;
using detail::kWarpSize;

// ---- block-wide helpers (blockDim.x a multiple of the warp size, at most 1024) ----

constexpr int kMaxWarps = 32;

struct MaxOf {
  // std::max's choice (the first unless the second is larger), as the CPU takes its maxima.
  __device__ float operator()(float a, float b) const { return a < b ? b : a; }
};
struct SumOf {
  __device__ int operator()(int a, int b) const { return a + b; }
};

// `op` over the block's values; every thread gets the result. `partials` holds one value per
// warp; the leading barrier lets a previous call's readers finish before it is overwritten.
template <typename T, typename Op>
__device__ T block_reduce(T value, T* partials, Op op) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value = op(value, __shfl_xor_sync(kFullMask, value, offset));
  }
  __syncthreads();
  if (lane == 0) partials[warp] = value;
  __syncthreads();
  T result = partials[0];
  for (int w = 1; w < warps; ++w) result = op(result, partials[w]);
  return result;
}

// Inclusive prefix sum of `value` over the block in thread order; *total receives the block's
// sum. `partials` holds kMaxWarps values.
__device__ unsigned block_inclusive_scan(unsigned value, unsigned* partials, unsigned* total) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const unsigned before = __shfl_up_sync(kFullMask, value, offset);
    if (lane >= offset) value += before;
  }
  __syncthreads();  // a previous call's readers of `partials` are done
  if (lane == kWarpSize - 1) partials[warp] = value;
  __syncthreads();
  if (warp == 0) {
    unsigned sum = lane < warps ? partials[lane] : 0u;
#pragma unroll
    for (int offset = 1; offset < kWarpSize; offset *= 2) {
      const unsigned before = __shfl_up_sync(kFullMask, sum, offset);
      if (lane >= offset) sum += before;
    }
    if (lane < warps) partials[lane] = sum;
  }
  __syncthreads();
  if (warp > 0) value += partials[warp - 1];
  *total = partials[warps - 1];
  return value;
}

// The bits of a float as an unsigned integer whose order is the floats' order (-0 as +0, so that
// equal values have equal keys, as the CPU compares them).
__device__ __forceinline__ unsigned ordered_key(float value) {
  if (value == 0.0f) value = 0.0f;
  unsigned bits;
  memcpy(&bits, &value, sizeof bits);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The largest float f with f <= value (a double), so that for every float s, s > f exactly when
// (double)s > value: the CPU's `s[p] > top - alpha`, taken in double, as one float comparison.
__device__ __forceinline__ float largest_float_at_most(double value) {
  if (value != value) return NAN;  // nothing compares greater than NaN
  if (value < -static_cast<double>(FLT_MAX)) return -INFINITY;
  if (value >= static_cast<double>(FLT_MAX)) return value == INFINITY ? INFINITY : FLT_MAX;
  float f = static_cast<float>(value);
  if (static_cast<double>(f) > value) f = nextafterf(f, -INFINITY);
  return f;
}

// ---- logits ----

constexpr int kLogitThreads = 256;
constexpr int64_t kPositionsPerBlock = 2048;  // partial queries are rebuilt once per block

size_t logits_shared_bytes(int64_t d, int64_t group, int64_t r) {
  return static_cast<size_t>(d + group * r) * sizeof(float);
}

// Grid (ceil(used / kPositionsPerBlock), H_kv, B). Shared memory: one head's query (d), then the
// group's partial queries (group, r), scaled.
template <typename T>
__global__ void __launch_bounds__(kLogitThreads)
    logits_kernel(const float* query_rows, int64_t query_width, const int32_t* head_rows,
                  const int32_t* needed_dims, const int32_t* columns, const float* skew,
                  const float* inv_freq, const int32_t* rope_positions, const T* partial_keys,
                  const int32_t* position_tokens, const int32_t* first_valid,
                  const int32_t* prefix_begin, const int32_t* prefix_source, int64_t prefix_end,
                  float* logits, int64_t H, int64_t H_kv, int64_t d, int64_t r, int64_t capacity,
                  int64_t used) {
  INFINIGEN_DYNAMIC_SHARED(float, shared);
  const int64_t group = H / H_kv;
  float* q = shared;            // (d)
  float* partial = shared + d;  // (group, r)
  const int64_t b = blockIdx.z, g = blockIdx.y;
  const int64_t p0 = static_cast<int64_t>(blockIdx.x) * kPositionsPerBlock;
  const int64_t p_end = p0 + kPositionsPerBlock < used ? p0 + kPositionsPerBlock : used;
  const int64_t half = d / 2;
  // PartialLayer::partial_query's scale: 1 / sqrt(d) in float.
  const float scale = 1.0f / sqrtf(static_cast<float>(d));
  const int32_t* cols = columns + g * r;
  const float* a = skew != nullptr ? skew + g * d * d : nullptr;

  for (int64_t k = 0; k < group; ++k) {
    const int64_t h = g * group + k;
    __syncthreads();  // the previous head's query is consumed
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) q[i] = 0.0f;
    __syncthreads();
    // The head's query with only its needed dimensions...
    const float* rows = query_rows + b * query_width;
    for (int64_t j = head_rows[h] + threadIdx.x; j < head_rows[h + 1]; j += blockDim.x) {
      q[needed_dims[j]] = rows[j];
    }
    __syncthreads();
    // ... rotated as the model rotates it (the CPU's std::cos and std::sin of a float angle) ...
    if (inv_freq != nullptr) {
      const float position = static_cast<float>(rope_positions[b]);
      for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
        const float angle = position * inv_freq[i];
        const float c = cosf(angle), s = sinf(angle);
        const float x1 = q[i], x2 = q[i + half];
        q[i] = x1 * c - x2 * s;
        q[i + half] = x2 * c + x1 * s;
      }
      __syncthreads();
    }
    // ... skewed, its partial columns, scaled (PartialLayer::partial_of, then the scale).
    for (int64_t j = threadIdx.x; j < r; j += blockDim.x) {
      const int64_t col = cols[j];
      float value;
      if (a != nullptr) {
        float sum = 0.0f;
        for (int64_t i = 0; i < d; ++i) sum += q[i] * a[i * d + col];
        value = sum;
      } else {
        value = q[col];
      }
      partial[k * r + j] = value * scale;
    }
  }
  __syncthreads();

  const int64_t first = first_valid[b];
  const int64_t begin = prefix_end > 0 ? prefix_begin[b] : 0;
  const int64_t source = prefix_end > 0 ? prefix_source[b] : b;
  const int64_t row = b * H_kv + g;
  for (int64_t p = p0 + threadIdx.x; p < p_end; p += blockDim.x) {
    const int64_t token = position_tokens != nullptr ? position_tokens[row * capacity + p] : p;
    // PartialLayer::holds_token: not padding, or a token of the sequence's shared prefix.
    const bool holds = token >= first || (token >= 0 && token < prefix_end && token >= begin);
    float best = -INFINITY;
    if (holds) {
      // key_offset: a position in the shared prefix reads its source's keys.
      const int64_t sequence = p < prefix_end && p >= begin ? source : b;
      const T* key = partial_keys + ((sequence * H_kv + g) * capacity + p) * r;
      for (int64_t k = 0; k < group; ++k) {
        const float* pq = partial + k * r;
        float dot = 0.0f;
        for (int64_t j = 0; j < r; ++j) dot += pq[j] * detail::to_float(key[j]);
        best = best < dot ? dot : best;  // std::max(best, dot)
      }
    }
    logits[row * used + p] = best;
  }
}

// ---- selection ----

constexpr int kSelectThreads = 256;
constexpr int kBins = 256;  // radix digits of 8 bits: four passes over a row

// A block per row: its maximum and valid entries (not -inf), then its alpha count.
__global__ void __launch_bounds__(kSelectThreads)
    count_kernel(const float* logits, int64_t used, double alpha, int32_t* counts, int32_t* valid) {
  __shared__ float top_partials[kMaxWarps];
  __shared__ int count_partials[kMaxWarps];
  const int64_t row = blockIdx.x;
  const float* s = logits + row * used;
  float top = -INFINITY;
  int n_valid = 0;
  for (int64_t p = threadIdx.x; p < used; p += blockDim.x) {
    const float v = s[p];
    if (v == -INFINITY) continue;
    top = top < v ? v : top;
    ++n_valid;
  }
  top = block_reduce(top, top_partials, MaxOf{});
  n_valid = block_reduce(n_valid, count_partials, SumOf{});
  const float threshold = largest_float_at_most(static_cast<double>(top) - alpha);
  int count = 0;
  for (int64_t p = threadIdx.x; p < used; p += blockDim.x) count += s[p] > threshold ? 1 : 0;
  count = block_reduce(count, count_partials, SumOf{});
  if (threadIdx.x == 0) {
    counts[row] = count;
    valid[row] = n_valid;
  }
}

// One block: the mean count, then per sequence n' and take (PartialLayer::select's fetch_size).
__global__ void __launch_bounds__(kSelectThreads)
    fetch_kernel(const int32_t* counts, const int32_t* valid, int64_t B, int64_t H_kv,
                 int64_t max_num_kv, bool batch_mean, int32_t* fetch, int32_t* take,
                 double* mean_count) {
  __shared__ long long partials[kSelectThreads];
  const int64_t rows = B * H_kv;
  long long sum = 0;
  for (int64_t row = threadIdx.x; row < rows; row += blockDim.x) sum += counts[row];
  partials[threadIdx.x] = sum;
  __syncthreads();
  long long total = 0;
  for (int t = 0; t < static_cast<int>(blockDim.x); ++t) total += partials[t];
  if (threadIdx.x == 0) {
    mean_count[0] = static_cast<double>(total) / static_cast<double>(rows);
  }
  for (int64_t b = threadIdx.x; b < B; b += blockDim.x) {
    long long wanted_total = total;
    int64_t n_rows = rows;
    if (!batch_mean) {
      wanted_total = 0;
      for (int64_t g = 0; g < H_kv; ++g) wanted_total += counts[b * H_kv + g];
      n_rows = H_kv;
    }
    const double mean = static_cast<double>(wanted_total) / static_cast<double>(n_rows);
    int64_t wanted = static_cast<int64_t>(floor(mean));
    wanted = wanted < 1 ? 1 : (wanted > max_num_kv ? max_num_kv : wanted);
    int64_t fewest = valid[b * H_kv];
    for (int64_t g = 1; g < H_kv; ++g) {
      const int64_t n = valid[b * H_kv + g];
      fewest = n < fewest ? n : fewest;
    }
    fetch[b] = static_cast<int32_t>(wanted);
    take[b] = static_cast<int32_t>(wanted < fewest ? wanted : fewest);
  }
}

// A block per row of sequence b: its take[b] largest entries, ties to the lower position, written
// ascending to tokens[row * fetch_cap ...], the rest of the row 0.
//
// 1. Radix select: the key K of the take-th largest valid entry, from the most significant byte
//    down, each pass a shared histogram of the next byte of the entries whose higher bytes match
//    what is chosen so far. It leaves `greater`, the entries with a key above K (all taken), and
//    `need`, how many entries equal to K are taken (the first ones in position order).
// 2. One pass over the positions in order, a chunk of blockDim at a time: a block scan of the
//    packed flags (key > K) << 16 | (key == K) gives each winner its place in the output.
__global__ void __launch_bounds__(kSelectThreads)
    select_kernel(const float* logits, int64_t H_kv, int64_t used, const int32_t* take,
                  int32_t* tokens, int64_t fetch_cap) {
  __shared__ unsigned histogram[kBins];
  __shared__ unsigned chosen_prefix, chosen_greater, chosen_remaining;
  __shared__ unsigned scan_partials[kMaxWarps];
  const int64_t row = blockIdx.x;
  const float* s = logits + row * used;
  int32_t* out = tokens + row * fetch_cap;
  const unsigned k = static_cast<unsigned>(take[row / H_kv]);

  if (k > 0) {
    if (threadIdx.x == 0) {
      chosen_prefix = 0u;
      chosen_greater = 0u;
      chosen_remaining = k;
    }
    unsigned mask = 0u;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = threadIdx.x; i < kBins; i += blockDim.x) histogram[i] = 0u;
      __syncthreads();
      const unsigned prefix = chosen_prefix;
      for (int64_t p = threadIdx.x; p < used; p += blockDim.x) {
        const float v = s[p];
        if (v == -INFINITY) continue;
        const unsigned key = ordered_key(v);
        if ((key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 0xffu], 1u);
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        // The digit holding the remaining-th largest, counted from the top.
        const unsigned remaining = chosen_remaining;
        unsigned above = 0u, digit = 0u;
        for (int bin = kBins - 1; bin >= 0; --bin) {
          const unsigned n = histogram[bin];
          if (above + n >= remaining) {
            digit = static_cast<unsigned>(bin);
            break;
          }
          above += n;
        }
        chosen_prefix = prefix | (digit << shift);
        chosen_greater += above;
        chosen_remaining = remaining - above;
      }
      mask |= 0xffu << shift;
      __syncthreads();  // the histogram is read before the next pass clears it
    }
    const unsigned kth = chosen_prefix, greater = chosen_greater, need = chosen_remaining;

    unsigned seen_greater = 0u, seen_equal = 0u;
    for (int64_t base = 0; base < used; base += blockDim.x) {
      const int64_t p = base + threadIdx.x;
      unsigned flags = 0u;
      if (p < used) {
        const float v = s[p];
        if (v != -INFINITY) {
          const unsigned key = ordered_key(v);
          flags = key > kth ? (1u << 16) : (key == kth ? 1u : 0u);
        }
      }
      unsigned chunk = 0u;
      const unsigned before = block_inclusive_scan(flags, scan_partials, &chunk) - flags;
      const unsigned greater_before = seen_greater + (before >> 16);
      const unsigned equal_before = seen_equal + (before & 0xffffu);
      if (flags >> 16) {
        out[greater_before + (equal_before < need ? equal_before : need)] = static_cast<int32_t>(p);
      } else if (flags != 0u && equal_before < need) {
        out[greater_before + equal_before] = static_cast<int32_t>(p);
      }
      seen_greater += chunk >> 16;
      seen_equal += chunk & 0xffffu;
      if (seen_greater == greater && seen_equal >= need) break;  // the same for every thread
    }
  }
  for (int64_t i = k + threadIdx.x; i < fetch_cap; i += blockDim.x) out[i] = 0;
}

// ---- append ----

// One thread per (sequence, KV head, partial column): PartialLayer::partial_of of the new key,
// written at its position.
template <typename T>
__global__ void append_kernel(const float* keys, const int32_t* columns, const float* skew,
                              T* partial_keys, int64_t H_kv, int64_t d, int64_t r, int64_t capacity,
                              int64_t position, const int32_t* positions,
                              const int32_t* prefix_begin, const int32_t* prefix_source,
                              int64_t prefix_end, int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const int64_t j = i % r, row = i / r, b = row / H_kv, g = row % H_kv;
    const int64_t at = positions != nullptr ? positions[row] : position;
    if (at < 0 || at >= capacity) continue;
    const bool shared = prefix_end > 0 && at < prefix_end && at >= prefix_begin[b];
    const int64_t sequence = shared ? prefix_source[b] : b;
    const float* key = keys + row * d;
    const int64_t col = columns[g * r + j];
    float value;
    if (skew != nullptr) {
      const float* a = skew + g * d * d;
      float sum = 0.0f;
      for (int64_t e = 0; e < d; ++e) sum += key[e] * a[e * d + col];
      value = sum;
    } else {
      value = key[col];
    }
    partial_keys[((sequence * H_kv + g) * capacity + at) * r + j] = detail::from_float<T>(value);
  }
}

bool grid_fits(int64_t x, int64_t y, int64_t z) {
  return x >= 1 && x <= 0x7fffffff && y <= 65535 && z <= 65535;
}

}  // namespace

int speculate_logits(const float* query_rows, int64_t query_width, const int32_t* head_rows,
                     const int32_t* needed_dims, const int32_t* columns, const float* skew,
                     const float* inv_freq, const int32_t* rope_positions, const void* partial_keys,
                     Element key_type, const int32_t* position_tokens, const int32_t* first_valid,
                     const int32_t* prefix_begin, const int32_t* prefix_source, int64_t prefix_end,
                     float* logits, int64_t B, int64_t H, int64_t H_kv, int64_t d, int64_t r,
                     int64_t capacity, int64_t used, void* stream) {
  if (B <= 0 || H_kv <= 0 || used <= 0) return cudaSuccess;
  if (H <= 0 || H % H_kv != 0 || d <= 0 || d > kMaxSpeculationHeadDim || r <= 0 || r > d ||
      used > capacity || query_width < 0 || prefix_end < 0 || prefix_end > capacity) {
    return cudaErrorInvalidValue;
  }
  if (inv_freq != nullptr && (d % 2 != 0 || rope_positions == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (prefix_end > 0 && (prefix_begin == nullptr || prefix_source == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const int64_t blocks = (used + kPositionsPerBlock - 1) / kPositionsPerBlock;
  if (!grid_fits(blocks, H_kv, B)) return cudaErrorInvalidValue;
  const size_t shared_bytes = logits_shared_bytes(d, H / H_kv, r);
  const cudaStream_t s = detail::as_stream(stream);
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(H_kv),
                  static_cast<unsigned>(B));
  return detail::dispatch_element(key_type, [&](auto tag) {
    using T = decltype(tag);
    if (shared_bytes > 48 * 1024) {  // a large group of heads: opt in beyond the default
      const cudaError_t status =
          cudaFuncSetAttribute(logits_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(shared_bytes));
      if (status != cudaSuccess) return static_cast<int>(status);
    }
    INFINIGEN_LAUNCH(grid, kLogitThreads, shared_bytes, s, logits_kernel<T>)
    (query_rows, query_width, head_rows, needed_dims, columns, skew, inv_freq, rope_positions,
     static_cast<const T*>(partial_keys), position_tokens, first_valid, prefix_begin, prefix_source,
     prefix_end, logits, H, H_kv, d, r, capacity, used);
    return static_cast<int>(cudaGetLastError());
  });
}

int select_top(const float* logits, int64_t B, int64_t H_kv, int64_t used, double alpha,
               int64_t max_num_kv, FetchMean mean, int32_t* counts, int32_t* valid, int32_t* fetch,
               int32_t* take, double* mean_count, int32_t* tokens, int64_t fetch_cap,
               void* stream) {
  if (B <= 0 || H_kv <= 0) return cudaSuccess;
  const int64_t rows = B * H_kv;
  // Counts fit int32, and the scan's packed flags count a chunk in 16 bits.
  if (used < 0 || used > 0x7fffffff || max_num_kv < 1 || alpha != alpha || rows > 0x7fffffff ||
      fetch_cap < 1 || fetch_cap < (max_num_kv < used ? max_num_kv : used)) {
    return cudaErrorInvalidValue;
  }
  const cudaStream_t s = detail::as_stream(stream);
  const unsigned grid = static_cast<unsigned>(rows);
  INFINIGEN_LAUNCH(grid, kSelectThreads, 0, s, count_kernel)(logits, used, alpha, counts, valid);
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  INFINIGEN_LAUNCH(1, kSelectThreads, 0, s, fetch_kernel)
  (counts, valid, B, H_kv, max_num_kv, mean == FetchMean::Batch, fetch, take, mean_count);
  status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  INFINIGEN_LAUNCH(grid, kSelectThreads, 0, s, select_kernel)
  (logits, H_kv, used, take, tokens, fetch_cap);
  return cudaGetLastError();
}

int append_partial_keys(const float* keys, const int32_t* columns, const float* skew,
                        void* partial_keys, Element key_type, int64_t B, int64_t H_kv, int64_t d,
                        int64_t r, int64_t capacity, int64_t position, const int32_t* positions,
                        const int32_t* prefix_begin, const int32_t* prefix_source,
                        int64_t prefix_end, void* stream) {
  const int64_t count = B * H_kv * r;
  if (B <= 0 || H_kv <= 0) return cudaSuccess;
  if (d <= 0 || d > kMaxSpeculationHeadDim || r <= 0 || r > d || prefix_end < 0 ||
      prefix_end > capacity) {
    return cudaErrorInvalidValue;
  }
  if (positions == nullptr && (position < 0 || position >= capacity)) {
    return cudaErrorInvalidValue;
  }
  if (prefix_end > 0 && (prefix_begin == nullptr || prefix_source == nullptr)) {
    return cudaErrorInvalidValue;
  }
  constexpr int threads = 256;
  const cudaStream_t s = detail::as_stream(stream);
  return detail::dispatch_element(key_type, [&](auto tag) {
    using T = decltype(tag);
    INFINIGEN_LAUNCH(detail::grid_stride_blocks(count, threads), threads, 0, s, append_kernel<T>)
    (keys, columns, skew, static_cast<T*>(partial_keys), H_kv, d, r, capacity, position, positions,
     prefix_begin, prefix_source, prefix_end, count);
    return static_cast<int>(cudaGetLastError());
  });
}

}  // namespace infinigen::kernels::cuda
