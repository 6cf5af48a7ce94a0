// predict: hardware profiles, the constants the cost model (predict/cost_model.h) turns a schedule
// into seconds with: compute rates of the device, the host <-> device link, the host's copy
// threads. Bundled profiles live in configs/hardware/*.yaml (compiled into the binary); any other
// YAML file with the same keys can be loaded by path.
//
// Every rate is a sustained one (what a long run of the op achieves), never a peak: the GPU
// profiles take the vendor's peak times a stated achievable fraction, the CPU backend's profile
// is measured on the machine by predict/profile_measurement.h. Each constant carries its source
// in `sources` (key = field name).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "predict/linear_cost_table.h"

namespace infinigen {

struct HardwareProfile {
  std::string name;
  std::string description;
  std::string backend;  // "cuda" | "cpu"

  double device_memory_bytes = 0;  // usable device memory, bytes

  // Compute (roofline per op: op_overhead_s + max(flops / rate, bytes / bandwidth)).
  double gemm_flops = 0;  // fp16 GEMM (fp32 accumulate) on large shapes, FLOP/s
  // Streaming from device memory, B/s: the weights of decode-shape projections (a few rows) and
  // the K/V of prefill attention.
  double device_memory_bytes_per_s = 0;
  // Bytes of last-level cache (0 = none): a decode step whose working set fits in half of it
  // takes its linear layers from linear_table's cache grid (measured on sets that size).
  double device_cache_bytes = 0;
  // Where present (the CPU backend), linear layers cost what this measured table says instead of
  // the roofline (predict/linear_cost_table.h).
  LinearCostTable linear_table;
  double attention_flops = 0;          // prefill attention (QK^T, softmax, PV), FLOP/s
  double attention_bytes_per_s = 0;    // decode attention, KV bytes read per second
  double elementwise_bytes_per_s = 0;  // LayerNorm, residual add, KV row writes, B/s
  double kv_codec_bytes_per_s = 0;  // int4 quantise/dequantise, fp16 bytes of rows coded per second
  double speculation_bytes_per_s = 0;  // InfiniGen scoring: partial-key bytes scanned per second
  double speculation_flops = 0;  // InfiniGen scoring: query-head x partial-key products, FLOP/s
  double scoring_flops = 0;            // H2O's per-entry attention-score accumulation, FLOP/s
  double op_overhead_s = 0;            // fixed cost per op / kernel launch

  // Host <-> device link (pinned memory, bulk copies).
  double h2d_bytes_per_s = 0;
  double d2h_bytes_per_s = 0;
  double transfer_latency_s = 0;  // per transfer (one gather list)
  // CPU backend: how much longer than requested an emulated transfer lasts (the copy thread's
  // timed sleep wakes late); with_link adds it to transfer_latency_s. 0 for a real link.
  double link_emulation_overhead_s = 0;

  // Sequential reads from the disk a session is kept on (offload/session.h), B/s; 0: not given
  // (a resumed turn cannot be predicted).
  double disk_read_bytes_per_s = 0;

  // Host CPU copies.
  double host_copy_bytes_per_s = 0;      // one thread copying contiguous runs (memcpy)
  double host_row_copy_bytes_per_s = 0;  // one thread copying scattered KV rows (d elements each)
  double host_gather_bytes_per_s = 0;    // OpenMP threads copying scattered KV rows
  // Where device compute and host copies share the same cores (the CPU backend), the factor by
  // which each slows while the other runs; 1 where they do not (a GPU with copy engines).
  double compute_slowdown_under_copy = 1;
  double copy_slowdown_under_compute = 1;

  // field name (linear_table included) -> where its value comes from
  std::map<std::string, std::string> sources;
};

// A bundled profile by name (configs/hardware/<name>.yaml), or a YAML file by path (anything
// containing '/' or ending in .yaml). Throws one-line Errors naming the file and the field.
HardwareProfile load_hardware_profile(const std::string& name_or_path);
// Parses a profile's YAML text; `source` names it in errors.
HardwareProfile parse_hardware_profile(const std::string& yaml, const std::string& source);
// Names of the bundled profiles, sorted.
std::vector<std::string> hardware_profile_names();
// Writes `profile` as YAML loadable by load_hardware_profile (sources as comments and a map).
void write_hardware_profile(const HardwareProfile& profile, const std::string& path);
// The profile's YAML text.
std::string hardware_profile_yaml(const HardwareProfile& profile);

// `profile` with the link replaced: `gbps` GB/s (1e9 bytes) both ways, 0 = unlimited (the CPU
// backend without emulation), and `latency_us` per transfer. The CPU backend's link is whatever
// LinkEmulation the measured run used.
HardwareProfile with_link(HardwareProfile profile, double gbps, double latency_us);

}  // namespace infinigen
