// core: safetensors checkpoints (https://github.com/huggingface/safetensors format), read through
// a memory map and written in one pass.
//
// File layout: u64 little-endian header length N, N bytes of JSON header, then the data buffer.
// Header: {"__metadata__": {str: str}?, "<name>": {"dtype": "F16", "shape": [..],
// "data_offsets": [begin, end]}, ...} with offsets relative to the start of the data buffer.
// Opening a file validates everything before any tensor is read: header length within the file,
// well-formed JSON, known dtypes, offsets inside the buffer, end - begin == numel * dtype size,
// and no two tensors overlapping. Every failure is an Error naming the file (and tensor).
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace infinigen {

struct SafetensorsEntry {
  std::string name;
  DType dtype;
  Shape shape;
  size_t begin = 0;  // byte offset in the data buffer
  size_t nbytes = 0;
};

// One memory-mapped .safetensors file.
class SafetensorsFile {
 public:
  // Maps and validates `path`. Throws Error("<path>: <what is wrong>") on any defect.
  static std::shared_ptr<const SafetensorsFile> open(const std::string& path);
  // A copy of `file` in anonymous memory, independent of its file from then on (a file later
  // removed or dropped from the page cache is not read again): a session tier's copy
  // (offload/session_tier.h).
  static std::shared_ptr<const SafetensorsFile> copy_in_memory(const SafetensorsFile& file);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }  // sorted by name
  const SafetensorsEntry* find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  size_t size() const { return map_size_; }  // the whole file's bytes
  // Start of the tensor's bytes inside the mapping (not necessarily aligned).
  const void* bytes(const SafetensorsEntry& entry) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
  const unsigned char* map_ = nullptr;
  size_t map_size_ = 0;
  size_t data_start_ = 0;
};

// All tensors of a checkpoint directory: `model.safetensors`, or the shards listed by
// `model.safetensors.index.json` ({"weight_map": {"<tensor>": "<shard file>"}}).
class SafetensorsCheckpoint {
 public:
  // Throws Error naming the directory or file when it is missing, unreadable or malformed, or
  // when the index names a tensor its shard does not contain.
  static SafetensorsCheckpoint open(const std::string& directory);

  const std::string& directory() const { return directory_; }
  std::vector<std::string> names() const;  // sorted
  bool contains(std::string_view name) const;
  // Throws Error("<directory>: no tensor '<name>'") when absent.
  const SafetensorsEntry& entry(std::string_view name) const;
  const SafetensorsFile& file_of(std::string_view name) const;
  // A CPU tensor holding a copy of the tensor's bytes, in its stored dtype.
  Tensor load(std::string_view name) const;
  size_t total_bytes() const;                                  // sum of all tensors' sizes
  const std::map<std::string, std::string>& metadata() const;  // of the first file

 private:
  std::string directory_;
  std::vector<std::shared_ptr<const SafetensorsFile>> files_;
  std::map<std::string, size_t, std::less<>> file_index_;  // tensor name -> index in files_
};

// A tensor to be written: name, dtype, shape, and its bytes (numel * dtype size of them).
struct TensorRecord {
  std::string name;
  DType dtype;
  Shape shape;
};

// Writes one .safetensors file in a single pass: the header is written from the records given
// up front, then `write` must be called once per record, in the same order. The header is padded
// with spaces so that the data buffer starts 8-byte aligned in the file; tensors follow back to
// back in record order (readers of the format reject gaps between data_offsets), so a tensor
// starts 8-byte aligned whenever the sizes before it are multiples of 8, as all OPT weights are.
// `finish` checks that every record was written; the file is written to "<path>.tmp" and renamed
// into place, so a crash never leaves a truncated checkpoint behind.
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, std::vector<TensorRecord> records,
                    std::map<std::string, std::string> metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  void write(std::string_view name, const void* data, size_t nbytes);
  void finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Writes `tensors` (CPU tensors, any dtype) to `path` in one call.
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Writes `tensors` into `directory` as shards of at most `max_shard_bytes` each
// (model-0000i-of-0000n.safetensors) plus model.safetensors.index.json; a single file
// (model.safetensors, no index) when everything fits in one shard.
void write_sharded_safetensors(const std::string& directory,
                               const std::vector<std::pair<std::string, Tensor>>& tensors,
                               size_t max_shard_bytes,
                               const std::map<std::string, std::string>& metadata = {});

}  // namespace infinigen
