// offload: conversations kept on disk between runs (CachedAttention, ATC'24): `run --session DIR`
// saves each sequence's keys and values, and `run --resume DIR` continues the conversations with
// their history read back layer by layer while the new turn's first pass runs.
//
// A session directory (docs/sessions.md):
//   manifest.json                    what the session is: its format and version, the key that
//                                    must match to continue it (model identity, policy, KV dtype,
//                                    the policy's fixed options), each sequence's tokens, the
//                                    segments and state files with their sizes and CRC-32s, and
//                                    a CRC-32 of the rest of the manifest
//   seg-NNNNNN/layer-LLL.safetensors one file per layer of each segment (the rows one turn's first
//                                    pass, or its decode steps, added): per token stream of the
//                                    store ("keys", "values", InfiniGen's "partial_keys"; int4's
//                                    codes and scales) a tensor
//                                    (B, H_kv, R, width), sequence b's rows[b] rows first, in
//                                    token order, R the largest rows[b]
//   seg-NNNNNN/state-LLL.safetensors the layer's state beyond its rows (InfiniGen's partial
//                                    columns and query weights), written with the first segment
// A first turn whose prompts shared prefixes (KvStore::share_prefixes) keeps each once: the
// manifest's "prefix" segment names each sequence's group ("groups", -1 for none) and each
// group's prefix length ("rows", P_g), and holds group g's rows from its leader as (G, H_kv,
// max P_g, width) per stream; every member's tokens start with its leader's first P_g, and the
// other segments hold each sequence's own rows.
// A save writes new files only, each fsynced, then replaces manifest.json atomically (a hidden
// sibling written, fsynced and renamed, the directory fsynced): a crash or kill at any point
// leaves the previous manifest and every file it names. Files no manifest names (a save that was
// killed) are removed by the next save. A save that leaves more segments than a count first
// merges them into one (offload/session_compact.h), committed by the same manifest.
//
// The key is made in session_key.h, the manifest read and written in session_manifest.h. A
// process that runs many turns (a batch job) keeps sessions in host memory between them
// (session_tier.h): a turn resumed from there reads nothing from the disk.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/file_io.h"  // drop_from_page_cache: how a session's restore is timed cold
#include "core/generation.h"
#include "offload/session_compact.h"
#include "offload/session_key.h"
#include "offload/session_manifest.h"
#include "offload/session_tier.h"

namespace infinigen {

// Time and bytes of a turn's session I/O.
struct SessionStats {
  uint64_t bytes_read = 0;
  double read_seconds = 0.0;          // reading and checking the history (the read-ahead thread)
  double restore_wait_seconds = 0.0;  // the first pass waiting for a layer not read yet
  uint64_t bytes_written = 0;
  double write_seconds = 0.0;  // writing the turn's segments (partly while decoding)
  int64_t segments_compacted = 0;  // segments the save merged into one (0: none)
  bool from_tier = false;          // the history came from the host-memory tier, not the disk
  uint64_t bytes_from_tier = 0;    // history bytes the tier served (none read from the disk)
  int64_t tokens_dropped = 0;      // history tokens an overflow dropped, over every sequence
  double shift_seconds = 0.0;      // rotating the kept keys to their new positions (restore)
};

// What a turn's overflow keeps of a conversation (DiskSession::drop_oldest): every history token
// but [keep_prefix, keep_prefix + dropped[b]) of sequence b, the later ones moved dropped[b]
// positions earlier.
struct SessionOverflow {
  int64_t keep_prefix = 0;
  std::vector<int64_t> dropped;  // (B)
};
// The tokens each sequence must drop so that a conversation of held[b] tokens (the last one, not
// yet through the model, included), added[b] new prompt tokens and gen_len generated fits
// `context` positions, keeping its first keep_prefix and at least its last token: all zeros when
// every sequence fits. A sequence that must drop drops `margin` tokens more where its history
// has them, so that its next turns fit without dropping (and rewriting its kept history) again.
// One-line Error when one cannot fit, or when a sequence's shared prompt prefix
// (shared_lengths[b], 0 for none) is longer than keep_prefix.
std::vector<int64_t> overflow_drops(const std::vector<int64_t>& held,
                                    const std::vector<int64_t>& added, int64_t gen_len,
                                    int64_t context, int64_t keep_prefix,
                                    const std::vector<int64_t>& shared_lengths, int64_t margin = 0);

// The tokens kept at the start of a conversation when it overflows (run --keep-prefix): the
// first few tokens hold much of the attention of every later one (StreamingLLM's attention
// sinks: BOS and the start of a system prompt), so dropping them hurts most.
inline constexpr int64_t kSessionKeepPrefix = 4;

class DiskSession : public Conversation {
 public:
  // A new session in `directory`: absent, empty, or holding only what a first save that never
  // committed left (segment directories, no manifest.json). One-line Error otherwise.
  static std::unique_ptr<DiskSession> create(const std::filesystem::path& directory,
                                             SessionKey key);
  // The session in `directory`, its manifest checked (format, checksum, shapes, file list) and
  // its key compared with `key`: one-line Errors naming what differs or is wrong. The files'
  // checksums are checked as they are read.
  // With a `tier` that holds the session, its manifest and files come from there, and nothing is
  // read from the disk; a tier also receives the session after its turn (commit()).
  static std::unique_ptr<DiskSession> open(const std::filesystem::path& directory,
                                           const SessionKey& key, SessionTier* tier = nullptr);
  // The session in `directory` read whole from the disk, every file checked and copied into
  // memory, as a tier holds it (a prefetch); `bytes_read` adds what was read. Nothing but the
  // manifest is read when its files pass `most` bytes (nullopt then).
  static std::optional<SessionTier::Entry> read_whole(const std::filesystem::path& directory,
                                                      const SessionKey& key, uint64_t most,
                                                      uint64_t* bytes_read);
  // A new session that goes to `tier` after its first turn.
  void set_tier(SessionTier* tier) { tier_ = tier; }
  ~DiskSession() override;

