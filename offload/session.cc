// offload: sessions on disk.
#include "offload/session.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include "core/error.h"
#include "core/output_directory.h"
#include "core/safetensors.h"
#include "core/trace.h"
#include "offload/kv_policy.h"

namespace infinigen {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kFormat = "infinigen-session";
constexpr int kVersion = 1;
constexpr const char* kManifest = "manifest.json";
constexpr int64_t kReadAhead = 4;  // layers read ahead of the pass

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::string hex32(uint32_t value) {
  char text[9];
  std::snprintf(text, sizeof text, "%08x", value);
  return text;
}

uint32_t crc_of(std::string_view text) {
  return static_cast<uint32_t>(
      crc32(0L, reinterpret_cast<const Bytef*>(text.data()), static_cast<uInt>(text.size())));
}

// Reads `path` whole and returns its CRC-32 and size (the disk read of a restore).
std::pair<uint32_t, uint64_t> checksum_file(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  INFINIGEN_CHECK(fd >= 0, path.string(), ": missing or unreadable (the session is incomplete)");
  std::vector<unsigned char> buffer(1 << 20);
  uLong crc = crc32(0L, Z_NULL, 0);
  uint64_t size = 0;
  for (;;) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ::close(fd);
      fail(path.string(), ": cannot read");
    }
    if (n == 0) break;
    crc = crc32(crc, buffer.data(), static_cast<uInt>(n));
    size += static_cast<uint64_t>(n);
  }
  ::close(fd);
  return {static_cast<uint32_t>(crc), size};
}

void fsync_directory(const fs::path& directory) {
  const int fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

std::string segment_name(int64_t index) {
  char name[32];
  std::snprintf(name, sizeof name, "seg-%06lld", static_cast<long long>(index));
  return name;
}

// Sequences 0, 1, ..., batch - 1.
std::vector<int32_t> all_sequences(int64_t batch) {
  std::vector<int32_t> sequences(static_cast<size_t>(batch));
  std::iota(sequences.begin(), sequences.end(), 0);
  return sequences;
}

std::string layer_file(const std::string& prefix, int64_t layer) {
  char name[48];
  std::snprintf(name, sizeof name, "%s-%03lld.safetensors", prefix.c_str(),
                static_cast<long long>(layer));
  return name;
}

json key_json(const SessionKey& key) {
  json options = json::object();
  for (const auto& [name, value] : key.options) options[name] = value;
  return {{"model", key.model},   {"identity", key.identity},
          {"policy", key.policy}, {"kv_dtype", std::string(dtype_name(key.kv_dtype))},
          {"options", options},   {"layers", key.num_layers}};
}

json file_json(const DiskSession::FileRecord& file) {
  if (file.path.empty()) return nullptr;
  return {{"path", file.path}, {"bytes", file.bytes}, {"crc32", hex32(file.crc32)}};
}

// A file entry of a manifest; its path must stay inside the session.
DiskSession::FileRecord file_record(const json& entry, const std::string& where) {
  DiskSession::FileRecord file;
  if (entry.is_null()) return file;
  INFINIGEN_CHECK(entry.is_object() && entry.contains("path") && entry["path"].is_string() &&
                      entry.contains("bytes") && entry["bytes"].is_number_unsigned() &&
                      entry.contains("crc32") && entry["crc32"].is_string(),
                  where, ": malformed file entry");
  file.path = entry["path"].get<std::string>();
  const fs::path path(file.path);
  INFINIGEN_CHECK(
      !file.path.empty() && path.is_relative() &&
          std::none_of(path.begin(), path.end(), [](const fs::path& part) { return part == ".."; }),
      where, ": file path ", file.path, " leaves the session directory");
  file.bytes = entry["bytes"].get<uint64_t>();
  const std::string crc = entry["crc32"].get<std::string>();
  INFINIGEN_CHECK(crc.size() == 8 && crc.find_first_not_of("0123456789abcdef") == std::string::npos,
                  where, ": malformed checksum ", crc);
  file.crc32 = static_cast<uint32_t>(std::stoul(crc, nullptr, 16));
  return file;
}

// A list of non-negative 32-bit integers (token ids, row counts).
// A list of counts or token ids (>= 0), or of group indices (>= -1: none) when `groups`.
std::vector<int32_t> int32_list(const json& value, const std::string& where, const char* what,
                                bool groups = false) {
  INFINIGEN_CHECK(value.is_array(), where, ": ", what, " must be a list");
  std::vector<int32_t> out;
  for (const json& item : value) {
    INFINIGEN_CHECK(item.is_number_integer() && item.get<int64_t>() >= (groups ? -1 : 0) &&
                        item.get<int64_t>() <= std::numeric_limits<int32_t>::max(),
                    where, ": ", what, " hold ", item.dump(), ", not ",
                    groups ? "a group index or -1" : "a count or token id");
    out.push_back(static_cast<int32_t>(item.get<int64_t>()));
  }
  return out;
}

// The manifest's checksum covers its text without the checksum itself.
uint32_t manifest_checksum(json manifest) {
  manifest.erase("checksum");
  return crc_of(manifest.dump());
}

}  // namespace

