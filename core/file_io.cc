// core: file helpers (descriptors, whole reads and writes, files written atomically, CRC-32).
#include "core/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <system_error>
#include <utility>
#include <vector>

#include "core/error.h"

namespace infinigen {

namespace fs = std::filesystem;

std::string errno_text(int error) {
  return std::strerror(error);
}

FileDescriptor::~FileDescriptor() {
  if (fd_ >= 0) ::close(fd_);
}

FileDescriptor::FileDescriptor(FileDescriptor&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)) {}

FileDescriptor& FileDescriptor::operator=(FileDescriptor&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

int FileDescriptor::release() {
  return std::exchange(fd_, -1);
}

// O_NONBLOCK keeps a FIFO from blocking the open until fstat can refuse it; it changes nothing
// for regular files.
FileDescriptor open_regular_file(const std::string& path, size_t* size) {
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (!fd) {
    const int error = errno;
    if (error == ENOENT) fail(path, ": no such file");
    fail(path, ": cannot open: ", errno_text(error));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) fail(path, ": cannot stat: ", errno_text(errno));
  if (S_ISDIR(st.st_mode)) fail(path, ": is a directory, not a file");
  if (!S_ISREG(st.st_mode)) fail(path, ": not a regular file");
  *size = static_cast<size_t>(st.st_size);
  return fd;
}

int read_to_end(int fd, const std::function<void(std::string_view)>& consume) {
  std::vector<char> buffer(size_t{1} << 20);
  for (;;) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return 0;
    consume(std::string_view(buffer.data(), static_cast<size_t>(n)));
  }
}

std::string read_text_file(const std::string& path) {
  size_t size = 0;
  const FileDescriptor fd = open_regular_file(path, &size);
  std::string text;
  text.reserve(size);
  const int error = read_to_end(fd.get(), [&](std::string_view piece) { text.append(piece); });
  if (error != 0) fail(path, ": cannot read: ", errno_text(error));
  return text;
}

int write_all(int fd, const void* data, size_t nbytes) {
  const char* p = static_cast<const char*>(data);
  while (nbytes > 0) {
    // Linux caps one write at just under 2 GiB; chunking keeps the count portable.
    const ssize_t n = ::write(fd, p, std::min<size_t>(nbytes, size_t{1} << 30));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return ENOSPC;
    p += n;
    nbytes -= static_cast<size_t>(n);
  }
  return 0;
}

int sync_and_close(int fd, const char** step) {
  // Flushed before the caller renames the file into place: otherwise a crash could leave the
  // new name pointing at unwritten data.
  if (::fsync(fd) != 0) {
    const int error = errno;
    ::close(fd);
    *step = "fsync";
    return error;
  }
  if (::close(fd) != 0) {
    *step = "close";
    return errno;
  }
  return 0;
}

void fsync_directory(const fs::path& directory) {
  const FileDescriptor fd(::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd) ::fsync(fd.get());
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
    remove_quietly(staging);
    fail(path.string(), ": cannot write (", step, ": ", errno_text(error), ")");
  };
  FileDescriptor fd(::open(staging.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd) refuse("create", errno);
  if (const int error = write_all(fd.get(), text.data(), text.size()); error != 0) {
    fd = FileDescriptor();
    refuse("write", error);
  }
  const char* step = nullptr;
  if (const int error = sync_and_close(fd.release(), &step); error != 0) refuse(step, error);
  replace_file(staging, path);
}

void remove_quietly(const fs::path& path) noexcept {
  std::error_code ignored;
  fs::remove_all(path, ignored);
}

void drop_from_page_cache(const fs::path& directory) {
  for (const fs::directory_entry& entry : fs::recursive_directory_iterator(directory)) {
    if (!entry.is_regular_file()) continue;
    const FileDescriptor fd(::open(entry.path().c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) continue;
    ::fdatasync(fd.get());
    ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED);
  }
}

uint32_t crc32_of(std::string_view bytes, uint32_t crc) {
  return static_cast<uint32_t>(
      ::crc32(crc, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(bytes.size())));
}

std::string hex32(uint32_t value) {
  char text[9];
  std::snprintf(text, sizeof text, "%08x", value);
  return text;
}

}  // namespace infinigen
