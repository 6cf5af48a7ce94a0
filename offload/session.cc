// offload: sessions on disk: a turn's history read ahead and restored layer by layer, and its
// rows saved while the decode steps run.
#include "offload/session.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <numeric>

#include "core/error.h"
#include "core/file_io.h"
#include "core/rope.h"
#include "core/safetensors.h"
#include "offload/kv_policy.h"
#include "offload/session_compact.h"

namespace infinigen {

namespace fs = std::filesystem;

namespace {

constexpr int64_t kReadAhead = 4;  // layers read ahead of the pass

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Sequences 0, 1, ..., batch - 1.
std::vector<int32_t> all_sequences(int64_t batch) {
  std::vector<int32_t> sequences(static_cast<size_t>(batch));
  std::iota(sequences.begin(), sequences.end(), 0);
  return sequences;
}

}  // namespace

std::vector<int64_t> overflow_drops(const std::vector<int64_t>& held,
                                    const std::vector<int64_t>& added, int64_t gen_len,
                                    int64_t context, int64_t keep_prefix,
                                    const std::vector<int64_t>& shared_lengths, int64_t margin) {
  INFINIGEN_CHECK(keep_prefix >= 0, "--keep-prefix must be at least 0, got ", keep_prefix);
  INFINIGEN_CHECK(margin >= 0, "--overflow-margin must be at least 0, got ", margin);
  std::vector<int64_t> dropped(held.size(), 0);
  for (size_t b = 0; b < held.size(); ++b) {
    // The sizes come from the user: clamped where the sum could overflow (such a turn cannot fit).
    constexpr int64_t most = std::numeric_limits<int64_t>::max() / 4;
    const int64_t over =
        std::min(held[b], most) + std::min(added[b], most) + std::min(gen_len, most) - context;
    if (over <= 0) continue;
    // Droppable: the history after the kept prefix, up to the last token (not yet through the
    // model, it starts this turn's prompt).
    const int64_t droppable = std::max<int64_t>(0, held[b] - 1 - keep_prefix);
    INFINIGEN_CHECK(over <= droppable, "sequence ", b + 1, ": this turn's ", added[b],
                    " prompt tokens and ", gen_len, " generated need ", over,
                    " positions more than the context of ", context, " leaves, and only ",
                    droppable, " history tokens after the kept prefix of ", keep_prefix,
                    " can be dropped");
    INFINIGEN_CHECK(shared_lengths.empty() || shared_lengths[b] <= keep_prefix, "sequence ", b + 1,
                    " shares a prompt prefix of ", shared_lengths[b],
                    " tokens with others, which an overflow cannot drop: --keep-prefix must be at "
                    "least that");
    // And the margin, as far as the history goes: the next turns fit without dropping again.
    dropped[b] = over + std::min(margin, droppable - over);
  }
  return dropped;
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
  INFINIGEN_CHECK(!fs::exists(directory / kSessionManifest), directory.string(),
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
  session->manifest_.state.assign(static_cast<size_t>(session->key_.num_layers), {});
  return session;
}

std::unique_ptr<DiskSession> DiskSession::open(const fs::path& directory, const SessionKey& key,
                                               SessionTier* tier) {
  std::unique_ptr<DiskSession> session(new DiskSession(directory, key));
  session->tier_ = tier;
  // Every session in a tier was saved under its owner's key, this run's (session_tier.h).
  if (tier) session->cached_ = tier->find(directory.string());
  session->stats_.from_tier = session->cached_ != nullptr;
  session->manifest_ =
      session->cached_ ? session->cached_->manifest : read_session_manifest(directory, key);
  for (const std::vector<int32_t>& tokens : session->manifest_.tokens) {
    // Every token but the last generated one has its rows stored.
    session->history_.emplace_back(tokens.begin(), tokens.end() - 1);
  }
  return session;
}

std::optional<SessionTier::Entry> DiskSession::read_whole(const fs::path& directory,
                                                          const SessionKey& key, uint64_t most,
                                                          uint64_t* bytes_read) {
  SessionTier::Entry entry;
  entry.manifest = read_session_manifest(directory, key);
  std::vector<const SessionFile*> files;
  for (const SessionSegment& segment : entry.manifest.segments) {
    for (const SessionFile& file : segment.layers) files.push_back(&file);
  }
  for (const SessionFile& file : entry.manifest.prefix.layers) files.push_back(&file);
  for (const SessionFile& file : entry.manifest.state) {
    if (!file.path.empty()) files.push_back(&file);
  }
  for (const SessionFile* file : files) entry.bytes += file->bytes;
  if (entry.bytes > most) return std::nullopt;
  for (const SessionFile* file : files) {
    *bytes_read += check_session_file(directory, *file);
    entry.files[file->path] =
        SafetensorsFile::copy_in_memory(*SafetensorsFile::open((directory / file->path).string()));
  }
  return entry;
}

void DiskSession::verify() const {
  const auto check = [&](const SessionFile& file) {
    if (!file.path.empty()) check_session_file(directory_, file);
  };
  for (const SessionSegment& segment : manifest_.segments) {
    for (const SessionFile& file : segment.layers) check(file);
  }
  for (const SessionFile& file : manifest_.prefix.layers) check(file);
  for (const SessionFile& file : manifest_.state) check(file);
}

std::vector<std::vector<int32_t>> DiskSession::turn_prompts(
    const std::vector<std::vector<int32_t>>& new_prompts) {
  prompts_ = new_prompts;
  if (!manifest_.tokens.empty()) {
    INFINIGEN_CHECK(new_prompts.size() == manifest_.tokens.size(), "the session holds ",
                    manifest_.tokens.size(), " conversations; give one prompt for each (got ",
                    new_prompts.size(), ")");
    for (size_t b = 0; b < manifest_.tokens.size(); ++b) {
      prompts_[b].insert(prompts_[b].begin(), manifest_.tokens[b].back());
    }
  }
  return prompts_;
}

int64_t DiskSession::drop_oldest(const ModelConfig& config, const std::vector<int64_t>& added,
                                 int64_t gen_len, int64_t keep_prefix, int64_t margin) {
  std::vector<int64_t> held, shared_lengths;
  for (const std::vector<int32_t>& tokens : manifest_.tokens) held.push_back(std::ssize(tokens));
  for (int64_t b = 0; !manifest_.shared.empty() && b < batch(); ++b) {
    shared_lengths.push_back(manifest_.shared.prefix_length(b));
  }
  const std::vector<int64_t> dropped = overflow_drops(held, added, gen_len, config.max_positions,
                                                      keep_prefix, shared_lengths, margin);
  const int64_t total = std::accumulate(dropped.begin(), dropped.end(), int64_t{0});
  if (total == 0) return 0;
  INFINIGEN_CHECK(config.rope.enabled(), "the conversation passes the model's context of ",
                  config.max_positions, " positions, and ", config.name,
                  " learns its positions (no rotary embedding): its kept keys cannot move to new "
                  "positions; start a new session");
  INFINIGEN_CHECK(kv_policy(key_.policy).shifts_positions,
                  "the conversation passes the model's context of ", config.max_positions,
                  " positions, and the policy ", key_.policy,
                  "'s saved rows cannot move to new positions; start a new session");
  // A store saved as its state (a capped pool's positions) keeps no rows per token to move.
  INFINIGEN_CHECK(!manifest_.segments.empty(), "the conversation passes the model's context of ",
                  config.max_positions, " positions, and the session keeps its store's positions (",
                  option("kv_pool_limit"), "), not rows per token to move; start a new session");
  rope_inv_freq_ = rope_inv_freq(config.rope, config.head_dim());
  for (size_t b = 0; b < history_.size(); ++b) {
    const auto first = history_[b].begin() + keep_prefix;
    history_[b].erase(first, first + dropped[b]);
  }
  overflow_ = SessionOverflow{keep_prefix, dropped};
  stats_.tokens_dropped = total;
  return total;
}

void DiskSession::begin() {
  if (history_.empty()) return;
  read_.clear();
  for (int64_t l = 0; l < key_.num_layers; ++l) read_.push_back(std::make_unique<ReadLayer>());
  consumed_ = 0;
  reader_ = std::thread([this] { read_ahead(); });
}

std::shared_ptr<const SafetensorsFile> DiskSession::load(const SessionFile& file) {
  if (cached_) {
    const auto it = cached_->files.find(file.path);
    INFINIGEN_CHECK(it != cached_->files.end(), file.path, ": not in the session tier");
    stats_.bytes_from_tier += file.bytes;
    return it->second;
  }
  stats_.bytes_read += check_session_file(directory_, file);
  std::shared_ptr<const SafetensorsFile> read =
      SafetensorsFile::open((directory_ / file.path).string());
  if (!tier_) return read;
  std::shared_ptr<const SafetensorsFile> copy = SafetensorsFile::copy_in_memory(*read);
  std::lock_guard lock(kept_mutex_);
  kept_[file.path] = copy;
  return copy;
}

void DiskSession::keep_written(const std::string& relative) {
  if (!tier_) return;
  // Just written: the page cache holds it, and the copy reads no disk.
  std::shared_ptr<const SafetensorsFile> copy =
      SafetensorsFile::copy_in_memory(*SafetensorsFile::open((directory_ / relative).string()));
  std::lock_guard lock(kept_mutex_);
  kept_[relative] = std::move(copy);
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
      const auto read = [&](const SessionFile& file) { return load(file); };
      if (!manifest_.prefix.layers.empty())
        layer.prefix = read(manifest_.prefix.layers[static_cast<size_t>(l)]);
      for (const SessionSegment& segment : manifest_.segments) {
        layer.segments.push_back(read(segment.layers[static_cast<size_t>(l)]));
      }
      const SessionFile& state = manifest_.state[static_cast<size_t>(l)];
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
  // Rows rows[i] of the file's sequence i into the store's sequence sequences[i], file row j at
  // store row destination(i, j) (negative: dropped by an overflow), up to what the pass computes
  // again (those need no restoring).
  const auto restore_rows = [&](const SafetensorsFile& file, const std::vector<int32_t>& rows,
                                const std::vector<int32_t>& sequences, const auto& destination) {
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
        for (int64_t j = 0; j < rows[b]; ++j) {
          const int64_t row = destination(b, j);
          if (row < 0 || row >= store.length()) continue;
          for (int64_t h = 0; h < H; ++h) {
            std::memcpy(store.mutable_token_row(layer, k, sequences[b], h, row),
                        data + static_cast<size_t>((b * H + h) * R + j) * row_bytes, row_bytes);
          }
        }
      }
    }
  };
  if (read.prefix) {  // kept once: each group's in its leader's rows, which every member reads
    INFINIGEN_CHECK(store.shared() == manifest_.shared,
                    "the store does not share the prefixes of the session");
    const std::vector<int32_t>& begin = manifest_.shared.leader_first_valid();
    restore_rows(*read.prefix, manifest_.prefix.rows, manifest_.shared.leaders(),
                 [&](int64_t i, int64_t j) { return begin[static_cast<size_t>(i)] + j; });
  }
  const int64_t B = store.batch();
  const std::vector<int32_t> sequences = all_sequences(B);
  // Per sequence: its own history rows (after a shared prefix) the earlier segments held, the
  // first `kept[b]` of which stay where they are, the next `dropped[b]` of which an overflow drops.
  std::vector<int64_t> held(static_cast<size_t>(B), 0), kept(static_cast<size_t>(B)),
      dropped(static_cast<size_t>(B), 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t shared = manifest_.shared.empty() ? 0 : manifest_.shared.prefix_length(b);
    kept[b] = overflow_ ? overflow_->keep_prefix - shared : std::numeric_limits<int64_t>::max();
    if (overflow_) dropped[b] = overflow_->dropped[b];
  }
  for (size_t s = 0; s < manifest_.segments.size(); ++s) {
    restore_rows(*read.segments[s], manifest_.segments[s].rows, sequences,
                 [&](int64_t b, int64_t j) -> int64_t {
                   const int64_t own = held[b] + j;
                   if (own < kept[b]) return store.first_valid()[b] + own;
                   if (own < kept[b] + dropped[b]) return -1;
                   return store.first_valid()[b] + own - dropped[b];
                 });
    for (int64_t b = 0; b < B; ++b) held[b] += manifest_.segments[s].rows[b];
  }
  if (overflow_) move_kept_keys(layer, store, streams, kept);
  {
    std::lock_guard lock(mutex_);
    consumed_ = layer + 1;
  }
  changed_.notify_all();
}

