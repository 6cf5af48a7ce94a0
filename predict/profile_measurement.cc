// predict: timing the CPU backend's ops and transfers into a hardware profile.
#include "predict/profile_measurement.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "core/model_loader.h"
#include "core/ops.h"
#include "kernels/cpu/int4.h"
#include "offload/h2o_kv.h"
#include "offload/row_gather.h"
#include "offload/transfer_engine.h"
#include "predict/cost_model.h"
#include "predict/op_costs.h"
#include "speculate/speculation.h"

namespace infinigen {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_of(const std::function<void()>& run) {
  const Clock::time_point start = Clock::now();
  run();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Median seconds of `reps` runs after `warmup` untimed ones.
double median_seconds(const std::function<void()>& run, int reps, int warmup = 2) {
  for (int i = 0; i < warmup; ++i) run();
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) times.push_back(seconds_of(run));
  std::nth_element(times.begin(), times.begin() + reps / 2, times.end());
  return times[static_cast<size_t>(reps / 2)];
}

// A CPU tensor of values uniform in [-1, 1), stored as `dtype` (no denormals, no NaN).
Tensor random_tensor(const Shape& shape, DType dtype, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(shape_numel(shape)));
  for (float& v : values) v = uniform(rng);
  const Tensor t = Tensor::from_floats(shape, values);
  return dtype == DType::F32 ? t : t.to_dtype(dtype);
}

// Pinned host bytes freed on scope exit.
struct Pinned {
  explicit Pinned(size_t bytes)
      : data(static_cast<char*>(pinned_alloc(bytes, "a measurement buffer"))), size(bytes) {
    std::memset(data, 1, bytes);
  }
  ~Pinned() { pinned_free(data); }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  char* data;
  size_t size;
};

