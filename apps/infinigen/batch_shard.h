// apps/infinigen: which share of a batch job this process runs (shard i of n), from --shard or
// from the environment a cluster launcher sets, and which GPU of its node a rank takes.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace infinigen::cli {

struct Shard {
  int64_t index = 0;  // 0-based
  int64_t count = 1;
  std::string source;  // where it came from, for messages: "--shard", "SLURM_ARRAY_TASK_ID", ...

  // Item k of a job (its k-th batch, or the request on its k-th non-blank line when that cannot
  // run) belongs to shard k % count: a deterministic, interleaved share (batches of every length
  // on every shard).
  bool owns(int64_t k) const { return k % count == index; }
};

// Reads an environment variable (std::getenv, or a map in tests); null when unset.
using Environment = std::function<const char*(const char*)>;

// The shard of this process: `flag` ("I/N", 0-based I) when given, else, in this order, a Slurm
// job array (SLURM_ARRAY_TASK_ID with SLURM_ARRAY_TASK_COUNT, or with SLURM_ARRAY_TASK_MIN/MAX and
// SLURM_ARRAY_TASK_STEP), srun ranks (SLURM_PROCID/SLURM_NTASKS), Open MPI
// (OMPI_COMM_WORLD_RANK/SIZE), PMI (MPICH, Intel MPI: PMI_RANK/PMI_SIZE), a Kubernetes Indexed Job
// (JOB_COMPLETION_INDEX, its count from `count_flag`, --shard-count), else 0 of 1. One-line
// Error for a malformed value, an index outside its count, or JOB_COMPLETION_INDEX without a count.
Shard resolve_shard(const std::string& flag, std::optional<int64_t> count_flag,
                    const Environment& env);

// The rank of this process among those on its node (SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK,
// MPI_LOCALRANKID, LOCAL_RANK), if a launcher set one.
std::optional<int64_t> local_rank(const Environment& env);

// CUDA_VISIBLE_DEVICES for a rank of its node, set before CUDA starts, so that ranks sharing a
// node take different GPUs: the local rank's entry of the visible list (modulo its length), or
// when nothing is set the local rank modulo `node_gpus` (0: the rank itself). nullopt: leave it
// (no local rank, or the launcher already gave this rank a single GPU).
std::optional<std::string> rank_visible_devices(const Environment& env, int64_t node_gpus);

}  // namespace infinigen::cli
