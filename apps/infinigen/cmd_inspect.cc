// apps/infinigen: `infinigen inspect DIR`, a checkpoint's config, tensors and sizes.
#include <cstdio>
#include <filesystem>

#include "apps/infinigen/commands.h"
#include "core/model_config.h"
#include "core/model_loader.h"
#include "core/weights.h"
#include "core/safetensors.h"

namespace infinigen::cli {
namespace {

int inspect(const std::string& spec) {
  // A directory, or a built-in model's name, as every other command takes them.
  const std::string directory = is_builtin_model(spec) ? builtin_model_directory(spec) : spec;
  INFINIGEN_CHECK(std::filesystem::is_directory(directory), spec, ": no such directory");
  const ModelConfig config = load_hf_config(directory);
  const SafetensorsCheckpoint checkpoint = SafetensorsCheckpoint::open(directory);
  std::printf("checkpoint %s\n", directory.c_str());
  std::printf(
      "  family %s: %lld layers, hidden %lld, %lld heads of %lld (%lld KV heads), ffn %lld, vocab %lld, "
      "%lld positions, %s\n",
      config.family.c_str(),
      static_cast<long long>(config.num_layers), static_cast<long long>(config.hidden_size),
      static_cast<long long>(config.num_heads), static_cast<long long>(config.head_dim()),
      static_cast<long long>(config.kv_heads()), static_cast<long long>(config.ffn_dim),
      static_cast<long long>(config.vocab_size), static_cast<long long>(config.max_positions),
      std::string(dtype_name(config.dtype)).c_str());
  std::printf("  parameters %.1fM, KV cache %.1f KiB per token (f16)\n\n",
              static_cast<double>(config.num_parameters()) / 1e6,
              static_cast<double>(config.kv_bytes_per_token(DType::F16)) / 1024.0);
  int64_t parameters = 0;
  std::printf("  %-56s %-5s %-16s %12s\n", "tensor", "dtype", "shape", "bytes");
  for (const std::string& name : checkpoint.names()) {
    const SafetensorsEntry& e = checkpoint.entry(name);
    parameters += shape_numel(e.shape);
    std::printf("  %-56s %-5s %-16s %12zu\n", name.c_str(),
                std::string(dtype_name(e.dtype)).c_str(), shape_string(e.shape).c_str(), e.nbytes);
  }
  std::printf("\n  %zu tensors, %lld parameters, %.1f MiB\n", checkpoint.names().size(),
              static_cast<long long>(parameters),
              static_cast<double>(checkpoint.total_bytes()) / (1024.0 * 1024.0));
  check_checkpoint(checkpoint, config);
  std::printf("  every tensor matches the config\n");
  return 0;
}

}  // namespace

Command add_inspect_command(CLI::App& app) {
  auto directory = std::make_shared<std::string>();
  app.add_option("directory", *directory,
                 "Checkpoint directory (or \"builtin\", \"builtin-llama\")")
      ->required();
  return [directory] { return inspect(*directory); };
}

}  // namespace infinigen::cli