  // Sequences of the session (0 for a new one).
  int64_t batch() const { return std::ssize(manifest_.tokens); }
  // Per sequence, every token of the conversation so far.
  const std::vector<std::vector<int32_t>>& tokens() const { return manifest_.tokens; }
  // The prompts a turn's request carries for `new_prompts` (one per sequence): for a resumed
  // session each sequence's last generated token (not yet through the model) then its new
  // prompt; for a new session the prompts themselves. Remembered for the save.
  std::vector<std::vector<int32_t>> turn_prompts(
      const std::vector<std::vector<int32_t>>& new_prompts);

  // Makes room for this turn when a conversation would pass a rotary model's context
  // (docs/sessions.md, "Overflow"): `added[b]` new prompt tokens and `gen_len` generated. Where
  // sequence b would not fit, its oldest history tokens after the first `keep_prefix` go, and
  // `margin` more (overflow_drops); the restore moves the rest to their new positions (keys rotated
  // back by the tokens dropped, what the store derives from keys derived again) and the save
  // rewrites the kept history as one segment. Returns the tokens dropped (0: the turn fits; nothing
  // changes). One-line Errors: a model with learned positions (OPT), a policy whose rows cannot
  // move (KvPolicy::shifts_positions), and overflow_drops's.
  int64_t drop_oldest(const ModelConfig& config, const std::vector<int64_t>& added, int64_t gen_len,
                      int64_t keep_prefix, int64_t margin = 0);

  const std::vector<std::vector<int32_t>>& history() const override { return history_; }
  const SharedPrefixes& shared_prefixes() const override { return manifest_.shared; }
  void begin() override;
  void restore_layer(int64_t layer, KvStore& store) override;
  void after_first_pass(const KvStore& store, const std::vector<int32_t>& rows_from) override;
  void finish(const KvStore& store, const std::vector<int32_t>& rows_from,
              const std::vector<std::vector<int32_t>>& generated) override;
  void abandon() override;

  // A save that leaves more than `segments` segments merges them into one (0: never);
  // kSessionCompactAfter unless set.
  void set_compact_after(int64_t segments) { compact_after_ = segments; }
  // With deferred commits, finish() writes the turn's files but not its manifest, and commit()
  // does, with the caller's record of the turn (SessionManifest::turn_label, turn_record).
  void set_defer_commit(bool defer) { defer_commit_ = defer; }
  void commit(const std::string& label, const std::string& record);
  // The record committed with the last turn (empty for none).
  const std::string& turn_label() const { return manifest_.turn_label; }
  const std::string& turn_record() const { return manifest_.turn_record; }

  const SessionStats& stats() const { return stats_; }
  // Reads every file the manifest names and checks its size and checksum (one-line Error).
  void verify() const;