// `count` chunks of `bytes` each from random distinct slots of `src` into consecutive `dst`.
std::vector<CopyChunk> scattered_chunks(char* dst, const Pinned& src, size_t bytes, size_t count,
                                        uint64_t seed) {
  const size_t slots = src.size / bytes;
  std::vector<size_t> order(slots);
  for (size_t i = 0; i < slots; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
  std::vector<CopyChunk> chunks;
  for (size_t i = 0; i < count; ++i) {
    chunks.push_back({dst + i * bytes, src.data + order[i] * bytes, bytes});
  }
  return chunks;
}

// How hard a measurement works: repetitions per timing, the size of a rotating set that streams
// from memory (beyond the last-level cache), sweeps over the linear table, contention pairs.
struct Effort {
  bool quick = false;
  double memory_set = 0;
  int reps(int n) const { return quick ? std::max(3, n / 8) : n; }
  int sweeps() const { return quick ? 1 : 3; }
  int pairs() const { return quick ? 2 : 15; }
};

// One linear layer shape repeated over a rotating set of weight matrices, so that the weights
// come from where the set fits (beyond the last-level cache: memory) as a real model's do.
class DecodeLinear {
 public:
  DecodeLinear(int64_t M, int64_t N, int64_t K, int copies)
      : N_(N), K_(K), bias_(random_tensor({N}, DType::F32, 2)) {
    for (int i = 0; i < copies; ++i) {
      weights_.push_back(random_tensor({N, K}, DType::F16, 10 + static_cast<uint64_t>(i)));
    }
    set_rows(M);
  }
  void set_rows(int64_t M) {
    M_ = M;
    x_ = random_tensor({M, K_}, DType::F32, 1);
    y_ = Tensor::empty({M, N_}, DType::F32);
  }
  void run() {
    ops::linear(x_, weights_[next_], bias_, y_);
    next_ = (next_ + 1) % weights_.size();
  }
  int copies() const { return static_cast<int>(weights_.size()); }
  double weight_bytes() const { return static_cast<double>(N_ * K_ * 2); }
  double bytes() const { return linear_bytes(M_, N_, K_, 2); }

 private:
  int64_t M_ = 0, N_, K_;
  Tensor x_, y_, bias_;
  std::vector<Tensor> weights_;
  size_t next_ = 0;
};

// Decode attention of B 4, H 8 queries over 1024 fp16 KV rows of d 128, repeated over a rotating
// set of K and V bigger than the last-level cache: a real step's KV streams from memory next to
// the weights.
class DecodeAttention {
 public:
  static constexpr int64_t B = 4, H = 8, n = 1024, d = 128;
  DecodeAttention(double set_bytes, uint64_t seed)
      : q_(random_tensor({B, H * d}, DType::F32, seed)),
        out_(Tensor::empty({B, H * d}, DType::F32)),
        first_valid_(static_cast<size_t>(B), 0) {
    const int copies = std::max(2, static_cast<int>(set_bytes / kv_bytes()));
    for (int i = 0; i < copies; ++i) {
      keys_.push_back(
          random_tensor({B, H, n, d}, DType::F16, seed + 1 + 2 * static_cast<uint64_t>(i)));
      values_.push_back(
          random_tensor({B, H, n, d}, DType::F16, seed + 2 + 2 * static_cast<uint64_t>(i)));
    }
  }
  void run() {
    ops::attention_decode(q_, keys_[next_], values_[next_], out_, n, first_valid_);
    next_ = (next_ + 1) % keys_.size();
  }
  int copies() const { return static_cast<int>(keys_.size()); }
  static double kv_bytes() { return 2.0 * static_cast<double>(B * H * n * d * 2); }

 private:
  Tensor q_, out_;
  std::vector<int32_t> first_valid_;
  std::vector<Tensor> keys_, values_;
  size_t next_ = 0;
};

// Median seconds of one run of `linear`, after a warm-up that cycles through its weight set.
double linear_seconds(DecodeLinear& linear, const Effort& effort) {
  return median_seconds([&] { linear.run(); }, effort.reps(std::max(41, 4 * linear.copies() + 1)),
                        linear.copies());
}

// How much compute and host copies slow each other, arranged as the runtime arranges them:
// `compute` runs on this thread (the master of the OpenMP team, as the forward pass does) while a
// helper thread keeps a transfer engine's load worker copying `chunks` back to back. With three
// busy threads on the cores, how the OS places them decides who yields (one run of a process
// sees the compute 2x slower, the next the copies), and a placement lasts: so each pair of solo
// and shared timings gets a fresh engine (a fresh worker thread), and each factor is the mean
// over the pairs of its time shared over its time alone (at least 1).
struct Slowdowns {
  double compute = 1, copy = 1;
};

Slowdowns contention(const std::function<void()>& compute, const std::vector<CopyChunk>& chunks,
                     const Effort& effort) {
  const int compute_reps = effort.reps(21), copy_reps = effort.reps(11);
  std::vector<double> compute_ratios, copy_ratios;
  for (int pair = 0; pair < effort.pairs(); ++pair) {
    TransferEngine engine(Device::Cpu, {});
    const auto copy_seconds = [&] { return seconds_of([&] { engine.load(chunks)->wait(); }); };
    const double compute_alone = median_seconds(compute, compute_reps);
    const double copy_alone = median_seconds([&] { engine.load(chunks)->wait(); }, copy_reps);
    std::atomic<bool> computing{true};
    std::vector<double> shared_copies;
    std::thread copier([&] {
      while (computing.load()) {
        const double t = copy_seconds();
        if (computing.load()) shared_copies.push_back(t);
      }
    });
    const double compute_shared = median_seconds(compute, compute_reps);
    computing = false;
    copier.join();
    compute_ratios.push_back(compute_shared / compute_alone);
    if (!shared_copies.empty()) {
      std::nth_element(shared_copies.begin(), shared_copies.begin() + shared_copies.size() / 2,
                       shared_copies.end());
      copy_ratios.push_back(shared_copies[shared_copies.size() / 2] / copy_alone);
    }
  }
  const auto mean_at_least_1 = [](const std::vector<double>& v) {
    if (v.empty()) return 1.0;
    double total = 0;
    for (double x : v) total += x;
    return std::max(1.0, total / static_cast<double>(v.size()));
  };
  return {mean_at_least_1(compute_ratios), mean_at_least_1(copy_ratios)};
}

// How many matrices of `bytes` make a rotating set of `set_bytes` (at least 2).
int copies_for(double set_bytes, double bytes) {
  return std::max(2, static_cast<int>(set_bytes / bytes));
}

// The linear cost table (predict/linear_cost_table.h): for each K and row count, ops::linear at
// output widths 512 and `wide_n(K)` over weights rotating through `set_bytes`; the two times give
// the cell's fixed part and its seconds per weight byte.
LinearCostGrid measure_linear_grid(const LinearCostTable& axes, double set_bytes,
                                   const std::function<int64_t(int64_t)>& wide_n,
                                   const std::function<void(const std::string&)>& say,
                                   const char* placement, const Effort& effort) {
  constexpr int64_t kNarrow = 512;
  LinearCostGrid grid;
  for (const int64_t K : axes.k) {
    const int64_t wide = wide_n(K);
    DecodeLinear narrow(1, kNarrow, K, copies_for(set_bytes, kNarrow * K * 2.0));
    DecodeLinear broad(1, wide, K, copies_for(set_bytes, static_cast<double>(wide * K * 2)));
    // Several sweeps over the row counts, each cell's time the median of its sweeps: this
    // machine has slow spells of seconds that would otherwise bend whole rows of the table.
    const size_t cells = axes.rows.size();
    std::vector<std::vector<double>> narrow_t(cells), broad_t(cells);
    for (int sweep = 0; sweep < effort.sweeps(); ++sweep) {
      for (size_t j = 0; j < cells; ++j) {
        narrow.set_rows(axes.rows[j]);
        broad.set_rows(axes.rows[j]);
        narrow_t[j].push_back(linear_seconds(narrow, effort));
        broad_t[j].push_back(linear_seconds(broad, effort));
      }
    }
    const auto median = [](std::vector<double> v) {
      std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
      return v[v.size() / 2];
    };
    std::vector<double> fixed, rates;
    for (size_t j = 0; j < cells; ++j) {
      const double t1 = median(narrow_t[j]), t2 = median(broad_t[j]);
      const double b1 = narrow.weight_bytes(), b2 = broad.weight_bytes();
      double per_byte = (t2 - t1) / (b2 - b1);
      if (per_byte <= 0) per_byte = t2 / b2;  // noise swamped the difference: all of it per byte
      fixed.push_back(std::max(0.0, t1 - b1 * per_byte));
      rates.push_back(1.0 / per_byte);
    }
    say(cat("linear, ", placement, ", K ", K, ": ", rates.front() / 1e9, " GB/s at 1 row, ",
            rates.back() / 1e9, " GB/s at ", axes.rows.back(), " rows"));
    grid.fixed_s.push_back(std::move(fixed));
    grid.bytes_per_s.push_back(std::move(rates));
  }
  return grid;
}

// The host CPU's model name (/proc/cpuinfo), or "an unknown CPU".
std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (!line.starts_with("model name")) continue;
    const size_t colon = line.find(':');
    if (colon != std::string::npos && colon + 2 <= line.size()) return line.substr(colon + 2);
  }
  return "an unknown CPU";
}

