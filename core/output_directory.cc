// core: atomic output directories.
#include "core/output_directory.h"

#include <unistd.h>

#include <system_error>

#include "core/error.h"

namespace infinigen {

namespace fs = std::filesystem;

fs::path checked_output_directory(const std::string& directory) {
  fs::path target(directory);
  if (!target.has_filename()) target = target.parent_path();
  INFINIGEN_CHECK(!fs::exists(target) || (fs::is_directory(target) && fs::is_empty(target)),
                  directory, ": already exists and is not an empty directory");
  return target;
}

void write_directory_atomically(const fs::path& target,
                                const std::function<void(const fs::path&)>& fill) {
  const fs::path staging =
      target.parent_path() / (target.filename().string() + ".partial-" + std::to_string(getpid()));
  // Filesystem failures end in one line of ours naming the directory, not the library's text.
  const auto refuse = [&](const char* step, const std::error_code& error) {
    remove_quietly(staging);
    fail(target.string(), ": cannot write (", step, ": ", error.message(), ")");
  };
  std::error_code error;
  fs::remove_all(staging, error);
  if (error) refuse("clearing a previous attempt", error);
  fs::create_directories(staging, error);
  if (error) refuse("creating it", error);
  try {
    fill(staging);
  } catch (...) {
    remove_quietly(staging);
    throw;
  }
  if (fs::exists(target, error)) fs::remove(target, error);  // empty: checked_output_directory
  if (error) refuse("replacing the empty directory", error);
  fs::rename(staging, target, error);
  if (error) refuse("moving it into place", error);
}

}  // namespace infinigen