void DiskSession::move_kept_keys(int64_t layer, KvStore& store,
                                 const std::vector<KvStore::TokenStream>& streams,
                                 const std::vector<int64_t>& kept) {
  const auto start = std::chrono::steady_clock::now();
  const auto keys = std::find_if(streams.begin(), streams.end(),
                                 [](const KvStore::TokenStream& s) { return s.name == "keys"; });
  INFINIGEN_CHECK(keys != streams.end(), "this run's KV store keeps no keys to move");
  const size_t k = static_cast<size_t>(keys - streams.begin());
  for (int64_t b = 0; b < store.batch(); ++b) {
    const int64_t delta = overflow_->dropped[static_cast<size_t>(b)];
    if (delta == 0) continue;
    RotaryShift shift(rope_inv_freq_, -delta);
    const int64_t shared = manifest_.shared.empty() ? 0 : manifest_.shared.prefix_length(b);
    const int64_t from = store.first_valid()[b] + kept[b];
    const int64_t to = std::min<int64_t>(store.length(),
                                         store.first_valid()[b] + std::ssize(history_[b]) - shared);
    for (int64_t h = 0; h < key_.kv_heads; ++h) {
      for (int64_t t = from; t < to; ++t) {
        shift.apply(store.mutable_token_row(layer, k, b, h, t), keys->dtype);
      }
    }
    if (to > from) store.rederive_rows(layer, b, from, to - from);
  }
  stats_.shift_seconds += seconds_since(start);
}