// Bytes of the host's largest cache level (the last-level cache); 0 when unknown.
size_t last_level_cache_bytes() {
  size_t best = 0;
  int best_level = 0;
  for (int index = 0; index < 8; ++index) {
    const std::string dir = cat("/sys/devices/system/cpu/cpu0/cache/index", index, "/");
    std::ifstream level_file(dir + "level"), size_file(dir + "size");
    int level = 0;
    std::string size;
    if (!(level_file >> level) || !(size_file >> size) || size.empty()) continue;
    size_t bytes = std::strtoull(size.c_str(), nullptr, 10);
    if (size.back() == 'K') bytes <<= 10;
    if (size.back() == 'M') bytes <<= 20;
    if (level > best_level) {
      best_level = level;
      best = bytes;
    }
  }
  return best;
}

// What every step of a measurement shares: how hard it works, where it reports, and the op
// overhead its rates are net of (0 until measured, by the first step).
struct Measurement {
  Effort effort;
  std::function<void(const std::string&)> say;
  double overhead = 0;
  // `amount` per second of an op that took `seconds`, net of the op overhead.
  double rate(double amount, double seconds) const {
    return amount / std::max(seconds - overhead, 1e-9);
  }
};

// The sources' words for a timed op.
std::string measured(const std::string& what) {
  return "measured by measure_cpu_backend_profile: median of repeated runs of " + what;
}

