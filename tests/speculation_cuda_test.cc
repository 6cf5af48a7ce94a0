// tests: the speculation kernels (kernels/cuda/speculation.h) against PartialLayer on the CPU
// (label gpu; each test skips when no CUDA device is present). A layer is built on the CPU from
// random inputs, its state uploaded, and the device's estimated logits, alpha counts, fetch sizes
// and selected positions compared with estimate_logits and select: logits within 1e-5 relative,
// everything selected equal. The partial key append is compared with PartialLayer::append. The
// engine's device twin of a layer (DevicePartialLayer) selects the CPU's tokens from the same
// inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/ops.h"
#include "core/rope.h"
#include "core/shared_prefixes.h"
#include "core/tensor.h"
#include "kernels/cuda/runtime.h"
#include "kernels/cuda/speculation.h"
#include "speculate/device_partial.h"
#include "speculate/speculation.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

namespace kc = kernels::cuda;

#define ASSERT_KERNEL_OK(call)                                       \
  do {                                                               \
    const int code_ = (call);                                        \
    ASSERT_EQ(code_, 0) << #call << ": " << kc::error_string(code_); \
  } while (false)

// A device copy of `values` (at least one element, so that nothing is empty).
template <typename T>
Tensor device_array(const std::vector<T>& values, DType dtype) {
  const int64_t n = std::max<int64_t>(1, static_cast<int64_t>(values.size()));
  Tensor t = Tensor::empty({n}, dtype, Device::Cuda);
  if (!values.empty()) {
    device_copy(t.raw(), Device::Cuda, values.data(), Device::Cpu, values.size() * sizeof(T));
  }
  return t;
}
Tensor device_ints(const std::vector<int32_t>& values) {
  return device_array(values, DType::I32);
}
Tensor device_floats(const std::vector<float>& values) {
  return device_array(values, DType::F32);
}

template <typename T>
std::vector<T> download(const Tensor& t, size_t n) {
  std::vector<T> values(n);
  device_copy(values.data(), Device::Cpu, t.raw(), Device::Cuda, n * sizeof(T));
  return values;
}

std::vector<float> normal_values(size_t n, std::mt19937_64& rng, float scale = 1.0f) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> values(n);
  for (float& v : values) v = normal(rng);
  return values;
}
Tensor normal_tensor(Shape shape, std::mt19937_64& rng, float scale = 1.0f) {
  const size_t n = static_cast<size_t>(shape_numel(shape));
  return Tensor::from_floats(std::move(shape), normal_values(n, rng, scale));
}

// Logits equal within 1e-5 relative, -inf exactly where the CPU has it. Returns how many finite
// entries differ in any bit (reported, not a failure).
int64_t expect_logits_close(const std::vector<float>& device, const std::vector<float>& cpu) {
  EXPECT_EQ(device.size(), cpu.size());
  int64_t bit_differences = 0, failures = 0;
  for (size_t i = 0; i < std::min(device.size(), cpu.size()); ++i) {
    if (cpu[i] == -INFINITY || device[i] == -INFINITY) {
      if (device[i] != cpu[i] && failures++ < 5) {
        ADD_FAILURE() << "logit " << i << ": device " << device[i] << ", cpu " << cpu[i];
      }
      continue;
    }
    if (std::memcmp(&device[i], &cpu[i], sizeof(float)) != 0) ++bit_differences;
    const double tolerance = 1e-5 * std::max(1.0, std::fabs(static_cast<double>(cpu[i])));
    if (!(std::fabs(static_cast<double>(device[i]) - cpu[i]) <= tolerance) && failures++ < 5) {
      ADD_FAILURE() << "logit " << i << ": device " << device[i] << ", cpu " << cpu[i];
    }
  }
  EXPECT_EQ(failures, 0);
  return bit_differences;
}

// What select_top returns, downloaded.
struct DeviceSelection {
  std::vector<int32_t> counts, valid, fetch, take, tokens;
  double mean_count = 0.0;
  int64_t fetch_cap = 0;
};

DeviceSelection select_on_device(const Tensor& logits, int64_t B, int64_t H_kv, int64_t used,
                                 const SpeculationOptions& options, int64_t fetch_cap) {
  const int64_t rows = B * H_kv;
  Tensor counts = Tensor::empty({rows}, DType::I32, Device::Cuda);
  Tensor valid = Tensor::empty({rows}, DType::I32, Device::Cuda);
  Tensor fetch = Tensor::empty({B}, DType::I32, Device::Cuda);
  Tensor take = Tensor::empty({B}, DType::I32, Device::Cuda);
  Tensor mean = Tensor::empty({1}, DType::I64, Device::Cuda);  // 8 bytes for a double
  // -7 everywhere: anything the kernel forgot to write shows.
  Tensor tokens = device_ints(std::vector<int32_t>(static_cast<size_t>(rows * fetch_cap), -7));
  const int code = kc::select_top(
      logits.data<float>(), B, H_kv, used, options.alpha, options.max_num_kv,
      options.fetch_rule == FetchRule::Batch ? kc::FetchMean::Batch : kc::FetchMean::Sequence,
      counts.data<int32_t>(), valid.data<int32_t>(), fetch.data<int32_t>(), take.data<int32_t>(),
      static_cast<double*>(mean.raw()), tokens.data<int32_t>(), fetch_cap, nullptr);
  EXPECT_EQ(code, 0) << kc::error_string(code);
  DeviceSelection sel;
  sel.counts = download<int32_t>(counts, static_cast<size_t>(rows));
  sel.valid = download<int32_t>(valid, static_cast<size_t>(rows));
  sel.fetch = download<int32_t>(fetch, static_cast<size_t>(B));
  sel.take = download<int32_t>(take, static_cast<size_t>(B));
  sel.tokens = download<int32_t>(tokens, static_cast<size_t>(rows * fetch_cap));
  sel.mean_count = download<double>(mean, 1)[0];
  sel.fetch_cap = fetch_cap;
  return sel;
}

