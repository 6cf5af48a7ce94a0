// offload: copying a gather list (scattered KV rows of the host pool into contiguous staging) on
// several host threads. The cuda backend's host gather feeds the link with it, and the hardware
// profile measures it; kv_pool_bench compares it with memcpy of the same bytes.
#pragma once

#include <vector>

#include "offload/transfer_engine.h"

namespace infinigen {

struct GatherOptions {
  int threads = 0;         // OpenMP threads; 0 = the OpenMP default (every core)
  int prefetch_rows = 4;   // source rows fetched ahead of the copy (0 = none)
  bool streaming = false;  // non-temporal stores, bypassing the cache (for staging the CPU
                           // does not read next, such as a DMA source)
};

// Copies every chunk. Each thread takes one contiguous share of the list (equal rows in practice),
// so neighbouring rows of the pool stay on one core.
void gather_rows(const std::vector<CopyChunk>& chunks, const GatherOptions& options = {});

}  // namespace infinigen