// The profile's name and description, the host's cache and memory; the effort's rotating set.
HardwareProfile host_profile(Effort& effort) {
  HardwareProfile p;
  p.name = "cpu-backend";
  p.backend = "cpu";
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  p.description = cat("the engine's CPU backend (emulated device in host memory) on ", cpu_name(),
                      ", ", threads, " hardware threads; measured by measure_cpu_backend_profile");
  p.device_cache_bytes = static_cast<double>(last_level_cache_bytes());
  effort.memory_set = effort.quick ? std::max(16.0 * 1048576.0, 2.0 * p.device_cache_bytes)
                                   : std::max(128.0 * 1048576.0, 4.0 * p.device_cache_bytes);
  if (effort.quick) p.description += " (quick measurement: few repetitions, rough)";
  p.device_memory_bytes = static_cast<double>(available_host_memory());
  p.sources["device_memory_bytes"] = "available host memory when measured (MemAvailable)";
  return p;
}

// Fixed cost of an op: a residual add of 16 elements, all bookkeeping and no work.
void measure_op_overhead(HardwareProfile& p, Measurement& m) {
  Tensor y = random_tensor({1, 16}, DType::F32, 3);
  const Tensor x = random_tensor({1, 16}, DType::F32, 4);
  p.op_overhead_s = median_seconds([&] { ops::add_inplace(y, x); }, m.effort.reps(2001), 50);
  p.sources["op_overhead_s"] = measured("ops::add_inplace on 16 elements");
  m.say(cat("op overhead: ", p.op_overhead_s * 1e6, " us"));
  m.overhead = p.op_overhead_s;
}

// Prefill-shape GEMM: compute-bound.
void measure_gemm(HardwareProfile& p, const Measurement& m) {
  const int64_t M = 512, N = 1024, K = 1024;
  const Tensor x = random_tensor({M, K}, DType::F32, 5);
  const Tensor w = random_tensor({N, K}, DType::F16, 6);
  const Tensor b = random_tensor({N}, DType::F32, 7);
  Tensor y = Tensor::empty({M, N}, DType::F32);
  const double t = median_seconds([&] { ops::linear(x, w, b, y); }, m.effort.reps(9));
  p.gemm_flops = m.rate(linear_flops(M, N, K), t);
  p.sources["gemm_flops"] = measured("ops::linear x (512, 1024) . w (1024, 1024)^T, fp16 weights");
  m.say(cat("gemm (prefill shape): ", p.gemm_flops / 1e9, " GFLOP/s"));
}

// Decode-shape projections: weight streaming from memory (fp16 matrices rotating over a set
// beyond the last-level cache), then the linear cost table from memory and from the cache
// (rotating over half of it).
void measure_decode_projections(HardwareProfile& p, const Measurement& m) {
  const Effort& effort = m.effort;
  p.sources["device_cache_bytes"] = "the host's largest cache level (sysfs cpu0 cache)";
  m.say(cat("last-level cache: ", p.device_cache_bytes / 1048576.0, " MiB"));
  const double memory_set = effort.memory_set, cache_set = p.device_cache_bytes / 2;
  {
    DecodeLinear linear(4, 2048, 2048, copies_for(memory_set, 2048.0 * 2048 * 2));
    p.device_memory_bytes_per_s = m.rate(linear.bytes(), linear_seconds(linear, effort));
    p.sources["device_memory_bytes_per_s"] = measured(
        "ops::linear x (4, 2048) . w (2048, 2048)^T, fp16 weights rotating beyond the "
        "last-level cache");
    m.say(cat("weight streaming (decode shape): ", p.device_memory_bytes_per_s / 1e9, " GB/s"));
  }
  if (effort.quick) {
    p.linear_table.rows = {1, 2, 4, 8, 16};
    p.linear_table.k = {512, 2048};
  } else {
    p.linear_table.rows = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14, 16, 20, 24, 32, 48, 64};
    p.linear_table.k = {512, 1024, 2048, 4096};
  }
  p.linear_table.memory = measure_linear_grid(
      p.linear_table, memory_set, [](int64_t) { return int64_t{2048}; }, m.say, "memory", effort);
  // In the cache two copies of the wide matrix must fit in the set; without room for a width
  // twice the narrow one, the cache is too small to matter and shares the memory grid.
  const auto cache_wide = [&](int64_t K) {
    return std::min<int64_t>(2048, static_cast<int64_t>(cache_set / (4.0 * K)) / 64 * 64);
  };
  bool cache_room = true;
  for (const int64_t K : p.linear_table.k) cache_room = cache_room && cache_wide(K) >= 1024;
  p.linear_table.cache = cache_room ? measure_linear_grid(p.linear_table, cache_set, cache_wide,
                                                          m.say, "cache", effort)
                                    : p.linear_table.memory;
  p.sources["linear_table"] = measured(
      "ops::linear x (rows, K) . w (N, K)^T at N 512 and N 2048 (cache: up to 2048, two copies "
      "in the set), fp16 weights rotating beyond the last-level cache (memory) or over half of "
      "it (cache); the two widths give fixed_s and bytes_per_s; each cell the median of " +
      std::to_string(effort.sweeps()) + " sweeps");
}