SessionKey session_key(const ModelSource& source, const OffloadOptions& options, DType kv_dtype,
                       Device device) {
  const KvPolicy& policy = kv_policy(options.policy);
  INFINIGEN_CHECK(policy.resumable, option("policy"), " ", policy.name,
                  " cannot keep a session (its store is not saved yet); use full, gpu or "
                  "infinigen");
  INFINIGEN_CHECK(device == Device::Cpu || policy.host_token_rows, "a session on ",
                  option("device"), " cuda needs a policy that keeps its KV in host memory (",
                  option("policy"), " full); ", policy.name, " keeps it on the device");
  INFINIGEN_CHECK(options.kv_pool_limit == 0.0, option("kv_pool_limit"),
                  " cannot be used with a session yet");
  const ModelConfig& c = source.config;
  std::ostringstream text;
  text << "family=" << c.family << " layers=" << c.num_layers << " hidden=" << c.hidden_size
       << " heads=" << c.num_heads << " kv_heads=" << c.kv_heads() << " head_dim=" << c.head_dim()
       << " ffn=" << c.ffn_dim << " vocab=" << c.vocab_size << " positions=" << c.max_positions
       << " dtype=" << dtype_name(c.dtype) << "\n";
  if (source.directory.empty()) {
    text << "synthetic seed=" << source.seed << "\n";
  } else {
    const SafetensorsCheckpoint checkpoint = SafetensorsCheckpoint::open(source.directory);
    for (const std::string& name : checkpoint.names()) {
      const SafetensorsEntry& entry = checkpoint.entry(name);
      text << name << " " << dtype_name(entry.dtype) << " " << shape_string(entry.shape) << "\n";
    }
  }
  SessionKey key;
  key.model = c.name;
  key.identity = hex32(crc_of(text.str()));
  key.policy = policy.name;
  key.kv_dtype = kv_dtype;
  for (const std::string& name : policy.session_options) {
    key.options.emplace_back(name, find_option(offload_option_table(), name)->format(options));
  }
  key.num_layers = c.num_layers;
  key.kv_heads = c.kv_heads();
  return key;
}

struct DiskSession::ReadLayer {
  bool ready = false;
  std::exception_ptr error;
  std::vector<std::shared_ptr<const SafetensorsFile>> segments;  // (segments)
  std::shared_ptr<const SafetensorsFile> prefix;                 // null: none shared
  std::shared_ptr<const SafetensorsFile> state;                  // null: none
};

DiskSession::DiskSession(fs::path directory, SessionKey key)
    : directory_(std::move(directory)), key_(std::move(key)) {}

DiskSession::~DiskSession() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  if (reader_.joinable()) reader_.join();
  if (writer_.joinable()) writer_.join();
}

std::unique_ptr<DiskSession> DiskSession::create(const fs::path& directory, SessionKey key) {
  INFINIGEN_CHECK(!fs::exists(directory / kManifest), directory.string(),
                  ": already holds a session; continue it with --resume, or remove it");
  INFINIGEN_CHECK(!fs::exists(directory) || fs::is_directory(directory), directory.string(),
                  ": not a directory");
  // Only what a first save that never committed leaves may be there (the save removes it).
  if (fs::exists(directory)) {
    for (const fs::directory_entry& entry : fs::directory_iterator(directory)) {
      const std::string name = entry.path().filename().string();
      INFINIGEN_CHECK(name.rfind("seg-", 0) == 0 || name.rfind(".manifest.json.", 0) == 0,
                      directory.string(), ": already exists and holds ", name,
                      "; a new session needs an empty directory");
    }
  }
  std::unique_ptr<DiskSession> session(new DiskSession(directory, std::move(key)));
  session->state_.assign(static_cast<size_t>(session->key_.num_layers), {});
  return session;
}

