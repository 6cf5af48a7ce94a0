// core: atomic output directories.
#include "core/output_directory.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
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
    std::error_code ignored;
    fs::remove_all(staging, ignored);
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
    std::error_code ignored;
    fs::remove_all(staging, ignored);
    throw;
  }
  if (fs::exists(target, error)) fs::remove(target, error);  // empty: checked_output_directory
  if (error) refuse("replacing the empty directory", error);
  fs::rename(staging, target, error);
  if (error) refuse("moving it into place", error);
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
  const auto refuse = [&](const char* step, int error) {
    std::error_code ignored;
    fs::remove(staging, ignored);
    fail(path.string(), ": cannot write (", step, ": ",
         std::error_code(error, std::generic_category()).message(), ")");
  };
  const int fd = ::open(staging.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) refuse("create", errno);
  // Written, flushed to the disk and closed before the rename, so that neither a full disk nor a
  // crash leaves a partial file under `path`.
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = n < 0 ? errno : ENOSPC;
      ::close(fd);
      refuse("write", error);
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const int error = errno;
    ::close(fd);
    refuse("fsync", error);
  }
  if (::close(fd) != 0) refuse("close", errno);
  replace_file(staging, path);
}

}  // namespace infinigen
