// apps/infinigen: shards of a batch job from flags and launcher environments.
#include "apps/infinigen/batch_shard.h"

#include <charconv>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace infinigen::cli {
namespace {

std::optional<int64_t> parse_count(std::string_view text) {
  int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, value);
  if (text.empty() || error != std::errc() || stop != end || value < 0) return std::nullopt;
  return value;
}

// The whole number in variable `name` (one-line Error when it holds anything else).
std::optional<int64_t> env_number(const Environment& env, const char* name) {
  const char* value = env(name);
  if (value == nullptr) return std::nullopt;
  const std::optional<int64_t> number = parse_count(value);
  INFINIGEN_CHECK(number.has_value(), "the environment variable ", name, " holds '", value,
                  "', not a whole number >= 0");
  return number;
}

Shard checked(Shard shard) {
  INFINIGEN_CHECK(shard.count >= 1 && shard.index < shard.count, shard.source, ": shard ",
                  shard.index, " of ", shard.count, " does not exist (shards are 0 to ",
                  shard.count - 1, ")");
  return shard;
}

// A Slurm job array's task: its index among the array's tasks and their count.
std::optional<Shard> slurm_array(const Environment& env) {
  const std::optional<int64_t> id = env_number(env, "SLURM_ARRAY_TASK_ID");
  if (!id) return std::nullopt;
  const std::optional<int64_t> min = env_number(env, "SLURM_ARRAY_TASK_MIN");
  const std::optional<int64_t> max = env_number(env, "SLURM_ARRAY_TASK_MAX");
  const int64_t step = env_number(env, "SLURM_ARRAY_TASK_STEP").value_or(1);
  INFINIGEN_CHECK(step >= 1, "SLURM_ARRAY_TASK_STEP must be at least 1");
  const int64_t first = min.value_or(0);
  INFINIGEN_CHECK(*id >= first && (*id - first) % step == 0, "SLURM_ARRAY_TASK_ID ", *id,
                  " is not a task of the array ", first, "-", max.value_or(first), ":", step);
  Shard shard{(*id - first) / step, 0, "SLURM_ARRAY_TASK_ID"};
  if (min && max) {
    shard.count = (*max - *min) / step + 1;
  } else if (const std::optional<int64_t> count = env_number(env, "SLURM_ARRAY_TASK_COUNT")) {
    shard.count = *count;
  } else {
    fail(
        "SLURM_ARRAY_TASK_ID is set without SLURM_ARRAY_TASK_COUNT or SLURM_ARRAY_TASK_MIN/MAX: "
        "give --shard I/N");
  }
  return checked(shard);
}

}  // namespace

Shard resolve_shard(const std::string& flag, std::optional<int64_t> count_flag,
                    const Environment& env) {
  if (!flag.empty()) {
    const size_t slash = flag.find('/');
    const std::optional<int64_t> index =
        slash == std::string::npos ? std::nullopt : parse_count(flag.substr(0, slash));
    const std::optional<int64_t> count =
        slash == std::string::npos ? std::nullopt : parse_count(flag.substr(slash + 1));
    INFINIGEN_CHECK(index && count, "--shard must be I/N (shard I of N, I from 0), got '", flag,
                    "'");
    return checked({*index, *count, "--shard"});
  }
  if (std::optional<Shard> array = slurm_array(env)) return *array;
  // Rank variables of launchers, each pair a rank and the number of ranks.
  const std::vector<std::pair<const char*, const char*>> ranks = {
      {"SLURM_PROCID", "SLURM_NTASKS"},
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
      {"PMI_RANK", "PMI_SIZE"}};
  for (const auto& [rank_name, size_name] : ranks) {
    const std::optional<int64_t> rank = env_number(env, rank_name);
    if (!rank) continue;
    const std::optional<int64_t> size = env_number(env, size_name);
    INFINIGEN_CHECK(size.has_value(), rank_name, " is set without ", size_name,
                    ": give --shard I/N");
    return checked({*rank, *size, std::string(rank_name) + "/" + size_name});
  }
  if (const std::optional<int64_t> index = env_number(env, "JOB_COMPLETION_INDEX")) {
    INFINIGEN_CHECK(count_flag.has_value(),
                    "JOB_COMPLETION_INDEX is set (a Kubernetes Indexed Job): give the job's "
                    "completions with --shard-count N");
    return checked({*index, *count_flag, "JOB_COMPLETION_INDEX"});
  }
  INFINIGEN_CHECK(!count_flag.has_value(),
                  "--shard-count is for a Kubernetes Indexed Job, but JOB_COMPLETION_INDEX is "
                  "not set: give --shard I/N");
  return {0, 1, "one shard"};
}

std::optional<int64_t> local_rank(const Environment& env) {
  for (const char* name :
       {"SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "LOCAL_RANK"}) {
    if (const std::optional<int64_t> rank = env_number(env, name)) return rank;
  }
  return std::nullopt;
}

std::optional<std::string> rank_visible_devices(const Environment& env, int64_t node_gpus) {
  const std::optional<int64_t> rank = local_rank(env);
  if (!rank) return std::nullopt;
  const char* visible = env("CUDA_VISIBLE_DEVICES");
  if (visible == nullptr) {
    return std::to_string(node_gpus > 0 ? *rank % node_gpus : *rank);
  }
  std::vector<std::string> devices;
  std::string_view list(visible);
  while (!list.empty()) {
    const size_t comma = list.find(',');
    devices.emplace_back(list.substr(0, comma));
    list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
  }
  if (devices.size() <= 1) return std::nullopt;  // one GPU (or none) given to this rank already
  return devices[static_cast<size_t>(*rank) % devices.size()];
}

}  // namespace infinigen::cli
