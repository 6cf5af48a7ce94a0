// core: atomic output directories.
#include "core/output_directory.h"

#include <unistd.h>

#include <fstream>

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
  fs::remove_all(staging);
  fs::create_directories(staging);
  try {
    fill(staging);
    if (fs::exists(target)) fs::remove(target);  // empty: checked_output_directory
    fs::rename(staging, target);
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(staging, ignored);
    throw;
  }
}

fs::path staging_path(const fs::path& target) {
  std::string name = ".";
  name.append(target.filename().string()).append(".partial-").append(std::to_string(getpid()));
  return target.parent_path() / name;
}

void replace_file(const fs::path& staging, const fs::path& target) {
  std::error_code error;
  fs::rename(staging, target, error);
  if (error) {
    fs::remove(staging, error);
    fail(target.string(), ": cannot write (", error.message(), ")");
  }
}

void write_text_file(const fs::path& path, std::string_view text) {
  const fs::path staging = staging_path(path);
  {
    std::ofstream out(staging, std::ios::binary);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.flush();
    if (!out.good()) {
      out.close();
      std::error_code ignored;
      fs::remove(staging, ignored);
      fail(path.string(), ": cannot write (disk full or not writable?)");
    }
  }
  replace_file(staging, path);
}

}  // namespace infinigen
