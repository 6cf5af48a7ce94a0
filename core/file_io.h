// core: the file helpers every reader and writer of files shares (checkpoints, output
// directories, sessions): descriptors closed on scope exit, reads and writes that retry what the
// kernel interrupts, files written in full or not at all, and CRC-32s.
//
// Writing a file so that it appears whole or not at all: write it under another name, flush it
// to the disk and close it (sync_and_close), then rename it over the target; fsync the directory
// when the rename itself must survive a crash (fsync_directory).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

namespace infinigen {

// strerror(error): the text of an errno value.
std::string errno_text(int error);

// A file descriptor, closed when it goes out of scope unless released; false when invalid (an
// open that failed, errno telling why).
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd = -1) : fd_(fd) {}
  ~FileDescriptor();
  FileDescriptor(FileDescriptor&& other) noexcept;
  FileDescriptor& operator=(FileDescriptor&& other) noexcept;
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;

  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  // Gives up ownership: the caller closes the descriptor.
  int release();

 private:
  int fd_;
};

// Opens `path` for reading and checks it is a regular file; returns the descriptor and sets
// *size. One-line Error naming the path otherwise ("no such file", "cannot open: ...", "is a
// directory, not a file", "not a regular file").
FileDescriptor open_regular_file(const std::string& path, size_t* size);

// Reads `fd` from where it stands to its end, passing each piece read to `consume`, retrying
// interrupted reads. Returns 0, or the errno of the read that failed.
int read_to_end(int fd, const std::function<void(std::string_view)>& consume);

// The whole of the regular file `path` (open_regular_file's Errors, or "cannot read: ...").
std::string read_text_file(const std::string& path);

// Writes all of `data` to `fd`, retrying interrupted and short writes. Returns 0, or the errno
// of the write that failed (ENOSPC when a write makes no progress).
int write_all(int fd, const void* data, size_t nbytes);

// Flushes `fd`'s file to the disk and closes `fd` (closed either way): 0, or the errno of the
// step that failed, its name ("fsync", "close") in *step.
int sync_and_close(int fd, const char** step);

// Flushes `directory`'s entries (a rename into it, a new file) to the disk; best effort.
void fsync_directory(const std::filesystem::path& directory);

// The hidden sibling a file is written to before replace_file renames it to `target`.
std::filesystem::path staging_path(const std::filesystem::path& target);
void replace_file(const std::filesystem::path& staging, const std::filesystem::path& target);

// Writes `text` to `path`: into a hidden sibling first, flushed to the disk and renamed over
// `path` once complete, so a failure (a full disk) or an interruption never leaves a partial
// file under `path`. Error naming the path when it cannot.
void write_text_file(const std::filesystem::path& path, std::string_view text);

// Removes `path` and everything under it, ignoring errors: cleaning up after a write that failed
// or was abandoned.
void remove_quietly(const std::filesystem::path& path) noexcept;

// Drops every file under `directory` from the page cache (flushed first), so that the next read
// comes from the disk.
void drop_from_page_cache(const std::filesystem::path& directory);

// zlib's CRC-32 of `bytes`, continuing `crc` (0 to start).
uint32_t crc32_of(std::string_view bytes, uint32_t crc = 0);
// `value` as 8 lowercase hexadecimal digits.
std::string hex32(uint32_t value);

}  // namespace infinigen