std::unique_ptr<DiskSession> DiskSession::open(const fs::path& directory, const SessionKey& key) {
  const fs::path path = directory / kManifest;
  const std::string where = path.string();
  INFINIGEN_CHECK(fs::is_regular_file(path), directory.string(),
                  ": no session here (no manifest.json)");
  std::string text;
  {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    INFINIGEN_CHECK(fd >= 0, where, ": cannot read");
    char buffer[1 << 16];
    for (ssize_t n; (n = ::read(fd, buffer, sizeof buffer)) > 0;) text.append(buffer, n);
    ::close(fd);
  }
  json manifest;
  try {
    manifest = json::parse(text);
  } catch (const json::exception&) {
    fail(where, ": not valid JSON (the session is corrupt)");
  }
  std::unique_ptr<DiskSession> session(new DiskSession(directory, key));
  DiskSession& s = *session;
  try {
    INFINIGEN_CHECK(manifest.is_object() && manifest.value("format", "") == kFormat, where,
                    ": not an infinigen session manifest");
    INFINIGEN_CHECK(manifest.value("version", 0) == kVersion, where, ": session format version ",
                    manifest.value("version", 0), ", this build reads version ", kVersion);
    INFINIGEN_CHECK(
        manifest.contains("checksum") && manifest["checksum"].is_string() &&
            manifest["checksum"].get<std::string>() == hex32(manifest_checksum(manifest)),
        where, ": checksum mismatch (the session is corrupt)");
    const json saved = manifest.at("key");
    const json expected = key_json(key);
    INFINIGEN_CHECK(saved.at("identity") == expected["identity"], directory.string(),
                    ": saved with another model (", saved.at("model").get<std::string>(),
                    ", identity ", saved["identity"].get<std::string>(), "), not ", key.model, " (",
                    key.identity, ")");
    INFINIGEN_CHECK(saved.at("policy") == expected["policy"], directory.string(), ": saved with ",
                    option("policy"), " ", saved["policy"].get<std::string>(), ", not ",
                    key.policy);
    INFINIGEN_CHECK(saved.at("kv_dtype") == expected["kv_dtype"], directory.string(),
                    ": saved with KV dtype ", saved["kv_dtype"].get<std::string>(), ", not ",
                    expected["kv_dtype"].get<std::string>());
    for (const auto& [name, value] : key.options) {
      const json& was = saved.at("options").at(name);
      INFINIGEN_CHECK(was == value, directory.string(), ": saved with ", option(name), " ",
                      was.get<std::string>(), "; this run has ", value);
    }
    INFINIGEN_CHECK(saved.at("layers") == key.num_layers, where, ": layer count differs");
    const int64_t L = key.num_layers;
    for (const json& sequence : manifest.at("sequences")) {
      s.tokens_.push_back(int32_list(sequence, where, "a sequence's tokens"));
      INFINIGEN_CHECK(!s.tokens_.back().empty(), where, ": a sequence without tokens");
    }
    const size_t B = s.tokens_.size();
    INFINIGEN_CHECK(B >= 1, where, ": no sequences");
    std::vector<int64_t> stored(B, 0);
    if (manifest.contains("prefix")) {
      const json& entry = manifest.at("prefix");
      s.prefix_.rows = int32_list(entry.at("rows"), where, "the shared prefixes' rows");
      const int64_t G = std::ssize(s.prefix_.rows);
      // Each sequence's group; a session saved before groups shares one prefix with the batch.
      const std::vector<int32_t> groups =
          entry.contains("groups")
              ? int32_list(entry.at("groups"), where, "the prefix groups", true)
              : std::vector<int32_t>(B, 0);
      INFINIGEN_CHECK(G >= 1 && groups.size() == B, where, ": malformed shared prefixes");
      std::vector<int64_t> lengths;
      std::vector<int64_t> leader(static_cast<size_t>(G), -1);
      for (int32_t rows : s.prefix_.rows) {
        INFINIGEN_CHECK(rows >= 1, where, ": malformed shared prefix rows");
        lengths.push_back(rows);
      }
      for (size_t b = 0; b < B; ++b) {
        const int32_t g = groups[b];
        INFINIGEN_CHECK(g >= -1 && g < G, where, ": sequence ", b + 1,
                        " is in shared prefix group ", g, " of ", G);
        if (g < 0) continue;
        if (leader[static_cast<size_t>(g)] < 0)
          leader[static_cast<size_t>(g)] = static_cast<int64_t>(b);
        const int64_t P = lengths[static_cast<size_t>(g)];
        const auto& tokens = s.tokens_[b];
        const auto& first = s.tokens_[static_cast<size_t>(leader[static_cast<size_t>(g)])];
        INFINIGEN_CHECK(
            std::ssize(tokens) > P && std::equal(tokens.begin(), tokens.begin() + P, first.begin()),
            where, ": sequence ", b + 1, " does not start with the ", P,
            "-token prefix it shares (the session is corrupt)");
        stored[b] += P;
      }
      INFINIGEN_CHECK(std::none_of(leader.begin(), leader.end(), [](int64_t b) { return b < 0; }),
                      where, ": a shared prefix no sequence shares");
      s.shared_ = SharedPrefixes(groups, lengths);
      for (const json& file : entry.at("files"))
        s.prefix_.layers.push_back(file_record(file, where));
      INFINIGEN_CHECK(static_cast<int64_t>(s.prefix_.layers.size()) == L, where,
                      ": the shared prefix has ", s.prefix_.layers.size(), " layer files for ", L,
                      " layers");
    }
    for (const json& entry : manifest.at("segments")) {
      Segment segment;
      segment.rows = int32_list(entry.at("rows"), where, "a segment's rows");
      INFINIGEN_CHECK(segment.rows.size() == B, where, ": a segment's rows do not cover ", B,
                      " sequences");
      for (size_t b = 0; b < B; ++b) {
        INFINIGEN_CHECK(segment.rows[b] >= 0, where, ": negative row count");
        stored[b] += segment.rows[b];
      }
      for (const json& file : entry.at("files")) segment.layers.push_back(file_record(file, where));
      INFINIGEN_CHECK(static_cast<int64_t>(segment.layers.size()) == L, where, ": a segment has ",
                      segment.layers.size(), " layer files for ", L, " layers");
      s.segments_.push_back(std::move(segment));
    }
    for (const json& file : manifest.at("state")) s.state_.push_back(file_record(file, where));
    INFINIGEN_CHECK(static_cast<int64_t>(s.state_.size()) == L, where, ": state for ",
                    s.state_.size(), " of ", L, " layers");
    for (size_t b = 0; b < B; ++b) {
      // Every token but the last generated one has its rows stored.
      INFINIGEN_CHECK(stored[b] + 1 == static_cast<int64_t>(s.tokens_[b].size()), where,
                      ": sequence ", b + 1, " has ", s.tokens_[b].size(), " tokens but ", stored[b],
                      " stored rows");
      s.history_.emplace_back(s.tokens_[b].begin(), s.tokens_[b].end() - 1);
    }
    const json& next = manifest.at("next_segment");
    INFINIGEN_CHECK(
        next.is_number_integer() && next.get<int64_t>() >= 1 && next.get<int64_t>() < 1000000,
        where, ": malformed next_segment");
    s.next_segment_ = next.get<int64_t>();
    // Every file the manifest names must be there, whole, before anything is computed.
    std::vector<const Segment*> named = {&s.prefix_};
    for (const Segment& segment : s.segments_) named.push_back(&segment);
    for (const Segment* segment : named) {
      for (const FileRecord& file : segment->layers) {
        const fs::path p = directory / file.path;
        INFINIGEN_CHECK(fs::is_regular_file(p), p.string(),
                        ": missing (the session is incomplete)");
        INFINIGEN_CHECK(fs::file_size(p) == file.bytes, p.string(), ": ", fs::file_size(p),
                        " bytes, the manifest says ", file.bytes, " (the session is corrupt)");
      }
    }
  } catch (const json::exception& e) {
    fail(where, ": malformed manifest (", e.what(), ")");
  }
  return session;
}

