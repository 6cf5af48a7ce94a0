// core: safetensors reading (memory-mapped, validated up front) and single-pass writing.
#include "core/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/file_io.h"

namespace infinigen {
namespace {

using nlohmann::json;

// Reference readers refuse larger headers; so do we, before allocating anything for them.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleName = "model.safetensors";
constexpr const char* kMetadataKey = "__metadata__";

// Names and parser messages come from the file; escaping control bytes keeps every Error on one
// line whatever the file contains. `ascii` also escapes bytes >= 0x80, for text that may quote
// ill-formed UTF-8.
std::string printable(std::string_view text, bool ascii = false) {
  std::string out;
  out.reserve(text.size());
  for (unsigned char c : text) {
    if (c < 0x20 || c == 0x7f || (ascii && c >= 0x80)) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

std::string quote_name(std::string_view name) {
  return cat('\'', printable(name), '\'');
}

std::string join_path(const std::string& directory, const std::string& name) {
  return (std::filesystem::path(directory) / name).string();
}

// A non-negative JSON integer. nlohmann stores non-negative literals as unsigned and negative
// ones as signed; fractions and integers beyond 2^64 come back as floats and are refused.
bool as_count(const json& value, uint64_t* out) {
  if (value.is_number_unsigned()) {
    *out = value.get<uint64_t>();
    return true;
  }
  if (value.is_number_integer() && value.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(value.get<int64_t>());
    return true;
  }
  return false;
}

// Product of the extents times the element size, or false when it does not fit. The product of
// the non-zero extents must fit in int64 even when some extent is zero, because shape_numel()
// multiplies left to right in int64 and must never overflow on a shape we accepted.
bool checked_nbytes(const Shape& shape, size_t element_size, size_t* out) {
  uint64_t nonzero_product = 1;
  bool has_zero = false;
  for (int64_t extent : shape) {
    if (extent < 0) return false;
    if (extent == 0) {
      has_zero = true;
      continue;
    }
    if (__builtin_mul_overflow(nonzero_product, static_cast<uint64_t>(extent), &nonzero_product)) {
      return false;
    }
  }
  uint64_t bytes = 0;
  if (nonzero_product > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
      __builtin_mul_overflow(nonzero_product, static_cast<uint64_t>(element_size), &bytes) ||
      bytes > std::numeric_limits<size_t>::max()) {
    return false;
  }
  *out = has_zero ? 0 : static_cast<size_t>(bytes);
  return true;
}

json parse_json(const std::string& path, const char* what, const char* first, const char* last) {
  // The JSON library keeps the last of a key an object gives twice; a header naming a tensor
  // twice (or an index mapping one twice) would then silently load another tensor's bytes.
  std::vector<std::unordered_set<std::string>> keys;  // per object being parsed
  std::string repeated;
  const json::parser_callback_t note_keys = [&](int, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) keys.emplace_back();
    if (event == json::parse_event_t::object_end) keys.pop_back();
    if (event == json::parse_event_t::key && repeated.empty() &&
        !keys.back().insert(parsed.get<std::string>()).second) {
      repeated = parsed.get<std::string>();
    }
    return true;
  };
  json parsed;
  try {
    parsed = json::parse(first, last, note_keys);
  } catch (const json::exception& e) {
    fail(path, ": ", what, " is not valid JSON (", printable(e.what(), true), ")");
  }
  if (!repeated.empty()) fail(path, ": ", what, " names ", quote_name(repeated), " twice");
  return parsed;
}

const char* json_type(const json& value) {
  return value.type_name();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

std::shared_ptr<const SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  // The object owns the mapping from the moment it exists, so every failure below unmaps it.
  std::shared_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;

  size_t file_size = 0;
  {
    const FileDescriptor fd = open_regular_file(path, &file_size);
    if (file_size == 0) fail(path, ": file is empty");
    if (file_size < 8) {
      fail(path, ": file is ", file_size, " bytes, shorter than the 8-byte header length");
    }
    void* map = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    if (map == MAP_FAILED) fail(path, ": cannot map: ", errno_text(errno));
    file->map_ = static_cast<const unsigned char*>(map);
    file->map_size_ = file_size;
  }

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | file->map_[i];
  if (header_len > file_size - 8) {
    fail(path, ": header length ", header_len, " exceeds the file size (", file_size, " bytes)");
  }
  if (header_len > kMaxHeaderBytes) {
    fail(path, ": header length ", header_len, " exceeds the limit of ", kMaxHeaderBytes, " bytes");
  }
  file->data_start_ = 8 + static_cast<size_t>(header_len);
  const size_t data_size = file_size - file->data_start_;

  const char* header = reinterpret_cast<const char*>(file->map_ + 8);
  const json root = parse_json(path, "header", header, header + header_len);
  if (!root.is_object()) {
    fail(path, ": header is not a JSON object (found ", json_type(root), ")");
  }

  for (const auto& [name, value] : root.items()) {
    if (name == kMetadataKey) {
      if (!value.is_object()) {
        fail(path, ": '__metadata__' is not an object of strings (found ", json_type(value), ")");
      }
      for (const auto& [key, text] : value.items()) {
        if (!text.is_string()) {
          fail(path, ": '__metadata__' entry ", quote_name(key), " is not a string (found ",
               json_type(text), ")");
        }
        file->metadata_.emplace(key, text.get<std::string>());
      }
      continue;
    }
    const std::string tensor = "tensor " + quote_name(name);
    if (!value.is_object()) fail(path, ": ", tensor, " is not an object");

    const auto dtype_it = value.find("dtype");
    if (dtype_it == value.end() || !dtype_it->is_string()) {
      fail(path, ": ", tensor, " has no string 'dtype'");
    }
    SafetensorsEntry entry;
    entry.name = name;
    const std::string& dtype_text = dtype_it->get_ref<const std::string&>();
    if (!parse_dtype(dtype_text, &entry.dtype)) {
      fail(path, ": ", tensor, " has unsupported dtype ", quote_name(dtype_text),
           " (supported: F32, F16, BF16, I32, I64)");
    }

    const auto shape_it = value.find("shape");
    if (shape_it == value.end() || !shape_it->is_array()) {
      fail(path, ": ", tensor, " has no 'shape' array");
    }
    for (const json& extent : *shape_it) {
      uint64_t n = 0;
      if (!as_count(extent, &n)) {
        if (extent.is_number_integer()) {
          fail(path, ": ", tensor, " has a negative extent ", extent.get<int64_t>(),
               " in its shape");
        }
        fail(path, ": ", tensor, " has a shape entry that is not a non-negative integer");
      }
      if (n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        fail(path, ": ", tensor, " has a shape extent ", n, " that is too large");
      }
      entry.shape.push_back(static_cast<int64_t>(n));
    }

    const auto offsets_it = value.find("data_offsets");
    uint64_t begin = 0;
    uint64_t end = 0;
    if (offsets_it == value.end() || !offsets_it->is_array() || offsets_it->size() != 2 ||
        !as_count((*offsets_it)[0], &begin) || !as_count((*offsets_it)[1], &end)) {
      fail(path, ": ", tensor, " has no 'data_offsets' of two non-negative integers");
    }
    const std::string offsets = cat("data_offsets [", begin, ", ", end, "]");
    if (begin > end) fail(path, ": ", tensor, " ", offsets, " end before they begin");
    if (end > data_size) {
      fail(path, ": ", tensor, " ", offsets, " run past the end of the data (", data_size,
           " bytes; is the file truncated?)");
    }
    size_t expected = 0;
    if (!checked_nbytes(entry.shape, dtype_size(entry.dtype), &expected)) {
      fail(path, ": ", tensor, " has an impossibly large shape ", shape_string(entry.shape));
    }
    if (end - begin != expected) {
      fail(path, ": ", tensor, " ", offsets, " do not match its shape ", shape_string(entry.shape),
           " of ", dtype_name(entry.dtype), " (", expected, " bytes)");
    }
    entry.begin = static_cast<size_t>(begin);
    entry.nbytes = expected;
    file->entries_.push_back(std::move(entry));
  }

  // Overlap check: walk the byte ranges in order of their start. Empty tensors own no bytes and
  // cannot overlap anything.
  std::vector<const SafetensorsEntry*> by_offset;
  for (const SafetensorsEntry& e : file->entries_) {
    if (e.nbytes > 0) by_offset.push_back(&e);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const SafetensorsEntry* a, const SafetensorsEntry* b) {
              return a->begin != b->begin ? a->begin < b->begin : a->nbytes < b->nbytes;
            });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const SafetensorsEntry& prev = *by_offset[i - 1];
    const SafetensorsEntry& cur = *by_offset[i];
    if (prev.begin + prev.nbytes > cur.begin) {
      fail(path, ": tensors ", quote_name(prev.name), " and ", quote_name(cur.name), " overlap");
    }
  }