 private:
  DiskSession(std::filesystem::path directory, SessionKey key);
  // After an overflow's restore of `layer`: sequence b's restored rows after its first kept[b]
  // own rows (the kept prefix) moved overflow_->dropped[b] positions earlier, so their keys are
  // rotated back by as many, and the store derives what it keeps from them again.
  void move_kept_keys(int64_t layer, KvStore& store,
                      const std::vector<KvStore::TokenStream>& streams,
                      const std::vector<int64_t>& kept);
  // Reads and checks every file of layers [0, L) in order, at most kReadAhead layers ahead of
  // restore_layer.
  void read_ahead();
  // Writes segment `segment` (and the state files when `with_state`): its sequence i holds rows
  // [rows_from[i], rows_from[i] + rows[i]) of `store`'s sequence sequences[i] (every sequence, or
  // for the shared prefixes each group's leader), its layer files into `layer_files`.
  void write_segment(const KvStore& store, const std::vector<int32_t>& sequences,
                     const std::vector<int32_t>& rows_from, const SessionSegment& segment,
                     const std::string& directory, bool with_state,
                     std::vector<SessionFile>* layer_files, std::vector<SessionFile>* state_files);
  // Writes layer `layer`'s state (KvStore::layer_state) into `directory` of the session; an
  // empty file record where the layer keeps none.
  SessionFile write_state(const KvStore& store, const std::string& directory, int64_t layer);

  // The file `file` of the session: from the tier's entry when there is one, else read from the
  // disk and checked (and copied into memory when a tier will keep the session).
  std::shared_ptr<const SafetensorsFile> load(const SessionFile& file);
  // Writes manifest `next` (the turn's commit) and hands the session to the tier; with
  // `replaced`, removes the files it no longer names (segments merged, or moved by an overflow).
  void commit_manifest(SessionManifest next, bool replaced);
  // After a file of `relative` was written: its in-memory copy, when a tier will keep the session.
  void keep_written(const std::string& relative);

  std::filesystem::path directory_;
  bool created_directory_ = false;  // this turn made directory_ (a new session's first save)
  SessionKey key_;
  int64_t compact_after_ = kSessionCompactAfter;
  SessionManifest manifest_;  // what the session holds: as read, or as last committed
  std::vector<std::vector<int32_t>> history_;  // (B): tokens whose rows are stored
  std::vector<std::vector<int32_t>> prompts_;  // (B): this turn's prompts, for the save
  std::optional<SessionOverflow> overflow_;    // this turn drops history tokens
  std::vector<float> rope_inv_freq_;           // (d / 2): the rotation that moves kept keys
  SessionStats stats_;
  SessionTier* tier_ = nullptr;
  std::shared_ptr<const SessionTier::Entry> cached_;  // the tier's copy this turn resumed from
  // Copies in memory of the files this turn read or wrote, by relative path, for the tier.
  std::mutex kept_mutex_;
  std::map<std::string, std::shared_ptr<const SafetensorsFile>> kept_;
  bool defer_commit_ = false;
  std::optional<SessionManifest> pending_;  // finished, waiting for commit()
  bool pending_replaced_ = false;

  // The read-ahead: per layer its files read and checked, or the error that stopped it.
  struct ReadLayer;
  std::vector<std::unique_ptr<ReadLayer>> read_;
  std::mutex mutex_;
  std::condition_variable changed_;
  int64_t consumed_ = 0;  // layers restored so far
  bool stop_ = false;
  std::thread reader_;

  // The turn's first-pass segment, written while the decode steps run.
  std::thread writer_;
  std::exception_ptr writer_error_;
  std::vector<SessionSegment> new_segments_;
  SessionSegment new_prefix_;
  SharedPrefixes new_shared_;
  std::vector<SessionFile> new_state_;
};

// A resumed turn in a dry run (core/trace.h), for the cost model: every sequence holds
// `history_len` tokens, whose layers are read from the disk one after another from the turn's
// start (session_read on the disk lane), each waited for and copied into the pool
// (session_restore) before the pass needs its layer, as DiskSession does; nothing is read or
// written.
class DrySessionTurn : public Conversation {
 public:
  DrySessionTurn(int64_t batch, int64_t history_len, int64_t num_layers, int64_t kv_heads);
  const std::vector<std::vector<int32_t>>& history() const override { return history_; }
  void restore_layer(int64_t layer, KvStore& store) override;
  void after_first_pass(const KvStore&, const std::vector<int32_t>&) override {}
  void finish(const KvStore&, const std::vector<int32_t>&,
              const std::vector<std::vector<int32_t>>&) override {}

 private:
  std::vector<std::vector<int32_t>> history_;
  int64_t num_layers_;
  int64_t kv_heads_;
  std::vector<int32_t> reads_;   // per layer: its traced read
  std::vector<uint64_t> bytes_;  // per layer: bytes read
};

}  // namespace infinigen