void DiskSession::write_segment(const KvStore& store, const std::vector<int32_t>& sequences,
                                const std::vector<int32_t>& rows_from,
                                const SessionSegment& segment, const std::string& directory,
                                bool with_state, std::vector<SessionFile>* layer_files,
                                std::vector<SessionFile>* state_files) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t B = std::ssize(segment.rows);
  const int64_t R = *std::max_element(segment.rows.begin(), segment.rows.end());
  fs::create_directories(directory_ / directory);
  const auto record = [&](const std::string& relative) {
    SessionFile file = session_file(directory_, relative);
    stats_.bytes_written += file.bytes;
    return file;
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
    const std::string relative = directory + "/" + session_layer_file("layer", l);
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
    keep_written(relative);
    if (with_state) state_files->push_back(write_state(store, directory, l));
  }
  fsync_directory(directory_ / directory);
  stats_.write_seconds += seconds_since(start);
}

SessionFile DiskSession::write_state(const KvStore& store, const std::string& directory,
                                     int64_t layer) {
  const KvStore::LayerState state = store.layer_state(layer);
  if (state.empty()) return {};
  const std::string relative = directory + "/" + session_layer_file("state", layer);
  std::vector<std::pair<std::string, Tensor>> tensors(state.begin(), state.end());
  write_safetensors((directory_ / relative).string(), tensors);
  SessionFile file = session_file(directory_, relative);
  stats_.bytes_written += file.bytes;
  keep_written(relative);
  return file;
}

