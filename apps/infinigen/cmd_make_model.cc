// apps/infinigen: `infinigen make-model`, a synthetic HF-layout checkpoint of any preset (the
// OPT and Llama families).
#include <cstdio>

#include "apps/infinigen/commands.h"
#include "apps/infinigen/option_flags.h"
#include "apps/infinigen/progress.h"
#include "core/interrupt.h"
#include "core/model_config.h"
#include "core/synthetic_model.h"

namespace infinigen::cli {
namespace {

struct MakeModelOptions {
  std::string preset;
  std::string out;
  std::string dtype;
  SyntheticModelOptions synthetic;
};

int make_model(const MakeModelOptions& o) {
  ModelConfig config = load_preset(o.preset);
  if (!o.dtype.empty()) config.dtype = parse_float_dtype(o.dtype);
  const SyntheticModelOptions& s = o.synthetic;
  s.validate(config);  // each knob in its range for this preset, before anything is written
  {
    Progress progress("writing tensors");
    with_interrupt_context(
        [&] {
          write_synthetic_checkpoint(
              config, s, o.out, [&](int64_t done, int64_t total) { progress.update(done, total); });
        },
        [&] { return "; " + o.out + " was not written"; });
  }
  std::printf("wrote %s (%.1fM parameters, %s, seed %llu) to %s\n", o.preset.c_str(),
              static_cast<double>(config.num_parameters()) / 1e6,
              std::string(dtype_name(config.dtype)).c_str(),
              static_cast<unsigned long long>(s.seed), o.out.c_str());
  return 0;
}

}  // namespace

Command add_make_model_command(CLI::App& app) {
  auto o = std::make_shared<MakeModelOptions>();
  SyntheticModelOptions& s = o->synthetic;
  std::string presets;
  for (const std::string& name : preset_names()) presets += (presets.empty() ? "" : ", ") + name;
  app.add_option("--preset", o->preset, "Model preset (configs/models): " + presets)->required();
  app.add_option("--out,-o", o->out, "Output directory (must not exist, or be empty)")->required();
  app.add_option("--seed", s.seed, "Seed of the weights")
      ->check(unsigned_integer())
      ->capture_default_str();
  app.add_option("--dtype", o->dtype, "Storage type: f16, bf16 or f32 (default: the preset's)")
      ->check(float_type_in({DType::F16, DType::BF16, DType::F32}));
  app.add_option("--outlier-channels", s.outlier_channels,
                 "Residual channels with massive activations")
      ->capture_default_str();
  app.add_option("--outlier-ratio", s.outlier_ratio,
                 "Outlier channel magnitude over a typical channel's, at every layer")
      ->capture_default_str();
  app.add_option("--residual-update-ratio", s.residual_update_ratio,
                 "Std of each layer's residual update over the residual stream's")
      ->capture_default_str();
  app.add_option("--embed-std", s.embed_std, "Std of the other embedding entries")
      ->capture_default_str();
  app.add_option("--attention-rank", s.attention_rank, "Rank of each head's query-key interaction")
      ->capture_default_str();
  app.add_option("--attention-logit-std", s.attention_logit_std,
                 "Std of attention logits between unrelated tokens (higher = sharper)")
      ->capture_default_str();
  app.add_option("--attention-sink-logit", s.attention_sink_logit,
                 "Attention logit of the BOS token for every query (0: no attention sink)")
      ->capture_default_str();
  app.add_option("--weight-std", s.weight_std, "Std of the other weight matrices")
      ->capture_default_str();
  return [o] { return make_model(*o); };
}

}  // namespace infinigen::cli