// The device's selection equals PartialLayer::select's on the same logits: counts and valid
// entries per row (recomputed here by select's definitions), n', take, the mean count and the
// selected positions of every row; the rest of each device row is 0.
void expect_same_selection(const DeviceSelection& device, const PartialLayer::Selection& cpu,
                           const std::vector<float>& logits, int64_t B, int64_t H_kv, int64_t used,
                           const SpeculationOptions& options) {
  const int64_t rows = B * H_kv;
  std::vector<int64_t> counts(static_cast<size_t>(rows)), valid(static_cast<size_t>(rows));
  for (int64_t row = 0; row < rows; ++row) {
    const float* s = logits.data() + row * used;
    float top = -INFINITY;
    for (int64_t p = 0; p < used; ++p) {
      if (s[p] == -INFINITY) continue;
      top = std::max(top, s[p]);
      ++valid[static_cast<size_t>(row)];
    }
    for (int64_t p = 0; p < used; ++p) {
      counts[static_cast<size_t>(row)] += s[p] > top - options.alpha ? 1 : 0;
    }
    EXPECT_EQ(device.counts[static_cast<size_t>(row)], counts[static_cast<size_t>(row)])
        << "row " << row;
    EXPECT_EQ(device.valid[static_cast<size_t>(row)], valid[static_cast<size_t>(row)])
        << "row " << row;
  }
  EXPECT_EQ(device.mean_count, cpu.mean_count);
  const auto n_prime = [&](int64_t first, int64_t n) {
    const int64_t total =
        std::accumulate(counts.begin() + first, counts.begin() + first + n, int64_t{0});
    const double mean = static_cast<double>(total) / static_cast<double>(n);
    return std::clamp<int64_t>(static_cast<int64_t>(std::floor(mean)), 1, options.max_num_kv);
  };
  ASSERT_EQ(cpu.take.size(), static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t wanted =
        options.fetch_rule == FetchRule::Batch ? n_prime(0, rows) : n_prime(b * H_kv, H_kv);
    EXPECT_EQ(device.fetch[static_cast<size_t>(b)], wanted) << "n' of sequence " << b;
    EXPECT_EQ(device.take[static_cast<size_t>(b)], cpu.take[static_cast<size_t>(b)])
        << "take of sequence " << b;
  }
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t take = cpu.take[static_cast<size_t>(row / H_kv)];
    const int32_t* expected = cpu.tokens.data() + row * cpu.fetch;
    const int32_t* got = device.tokens.data() + row * device.fetch_cap;
    EXPECT_EQ(std::vector<int32_t>(got, got + take),
              std::vector<int32_t>(expected, expected + take))
        << "row " << row << " (sequence " << row / H_kv << ", KV head " << row % H_kv << ")";
    for (int64_t i = take; i < device.fetch_cap; ++i) {
      ASSERT_EQ(got[i], 0) << "row " << row << " slot " << i << " past take";
    }
  }
}

// Calls check(options) for each alpha and cap of n' given and both fetch rules, under a trace that
// names them (after `what`).
template <typename Check>
void for_each_selection_option(const std::vector<double>& alphas, const std::vector<int64_t>& caps,
                               const std::string& what, const Check& check) {
  for (double alpha : alphas) {
    for (FetchRule rule : {FetchRule::Sequence, FetchRule::Batch}) {
      for (int64_t cap : caps) {
        SpeculationOptions options;
        options.alpha = alpha;
        options.fetch_rule = rule;
        options.max_num_kv = cap;
        SCOPED_TRACE(what + "alpha " + std::to_string(alpha) + ", rule " +
                     (rule == FetchRule::Batch ? "batch" : "sequence") + ", cap " +
                     std::to_string(cap));
        check(options);
      }
    }
  }
}

// ---- a layer built on the CPU, speculated on both ----

struct LayerCase {
  std::string name;
  bool rotary = false;
  bool skewed = false;
  DType key_dtype = DType::F32;
  int64_t heads = 4, kv_heads = 4;
  bool padded = false;  // left padding
  bool capped = false;  // a capped pool: position_tokens with empty (-1) positions
  bool shared = false;  // shared prefixes
  bool ties = false;    // keys repeating every 5 tokens: equal logits
};
std::ostream& operator<<(std::ostream& out, const LayerCase& c) {
  return out << c.name;
}

class SpeculationCuda : public ::testing::TestWithParam<LayerCase> {
 protected:
  void SetUp() override { INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE(); }
};

// Everything a layer's device speculation reads, uploaded from a PartialLayer.
struct DeviceLayer {
  Tensor head_rows, needed, columns, skew, inv_freq, keys;
  int64_t query_width = 0;
  bool has_skew = false, has_rotation = false;
};

DeviceLayer upload_layer(const PartialLayer& layer, int64_t H, int64_t H_kv) {
  DeviceLayer dev;
  const int64_t group = H / H_kv;
  std::vector<int32_t> head_rows, needed;
  for (int64_t v : layer.head_rows()) head_rows.push_back(static_cast<int32_t>(v));
  for (int64_t h = 0; h < H; ++h) {
    const std::vector<int32_t>& dims = layer.needed_rows(h / group);
    needed.insert(needed.end(), dims.begin(), dims.end());
  }
  EXPECT_EQ(static_cast<int64_t>(needed.size()), layer.head_rows().back());
  dev.query_width = layer.head_rows().back();
  dev.head_rows = device_ints(head_rows);
  dev.needed = device_ints(needed);
  dev.columns = device_ints(layer.columns());
  for (const auto& [name, tensor] : layer.state()) {
    if (name == "partial_skew") {
      dev.skew = tensor.to(Device::Cuda);
      dev.has_skew = true;
    }
    if (name == "partial_inv_freq") {
      dev.inv_freq = tensor.to(Device::Cuda);
      dev.has_rotation = true;
    }
  }
  dev.keys = Tensor::empty(
      {static_cast<int64_t>(layer.key_bytes().size() / dtype_size(layer.key_dtype()))},
      layer.key_dtype(), Device::Cuda);
  device_copy(dev.keys.raw(), Device::Cuda, layer.key_bytes().data(), Device::Cpu,
              layer.key_bytes().size());
  return dev;
}

