// apps/infinigen: `infinigen skew`, a checkpoint with InfiniGen's SVD-skewed query/key projections.
#include <cstdio>
#include <optional>

#include "apps/infinigen/commands.h"
#include "apps/infinigen/progress.h"
#include "core/interrupt.h"
#include "core/model_loader.h"
#include "speculate/skew.h"

namespace infinigen::cli {
namespace {

struct SkewCommandOptions {
  std::string model;
  std::string out;
  std::string calib_file;
  int64_t calib_len = kDefaultCalibrationLength;
  const CLI::Option* calib_len_option = nullptr;
};

int skew(const SkewCommandOptions& o) {
  // The built-in model is a checkpoint too.
  const std::string in_dir = is_builtin_model(o.model) ? builtin_model_directory(o.model) : o.model;
  SkewOptions options;
  options.calib_file = o.calib_file;
  if (o.calib_len_option->count() > 0) options.calib_len = o.calib_len;
  std::optional<Progress> progress;
  std::string stage;
  const SkewReport report = with_interrupt_context(
      [&] {
        return skew_checkpoint(in_dir, o.out, options,
                               [&](const std::string& s, int64_t done, int64_t n) {
                                 if (s != stage) {
                                   progress.reset();  // ends the previous stage's line
                                   progress.emplace(s);
                                   stage = s;
                                 }
                                 progress->update(done, n);
                               });
      },
      [&] { return "; " + o.out + " was not written"; });
  progress.reset();
  std::printf(
      "skewed %s into %s: %zu layers, calibration %lld tokens (%s), %s; query energy in the top "
      "30%% of columns %.3f -> %.3f (mean over layers)\n",
      in_dir.c_str(), o.out.c_str(), report.energy_before.size(),
      static_cast<long long>(report.calib_len), report.calib_source.c_str(),
      std::string(dtype_name(report.dtype)).c_str(), report.mean_energy_before(),
      report.mean_energy_after());
  return 0;
}

}  // namespace

Command add_skew_command(CLI::App& app) {
  auto o = std::make_shared<SkewCommandOptions>();
  app.add_option("--model,-m", o->model, "Checkpoint directory (or \"builtin\", \"builtin-llama\")")
      ->required();
  app.add_option("--out,-o", o->out, "Output directory (must not exist, or be empty)")->required();
  app.add_option(
      "--calib-file", o->calib_file,
      "Calibration text (default: the bundled calibration text, configs/calibration.txt)");
  o->calib_len_option = app.add_option("--calib-len", o->calib_len,
                                       "Calibration tokens, BOS included (default: 2048, capped "
                                       "at the model's max_positions)");
  return [o] { return skew(*o); };
}

}  // namespace infinigen::cli
