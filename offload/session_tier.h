// offload: the host-memory tier of sessions (CachedAttention, ATC'24, its "AttentionStore" in
// DRAM above the disk): sessions kept in memory after their turn, up to a byte budget, so that
// the next turn of the same conversation resumes with no disk read (offload/session.h,
// docs/sessions.md, "A host-memory tier").
//
// The tier is write-through: every turn is saved on disk as without it (the disk stays the truth),
// and the tier holds copies of a session's committed manifest and of every file it names, in
// anonymous memory. Evicting a session therefore writes nothing: its files are on disk already.
// Invariants: an entry holds every file its manifest names (a session is in the tier whole, or not
// at all); the entries' bytes (their files' sizes) never exceed the budget; every session in one
// tier was saved under one SessionKey (its owner's: one job, one model and policy).
//
// Which session goes when another needs the room (choose_victim): with look-ahead (a batch job
// knows every later request), the one whose next use is furthest, never used again first
// (Belady's rule); ties, and without look-ahead, the least recently used.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "offload/session_manifest.h"

namespace infinigen {

// --session-cache unless given: the tier's budget.
inline constexpr const char* kSessionCacheDefault = "10%";

inline constexpr int64_t kNeverUsedAgain = std::numeric_limits<int64_t>::max();

// A session the policy may evict.
struct TierCandidate {
  int64_t next_use = kNeverUsedAgain;  // position of its next use in the job's order
  int64_t last_use = 0;                // when it was last used (a counter: larger is later)
};

// The index in `candidates` (not empty) of the session to evict: with `look_ahead` the furthest
// next use, ties to the least recently used; without, the least recently used.
size_t choose_victim(const std::vector<TierCandidate>& candidates, bool look_ahead);

// "10%" of the machine's memory, or bytes as parse_byte_size reads them ("512M", "2G"); nullopt
// for anything else.
std::optional<uint64_t> parse_session_cache(const std::string& text);

struct SessionTierStats {
  int64_t hits = 0;        // sessions resumed from the tier
  int64_t misses = 0;      // sessions resumed from the disk
  int64_t admitted = 0;    // sessions put in the tier after a turn (or a prefetch)
  int64_t bypassed = 0;    // sessions larger than the budget, or needed later than all others
  int64_t evictions = 0;   // sessions dropped for room
  int64_t prefetched = 0;  // sessions read from the disk into the tier ahead of their turn
  uint64_t peak_bytes = 0;
};

class SessionTier {
 public:
  // A session as the tier holds it: its committed manifest and every file it names, by the
  // file's path relative to the session directory.
  struct Entry {
    SessionManifest manifest;
    std::map<std::string, std::shared_ptr<const SafetensorsFile>> files;
    uint64_t bytes = 0;  // sum of the files' sizes
  };

  explicit SessionTier(uint64_t budget) : budget_(budget) {}

  // The position of a session's next use after the current one (kNeverUsedAgain: none), by its
  // directory: set, eviction looks ahead; unset, it is LRU.
  void set_next_use(std::function<int64_t(const std::string& directory)> next_use);

  // The entry of `directory`, or null; a hit or a miss in the statistics, and the session is
  // marked used.
  std::shared_ptr<const Entry> find(const std::string& directory);
  // Whether `directory` is resident (no statistics, no use).
  bool holds(const std::string& directory) const;
  // Makes `entry` the session's (replacing what the tier held of it) when it fits the budget,
  // evicting others by the policy; with look-ahead, never a session needed sooner than this one.
  // A session that does not fit bypasses the tier (its older entry is dropped too). Returns
  // whether it was admitted. `prefetch` counts it as prefetched.
  bool put(const std::string& directory, Entry entry, bool prefetch = false);
  // Drops `directory`'s entry (a turn that failed after its session changed on disk).
  void erase(const std::string& directory);

  uint64_t budget() const { return budget_; }
  uint64_t bytes() const;
  SessionTierStats stats() const;
  // Resident sessions' directories, for tests.
  std::vector<std::string> residents() const;

 private:
  struct Resident {
    std::shared_ptr<const Entry> entry;
    int64_t last_use = 0;
  };
  int64_t next_use_locked(const std::string& directory) const;

  const uint64_t budget_;
  mutable std::mutex mutex_;  // a prefetch thread puts while the job finds
  std::function<int64_t(const std::string&)> next_use_;
  std::map<std::string, Resident> residents_;
  uint64_t bytes_ = 0;
  int64_t clock_ = 0;
  SessionTierStats stats_;
};

}  // namespace infinigen