  // JSON objects iterate in key order already; sorting states the invariant find() relies on.
  std::sort(file->entries_.begin(), file->entries_.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) { return a.name < b.name; });
  return file;
}

std::shared_ptr<const SafetensorsFile> SafetensorsFile::copy_in_memory(
    const SafetensorsFile& file) {
  std::shared_ptr<SafetensorsFile> copy(new SafetensorsFile());
  copy->path_ = file.path_;
  copy->entries_ = file.entries_;
  copy->metadata_ = file.metadata_;
  copy->data_start_ = file.data_start_;
  void* map =
      ::mmap(nullptr, file.map_size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (map == MAP_FAILED) fail(file.path_, ": cannot allocate a copy: ", errno_text(errno));
  std::memcpy(map, file.map_, file.map_size_);
  copy->map_ = static_cast<const unsigned char*>(map);
  copy->map_size_ = file.map_size_;
  return copy;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(const_cast<unsigned char*>(map_), map_size_);
}

const SafetensorsEntry* SafetensorsFile::find(std::string_view name) const {
  const auto it = std::lower_bound(
      entries_.begin(), entries_.end(), name,
      [](const SafetensorsEntry& e, std::string_view key) { return e.name < key; });
  return it != entries_.end() && it->name == name ? &*it : nullptr;
}

const void* SafetensorsFile::bytes(const SafetensorsEntry& entry) const {
  INFINIGEN_CHECK(entry.begin <= map_size_ - data_start_ &&
                      entry.nbytes <= map_size_ - data_start_ - entry.begin,
                  path_, ": tensor ", quote_name(entry.name), " is not inside this file");
  return map_ + data_start_ + entry.begin;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsCheckpoint

SafetensorsCheckpoint SafetensorsCheckpoint::open(const std::string& directory) {
  struct stat st {};
  if (::stat(directory.c_str(), &st) != 0) {
    const int error = errno;
    if (error == ENOENT) fail(directory, ": no such directory");
    fail(directory, ": cannot access: ", errno_text(error));
  }
  if (!S_ISDIR(st.st_mode)) fail(directory, ": not a directory");

  SafetensorsCheckpoint checkpoint;
  checkpoint.directory_ = directory;
  const std::string index_path = join_path(directory, kIndexName);
  std::error_code ec;
  if (!std::filesystem::exists(index_path, ec)) {
    const std::string single_path = join_path(directory, kSingleName);
    if (!std::filesystem::exists(single_path, ec)) {
      fail(directory, ": no ", kSingleName, " or ", kIndexName);
    }
    checkpoint.files_.push_back(SafetensorsFile::open(single_path));
    for (const SafetensorsEntry& e : checkpoint.files_[0]->entries()) {
      checkpoint.file_index_.emplace(e.name, 0);
    }
    return checkpoint;
  }

  const std::string text = read_text_file(index_path);
  const json root = parse_json(index_path, "index", text.data(), text.data() + text.size());
  if (!root.is_object()) {
    fail(index_path, ": index is not a JSON object (found ", json_type(root), ")");
  }
  const auto map_it = root.find("weight_map");
  if (map_it == root.end() || !map_it->is_object()) {
    fail(index_path, ": index has no 'weight_map' object");
  }

  // tensor -> shard, checked, then each shard opened once, in name order so that files_[0] (whose
  // metadata the checkpoint reports) is the first shard.
  std::map<std::string, std::string> shard_of;
  std::set<std::string> shard_names;
  for (const auto& [name, shard] : map_it->items()) {
    if (!shard.is_string()) {
      fail(index_path, ": weight_map entry for tensor ", quote_name(name), " is not a string");
    }
    const std::string& file_name = shard.get_ref<const std::string&>();
    if (file_name.empty() || file_name.find('/') != std::string::npos ||
        file_name.find("..") != std::string::npos || file_name.find('\0') != std::string::npos) {
      fail(index_path, ": tensor ", quote_name(name), " names shard ", quote_name(file_name),
           ", which is not a plain file name inside the directory");
    }
    shard_of.emplace(name, file_name);
    shard_names.insert(file_name);
  }
  std::map<std::string, size_t> file_of_shard;
  for (const std::string& file_name : shard_names) {
    const std::string shard_path = join_path(directory, file_name);
    try {
      checkpoint.files_.push_back(SafetensorsFile::open(shard_path));
    } catch (const Error& e) {
      throw Error(cat(e.what(), " (listed in ", kIndexName, ")"));
    }
    file_of_shard.emplace(file_name, checkpoint.files_.size() - 1);
  }
  for (const auto& [name, file_name] : shard_of) {
    const size_t index = file_of_shard.at(file_name);
    if (checkpoint.files_[index]->find(name) == nullptr) {
      fail(index_path, ": tensor ", quote_name(name), " is not in its shard ",
           quote_name(file_name));
    }
    checkpoint.file_index_.emplace(name, index);
  }
  return checkpoint;
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> out;
  out.reserve(file_index_.size());
  for (const auto& [name, index] : file_index_) out.push_back(name);
  return out;
}

bool SafetensorsCheckpoint::contains(std::string_view name) const {
  return file_index_.find(name) != file_index_.end();
}

const SafetensorsFile& SafetensorsCheckpoint::file_of(std::string_view name) const {
  const auto it = file_index_.find(name);
  if (it == file_index_.end()) fail(directory_, ": no tensor ", quote_name(name));
  return *files_[it->second];
}

const SafetensorsEntry& SafetensorsCheckpoint::entry(std::string_view name) const {
  // open() checked that every indexed tensor is in its file.
  return *file_of(name).find(name);
}

Tensor SafetensorsCheckpoint::load(std::string_view name) const {
  const SafetensorsFile& file = file_of(name);
  const SafetensorsEntry& e = *file.find(name);
  Tensor tensor = Tensor::empty(e.shape, e.dtype);
  // The mapping gives no alignment guarantee for the tensor's start; memcpy needs none.
  if (e.nbytes > 0) std::memcpy(tensor.raw(), file.bytes(e), e.nbytes);
  return tensor;
}

size_t SafetensorsCheckpoint::total_bytes() const {
  size_t total = 0;
  for (const auto& [name, index] : file_index_) total += files_[index]->find(name)->nbytes;
  return total;
}

const std::map<std::string, std::string>& SafetensorsCheckpoint::metadata() const {
  static const std::map<std::string, std::string> kEmpty;
  return files_.empty() ? kEmpty : files_[0]->metadata();
}

// ---------------------------------------------------------------------------------------------
// SafetensorsWriter
//
// Layout written: u64 LE header length N, the header JSON (keys in sorted order, as nlohmann's
// std::map-backed object dumps them) padded with spaces so that 8 + N is a multiple of 8, then
// the tensors' bytes back to back in record order. Reference readers require the data_offsets
// to tile the buffer without gaps, so alignment padding can only go into the header.

struct SafetensorsWriter::Impl {
  std::string path;
  std::string tmp_path;
  std::vector<TensorRecord> records;
  std::vector<size_t> sizes;  // bytes of records[i]
  size_t next = 0;            // index of the record `write` expects next
  FileDescriptor fd;
  bool finished = false;
  bool broken = false;  // an I/O error happened; the tmp file is garbage

  ~Impl() {
    if (!finished && !tmp_path.empty()) ::unlink(tmp_path.c_str());
  }

  void write_bytes(const void* data, size_t nbytes) {
    if (const int error = write_all(fd.get(), data, nbytes); error != 0) {
      broken = true;
      fail(tmp_path, ": write failed: ", errno_text(error));
    }
  }
};

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<TensorRecord> records,
                                     std::map<std::string, std::string> metadata)
    : impl_(std::make_unique<Impl>()) {
  Impl& impl = *impl_;
  impl.path = std::move(path);
  impl.records = std::move(records);

  json header = json::object();
  std::set<std::string_view> seen;
  size_t offset = 0;
  for (const TensorRecord& r : impl.records) {
    const std::string tensor = "tensor " + quote_name(r.name);
    if (r.name == kMetadataKey) fail(impl.path, ": ", tensor, " is a reserved name");
    if (!seen.insert(r.name).second) fail(impl.path, ": ", tensor, " is recorded twice");
    size_t nbytes = 0;
    if (!checked_nbytes(r.shape, dtype_size(r.dtype), &nbytes)) {
      fail(impl.path, ": ", tensor, " has an invalid shape ", shape_string(r.shape));
    }
    if (__builtin_add_overflow(offset, nbytes, &offset)) {
      fail(impl.path, ": tensors are too large to write");
    }
    header[r.name] = {{"dtype", std::string(dtype_name(r.dtype))},
                      {"shape", r.shape},
                      {"data_offsets", {offset - nbytes, offset}}};
    impl.sizes.push_back(nbytes);
  }
  if (!metadata.empty()) header[kMetadataKey] = metadata;

  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception&) {
    fail(impl.path, ": tensor names and metadata must be valid UTF-8");
  }
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');
  unsigned char prefix[8];
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<unsigned char>(text.size() >> (8 * i));

  impl.tmp_path = impl.path + ".tmp";
  impl.fd =
      FileDescriptor(::open(impl.tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!impl.fd) {
    const int error = errno;
    impl.tmp_path.clear();  // nothing of ours to remove
    fail(impl.path, ".tmp: cannot create: ", errno_text(error));
  }
  impl.write_bytes(prefix, sizeof prefix);
  impl.write_bytes(text.data(), text.size());
}

SafetensorsWriter::~SafetensorsWriter() = default;

void SafetensorsWriter::write(std::string_view name, const void* data, size_t nbytes) {
  Impl& impl = *impl_;
  if (impl.finished) fail(impl.path, ": write of tensor ", quote_name(name), " after finish()");
  if (impl.broken) fail(impl.path, ": write of tensor ", quote_name(name), " after a failed write");
  if (impl.next >= impl.records.size()) {
    fail(impl.path, ": write of tensor ", quote_name(name), " but all ", impl.records.size(),
         " records are written");
  }
  const TensorRecord& r = impl.records[impl.next];
  if (name != r.name) {
    fail(impl.path, ": write of tensor ", quote_name(name), " but tensor ", quote_name(r.name),
         " comes next in record order");
  }
  if (nbytes != impl.sizes[impl.next]) {
    fail(impl.path, ": tensor ", quote_name(name), " given ", nbytes, " bytes, but its shape ",
         shape_string(r.shape), " of ", dtype_name(r.dtype), " needs ", impl.sizes[impl.next]);
  }
  if (nbytes > 0) impl.write_bytes(data, nbytes);
  ++impl.next;
}

void SafetensorsWriter::finish() {
  Impl& impl = *impl_;
  if (impl.finished) fail(impl.path, ": finish() called twice");
  if (impl.broken) fail(impl.path, ": finish() after a failed write");
  if (impl.next < impl.records.size()) {
    fail(impl.path, ": finish() with ", impl.next, " of ", impl.records.size(),
         " tensors written; tensor ", quote_name(impl.records[impl.next].name), " is missing");
  }
  const char* step = nullptr;
  if (const int error = sync_and_close(impl.fd.release(), &step); error != 0) {
    impl.broken = true;
    fail(impl.tmp_path, ": ", step, " failed: ", errno_text(error));
  }
  if (::rename(impl.tmp_path.c_str(), impl.path.c_str()) != 0) {
    impl.broken = true;
    fail(impl.path, ": cannot rename ", impl.tmp_path, " into place: ", errno_text(errno));
  }
  impl.finished = true;
}

// ---------------------------------------------------------------------------------------------
// One-call writers

namespace {

std::vector<TensorRecord> records_of(const std::string& path,
                                     const std::vector<std::pair<std::string, Tensor>>& tensors) {
  std::vector<TensorRecord> records;
  records.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    if (t.device() != Device::Cpu) fail(path, ": tensor ", quote_name(name), " is not on the CPU");
    if (!t.defined()) fail(path, ": tensor ", quote_name(name), " has no data");
    records.push_back({name, t.dtype(), t.shape()});
  }
  return records;
}

std::string shard_name(size_t index, size_t count) {
  std::ostringstream out;
  out << "model-" << std::setw(5) << std::setfill('0') << index << "-of-" << std::setw(5)
      << std::setfill('0') << count << ".safetensors";
  return out.str();
}

}  // namespace