// Attention: the prefill's (compute) and the decode's (KV streaming from memory).
void measure_attention(HardwareProfile& p, const Measurement& m) {
  {
    const int64_t B = 2, H = 8, n = 256, d = 128;
    const Tensor q = random_tensor({B * n, H * d}, DType::F32, 8);
    const Tensor k = random_tensor({B * n, H * d}, DType::F32, 9);
    const Tensor v = random_tensor({B * n, H * d}, DType::F32, 10);
    Tensor out = Tensor::empty({B * n, H * d}, DType::F32);
    const std::vector<int32_t> first_valid(static_cast<size_t>(B), 0);
    const double t = median_seconds(
        [&] { ops::attention_prefill(q, k, v, out, B, H, first_valid); }, m.effort.reps(7));
    p.attention_flops = m.rate(attention_prefill_flops(B, H, n, d), t);
    p.sources["attention_flops"] = measured("ops::attention_prefill, B 2, H 8, n 256, d 128");
    m.say(cat("attention (prefill): ", p.attention_flops / 1e9, " GFLOP/s"));
  }
  DecodeAttention attention(m.effort.memory_set, 100);
  const double t = median_seconds([&] { attention.run(); },
                                  m.effort.reps(4 * attention.copies() + 1), attention.copies());
  using A = DecodeAttention;
  p.attention_bytes_per_s = m.rate(attention_decode_bytes(A::B, A::H, A::n, A::d, 2), t);
  p.sources["attention_bytes_per_s"] = measured(
      "ops::attention_decode over fp16 KV, B 4, H 8, 1024 rows, d 128, rotating beyond "
      "the last-level cache");
  m.say(cat("attention (decode): ", p.attention_bytes_per_s / 1e9, " GB/s of KV"));
}

// Elementwise: LayerNorm.
void measure_elementwise(HardwareProfile& p, const Measurement& m) {
  const int64_t rows = 512, D = 1024;
  const Tensor x = random_tensor({rows, D}, DType::F32, 14);
  const Tensor g = random_tensor({D}, DType::F32, 15);
  const Tensor b = random_tensor({D}, DType::F32, 16);
  Tensor y = Tensor::empty({rows, D}, DType::F32);
  const double t = median_seconds([&] { ops::layer_norm(x, g, b, 1e-5f, y); }, m.effort.reps(21));
  p.elementwise_bytes_per_s = m.rate(layer_norm_bytes(rows, D), t);
  p.sources["elementwise_bytes_per_s"] = measured("ops::layer_norm on (512, 1024) fp32");
  m.say(cat("elementwise: ", p.elementwise_bytes_per_s / 1e9, " GB/s"));
}

