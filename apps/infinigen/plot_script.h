// apps/infinigen: what `bench` and `eval` share around their results: the command line as typed
// (recorded in the results) and the PNG drawn from a results JSON by a Python script in tools/.
#pragma once

#include <filesystem>
#include <string>

namespace infinigen::cli {

// The command as typed (from /proc/self/cmdline).
std::string this_command_line();

// Draws `png_path` from `json_path` with tools/`script` (e.g. "plot_bench.py") and a Python that
// has matplotlib: $INFINIGEN_PYTHON, else python3 on PATH, else /usr/bin/python3. The script is
// looked for next to an installed binary (share/infinigen/tools), else in the source tree this
// binary was built from. A one-line Error says what is missing (and that --no-plot skips it).
void plot(const std::string& script, const std::filesystem::path& json_path,
          const std::filesystem::path& png_path);

}  // namespace infinigen::cli
