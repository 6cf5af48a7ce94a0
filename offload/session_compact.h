// offload: compaction of a session's segments (docs/sessions.md, "Compaction"). Every turn adds
// two segments, each one file per layer, so a long conversation's restore would open and check
// ever more small files; compaction merges the rows of every segment into one new segment, byte
// for byte (a resumed turn restores the same rows), and commits it the way a save commits a turn.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

#include "offload/session_manifest.h"

namespace infinigen {

// A save that leaves more segments than this merges them into one (run --session-compact-after).
// Each compaction rewrites the whole history, which every resumed turn reads anyway: compacting
// every 8 turns or so writes an eighth of what the turns read, and keeps a restore at most 16
// segment files per layer.
inline constexpr int64_t kSessionCompactAfter = 16;

// Writes the rows of `manifest`'s segments, in their order, as one new segment of `directory`
// (numbered next_segment; each file fsynced, then the segment directory) and returns `manifest`
// naming it instead of them. Nothing is committed: the caller writes the manifest. Every file
// merged is read and checked against its size and CRC-32 (one-line Errors naming a damaged one);
// `bytes_written` grows by the new files' sizes; `after_file`, when set, is called with each new
// file's path once it is on the disk.
SessionManifest compact_session_segments(
    const std::filesystem::path& directory, const SessionManifest& manifest,
    uint64_t* bytes_written, const std::function<void(const std::string&)>& after_file = {});

struct SessionCompaction {
  int64_t segments = 0;        // segments the session held
  uint64_t bytes_written = 0;  // 0: nothing to merge (one segment or none)
};

// `infinigen session compact DIR`: the session in `directory`, whatever it was saved with, checked
// as a resume checks it, with its segments merged into one and committed atomically (the new
// segment's files fsynced, then manifest.json replaced): a kill at any moment leaves the old
// session or the new one. What no manifest names goes, before (what a killed save left) and after
// (the merged segments); a session of one segment is left as it is. One-line Errors for what is
// not a session, or is damaged. `after_step`, when set, is called after each step that reached
// the disk (each new file, the manifest, the removal of the merged files), with its name.
SessionCompaction compact_session(const std::filesystem::path& directory,
                                  const std::function<void(const std::string&)>& after_step = {});

}  // namespace infinigen