void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  SafetensorsWriter writer(path, records_of(path, tensors), metadata);
  for (const auto& [name, t] : tensors) writer.write(name, t.raw(), t.nbytes());
  writer.finish();
}

void write_sharded_safetensors(const std::string& directory,
                               const std::vector<std::pair<std::string, Tensor>>& tensors,
                               size_t max_shard_bytes,
                               const std::map<std::string, std::string>& metadata) {
  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  if (ec) fail(directory, ": cannot create directory: ", ec.message());
  records_of(directory, tensors);  // device checks before anything is written

  // Greedy packing in the given order: a tensor opens a new shard when it would push a
  // non-empty shard past the limit. A tensor larger than the limit gets a shard of its own.
  std::vector<std::vector<std::pair<std::string, Tensor>>> shards(1);
  std::set<std::string_view> seen;
  size_t shard_bytes = 0;
  size_t total = 0;
  for (const auto& item : tensors) {
    if (!seen.insert(item.first).second) {
      fail(directory, ": tensor ", quote_name(item.first), " is given twice");
    }
    const size_t nbytes = item.second.nbytes();
    if (!shards.back().empty() && shard_bytes + nbytes > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(item);
    shard_bytes += nbytes;
    total += nbytes;
  }

  const std::string index_path = join_path(directory, kIndexName);
  if (shards.size() == 1) {
    write_safetensors(join_path(directory, kSingleName), tensors, metadata);
    // A stale index from an earlier sharded save would shadow the new file when reading.
    if (::unlink(index_path.c_str()) != 0 && errno != ENOENT) {
      fail(index_path, ": cannot remove stale index: ", errno_text(errno));
    }
    return;
  }

  json weight_map = json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string file_name = shard_name(i + 1, shards.size());
    write_safetensors(join_path(directory, file_name), shards[i], metadata);
    for (const auto& [name, t] : shards[i]) weight_map[name] = file_name;
  }
  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", std::move(weight_map)}};
  std::string text;
  try {
    text = index.dump(2) + "\n";
  } catch (const json::exception&) {
    fail(index_path, ": tensor names must be valid UTF-8");
  }
  // The index goes last, so it never names a shard that is not complete on disk.
  write_text_file(index_path, text);
}

}  // namespace infinigen