void DiskSession::verify() const {
  const auto check = [&](const FileRecord& file) {
    if (file.path.empty()) return;
    const fs::path path = directory_ / file.path;
    const auto [crc, bytes] = checksum_file(path);
    INFINIGEN_CHECK(bytes == file.bytes && crc == file.crc32, path.string(),
                    ": checksum mismatch (the session is corrupt)");
  };
  for (const Segment& segment : segments_) {
    for (const FileRecord& file : segment.layers) check(file);
  }
  for (const FileRecord& file : prefix_.layers) check(file);
  for (const FileRecord& file : state_) check(file);
}

std::vector<std::vector<int32_t>> DiskSession::turn_prompts(
    const std::vector<std::vector<int32_t>>& new_prompts) {
  prompts_ = new_prompts;
  if (!tokens_.empty()) {
    INFINIGEN_CHECK(new_prompts.size() == tokens_.size(), "the session holds ", tokens_.size(),
                    " conversations; give one prompt for each (got ", new_prompts.size(), ")");
    for (size_t b = 0; b < tokens_.size(); ++b) {
      prompts_[b].insert(prompts_[b].begin(), tokens_[b].back());
    }
  }
  return prompts_;
}

void DiskSession::begin() {
  if (history_.empty()) return;
  read_.clear();
  for (int64_t l = 0; l < key_.num_layers; ++l) read_.push_back(std::make_unique<ReadLayer>());
  consumed_ = 0;
  reader_ = std::thread([this] { read_ahead(); });
}

