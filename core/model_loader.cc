// core: model resolution, the built-in model cache and the memory check before loading.
#include "core/model_loader.h"

#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/generation_config.h"
#include "core/safetensors.h"
#include "core/synthetic_model.h"
#include "core/trace.h"

namespace infinigen {
namespace {

namespace fs = std::filesystem;

std::string gib(size_t bytes) {
  std::ostringstream out;
  out.precision(1);
  out << std::fixed << static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0) << " GiB";
  return out.str();
}

void check_fits_in_memory(const ModelConfig& config, Device device) {
  if (device != Device::Cpu) return;  // device memory is planned by the runtime
  const size_t available = available_host_memory();
  const size_t needed = config.weight_bytes();
  INFINIGEN_CHECK(available == 0 || needed < available, config.name, ": the weights need ",
                  gib(needed), " of memory but only ", gib(available),
                  " is available on this machine (try a smaller model)");
}

}  // namespace

namespace {

// The `key:` line of a /proc file in kB, as bytes (0 when absent).
size_t proc_kib(const char* path, const std::string& key) {
  std::ifstream file(path);
  std::string line;
  while (std::getline(file, line)) {
    if (line.rfind(key, 0) == 0) return std::strtoull(line.c_str() + key.size(), nullptr, 10) * 1024;
  }
  return 0;
}

}  // namespace

size_t available_host_memory() {
  size_t available = proc_kib("/proc/meminfo", "MemAvailable:");
  // Under an address-space limit (ulimit -v) the process can map no more than the limit leaves.
  struct rlimit limit {};
  if (getrlimit(RLIMIT_AS, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    const size_t mapped = proc_kib("/proc/self/status", "VmSize:");
    const size_t left = limit.rlim_cur > mapped ? limit.rlim_cur - mapped : 0;
    available = available == 0 ? left : std::min(available, left);
  }
  return available;
}

bool is_builtin_model(const std::string& spec) {
  return spec == kBuiltinModel || spec == kBuiltinLlamaModel;
}

std::string builtin_model_directory(const std::string& name) {
  std::vector<fs::path> candidates;
  const char* dir = std::getenv("INFINIGEN_BUILTIN_MODEL");
  if (name == kBuiltinModel && dir && *dir) {
    candidates.push_back(dir);
  } else {
    std::error_code ec;
    const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
    if (!ec)
      candidates.push_back(exe.parent_path().parent_path() / "share/infinigen/models" / name);
    candidates.push_back(fs::path(INFINIGEN_SOURCE_DIR) / "models" / name);
  }
  std::string looked;
  for (const fs::path& candidate : candidates) {
    if (fs::is_regular_file(candidate / "config.json")) return candidate.string();
    looked += (looked.empty() ? "" : ", ") + candidate.string();
  }
  fail("the built-in model ", name, " was not found (looked in ", looked, "); pass ",
       option("model"), " DIR");
}

ModelSource resolve_model(const std::string& spec, const ModelLoadOptions& options) {
  ModelSource source;
  source.seed = options.seed;
  if (is_builtin_model(spec)) {
    source.directory = builtin_model_directory(spec);
    source.description = "built-in model " + spec + " (" + source.directory + ")";
  } else if (fs::is_directory(spec)) {
    source.directory = spec;
    source.description = "checkpoint " + spec;
  } else if (is_preset(spec)) {
    source.config = load_preset(spec);
    source.description = spec + " preset on seeded synthetic weights (seed " +
                         std::to_string(options.seed) + "; no checkpoint given)";
    source.tokenizer = Tokenizer::bundled();
    source.synthetic = true;
    return source;
  } else if (fs::exists(spec)) {
    fail(option("model"), " ", spec, ": not a directory");
  } else if (spec.find('/') != std::string::npos) {
    fail(option("model"), " ", spec, ": no such directory");
  } else {
    std::string known;
    for (const std::string& name : preset_names()) known += (known.empty() ? "" : ", ") + name;
    fail(option("model"), " ", spec, ": not a checkpoint directory or a preset (presets: ", known,
         ")");
  }
  source.config = load_hf_config(source.directory);
  // Fail on a malformed checkpoint now, before any planning or allocation.
  check_checkpoint(SafetensorsCheckpoint::open(source.directory), source.config);
  if (fs::exists(fs::path(source.directory) / "tokenizer.json") ||
      fs::exists(fs::path(source.directory) / "vocab.json")) {
    source.tokenizer = Tokenizer::from_directory(source.directory);
  }
  source.sampling = load_generation_config(source.directory);
  return source;
}

std::optional<int32_t> prompt_bos(const ModelSource& source) {
  if (!source.directory.empty() && source.tokenizer) return source.tokenizer->bos_id();
  return source.config.bos_token_id;
}

std::string token_text(const ModelSource& source, const std::vector<int32_t>& ids) {
  if (source.tokenizer) return source.tokenizer->decode(ids);
  std::string out;
  for (int32_t id : ids) {
    if (!out.empty()) out += ' ';
    out += std::to_string(id);
  }
  return out;
}

ModelWeights load_weights(const ModelSource& source, Device device) {
  if (dry_run()) {  // shapes only: the tensors of the family's layout, as the loader keeps them
    WeightsBuilder builder(source.config, device);
    for (const TensorSpec& spec : weight_layout(source.config).all()) {
      builder.add(spec.name, Tensor::empty(spec.shape, source.config.dtype));
    }
    return builder.finish();
  }
  if (source.directory.empty()) {
    SyntheticModelOptions synthetic;
    synthetic.seed = source.seed;
    return synthetic_weights(source.config, synthetic, device);
  }
  ModelWeights weights =
      load_checkpoint_weights(SafetensorsCheckpoint::open(source.directory), source.config, device);
  weights.attention_skew = load_attention_skew(source.directory, source.config, device);
  return weights;
}

std::string find_non_finite_tensor(const std::string& directory) {
  const SafetensorsCheckpoint checkpoint = SafetensorsCheckpoint::open(directory);
  constexpr size_t kChunk = 1 << 16;
  std::vector<float> values(kChunk);
  for (const std::string& name : checkpoint.names()) {
    const SafetensorsEntry& entry = checkpoint.entry(name);
    if (entry.dtype != DType::F32 && entry.dtype != DType::F16 && entry.dtype != DType::BF16) {
      continue;
    }
    const SafetensorsFile& file = checkpoint.file_of(name);
    const auto* bytes = static_cast<const char*>(file.bytes(entry));
    const size_t size = dtype_size(entry.dtype), count = entry.nbytes / size;
    for (size_t at = 0; at < count; at += kChunk) {
      const size_t n = std::min(kChunk, count - at);
      convert_to_f32(bytes + at * size, entry.dtype, values.data(), n);
      for (size_t i = 0; i < n; ++i) {
        if (!std::isfinite(values[i])) {
          return cat(file.path(), ": tensor ", name, " holds ", values[i], " at element ", at + i);
        }
      }
    }
  }
  return "";
}

LoadedModel load_model(const std::string& spec, const ModelLoadOptions& options) {
  ModelSource source = resolve_model(spec, options);
  check_fits_in_memory(source.config, options.device);
  LoadedModel loaded;
  loaded.model = make_model(source.config, load_weights(source, options.device), options.device);
  loaded.tokenizer = std::move(source.tokenizer);
  loaded.description = source.description;
  loaded.synthetic = source.synthetic;
  return loaded;
}

}  // namespace infinigen