// The int4 codec: dequantising rows into fp16 staging, one thread, as Int4Kv does on the CPU
// backend (ops::int4_dequantize runs kernels::cpu::int4_dequantize_row_f16 row by row).
void measure_int4_codec(HardwareProfile& p, const Measurement& m) {
  const int64_t rows = 8192, d = 128;
  const size_t code_bytes = ops::int4_code_bytes(d);
  const size_t meta_halves = ops::int4_meta_bytes(d) / sizeof(uint16_t);
  const Tensor x = random_tensor({rows, d}, DType::F32, 17);
  std::vector<uint8_t> codes(static_cast<size_t>(rows) * code_bytes);
  std::vector<uint16_t> meta(static_cast<size_t>(rows) * meta_halves);
  std::vector<uint16_t> out(static_cast<size_t>(rows * d));
  for (int64_t r = 0; r < rows; ++r) {
    const auto i = static_cast<size_t>(r);
    kernels::cpu::int4_quantize_row(x.data<float>() + r * d, d, codes.data() + i * code_bytes,
                                    meta.data() + i * meta_halves);
  }
  const double t = median_seconds(
      [&] {
        for (int64_t r = 0; r < rows; ++r) {
          const auto i = static_cast<size_t>(r);
          kernels::cpu::int4_dequantize_row_f16(
              codes.data() + i * code_bytes, meta.data() + i * meta_halves, d, out.data() + r * d);
        }
      },
      m.effort.reps(11));
  p.kv_codec_bytes_per_s = static_cast<double>(rows * d * 2) / t;
  p.sources["kv_codec_bytes_per_s"] =
      measured("int4_dequantize_row into fp16, 8192 rows of d 128, one thread");
  m.say(cat("int4 codec: ", p.kv_codec_bytes_per_s / 1e9, " GB/s of fp16 rows"));
}

// Seconds of one PartialLayer::speculate over n positions of B sequences, H query heads over
// H_kv KV heads, r columns, with the runtime's default partial key dtype, over layers whose
// partial key caches together exceed the last-level cache, as a decode step's layers do.
double time_speculation(const Measurement& m, int64_t H, int64_t Hkv) {
  const int64_t B = 4, d = 128, D = H * d, n = 2048, r = 38;
  const DType key_dtype = SpeculationOptions{}.partial_key_dtype;
  const Tensor q = random_tensor({B * n, D}, DType::F32, 18);
  const Tensor k = random_tensor({B * n, Hkv * d}, DType::F32, 19);
  const Tensor wq = random_tensor({D, D}, DType::F16, 20);
  const Tensor bq = random_tensor({D}, DType::F32, 21);
  const Tensor x = random_tensor({B, D}, DType::F32, 22);
  const std::vector<int32_t> first_valid(static_cast<size_t>(B), 0);
  SpeculationOptions options;
  options.max_num_kv = options.fetch_cap(n);
  const double key_bytes = static_cast<double>(B * Hkv * n * r * dtype_size(key_dtype));
  const int copies = copies_for(m.effort.memory_set, key_bytes);
  std::vector<PartialLayer> layers(static_cast<size_t>(copies));
  const Tensor none;
  for (PartialLayer& layer : layers) {
    layer.build({q, k, wq, bq, none, none}, first_valid, H, Hkv, n, r, PartialIndexRule::QK,
                nullptr, key_dtype);
  }
  size_t next = 0;
  return median_seconds(
      [&] {
        (void)layers[next].speculate(x, {}, n, first_valid, options);
        next = (next + 1) % layers.size();
      },
      m.effort.reps(4 * copies + 1), copies);
}

// Speculation, priced as max(products / speculation_flops, key bytes / speculation_bytes_per_s)
// (predict/op_costs.cc): the byte rate from multi-head attention (one query head per key, where
// widening and reading the keys dominate), the product rate from 4 query heads per KV head
// (Llama-3's grouping, where the products do). Both with the default partial key dtype.
void measure_speculation(HardwareProfile& p, const Measurement& m) {
  const int64_t B = 4, n = 2048, r = 38;
  const size_t e = dtype_size(SpeculationOptions{}.partial_key_dtype);
  const double multi_head = time_speculation(m, 8, 8);
  p.speculation_bytes_per_s = m.rate(static_cast<double>(B * 8 * n * r * e), multi_head);
  p.sources["speculation_bytes_per_s"] = measured(
      "PartialLayer::speculate (projection, scores, selection), B 4, H 8 = H_kv, r 38, 2048 "
      "positions, default partial key dtype, per byte of partial keys, layers rotating beyond "
      "the last-level cache");
  const double grouped = time_speculation(m, 32, 8);
  p.speculation_flops = m.rate(2.0 * static_cast<double>(B * 32 * n * r), grouped);
  p.sources["speculation_flops"] = measured(
      "PartialLayer::speculate as for speculation_bytes_per_s with H 32 over H_kv 8, per "
      "query-head x partial-key product (2 FLOP per element)");
  m.say(cat("speculation: ", p.speculation_bytes_per_s / 1e9, " GB/s of partial keys, ",
            p.speculation_flops / 1e9, " GFLOP/s grouped"));
}