void DiskSession::read_ahead() {
  const auto start = std::chrono::steady_clock::now();
  for (int64_t l = 0; l < key_.num_layers; ++l) {
    {
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [&] { return stop_ || l - consumed_ < kReadAhead; });
      if (stop_) return;
    }
    ReadLayer layer;
    try {
      const auto read = [&](const FileRecord& file) {
        const fs::path path = directory_ / file.path;
        const auto [crc, bytes] = checksum_file(path);
        INFINIGEN_CHECK(bytes == file.bytes && crc == file.crc32, path.string(),
                        ": checksum mismatch (the session is corrupt)");
        stats_.bytes_read += bytes;
        return SafetensorsFile::open(path.string());
      };
      if (!prefix_.layers.empty()) layer.prefix = read(prefix_.layers[static_cast<size_t>(l)]);
      for (const Segment& segment : segments_) {
        layer.segments.push_back(read(segment.layers[static_cast<size_t>(l)]));
      }
      const FileRecord& state = state_[static_cast<size_t>(l)];
      if (!state.path.empty()) layer.state = read(state);
    } catch (...) {
      layer.error = std::current_exception();
    }
    {
      std::lock_guard lock(mutex_);
      layer.ready = true;
      *read_[static_cast<size_t>(l)] = std::move(layer);
      stats_.read_seconds = seconds_since(start);
    }
    changed_.notify_all();
    if (layer.error) return;
  }
}

