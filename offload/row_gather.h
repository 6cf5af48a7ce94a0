// offload: copying a gather list (scattered KV rows of the host pool into contiguous staging) on
// several host threads. The cuda backend's host gather feeds the link with it, and the hardware
// profile measures it; kv_pool_bench compares it with memcpy of the same bytes.
#pragma once

#include <vector>

#include "offload/transfer_engine.h"

namespace infinigen {

// Copies every chunk on `threads` OpenMP threads (0: the OpenMP default, every core). Each thread
// takes one contiguous share of the list (equal rows in practice), so that rows next to each
// other in the pool are read by one core. Software prefetching and streaming stores were measured
// and left out: both were slower or no faster (docs/benchmarks/host-gather.md).
void gather_rows(const std::vector<CopyChunk>& chunks, int threads = 0);

}  // namespace infinigen
