// offload: a session's manifest.json (offload/session.h, docs/sessions.md): what a session on
// disk holds, read back with every check and written atomically, and the files it names, read
// back against their sizes and CRC-32s.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "core/shared_prefixes.h"
#include "offload/session_key.h"

namespace infinigen {

inline constexpr const char* kSessionManifest = "manifest.json";

// A file the manifest names.
struct SessionFile {
  std::string path;  // relative to the session directory; empty: no file
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
};

// The rows one turn's first pass, or its decode steps, added, in one file per layer.
struct SessionSegment {
  std::vector<int32_t> rows;        // (B): rows each sequence has in this segment
  std::vector<SessionFile> layers;  // (L)
};

struct SessionManifest {
  std::vector<std::vector<int32_t>> tokens;  // (B): the conversation so far
  std::vector<SessionSegment> segments;
  SessionSegment
      prefix;  // the prefixes groups of the conversations share, each kept once: rows (G)
  SharedPrefixes shared;           // those groups; empty: none
  std::vector<SessionFile> state;  // (L): path empty where a layer keeps no state
  int64_t next_segment = 1;        // the number of the next segment directory
  // What the last turn's caller said of it, committed with it (empty: nothing): a batch job's
  // request id and output line, so that a job killed after the save and before its line was
  // written finds the line here instead of running the turn twice.
  std::string turn_label;
  std::string turn_record;
};

// The name of segment directory `index` ("seg-NNNNNN"), and of a layer's file in it
// (`prefix`-LLL.safetensors: "layer" for its rows, "state" for the layer's state).
std::string session_segment_name(int64_t index);
std::string session_layer_file(const std::string& prefix, int64_t layer);

// The manifest of the session in `directory`, checked (format, checksum, shapes, every file it
// names there with its size) and its key compared with `key`: one-line Errors naming what differs
// or is wrong. Every token of a sequence but the last has its rows stored.
SessionManifest read_session_manifest(const std::filesystem::path& directory,
                                      const SessionKey& key);

// A session as it was saved, whatever it was saved with.
struct SavedSession {
  SessionKey key;  // kv_heads is not saved: 0
  SessionManifest manifest;
};
// The session in `directory` with every check of read_session_manifest but the comparison of its
// key, which is returned: what tools that only move its files (compaction) need.
SavedSession read_saved_session(const std::filesystem::path& directory);

// Replaces `directory`'s manifest.json with `manifest` under `key` atomically (a hidden sibling
// written, fsynced and renamed, the directory fsynced).
void write_session_manifest(const std::filesystem::path& directory, const SessionKey& key,
                            const SessionManifest& manifest);

// The record of the file `relative` in `directory`, read whole for its CRC-32.
SessionFile session_file(const std::filesystem::path& directory, const std::string& relative);

// Removes from `directory` what `manifest` does not name: segment directories and files in them
// (what a save or a compaction that never committed left, or the segments a committed compaction
// merged) and manifest staging files. Errors are ignored: what stays goes with the next save.
void remove_unnamed_session_files(const std::filesystem::path& directory,
                                  const SessionManifest& manifest) noexcept;

// Reads `file` in `directory` whole and checks its size and CRC-32 against the record (one-line
// Error); returns its size.
uint64_t check_session_file(const std::filesystem::path& directory, const SessionFile& file);

}  // namespace infinigen