// H2O's score accumulation: per (sequence, head), the h2o store's own scoring of the new query
// against each kept key (h2o_accumulate_scores: sequential fp32 dots and a softmax), rows spread
// over OpenMP threads as the store spreads them.
void measure_h2o_scoring(HardwareProfile& p, const Measurement& m) {
  const int64_t rows = 32, entries = 512, d = 128;
  const Tensor keys = random_tensor({rows, entries, d}, DType::F32, 23);
  const Tensor queries = random_tensor({rows, d}, DType::F32, 24);
  std::vector<float> scores(static_cast<size_t>(rows * entries), 0.0f);
  const float* kd = keys.data<float>();
  const float* qd = queries.data<float>();
  const double t = median_seconds(
      [&] {
#pragma omp parallel for schedule(static)
        for (int64_t row = 0; row < rows; ++row) {
          std::vector<float> probs(static_cast<size_t>(entries));
          h2o_accumulate_scores(qd + row * d, kd + row * entries * d, entries, d, probs.data(),
                                scores.data() + row * entries);
        }
      },
      m.effort.reps(21));
  p.scoring_flops = static_cast<double>(rows * entries * (2 * d + 4)) / t;
  p.sources["scoring_flops"] = measured(
      "sequential fp32 dots and softmax of 32 rows x 512 kept entries, d 128 (H2O's loop)");
  m.say(cat("h2o scoring: ", p.scoring_flops / 1e9, " GFLOP/s"));
}

