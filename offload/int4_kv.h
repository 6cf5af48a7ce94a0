// offload: the `int4` policy (FlexGen's KV compression): all KV in host memory as group-wise
// asymmetric 4-bit codes (ops::int4_quantize, core/ops.h; the arithmetic in kernels/cpu/int4.h),
// each layer's codes loaded while the previous layer computes and dequantised on the device into
// the fp16 rows attention reads.
//
// Host pool (pinned, allocated up front for `capacity` tokens): codes [L][2][B][H][capacity]
// rows of d / 2 bytes and meta [L][2][B][H][capacity] rows of G (min, scale) fp16 pairs; a
// (layer, K/V, sequence, head) run of tokens is contiguous in both.
// Device buffers, by layer parity: the loaded codes and meta ([2][B][H][capacity] rows, the
// pool's layout for one layer), which dequantise into the pipeline's fp16 staging K and V
// (B, H, capacity, d); a store buffer ([2][B][H][rows] rows: 1, or the prompt's chunk) carries
// each decode step's new token, or a prompt chunk's rows, to the pool.
//
// Bytes: a decode step with n tokens per sequence in the pool loads
// 2 * L * B * n * H * (d / 2 + 4 * G) (packed nibbles plus two fp16 per group; G = d / 64, or 1
// when d < 64) and stores 2 * L * B * H * (d / 2 + 4 * G); the prefill stores its n prompt rows.
//
// The new token's K and V are quantised, and attention reads their dequantised values (not the
// fresh fp32 ones), so a step's attention sees exactly what later steps will load. The prefill's
// attention reads the fresh rows (the model does that); the store only keeps their codes. A
// prompt computed in chunks (OffloadOptions::prefill_chunk) is a prefill of its first chunk,
// then passes that read every row before them, and their own, dequantised, as decode steps do:
// its logits differ from one pass's by the quantisation error of what the early chunks left
// (with chunks of 1, the prompt is decoded token by token, and the logits are a decode's).
//
// Where the steps run: quantising (the prefill's rows into this parity's load buffers, a decode
// step's token into its store buffer) and dequantising (the loaded rows in view, the new token in
// append) are ops on the compute stream, so on the device's kernels with --device cuda
// (kernels/cuda/int4.cu, bit-identical to the CPU's) and on the calling thread with the CPU
// backend; the load and store streams only copy codes. Nothing in a decode step reads device
// memory from the host, allocates, or synchronises the device (debug_poison's NaN fills aside):
// the layer pipeline's events (offload/layer_pipeline.h) order everything. The load of layer l
// waits for the previous step's store of layer l; quantising into a buffer of a parity waits for
// the latest store that read one; dequantising the loaded rows waits for their load.
//
// A resumed conversation (offload/session.h) restores the codes and scales a session saved into
// the pool as they were; its first pass is an extension that attends to the history dequantised,
// as a decode step does, and quantises its own rows into the load buffer of its parity, after the
// history's rows that the load brings (more than a store buffer holds).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/device.h"
#include "core/kv_cache.h"
#include "core/ops.h"
#include "offload/layer_pipeline.h"
#include "offload/offload_stats.h"
#include "offload/transfer_engine.h"

namespace infinigen {

struct KvPolicy;
const KvPolicy& int4_kv_policy();  // its entry (offload/kv_policy.h)

// Rows per (K/V, sequence, head) of the store buffers: a decode step's one, or a prompt's chunk
// (OffloadOptions::prefill_chunk, at most `capacity`).
int64_t int4_store_rows(int64_t prefill_chunk, int64_t capacity);

class Int4Kv : public KvStore {
 public:
  // `prefill_chunk`: the prompt's passes after the first carry up to this many tokens per
  // sequence (0: the prompt is one pass).
  Int4Kv(const ModelConfig& config, int64_t batch, int64_t capacity, Device device,
         TransferEngine& engine, OffloadStats& stats, int64_t prefill_chunk = 0);

  void append(int64_t layer, const Tensor& keys, const Tensor& values) override;
  View view(int64_t layer) override;
  void end_pass(int64_t n_new) override;