void DiskSession::restore_layer(int64_t layer, KvStore& store) {
  ReadLayer read;
  {
    const auto start = std::chrono::steady_clock::now();
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return read_[static_cast<size_t>(layer)]->ready; });
    read = std::move(*read_[static_cast<size_t>(layer)]);
    stats_.restore_wait_seconds += seconds_since(start);
  }
  if (read.error) std::rethrow_exception(read.error);
  KvStore::LayerState state;  // empty where the layer keeps none
  for (const SafetensorsEntry& entry :
       read.state ? read.state->entries() : std::vector<SafetensorsEntry>{}) {
    Tensor tensor = Tensor::empty(entry.shape, entry.dtype);
    std::memcpy(tensor.raw(), read.state->bytes(entry), entry.nbytes);
    state.emplace_back(entry.name, std::move(tensor));
  }
  store.restore_layer_state(layer, state);
  const std::vector<KvStore::TokenStream> streams = store.token_streams(layer);
  const int64_t H = key_.kv_heads;
  // Rows rows[i] of the file's sequences i into the rows from first[i] of the store's sequence
  // sequences[i], up to what the pass computes again (those need no restoring).
  const auto restore_rows = [&](const SafetensorsFile& file, const std::vector<int32_t>& rows,
                                const std::vector<int64_t>& first,
                                const std::vector<int32_t>& sequences) {
    const int64_t B = std::ssize(rows), R = *std::max_element(rows.begin(), rows.end());
    for (size_t k = 0; k < streams.size(); ++k) {
      const KvStore::TokenStream& stream = streams[k];
      const SafetensorsEntry* entry = file.find(stream.name);
      INFINIGEN_CHECK(entry != nullptr && entry->dtype == stream.dtype &&
                          entry->shape == Shape({B, H, R, stream.width}),
                      file.path(), ": no tensor ", stream.name, " of ", dtype_name(stream.dtype),
                      " ", shape_string({B, H, R, stream.width}), " (the session is corrupt)");
      const size_t row_bytes = static_cast<size_t>(stream.width) * dtype_size(stream.dtype);
      const char* data = static_cast<const char*>(file.bytes(*entry));
      for (int64_t b = 0; b < B; ++b) {
        const int64_t count = std::min<int64_t>(rows[b], store.length() - first[b]);
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t j = 0; j < count; ++j) {
            std::memcpy(store.mutable_token_row(layer, k, sequences[b], h, first[b] + j),
                        data + static_cast<size_t>((b * H + h) * R + j) * row_bytes, row_bytes);
          }
        }
      }
    }
  };
  if (read.prefix) {  // kept once: each group's in its leader's rows, which every member reads
    INFINIGEN_CHECK(store.shared() == shared_,
                    "the store does not share the prefixes of the session");
    const std::vector<int32_t>& begin = shared_.leader_first_valid();
    restore_rows(*read.prefix, prefix_.rows, {begin.begin(), begin.end()}, shared_.leaders());
  }
  const int64_t B = store.batch();
  const std::vector<int32_t> sequences = all_sequences(B);
  std::vector<int64_t> first(store.first_valid().begin(), store.first_valid().end());
  for (size_t s = 0; s < segments_.size(); ++s) {
    restore_rows(*read.segments[s], segments_[s].rows, first, sequences);
    for (int64_t b = 0; b < B; ++b) first[b] += segments_[s].rows[b];
  }
  {
    std::lock_guard lock(mutex_);
    consumed_ = layer + 1;
  }
  changed_.notify_all();
}

void DiskSession::write_segment(const KvStore& store, const std::vector<int32_t>& sequences,
                                const std::vector<int32_t>& rows_from, const Segment& segment,
                                const std::string& directory, bool with_state,
                                std::vector<FileRecord>* layer_files,
                                std::vector<FileRecord>* state_files) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t B = std::ssize(segment.rows);
  const int64_t R = *std::max_element(segment.rows.begin(), segment.rows.end());
  fs::create_directories(directory_ / directory);
  const auto record = [&](const std::string& relative) {
    const auto [crc, bytes] = checksum_file(directory_ / relative);
    stats_.bytes_written += bytes;
    return FileRecord{relative, bytes, crc};
  };
  for (int64_t l = 0; l < key_.num_layers; ++l) {
    {
      std::lock_guard lock(mutex_);
      if (stop_) return;  // abandoned: the store may be gone next
    }
    const std::vector<KvStore::TokenStream> streams = store.token_streams(l);
    INFINIGEN_CHECK(!streams.empty(), "this run's KV store cannot be saved in a session");
    const int64_t H = key_.kv_heads;
    std::vector<TensorRecord> records;
    for (const auto& stream : streams) {
      records.push_back({stream.name, stream.dtype, {B, H, R, stream.width}});
    }
    const std::string relative = directory + "/" + layer_file("layer", l);
    SafetensorsWriter writer((directory_ / relative).string(), records);
    std::vector<char> buffer;
    for (size_t k = 0; k < streams.size(); ++k) {
      const size_t row_bytes = static_cast<size_t>(streams[k].width) * dtype_size(streams[k].dtype);
      buffer.assign(static_cast<size_t>(B * H * R) * row_bytes, 0);
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t j = 0; j < segment.rows[b]; ++j) {
            std::memcpy(buffer.data() + static_cast<size_t>((b * H + h) * R + j) * row_bytes,
                        store.token_row(l, k, sequences[b], h, rows_from[b] + j), row_bytes);
          }
        }
      }
      writer.write(streams[k].name, buffer.data(), buffer.size());
    }
    writer.finish();
    layer_files->push_back(record(relative));
    if (with_state) {
      const KvStore::LayerState state = store.layer_state(l);
      if (state.empty()) {
        state_files->push_back({});
        continue;
      }
      const std::string state_path = directory + "/" + layer_file("state", l);
      std::vector<std::pair<std::string, Tensor>> tensors(state.begin(), state.end());
      write_safetensors((directory_ / state_path).string(), tensors);
      state_files->push_back(record(state_path));
    }
  }
  fsync_directory(directory_ / directory);
  stats_.write_seconds += seconds_since(start);
}

