// core: a checkpoint's own sampling defaults, from its generation_config.json (the HF file).
#pragma once

#include <optional>
#include <string>

#include "core/sampler.h"

namespace infinigen {

// The sampling a checkpoint asks for when the user names none: do_sample false (or absent) is
// greedy; true takes temperature and top_p (HF's defaults 1.0 when absent). nullopt when the
// directory has no generation_config.json; a one-line Error when it is malformed or out of range.
std::optional<SamplingOptions> load_generation_config(const std::string& directory);

}  // namespace infinigen