kc::Element element_of(DType dtype) {
  return dtype == DType::F16 ? kc::Element::F16 : kc::Element::F32;
}

TEST_P(SpeculationCuda, LogitsSelectionAndAppendMatchTheCpu) {
  const LayerCase c = GetParam();
  std::mt19937_64 rng(1234 + std::hash<std::string>{}(c.name) % 1000);
  const int64_t H = c.heads, H_kv = c.kv_heads, d = 32, D = 48, KV = H_kv * d;
  const int64_t r = partial_columns(0.3, d);
  const int64_t B = c.shared ? 4 : 3;
  const SharedPrefixes shared = c.shared ? SharedPrefixes({0, 1, 0, -1}, {8, 4}) : SharedPrefixes();
  // The prompt the layer is built from: every sequence's, or the groups' leaders' prefixes.
  const int64_t built_batch = c.shared ? shared.num_groups() : B;
  const int64_t n = c.shared ? shared.rows() : 40;
  const int64_t capacity = c.capped ? 32 : 64;
  std::vector<int32_t> prompt_first_valid(static_cast<size_t>(built_batch), 0);
  if (c.shared) {
    prompt_first_valid = shared.leader_first_valid();
  } else if (c.padded) {
    prompt_first_valid = {0, 5, 11};
  }

  const Tensor wq = normal_tensor({H * d, D}, rng, 0.2f), bq = normal_tensor({H * d}, rng);
  const Tensor x_prompt = normal_tensor({built_batch * n, D}, rng);
  Tensor queries = Tensor::empty({built_batch * n, H * d}, DType::F32);
  ops::linear(x_prompt, wq, bq, queries);
  Tensor keys = normal_tensor({built_batch * n, KV}, rng);
  Tensor inv_freq, skew;
  if (c.rotary) {
    RopeConfig rope;
    rope.theta = 10000.0;
    inv_freq = Tensor::from_floats({d / 2}, rope_inv_freq(rope, d));
    std::vector<int32_t> positions(static_cast<size_t>(built_batch * n));
    for (size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<int32_t>(i % n);
    ops::rope(queries, positions, inv_freq);
    ops::rope(keys, positions, inv_freq);
  }
  if (c.ties) {  // token t's key is token t % 5's (rotated)
    for (int64_t i = 0; i < built_batch * n; ++i) {
      const int64_t t = i % n, b = i / n;
      std::memcpy(keys.data<float>() + i * KV, keys.data<float>() + (b * n + t % 5) * KV,
                  static_cast<size_t>(KV) * sizeof(float));
    }
  }
  if (c.skewed) skew = normal_tensor({H_kv, d, d}, rng, 1.0f / std::sqrt(static_cast<float>(d)));
  ops::scale_inplace(queries, 1.0f / std::sqrt(static_cast<float>(d)));

  // A capped pool: each (b, g) holds capacity - 4 of the prompt's tokens at shuffled positions,
  // its other positions empty.
  std::vector<int32_t> position_tokens;
  if (c.capped) {
    for (int64_t row = 0; row < B * H_kv; ++row) {
      std::vector<int32_t> tokens(static_cast<size_t>(n));
      std::iota(tokens.begin(), tokens.end(), 0);
      std::shuffle(tokens.begin(), tokens.end(), rng);
      tokens.resize(static_cast<size_t>(capacity));
      std::fill(tokens.end() - 4, tokens.end(), -1);
      std::shuffle(tokens.begin(), tokens.end(), rng);
      position_tokens.insert(position_tokens.end(), tokens.begin(), tokens.end());
    }
  }

  PartialLayer layer;
  layer.build({queries, keys, wq, bq, inv_freq, skew}, prompt_first_valid, H, H_kv, capacity, r,
              PartialIndexRule::QK, c.capped ? &position_tokens : nullptr, c.key_dtype);
  int64_t used = c.capped ? capacity : n;
  std::vector<int32_t> first_valid = prompt_first_valid;
  if (c.shared) {
    // Every sequence's own tokens after the prefixes: 20 appended; sequence 2's first two are
    // padding.
    layer.share_prefixes(shared, /*from_leaders=*/true);
    for (int64_t i = 0; i < 20; ++i) {
      Tensor own = normal_tensor({B, KV}, rng);
      if (c.rotary) {
        const std::vector<int32_t> at(static_cast<size_t>(B), static_cast<int32_t>(n + i));
        ops::rope(own, at, inv_freq);
      }
      layer.append(own, n + i);
    }
    used = n + 20;
    first_valid = {static_cast<int32_t>(n), static_cast<int32_t>(n), static_cast<int32_t>(n + 2),
                   static_cast<int32_t>(n)};
  }
  ASSERT_EQ(static_cast<int64_t>(first_valid.size()), B);
  std::vector<int32_t> prefix_begin(static_cast<size_t>(B), 0),
      prefix_source(static_cast<size_t>(B), 0);
  if (c.shared) {
    prefix_begin = shared.begin();
    prefix_source = shared.source();
  }
  const int64_t prefix_end = shared.rows();

  DeviceLayer dev = upload_layer(layer, H, H_kv);
  // The engine's own device twin of the layer (speculate/device_partial.h), uploaded before the
  // host layer's append below and appended to alongside it.
  DevicePartialLayer twin;
  twin.upload(layer);
  Tensor d_first_valid = device_ints(first_valid);
  Tensor d_prefix_begin = device_ints(prefix_begin), d_prefix_source = device_ints(prefix_source);
  Tensor d_position_tokens = device_ints(position_tokens);

  // The decode token: its attention input x and rotary position.
  const Tensor x = normal_tensor({B, D}, rng);
  std::vector<int32_t> rope_positions(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    rope_positions[static_cast<size_t>(b)] = static_cast<int32_t>(used - first_valid[b] + 3 * b);
  }
  Tensor d_rope_positions = device_ints(rope_positions);
  // The partial query rows as the caller computes them (here on the CPU, as estimate_logits).
  Tensor weight, bias;
  for (const auto& [name, tensor] : layer.state()) {
    if (name == "partial_weight") weight = tensor;
    if (name == "partial_bias") bias = tensor;
  }
  ASSERT_TRUE(weight.defined() && bias.defined());

  // Speculates on both, compares the logits, and every selection option on them.
  const auto speculate_and_compare = [&](int64_t positions_used, const char* when) {
    SCOPED_TRACE(when);
    const std::vector<float> cpu_logits = layer.estimate_logits(
        x, rope_positions, positions_used, first_valid, c.capped ? &position_tokens : nullptr);
    Tensor rows = Tensor::empty({B, dev.query_width}, DType::F32);
    ops::linear(x, weight, bias, rows);
    const Tensor d_rows = rows.to(Device::Cuda);
    Tensor d_logits = Tensor::empty({B * H_kv * positions_used}, DType::F32, Device::Cuda);
    fill_nan(d_logits);
    ASSERT_KERNEL_OK(kc::speculate_logits(
        d_rows.data<float>(), dev.query_width, dev.head_rows.data<int32_t>(),
        dev.needed.data<int32_t>(), dev.columns.data<int32_t>(),
        dev.has_skew ? dev.skew.data<float>() : nullptr,
        dev.has_rotation ? dev.inv_freq.data<float>() : nullptr, d_rope_positions.data<int32_t>(),
        dev.keys.raw(), element_of(c.key_dtype),
        c.capped ? d_position_tokens.data<int32_t>() : nullptr, d_first_valid.data<int32_t>(),
        c.shared ? d_prefix_begin.data<int32_t>() : nullptr,
        c.shared ? d_prefix_source.data<int32_t>() : nullptr, prefix_end, d_logits.data<float>(), B,
        H, H_kv, d, r, capacity, positions_used, nullptr));
    const std::vector<float> device_logits =
        download<float>(d_logits, static_cast<size_t>(B * H_kv * positions_used));
    const int64_t differences = expect_logits_close(device_logits, cpu_logits);
    RecordProperty(std::string("logit_bit_differences_") + when, std::to_string(differences));

    // Selection, on the CPU's logits uploaded (select_top alone) and on the device's own (the
    // whole chain): alpha 1, 4 and 1e30 (everything), both fetch rules, a cap of n' that
    // binds and one that does not.
    const Tensor d_cpu_logits = device_floats(cpu_logits);
    for_each_selection_option({1.0, 4.0, 1e30}, {5, capacity}, "", [&](const auto& options) {
      const PartialLayer::Selection cpu = layer.select(cpu_logits, positions_used, options);
      const int64_t fetch_cap = std::min(options.max_num_kv, positions_used) + 3;
      expect_same_selection(
          select_on_device(d_cpu_logits, B, H_kv, positions_used, options, fetch_cap), cpu,
          cpu_logits, B, H_kv, positions_used, options);
      expect_same_selection(select_on_device(d_logits, B, H_kv, positions_used, options, fetch_cap),
                            cpu, cpu_logits, B, H_kv, positions_used, options);
    });
  };
  // Through the twin, from the attention input on the device: the same tokens per (sequence, KV
  // head) as PartialLayer::speculate, for alpha 4 and alpha 1e30, both fetch rules, a cap of n'
  // that binds and one that does not.
  const Tensor d_x = x.to(Device::Cuda);
  const auto twin_selects_as_the_cpu = [&](int64_t positions_used, const char* when) {
    const std::string what = std::string("device twin, ") + when + ", ";
    for_each_selection_option({4.0, 1e30}, {5, capacity}, what, [&](const auto& options) {
      const PartialLayer::Selection cpu =
          layer.speculate(x, rope_positions, positions_used, first_valid, options,
                          c.capped ? &position_tokens : nullptr);
      ops::SelectionTensors out =
          device_selection(B, H_kv, std::min(options.max_num_kv, capacity));
      Tensor logits = Tensor::empty({B, H_kv, capacity}, DType::F32, Device::Cuda);
      twin.speculate(d_x, rope_positions, positions_used, first_valid,
                     c.capped ? d_position_tokens.reshape({B, H_kv, capacity}) : Tensor{}, options,
                     logits, out);
      const std::vector<int32_t> summary = download<int32_t>(out.summary, 2 + B);
      const std::vector<int32_t> tokens =
          download<int32_t>(out.tokens, static_cast<size_t>(out.tokens.numel()));
      double mean = 0.0;
      std::memcpy(&mean, summary.data(), sizeof mean);
      EXPECT_EQ(mean, cpu.mean_count);
      for (int64_t row = 0; row < B * H_kv; ++row) {
        const int64_t b = row / H_kv, take = cpu.take[static_cast<size_t>(b)];
        ASSERT_EQ(summary[static_cast<size_t>(2 + b)], take) << "take of sequence " << b;
        const int32_t* got = tokens.data() + row * out.tokens.dim(2);
        const int32_t* expected = cpu.tokens.data() + row * cpu.fetch;
        EXPECT_EQ(std::vector<int32_t>(got, got + take),
                  std::vector<int32_t>(expected, expected + take))
            << "sequence " << b << ", KV head " << row % H_kv;
      }
    });
  };
  speculate_and_compare(used, "built");
  twin_selects_as_the_cpu(used, "built");

  // The next token's partial keys: at the next position, or in a capped pool at a victim position
  // of each (b, g) (the new token replaces what was there), or with shared prefixes at positions
  // per (b, g), one in a prefix.
  Tensor new_keys = normal_tensor({B, KV}, rng);
  if (c.rotary) {
    const std::vector<int32_t> at(static_cast<size_t>(B), static_cast<int32_t>(used));
    ops::rope(new_keys, at, inv_freq);
  }
  std::vector<int32_t> victims;
  if (c.capped) {
    std::uniform_int_distribution<int32_t> position(0, static_cast<int32_t>(capacity - 1));
    for (int64_t row = 0; row < B * H_kv; ++row) {
      const int32_t p = position(rng);
      victims.push_back(p);
      position_tokens[static_cast<size_t>(row * capacity + p)] = static_cast<int32_t>(n);
    }
    d_position_tokens = device_ints(position_tokens);
  } else if (c.shared) {
    // Sequence 2 writes positions 3 + g of its shared prefix: the leader's (sequence 0's) keys,
    // as on the CPU; the others the next position.
    for (int64_t row = 0; row < B * H_kv; ++row) {
      victims.push_back(static_cast<int32_t>(row / H_kv == 2 ? 3 + row % H_kv : used));
    }
  }
  const bool listed = !victims.empty();
  layer.append(new_keys, used, listed ? &victims : nullptr);
  const Tensor d_new_keys = new_keys.to(Device::Cuda);
  const Tensor d_victims = device_ints(victims);
  ASSERT_KERNEL_OK(kc::append_partial_keys(
      d_new_keys.data<float>(), dev.columns.data<int32_t>(),
      dev.has_skew ? dev.skew.data<float>() : nullptr, dev.keys.raw(), element_of(c.key_dtype), B,
      H_kv, d, r, capacity, used, listed ? d_victims.data<int32_t>() : nullptr,
      c.shared ? d_prefix_begin.data<int32_t>() : nullptr,
      c.shared ? d_prefix_source.data<int32_t>() : nullptr, prefix_end, nullptr));
  twin.append(d_new_keys, used, listed ? d_victims.reshape({B, H_kv}) : Tensor{});
  // The whole cache: the new rows within rounding (a skew's sums may contract differently), the
  // rest untouched.
  {
    const std::vector<char>& cpu_bytes = layer.key_bytes();
    std::vector<char> device_bytes(cpu_bytes.size());
    device_copy(device_bytes.data(), Device::Cpu, dev.keys.raw(), Device::Cuda,
                device_bytes.size());
    const size_t count = cpu_bytes.size() / dtype_size(c.key_dtype);
    std::vector<float> cpu_values(count), device_values(count);
    convert_to_f32(cpu_bytes.data(), c.key_dtype, cpu_values.data(), count);
    convert_to_f32(device_bytes.data(), c.key_dtype, device_values.data(), count);
    const double tolerance = c.key_dtype == DType::F16 ? 1e-3 : 1e-5;
    int64_t failures = 0;
    for (size_t i = 0; i < count; ++i) {
      const double bound = tolerance * std::max(1.0, std::fabs(static_cast<double>(cpu_values[i])));
      if (!(std::fabs(static_cast<double>(device_values[i]) - cpu_values[i]) <= bound) &&
          failures++ < 5) {
        ADD_FAILURE() << "partial key element " << i << ": device " << device_values[i] << ", cpu "
                      << cpu_values[i];
      }
    }
    EXPECT_EQ(failures, 0);
    if (!c.skewed) {
      EXPECT_EQ(device_bytes, cpu_bytes) << "a copy and a rounding: bit-identical";
    }
  }
  // And the speculation over the cache with the new token in it.
  speculate_and_compare(c.capped ? capacity : used + 1, "appended");
  twin_selects_as_the_cpu(c.capped ? capacity : used + 1, "appended");
}

std::vector<LayerCase> layer_cases() {
  std::vector<LayerCase> cases;
  const auto add = [&](LayerCase c) { cases.push_back(c); };
  add({.name = "OptLike"});
  add({.name = "OptLikePadded", .padded = true});
  add({.name = "LlamaLike", .rotary = true, .padded = true});
  add({.name = "RotarySkewed", .rotary = true, .skewed = true, .padded = true});
  add({.name = "OptLikeF16", .key_dtype = DType::F16, .padded = true});
  add({.name = "RotarySkewedF16", .rotary = true, .skewed = true, .key_dtype = DType::F16});
  add({.name = "GroupedQuery", .rotary = true, .heads = 8, .kv_heads = 4, .padded = true});
  add({.name = "GroupedQuerySkewedF16",
       .rotary = true,
       .skewed = true,
       .key_dtype = DType::F16,
       .heads = 8,
       .kv_heads = 4});
  add({.name = "CappedPool",
       .rotary = true,
       .heads = 8,
       .kv_heads = 4,
       .padded = true,
       .capped = true});
  add({.name = "CappedPoolF16", .key_dtype = DType::F16, .padded = true, .capped = true});
  add({.name = "SharedPrefix", .rotary = true, .heads = 8, .kv_heads = 4, .shared = true});
  add({.name = "SharedPrefixSkewedF16",
       .rotary = true,
       .skewed = true,
       .key_dtype = DType::F16,
       .shared = true});
  add({.name = "Ties", .padded = true, .ties = true});
  add({.name = "TiesF16Grouped",
       .rotary = true,
       .key_dtype = DType::F16,
       .heads = 8,
       .kv_heads = 4,
       .padded = true,
       .ties = true});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Layers, SpeculationCuda, ::testing::ValuesIn(layer_cases()),
                         [](const auto& param_info) { return param_info.param.name; });

// ---- the prompt's partial state built on the device (kernels/cuda/partial_build.h) ----
//
// The same prompt, in one pass or two (a chunked prefill: the second pass reads the first's keys
// from a pool of fp16 blocks in mapped pinned memory, as InfinigenKv's does), is accumulated by a
// PartialLayer from host tensors (the CPU's reference) and by one from device tensors (the
// column sums on the device); both choose columns, the device one gathering the partial query
// weights on the device, and a DevicePartialLayer writes the prompt's partial keys from the
// device layer's state. Compared: the column sums, bit for bit unskewed (each is one thread's
// double sum in the CPU's order), within 1e-6 relative skewed (the skewed values are fp32 sums
// over d, which the two compilers contract into multiply-adds differently: an ulp or so), then the
// chosen columns exactly: the inputs are random normals, whose column sums are far apart next to
// that rounding (a near-tie, which would let the two choose differently, is not what this test is
// about); the gathered weight rows bit for bit; the partial keys at every position that holds a
// token within 1e-5 (fp32) or an fp16 ulp, exactly where there is no skew.

struct BuildCase {
  std::string name;
  bool rotary = false;
  bool skewed = false;
  DType key_dtype = DType::F32;
  DType weight_dtype = DType::F32;
  int64_t heads = 4, kv_heads = 4;
  bool padded = false;
  bool two_passes = false;
  PartialIndexRule rule = PartialIndexRule::QK;
};
std::ostream& operator<<(std::ostream& out, const BuildCase& c) {
  return out << c.name;
}

class PartialBuildCuda : public ::testing::TestWithParam<BuildCase> {
 protected:
  void SetUp() override { INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE(); }
};

// Rows [first, first + count) of each of the B sequences of `t` (B * n, width), fp32 on the CPU.
Tensor sequence_rows(const Tensor& t, int64_t B, int64_t n, int64_t first, int64_t count) {
  const int64_t width = t.dim(1);
  Tensor out = Tensor::empty({B * count, width}, DType::F32);
  for (int64_t b = 0; b < B; ++b) {
    std::memcpy(out.data<float>() + b * count * width, t.data<float>() + (b * n + first) * width,
                static_cast<size_t>(count * width) * sizeof(float));
  }
  return out;
}

TEST_P(PartialBuildCuda, ColumnScoresWeightsAndPartialKeysMatchTheCpu) {
  const BuildCase c = GetParam();
  std::mt19937_64 rng(4321 + std::hash<std::string>{}(c.name) % 1000);
  const int64_t H = c.heads, H_kv = c.kv_heads, d = 32, D = 48, KV = H_kv * d, B = 3, n = 40;
  const int64_t r = partial_columns(0.3, d), capacity = 64;
  const std::vector<int32_t> first_valid =
      c.padded ? std::vector<int32_t>{0, 5, 29} : std::vector<int32_t>{0, 0, 0};
  const Tensor wq = normal_tensor({H * d, D}, rng, 0.2f).to_dtype(c.weight_dtype);
  const Tensor bq = normal_tensor({H * d}, rng);
  Tensor queries = normal_tensor({B * n, H * d}, rng);
  const Tensor keys = normal_tensor({B * n, KV}, rng);
  Tensor inv_freq, skew;
  if (c.rotary) {
    RopeConfig rope;
    rope.theta = 10000.0;
    inv_freq = Tensor::from_floats({d / 2}, rope_inv_freq(rope, d));
  }
  if (c.skewed) skew = normal_tensor({H_kv, d, d}, rng, 1.0f / std::sqrt(static_cast<float>(d)));
  const Tensor wq_dev = wq.to(Device::Cuda), bq_dev = bq.to(Device::Cuda);
  const Tensor queries_dev = queries.to(Device::Cuda), keys_dev = keys.to(Device::Cuda);
  const Tensor freq_dev = inv_freq.defined() ? inv_freq.to(Device::Cuda) : Tensor();
  const Tensor skew_dev = skew.defined() ? skew.to(Device::Cuda) : Tensor();

  // The passes: [0, n) at once, or [0, 24) then [24, n).
  const int64_t split = c.two_passes ? 24 : n;
  std::vector<std::pair<int64_t, int64_t>> passes = {{0, split}};
  if (c.two_passes) passes.emplace_back(split, n - split);
  const std::vector<int64_t> sequences = {0, 1, 2};
  PartialLayer cpu, gpu;
  cpu.begin_prompt({queries, keys, wq, bq, inv_freq, skew}, B, H, H_kv, r, c.rule, c.key_dtype);
  gpu.begin_prompt({queries_dev, keys_dev, wq_dev, bq_dev, freq_dev, skew_dev}, B, H, H_kv, r,
                   c.rule, c.key_dtype);
  for (const auto& [first, count] : passes) {
    const Tensor q = sequence_rows(queries, B, n, first, count);
    const Tensor k = sequence_rows(keys, B, n, first, count);
    cpu.accumulate(q, k, sequences, first_valid, first);
    gpu.accumulate(q.to(Device::Cuda), k.to(Device::Cuda), sequences, first_valid, first);
  }
  const std::vector<double> cpu_scores = cpu.column_scores(), gpu_scores = gpu.column_scores();
  ASSERT_EQ(gpu_scores.size(), static_cast<size_t>(B * KV));
  ASSERT_EQ(cpu_scores.size(), gpu_scores.size());
  int64_t score_bits = 0;
  for (size_t i = 0; i < cpu_scores.size(); ++i) {
    ASSERT_NEAR(gpu_scores[i], cpu_scores[i], 1e-6 * std::fabs(cpu_scores[i]) + 1e-12)
        << "sequence " << i / KV << ", column " << i % KV;
    score_bits += gpu_scores[i] != cpu_scores[i] ? 1 : 0;
  }
  if (!c.skewed) {
    EXPECT_EQ(score_bits, 0) << "unskewed sums are the same additions";
  }

  cpu.choose_columns(wq, bq, capacity);
  gpu.choose_columns(wq_dev, bq_dev, capacity, /*device_keys=*/true);
  ASSERT_EQ(gpu.columns(), cpu.columns());
  ASSERT_EQ(gpu.weight().device(), Device::Cuda) << "W_q's rows gathered where W_q is";
  const Tensor gpu_weight = gpu.weight().to(Device::Cpu);
  ASSERT_EQ(gpu_weight.nbytes(), cpu.weight().nbytes());
  EXPECT_EQ(std::memcmp(gpu_weight.raw(), cpu.weight().raw(), gpu_weight.nbytes()), 0);
  EXPECT_EQ(std::memcmp(gpu.bias().raw(), cpu.bias().raw(), cpu.bias().nbytes()), 0);
  EXPECT_TRUE(gpu.key_bytes().empty()) << "the device keeps the partial key cache";

  // The CPU's partial keys, as InfinigenKv::write_prompt_partial_keys writes them: the earlier
  // pass's keys through the pool's dtype (fp16), the last pass's as they are.
  const int64_t past = c.two_passes ? split : 0, block_tokens = 8;
  std::vector<float> row(static_cast<size_t>(d));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < H_kv; ++g) {
      for (int64_t t = first_valid[static_cast<size_t>(b)]; t < n; ++t) {
        const float* key = keys.data<float>() + (b * n + t) * KV + g * d;
        if (t < past) {
          std::vector<f16> half(static_cast<size_t>(d));
          convert_from_f32(key, half.data(), DType::F16, half.size());
          convert_to_f32(half.data(), DType::F16, row.data(), row.size());
          key = row.data();
        }
        cpu.write_partial_key(b, g, t, key);
      }
    }
  }
  // The device's: the earlier pass in fp16 pool blocks (H_kv, block_tokens, d) in mapped pinned
  // memory, their addresses in a (B, blocks) table there too.
  ops::PoolKeyBlocks pool;
  Tensor blocks, table;
  if (past > 0) {
    const int64_t per_sequence = (past + block_tokens - 1) / block_tokens;
    const int64_t block_elems = H_kv * block_tokens * d;
    blocks =
        Tensor::pinned({B * per_sequence * block_elems}, DType::F16, "test pool", Device::Cuda);
    table = Tensor::pinned({B * per_sequence}, DType::I64, "test block table", Device::Cuda);
    auto* block_data = static_cast<f16*>(blocks.raw());
    auto** addresses = static_cast<const void**>(table.raw());
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < per_sequence; ++i) {
        addresses[b * per_sequence + i] = block_data + (b * per_sequence + i) * block_elems;
      }
      for (int64_t g = 0; g < H_kv; ++g) {
        for (int64_t t = 0; t < past; ++t) {
          f16* dst = block_data + (b * per_sequence + t / block_tokens) * block_elems +
                     (g * block_tokens + t % block_tokens) * d;
          convert_from_f32(keys.data<float>() + (b * n + t) * KV + g * d, dst, DType::F16,
                           static_cast<size_t>(d));
        }
      }
    }
    pool = {static_cast<const void* const*>(table.raw()), per_sequence, block_tokens, DType::F16};
  }
  DevicePartialLayer device;
  device.adopt(gpu);
  device.write_prompt_keys(sequence_rows(keys, B, n, past, n - past).to(Device::Cuda), past, pool,
                           first_valid);
  const std::vector<char> got = download<char>(device.keys(), device.keys().nbytes());
  ASSERT_EQ(got.size(), cpu.key_bytes().size());
  const size_t key_size = dtype_size(c.key_dtype);
  std::vector<float> want_row(static_cast<size_t>(r)), got_row(static_cast<size_t>(r));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < H_kv; ++g) {
      for (int64_t t = first_valid[static_cast<size_t>(b)]; t < n; ++t) {
        const size_t at = static_cast<size_t>(((b * H_kv + g) * capacity + t) * r) * key_size;
        convert_to_f32(cpu.key_bytes().data() + at, c.key_dtype, want_row.data(), want_row.size());
        convert_to_f32(got.data() + at, c.key_dtype, got_row.data(), got_row.size());
        for (int64_t j = 0; j < r; ++j) {
          const float want = want_row[static_cast<size_t>(j)];
          const float tolerance =
              !c.skewed ? 0.0f
                        : (c.key_dtype == DType::F16 ? 1e-3f : 1e-5f) * (1.0f + std::fabs(want));
          ASSERT_NEAR(got_row[static_cast<size_t>(j)], want, tolerance)
              << "sequence " << b << ", KV head " << g << ", token " << t << ", column " << j;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Prompts, PartialBuildCuda,
    ::testing::Values(BuildCase{"opt_like", false, false},
                      BuildCase{"opt_like_padded_two_passes_f16_keys", false, false, DType::F16,
                                DType::F16, 4, 4, true, true},
                      BuildCase{"opt_like_q_rule_padded", false, false, DType::F32, DType::F32, 4,
                                4, true, false, PartialIndexRule::Q},
                      BuildCase{"llama_like_grouped_skewed", true, true, DType::F32, DType::BF16, 8,
                                2, true, false},
                      BuildCase{"llama_like_grouped_skewed_two_passes_f16_keys", true, true,
                                DType::F16, DType::F16, 8, 2, true, true},
                      BuildCase{"rotary_unskewed_two_passes", true, false, DType::F32, DType::F32,
                                4, 2, false, true}),
    [](const auto& param_info) { return param_info.param.name; });

// ---- select_top alone, on made-up logits ----

class SpeculationSelectTopCuda : public ::testing::Test {
 protected:
  void SetUp() override { INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE(); }
};

// A layer whose select() runs on logits of B x H_kv rows (select reads only the shapes).
PartialLayer shapes_only(int64_t B, int64_t H_kv, int64_t capacity) {
  PartialLayer layer;
  layer.restore_shapes(B, H_kv, H_kv, 8, capacity, 2, false, 8, DType::F32, DType::F32);
  return layer;
}

void expect_select_matches(const std::vector<float>& logits, int64_t B, int64_t H_kv, int64_t used,
                           const std::vector<double>& alphas, const std::vector<int64_t>& caps) {
  const PartialLayer layer = shapes_only(B, H_kv, used);
  const Tensor d_logits = device_floats(logits);
  for_each_selection_option(alphas, caps, "", [&](const auto& options) {
    const PartialLayer::Selection cpu = layer.select(logits, used, options);
    expect_same_selection(
        select_on_device(d_logits, B, H_kv, used, options, std::min(options.max_num_kv, used)),
        cpu, logits, B, H_kv, used, options);
  });
}

// Few distinct values (many ties, -0 beside +0), -inf entries, a sequence whose rows hold no
// token at all (take 0) and one with fewer valid entries than n' in one head.
TEST_F(SpeculationSelectTopCuda, TiesNegativeZeroAndEmptyRowsMatchTheCpu) {
  const int64_t B = 4, H_kv = 3, used = 1000;
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int> pick(0, 9);
  std::vector<float> logits(static_cast<size_t>(B * H_kv * used));
  const float values[] = {-INFINITY, -INFINITY, 0.0f, -0.0f, 1.5f, 1.5f, 2.0f, -3.0f, 7.25f, 7.25f};
  for (float& v : logits) v = values[pick(rng)];
  // Sequence 1: nothing valid. Sequence 2, head 1: only 3 valid entries.
  std::fill(logits.begin() + 1 * H_kv * used, logits.begin() + 2 * H_kv * used, -INFINITY);
  float* sparse = logits.data() + (2 * H_kv + 1) * used;
  std::fill(sparse, sparse + used, -INFINITY);
  sparse[10] = 5.0f;
  sparse[500] = -0.0f;
  sparse[999] = 0.0f;
  expect_select_matches(logits, B, H_kv, used, {0.0, 1.0, 4.0, 1e30}, {1, 7, 300, used});
}

// A long row, over several radix digits and chunks: every position's own value but for
// stretches of equal values, at 131072 positions.
TEST_F(SpeculationSelectTopCuda, LongRowsMatchTheCpu) {
  const int64_t B = 2, H_kv = 2, used = 131072;
  std::mt19937_64 rng(11);
  std::vector<float> logits = normal_values(static_cast<size_t>(B * H_kv * used), rng, 3.0f);
  for (int64_t i = 0; i < B * H_kv * used; i += 97) {
    logits[static_cast<size_t>(i)] = 2.5f;  // a value shared by about 1350 positions per row
  }
  for (int64_t p = 0; p < 4096; ++p) logits[static_cast<size_t>(p)] = -INFINITY;  // padding
  expect_select_matches(logits, B, H_kv, used, {4.0, 1e30}, {1, 2000, used});
}

// The alpha count compares s > max - alpha in double, as the CPU: near 2^25 (float steps of 2
// and 4) max - 2.9 is 33554429.1, which counts 33554430, where the same subtraction in float
// (33554430) would not; alpha 0 counts nothing (n' is then 1).
TEST_F(SpeculationSelectTopCuda, TheAlphaThresholdIsTakenInDouble) {
  const int64_t B = 2, H_kv = 1, used = 4;
  const std::vector<float> logits = {33554432.0f, 33554430.0f, 33554428.0f, -INFINITY,
                                     -1e-30f,     -INFINITY,   1e-30f,      0.0f};
  ASSERT_EQ(33554432.0f - 2.9f, 33554430.0f);
  expect_select_matches(logits, B, H_kv, used, {2.9, 0.0, 1e-30, 1e30}, {1, 2, used});
  SpeculationOptions options;
  options.alpha = 2.9;
  options.max_num_kv = used;
  const DeviceSelection device =
      select_on_device(device_floats(logits), B, H_kv, used, options, used);
  EXPECT_EQ(device.counts[0], 2);
  EXPECT_EQ(device.counts[1], 3);
}

// The kernels refuse what they cannot do, before launching anything.
TEST_F(SpeculationSelectTopCuda, BadSizesAreRefused) {
  Tensor logits = Tensor::zeros({16}, DType::F32, Device::Cuda);
  Tensor ints = Tensor::zeros({16}, DType::I32, Device::Cuda);
  Tensor mean = Tensor::zeros({1}, DType::I64, Device::Cuda);
  int32_t* i = ints.data<int32_t>();
  EXPECT_NE(kc::select_top(logits.data<float>(), 1, 1, 16, 4.0, 8, kc::FetchMean::Sequence, i, i, i,
                           i, static_cast<double*>(mean.raw()), i, 4, nullptr),
            0)
      << "fetch_cap below the cap";
  EXPECT_NE(kc::select_top(logits.data<float>(), 1, 1, 16, 4.0, 0, kc::FetchMean::Sequence, i, i, i,
                           i, static_cast<double*>(mean.raw()), i, 16, nullptr),
            0)
      << "max_num_kv 0";
  EXPECT_NE(
      kc::append_partial_keys(logits.data<float>(), i, nullptr, logits.raw(), kc::Element::F32, 1,
                              1, 4, 2, 4, 4, nullptr, nullptr, nullptr, 0, nullptr),
      0)
      << "position past the capacity";
}

}  // namespace
}  // namespace infinigen