void DiskSession::remove_uncommitted() noexcept {
  std::vector<std::string> named;
  for (const Segment& segment : segments_) {
    named.push_back(fs::path(segment.layers.front().path).parent_path().string());
  }
  if (!prefix_.layers.empty()) {
    named.push_back(fs::path(prefix_.layers.front().path).parent_path().string());
  }
  std::error_code error;
  for (fs::directory_iterator entry(directory_, error), end; !error && entry != end;
       entry.increment(error)) {
    const std::string name = entry->path().filename().string();
    const bool segment = name.rfind("seg-", 0) == 0;
    if ((segment && std::find(named.begin(), named.end(), name) == named.end()) ||
        name.rfind(".manifest.json.", 0) == 0) {
      std::error_code ignored;
      fs::remove_all(entry->path(), ignored);
    }
  }
}

void DiskSession::after_first_pass(const KvStore& store, const std::vector<int32_t>& rows_from) {
  // A killed save leaves directories no manifest names; they go before this one writes.
  created_directory_ = !fs::exists(directory_);
  fs::create_directories(directory_);
  remove_uncommitted();
  new_segments_.clear();
  new_state_.clear();
  Segment segment;
  for (int64_t b = 0; b < store.batch(); ++b) {
    segment.rows.push_back(
        static_cast<int32_t>(store.length() - rows_from[static_cast<size_t>(b)]));
  }
  new_segments_.push_back(segment);
  const bool with_state = segments_.empty();
  // A first turn that shares prefixes keeps each once, in a segment of its own: group g's rows
  // from its leader.
  new_prefix_ = {};
  new_shared_ = {};
  std::string prefix_directory;
  if (segments_.empty() && !store.shared().empty()) {
    new_shared_ = store.shared();
    for (int64_t length : new_shared_.lengths())
      new_prefix_.rows.push_back(static_cast<int32_t>(length));
    prefix_directory = segment_name(next_segment_++);
  }
  const std::string directory = segment_name(next_segment_++);
  writer_ =
      std::thread([this, &store, rows_from, segment, directory, prefix_directory, with_state] {
        try {
          if (!prefix_directory.empty()) {
            write_segment(store, new_shared_.leaders(), new_shared_.leader_first_valid(),
                          new_prefix_, prefix_directory, false, &new_prefix_.layers, nullptr);
          }
          write_segment(store, all_sequences(store.batch()), rows_from, segment, directory,
                        with_state, &new_segments_.front().layers, &new_state_);
        } catch (...) {
          writer_error_ = std::current_exception();
        }
      });
}

void DiskSession::abandon() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  if (writer_.joinable()) writer_.join();
  if (reader_.joinable()) reader_.join();
  // An interrupted or failed turn saves nothing: what its save wrote goes, and a new session's
  // directory that this turn made goes with it (a later save would remove the files anyway, but
  // the directory would look like a session that holds something).
  remove_uncommitted();
  std::error_code ignored;
  if (created_directory_ && fs::is_empty(directory_, ignored)) fs::remove(directory_, ignored);
}

