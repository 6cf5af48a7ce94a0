// apps/infinigen: `infinigen session VERB DIR`, tools for a session saved by `run --session`
// (docs/sessions.md): `compact` merges its segments into one.
#include <cstdio>
#include <memory>
#include <string>

#include "apps/infinigen/commands.h"
#include "offload/session_compact.h"

namespace infinigen::cli {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

int compact(const std::string& directory) {
  const SessionCompaction done = compact_session(directory);
  if (done.segments == 0) {
    // A store saved as its state alone (h2o): each turn replaces it whole.
    std::printf("%s: no segments (the session is its state), nothing to compact\n",
                directory.c_str());
  } else if (done.bytes_written == 0) {
    std::printf("%s: %lld segment, nothing to compact\n", directory.c_str(),
                static_cast<long long>(done.segments));
  } else {
    std::printf("%s: %lld segments compacted into 1 (%.1f MiB written)\n", directory.c_str(),
                static_cast<long long>(done.segments),
                static_cast<double>(done.bytes_written) / kMiB);
  }
  return 0;
}

}  // namespace

Command add_session_command(CLI::App& app) {
  app.require_subcommand(1, 1);
  auto directory = std::make_shared<std::string>();
  CLI::App* verb = app.add_subcommand(
      "compact",
      "Merge a session's segments (two per turn) into one, atomically: a resume reads one segment "
      "file per layer, and gives the same tokens. Saves do it past --session-compact-after");
  verb->add_option("directory", *directory, "Session directory (run --session DIR)")->required();
  return [directory] { return compact(*directory); };
}

}  // namespace infinigen::cli