  // A session saves the pool's rows as they are: per (K/V) the codes, d / 2 bytes a row (as
  // d / 8 I32 of 8 nibbles each: d must be a multiple of 8), and the (min, scale) fp16 pairs of
  // its G groups ("key_codes", "key_scales", "value_codes", "value_scales").
  std::vector<TokenStream> token_streams(int64_t layer) const override;
  const void* token_row(int64_t layer, size_t stream, int64_t b, int64_t h,
                        int64_t t) const override;
  // Sequences leave the batch (KvStore::drop_sequences) with the pool compacted in place into the
  // layout of the smaller batch (each kept run of codes and meta moves down once, in host
  // memory); the pool's memory is kept, as a whole, until the store goes.
  bool can_drop_sequences() const override { return true; }
  void finish_stores() override { pipeline_.drain_stores(); }

  // Bytes of one quantised row (d / 2 + 4 * G).
  size_t row_bytes() const { return code_bytes_ + meta_bytes_; }

 protected:
  void start_pass(int64_t n_new) override;
  void start_layer(int64_t layer) override;
  void keep_sequences(const std::vector<int64_t>& keep,
                      const std::vector<LeaderMove>& moves) override;

 private:
  // Quantised rows laid out [2][B][H][rows] (codes then meta, as two arrays), on device_ or in
  // the host pool.
  struct Packed {
    uint8_t* codes = nullptr;
    uint8_t* meta = nullptr;
  };
  // Frees bytes from device_alloc on `device`, or from pinned_alloc when `pinned`.
  struct Free {
    Device device;
    bool pinned;
    void operator()(uint8_t* bytes) const {
      pinned ? pinned_free(bytes) : device_free(device, bytes);
    }
  };
  using Bytes = std::unique_ptr<uint8_t[], Free>;
  // A Packed that owns its arrays.
  struct PackedBuffer {
    Bytes codes, meta;
    Packed get() const { return {codes.get(), meta.get()}; }
  };
  // `rows` quantised rows: pinned host memory, or on device_.
  PackedBuffer pinned_buffer(size_t rows) const;
  PackedBuffer device_buffer(size_t rows) const;

  // Row (kind, b, h, t) of a [2][B][H][rows] buffer.
  size_t row_index(int64_t kind, int64_t b, int64_t h, int64_t t, int64_t rows) const;
  Packed host_layer(int64_t layer) const;
  // A device buffer of `rows` rows as the int4 ops take it.
  ops::Int4Rows device_rows(Packed packed, int64_t rows) const;
  // Starts loading layer `layer`'s codes into loaded_packed_[layer % 2].
  void issue_load(int64_t layer);
  // Stores rows [0, n) of `src` ([2][B][H][src_rows]) into the pool at tokens
  // [length(), length() + n).
  void issue_store(int64_t layer, Packed src, int64_t src_rows, int64_t n);
  // Dequantises rows [t0, t1) of `src` ([2][B][H][src_rows], on the device) into layer `layer`'s
  // staging at rows [row0, row0 + t1 - t0), on the compute stream.
  void dequantize_into_staging(int64_t layer, Packed src, int64_t src_rows, int64_t t0, int64_t t1,
                               int64_t row0);

  int64_t store_rows_;  // rows per (K/V, sequence, head) of store_packed_
  int64_t num_heads_;
  int64_t head_dim_;
  size_t code_bytes_;  // d / 2
  size_t meta_bytes_;  // G * 2 fp16
  Device device_;
  PackedBuffer host_;                          // [L][2][B][H][capacity] rows, pinned
  std::array<PackedBuffer, 2> loaded_packed_;  // [2][B][H][capacity] rows by parity
  std::array<PackedBuffer, 2> store_packed_;   // [2][B][H][store_rows_] rows by parity
  // Staging K and V (B, H, capacity, d) fp16 by parity. Last: its destructor waits for the
  // transfers that read and write the buffers above.
  LayerPipeline pipeline_;
};

}  // namespace infinigen