// Device memory of the CPU backend, freed on scope exit.
struct DeviceBuffer {
  explicit DeviceBuffer(size_t bytes)
      : data(static_cast<char*>(device_alloc(Device::Cpu, bytes))), size(bytes) {
    std::memset(data, 0, bytes);
  }
  ~DeviceBuffer() { device_free(Device::Cpu, data); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  char* data;
  size_t size;
};

// Transfers through the engine itself, no link emulation: the host copy work of a transfer, from
// `pool` into `dst`. Returns the contiguous runs (`bulk`), which the contention step copies too.
std::vector<CopyChunk> measure_host_copies(HardwareProfile& p, const Measurement& m,
                                           const Pinned& pool, const DeviceBuffer& dst) {
  TransferEngine engine(Device::Cpu, {});
  const auto transfer_seconds = [&](const std::vector<CopyChunk>& chunks, int reps) {
    return median_seconds([&] { engine.load(chunks)->wait(); }, m.effort.reps(reps));
  };
  // Contiguous runs of one 128-token block row (128 x 256 B), as the `full` load gathers them.
  std::vector<CopyChunk> bulk = scattered_chunks(dst.data, pool, 32768, 1024, 25);
  p.host_copy_bytes_per_s = static_cast<double>(total_bytes(bulk)) / transfer_seconds(bulk, 11);
  p.sources["host_copy_bytes_per_s"] =
      measured("TransferEngine::load of 1024 contiguous 32 KiB runs from a 128 MiB pinned pool");
  m.say(cat("host copy (contiguous runs): ", p.host_copy_bytes_per_s / 1e9, " GB/s"));
  const std::vector<CopyChunk> few_rows = scattered_chunks(dst.data, pool, 256, 2048, 26);
  p.host_row_copy_bytes_per_s =
      static_cast<double>(total_bytes(few_rows)) / transfer_seconds(few_rows, 41);
  p.sources["host_row_copy_bytes_per_s"] =
      measured("TransferEngine::load of 2048 scattered 256-byte rows (one thread)");
  m.say(cat("host row copy (one thread): ", p.host_row_copy_bytes_per_s / 1e9, " GB/s"));
  // The cuda backend's host gather into pinned staging spreads the rows over OpenMP threads.
  const std::vector<CopyChunk> many_rows = scattered_chunks(dst.data, pool, 256, 65536, 27);
  const double gather_t = median_seconds([&] { gather_rows(many_rows); }, m.effort.reps(21));
  p.host_gather_bytes_per_s = static_cast<double>(total_bytes(many_rows)) / gather_t;
  p.sources["host_gather_bytes_per_s"] = measured(
      "gather_rows (every OpenMP thread) copying 65536 scattered 256-byte rows out of a 128 MiB "
      "pinned pool");
  m.say(cat("host gather (OpenMP): ", p.host_gather_bytes_per_s / 1e9, " GB/s"));
  return bulk;
}

// Contention: a decode layer's compute (a projection, then attention over a batch's KV, both
// streaming from memory) against 32 MiB loads (`bulk`).
void measure_contention(HardwareProfile& p, const Measurement& m,
                        const std::vector<CopyChunk>& bulk) {
  DecodeLinear linear(4, 2048, 2048, 8);
  DecodeAttention attention(m.effort.memory_set, 200);
  const Slowdowns slowdowns = contention(
      [&] {
        linear.run();
        attention.run();
      },
      bulk, m.effort);
  p.compute_slowdown_under_copy = slowdowns.compute;
  p.copy_slowdown_under_compute = slowdowns.copy;
  const std::string what =
      cat("ops::linear x (4, 2048) . w (2048, 2048)^T then ops::attention_decode (B 4, H 8, "
          "1024 rows, d 128), both rotating beyond the last-level cache, on the main thread, "
          "and 32 MiB TransferEngine::load copies on the engine's worker (a fresh engine for "
          "each of ",
          m.effort.pairs(), " pairs, mean); ");
  p.sources["compute_slowdown_under_copy"] =
      measured(what + "the compute's time while copies run over its time alone");
  p.sources["copy_slowdown_under_compute"] =
      measured(what + "a copy's time while the compute runs over its time alone");
  m.say(cat("contention: compute ", p.compute_slowdown_under_copy, "x slower under copies, copies ",
            p.copy_slowdown_under_compute, "x slower under compute"));
}

// Link emulation: how much an emulated transfer overruns latency + bytes / bandwidth (the copy
// thread's timed sleep wakes late), for a transfer the size of one small layer's KV.
void measure_link_emulation(HardwareProfile& p, const Measurement& m, const Pinned& pool,
                            const DeviceBuffer& dst) {
  const LinkEmulation link{12.0, 0.0};
  TransferEngine emulated(Device::Cpu, link);
  const std::vector<CopyChunk> layer = scattered_chunks(dst.data, pool, 32768, 32, 28);
  const double requested = static_cast<double>(total_bytes(layer)) / (link.gbps * 1e9);
  const double t = median_seconds([&] { emulated.load(layer)->wait(); }, m.effort.reps(41));
  p.link_emulation_overhead_s = std::max(0.0, t - requested);
  p.sources["link_emulation_overhead_s"] =
      measured("an emulated 12 GB/s TransferEngine::load of 1 MiB, minus its requested time");
  m.say(cat("link emulation overrun: ", p.link_emulation_overhead_s * 1e6, " us per transfer"));
}

}  // namespace

HardwareProfile measure_cpu_backend_profile(const std::function<void(const std::string&)>& progress,
                                            ProfileEffort effort_level) {
  Measurement m;
  m.effort.quick = effort_level == ProfileEffort::Quick;
  m.say = [&](const std::string& line) {
    if (progress) progress(line);
  };
  HardwareProfile p = host_profile(m.effort);
  measure_op_overhead(p, m);
  measure_gemm(p, m);
  measure_decode_projections(p, m);
  measure_attention(p, m);
  measure_elementwise(p, m);
  measure_int4_codec(p, m);
  measure_speculation(p, m);
  measure_h2o_scoring(p, m);
  {
    const Pinned pool(size_t{128} << 20);  // beyond the last-level cache
    const DeviceBuffer dst(size_t{32} << 20);
    const std::vector<CopyChunk> bulk = measure_host_copies(p, m, pool, dst);
    measure_contention(p, m, bulk);
    measure_link_emulation(p, m, pool, dst);
  }
  return with_link(p, 0.0, 0.0);
}

}  // namespace infinigen