void DiskSession::after_first_pass(const KvStore& store, const std::vector<int32_t>& rows_from) {
  // A killed save leaves directories no manifest names; they go before this one writes.
  created_directory_ = !fs::exists(directory_);
  fs::create_directories(directory_);
  remove_unnamed_session_files(directory_, manifest_);
  new_segments_.clear();
  new_state_.clear();
  if (store.saves_state_each_turn()) return;  // its state, saved when the turn ends (finish)
  // After an overflow the kept history moved: it is saved again, with the turn's rows, as the
  // session's only segment besides a shared prefix's.
  const std::vector<int32_t>& from = overflow_ ? store.first_valid() : rows_from;
  SessionSegment segment;
  for (int64_t b = 0; b < store.batch(); ++b) {
    segment.rows.push_back(static_cast<int32_t>(store.length() - from[static_cast<size_t>(b)]));
  }
  new_segments_.push_back(segment);
  const bool with_state = manifest_.segments.empty();
  // A first turn that shares prefixes keeps each once, in a segment of its own: group g's rows
  // from its leader.
  new_prefix_ = {};
  new_shared_ = {};
  std::string prefix_directory;
  if (manifest_.segments.empty() && !store.shared().empty()) {
    new_shared_ = store.shared();
    for (int64_t length : new_shared_.lengths())
      new_prefix_.rows.push_back(static_cast<int32_t>(length));
    prefix_directory = session_segment_name(manifest_.next_segment++);
  }
  const std::string directory = session_segment_name(manifest_.next_segment++);
  writer_ = std::thread(
      [this, &store, rows_from = from, segment, directory, prefix_directory, with_state] {
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
  remove_unnamed_session_files(directory_, manifest_);
  std::error_code ignored;
  if (created_directory_ && fs::is_empty(directory_, ignored)) fs::remove(directory_, ignored);
}

void DiskSession::finish(const KvStore& store, const std::vector<int32_t>& rows_from,
                         const std::vector<std::vector<int32_t>>& generated) {
  if (reader_.joinable()) reader_.join();  // done: every layer was restored
  if (writer_.joinable()) writer_.join();
  if (writer_error_) std::rethrow_exception(writer_error_);
  const bool state_each_turn = store.saves_state_each_turn();
  if (state_each_turn) {
    // The store's whole state as the turn left it, which replaces the last turn's.
    const auto start = std::chrono::steady_clock::now();
    const std::string directory = session_segment_name(manifest_.next_segment++);
    fs::create_directories(directory_ / directory);
    for (int64_t l = 0; l < key_.num_layers; ++l)
      new_state_.push_back(write_state(store, directory, l));
    fsync_directory(directory_ / directory);
    stats_.write_seconds += seconds_since(start);
  }
  SessionSegment segment;
  bool any = false;
  for (int64_t b = 0; b < store.batch(); ++b) {
    segment.rows.push_back(
        static_cast<int32_t>(store.length() - rows_from[static_cast<size_t>(b)]));
    any = any || segment.rows.back() > 0;
  }
  if (any && !state_each_turn) {
    new_segments_.push_back(segment);
    write_segment(store, all_sequences(store.batch()), rows_from, segment,
                  session_segment_name(manifest_.next_segment++), false,
                  &new_segments_.back().layers, nullptr);
  }
  // The conversation now: what it held, this turn's prompts and what was generated. manifest_
  // stays what is committed until the new manifest is (an abandoned save removes what it does
  // not name).
  SessionManifest next = manifest_;
  const bool first_turn = next.tokens.empty();
  if (first_turn) next.tokens.assign(prompts_.size(), {});
  if (overflow_) {  // the old segments hold the history before it moved
    next.segments.clear();
    for (size_t b = 0; b < next.tokens.size(); ++b) {
      const auto first = next.tokens[b].begin() + overflow_->keep_prefix;
      next.tokens[b].erase(first, first + overflow_->dropped[b]);
    }
  }
  for (size_t b = 0; b < next.tokens.size(); ++b) {
    // A resumed turn's prompt starts with the previous turn's last token, already there.
    const auto from = prompts_[b].begin() + (first_turn ? 0 : 1);
    next.tokens[b].insert(next.tokens[b].end(), from, prompts_[b].end());
    next.tokens[b].insert(next.tokens[b].end(), generated[b].begin(), generated[b].end());
  }
  if (first_turn) {
    next.state = new_state_;
    next.prefix = new_prefix_;
    next.shared = new_shared_;
  }
  if (state_each_turn) next.state = new_state_;
  next.segments.insert(next.segments.end(), new_segments_.begin(), new_segments_.end());
  new_segments_.clear();
  // Past the count, the turn commits with every segment merged into one, and the merged ones go.
  const bool compact = compact_after_ > 0 && std::ssize(next.segments) > compact_after_;
  if (compact) {
    const auto start = std::chrono::steady_clock::now();
    stats_.segments_compacted = std::ssize(next.segments);
    next = compact_session_segments(directory_, next, &stats_.bytes_written);
    stats_.write_seconds += seconds_since(start);
  }
  // Files the new manifest no longer names go after it commits: merged or moved segments, or the
  // state of the turn before (a store saved as its state each turn).
  const bool replaced = compact || overflow_.has_value() || state_each_turn;
  if (defer_commit_) {
    pending_ = std::move(next);
    pending_replaced_ = replaced;
    return;
  }
  commit_manifest(std::move(next), replaced);
}

void DiskSession::commit(const std::string& label, const std::string& record) {
  INFINIGEN_CHECK(pending_.has_value(), "no finished turn to commit");
  SessionManifest next = std::move(*pending_);
  pending_.reset();
  next.turn_label = label;
  next.turn_record = record;
  commit_manifest(std::move(next), pending_replaced_);
}

void DiskSession::commit_manifest(SessionManifest next, bool replaced) {
  if (tier_) tier_->erase(directory_.string());  // the old entry no longer matches the disk
  write_session_manifest(directory_, key_, next);
  manifest_ = std::move(next);
  if (replaced) remove_unnamed_session_files(directory_, manifest_);
  if (!tier_) return;
  // The session as committed, every file it names in memory: this turn's reads and writes, the
  // tier's entry it resumed from, or (files a compaction wrote) copied from the page cache.
  SessionTier::Entry entry;
  entry.manifest = manifest_;
  const auto add = [&](const SessionFile& file) {
    if (file.path.empty()) return;
    std::shared_ptr<const SafetensorsFile> copy;
    if (const auto it = kept_.find(file.path); it != kept_.end()) {
      copy = it->second;
    } else if (cached_ && cached_->files.count(file.path)) {
      copy = cached_->files.at(file.path);
    } else {
      keep_written(file.path);
      copy = kept_.at(file.path);
    }
    entry.files[file.path] = copy;
    entry.bytes += file.bytes;
  };
  for (const SessionSegment& segment : manifest_.segments) {
    for (const SessionFile& file : segment.layers) add(file);
  }
  for (const SessionFile& file : manifest_.prefix.layers) add(file);
  for (const SessionFile& file : manifest_.state) add(file);
  kept_.clear();
  cached_.reset();
  tier_->put(directory_.string(), std::move(entry));
}

}  // namespace infinigen