void DiskSession::finish(const KvStore& store, const std::vector<int32_t>& rows_from,
                         const std::vector<std::vector<int32_t>>& generated) {
  if (reader_.joinable()) reader_.join();  // done: every layer was restored
  if (writer_.joinable()) writer_.join();
  if (writer_error_) std::rethrow_exception(writer_error_);
  Segment segment;
  bool any = false;
  for (int64_t b = 0; b < store.batch(); ++b) {
    segment.rows.push_back(
        static_cast<int32_t>(store.length() - rows_from[static_cast<size_t>(b)]));
    any = any || segment.rows.back() > 0;
  }
  if (any) {
    new_segments_.push_back(segment);
    write_segment(store, all_sequences(store.batch()), rows_from, segment,
                  segment_name(next_segment_++), false, &new_segments_.back().layers, nullptr);
  }
  // The conversation now: what it held, this turn's prompts and what was generated.
  if (tokens_.empty()) tokens_.assign(prompts_.size(), {});
  for (size_t b = 0; b < tokens_.size(); ++b) {
    // A resumed turn's prompt starts with the previous turn's last token, already in tokens_.
    const auto from = prompts_[b].begin() + (segments_.empty() ? 0 : 1);
    tokens_[b].insert(tokens_[b].end(), from, prompts_[b].end());
    tokens_[b].insert(tokens_[b].end(), generated[b].begin(), generated[b].end());
  }
  if (segments_.empty()) {
    state_ = new_state_;
    prefix_ = new_prefix_;
    shared_ = new_shared_;
  }
  segments_.insert(segments_.end(), new_segments_.begin(), new_segments_.end());
  new_segments_.clear();
  commit();
}

void DiskSession::commit() {
  json manifest = {{"format", kFormat}, {"version", kVersion}, {"key", key_json(key_)}};
  manifest["sequences"] = tokens_;
  json segments = json::array();
  for (const Segment& segment : segments_) {
    json files = json::array();
    for (const FileRecord& file : segment.layers) files.push_back(file_json(file));
    segments.push_back({{"rows", segment.rows}, {"files", files}});
  }
  manifest["segments"] = segments;
  if (!prefix_.layers.empty()) {
    json files = json::array();
    for (const FileRecord& file : prefix_.layers) files.push_back(file_json(file));
    manifest["prefix"] = {{"rows", prefix_.rows}, {"groups", shared_.groups()}, {"files", files}};
  }
  json state = json::array();
  for (const FileRecord& file : state_) state.push_back(file_json(file));
  manifest["state"] = state;
  manifest["next_segment"] = next_segment_;
  manifest["checksum"] = hex32(manifest_checksum(manifest));
  write_text_file(directory_ / kManifest, manifest.dump(1) + "\n");
  fsync_directory(directory_);
}

DrySessionTurn::DrySessionTurn(int64_t batch, int64_t history_len, int64_t num_layers,
                               int64_t kv_heads)
    : history_(static_cast<size_t>(batch),
               std::vector<int32_t>(static_cast<size_t>(history_len), 0)),
      num_layers_(num_layers),
      kv_heads_(kv_heads) {}

void DrySessionTurn::restore_layer(int64_t layer, KvStore& store) {
  Trace* trace = active_trace();
  INFINIGEN_CHECK(trace != nullptr, "a dry session turn runs inside a trace");
  if (reads_.empty()) {
    // The read-ahead starts with the turn: every layer's files, one after another. A layer's
    // files hold each token stream's rows (B, H_kv, history, width), and the layer's state.
    const int64_t rows = store.batch() * kv_heads_ * std::ssize(history_.front());
    for (int64_t l = 0; l < num_layers_; ++l) {
      store.restore_layer_state(l, {});  // shapes only in a dry run
      uint64_t bytes = 0;
      for (const KvStore::TokenStream& stream : store.token_streams(l)) {
        bytes += static_cast<uint64_t>(rows * stream.width) * dtype_size(stream.dtype);
      }
      for (const auto& [name, tensor] : store.layer_state(l)) bytes += tensor.nbytes();
      bytes_.push_back(bytes);
      reads_.push_back(trace->transfer(TracedKind::Read, "session_read", l, bytes, 1,
                                       TransferContent::KvRange, -1));
    }
  }
  trace->host_waits(reads_[static_cast<size_t>(layer)]);
  traced("session_restore", {static_cast<int64_t>(bytes_[static_cast<size_t>(layer)])});
}

void drop_from_page_cache(const fs::path& directory) {
  for (const fs::directory_entry& entry : fs::recursive_directory_iterator(directory)) {
    if (!entry.is_regular_file()) continue;
    const int fd = ::open(entry.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

}  // namespace infinigen
