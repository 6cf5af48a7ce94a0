// offload: a session's segments merged into one, committed like a save.
#include "offload/session_compact.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "core/error.h"
#include "core/file_io.h"
#include "core/safetensors.h"

namespace infinigen {

namespace fs = std::filesystem;

SessionManifest compact_session_segments(
    const fs::path& directory, const SessionManifest& manifest, uint64_t* bytes_written,
    const std::function<void(const std::string&)>& after_file) {
  const std::vector<SessionSegment>& segments = manifest.segments;
  INFINIGEN_CHECK(!segments.empty(), directory.string(), ": no segments to compact");
  const int64_t B = std::ssize(manifest.tokens);
  const int64_t L = std::ssize(segments.front().layers);
  SessionSegment merged;
  merged.rows.assign(static_cast<size_t>(B), 0);
  for (const SessionSegment& segment : segments) {
    for (int64_t b = 0; b < B; ++b) merged.rows[b] += segment.rows[b];
  }
  const int64_t R = *std::max_element(merged.rows.begin(), merged.rows.end());
  const std::string name = session_segment_name(manifest.next_segment);
  fs::create_directories(directory / name);
  for (int64_t l = 0; l < L; ++l) {
    // The layer's file of every segment, checked; each holds per token stream (B, H_kv, R_s,
    // width), sequence b's rows[b] rows first, R_s the segment's largest count.
    std::vector<std::shared_ptr<const SafetensorsFile>> files;
    for (const SessionSegment& segment : segments) {
      const SessionFile& file = segment.layers[static_cast<size_t>(l)];
      check_session_file(directory, file);
      files.push_back(SafetensorsFile::open((directory / file.path).string()));
    }
    const std::vector<SafetensorsEntry>& streams = files.front()->entries();
    INFINIGEN_CHECK(!streams.empty() && streams.front().shape.size() == 4, files.front()->path(),
                    ": not a session segment (the session is corrupt)");
    const int64_t H = streams.front().shape[1];
    std::vector<TensorRecord> records;
    for (const SafetensorsEntry& stream : streams) {
      records.push_back({stream.name, stream.dtype, {B, H, R, stream.shape.back()}});
    }
    const std::string relative = name + "/" + session_layer_file("layer", l);
    SafetensorsWriter writer((directory / relative).string(), records);
    std::vector<char> buffer;
    for (const SafetensorsEntry& stream : streams) {
      const int64_t width = stream.shape.back();
      const size_t row_bytes = static_cast<size_t>(width) * dtype_size(stream.dtype);
      buffer.assign(static_cast<size_t>(B * H * R) * row_bytes, 0);
      std::vector<int64_t> filled(static_cast<size_t>(B), 0);  // rows of sequence b so far
      for (size_t s = 0; s < segments.size(); ++s) {
        const std::vector<int32_t>& rows = segments[s].rows;
        const int64_t R_s = *std::max_element(rows.begin(), rows.end());
        const SafetensorsEntry* entry = files[s]->find(stream.name);
        INFINIGEN_CHECK(entry != nullptr && entry->dtype == stream.dtype &&
                            entry->shape == Shape({B, H, R_s, width}),
                        files[s]->path(), ": no tensor ", stream.name, " of ",
                        dtype_name(stream.dtype), " ", shape_string({B, H, R_s, width}),
                        " (the session is corrupt)");
        const char* data = static_cast<const char*>(files[s]->bytes(*entry));
        for (int64_t b = 0; b < B; ++b) {
          for (int64_t h = 0; h < H; ++h) {
            std::memcpy(
                buffer.data() + static_cast<size_t>((b * H + h) * R + filled[b]) * row_bytes,
                data + static_cast<size_t>((b * H + h) * R_s) * row_bytes,
                static_cast<size_t>(rows[b]) * row_bytes);
          }
          filled[b] += rows[b];
        }
      }
      writer.write(stream.name, buffer.data(), buffer.size());
    }
    writer.finish();
    merged.layers.push_back(session_file(directory, relative));
    *bytes_written += merged.layers.back().bytes;
    if (after_file) after_file(relative);
  }
  fsync_directory(directory / name);
  SessionManifest compacted = manifest;
  compacted.segments = {merged};
  ++compacted.next_segment;
  return compacted;
}

SessionCompaction compact_session(const fs::path& directory,
                                  const std::function<void(const std::string&)>& after_step) {
  const SavedSession saved = read_saved_session(directory);
  remove_unnamed_session_files(directory, saved.manifest);  // what a killed save left
  SessionCompaction result;
  result.segments = std::ssize(saved.manifest.segments);
  if (result.segments <= 1) return result;
  SessionManifest compacted;
  try {
    compacted =
        compact_session_segments(directory, saved.manifest, &result.bytes_written, after_step);
    write_session_manifest(directory, saved.key, compacted);
  } catch (...) {
    remove_unnamed_session_files(directory, saved.manifest);  // the session stays as it was
    throw;
  }
  if (after_step) after_step(kSessionManifest);
  remove_unnamed_session_files(directory, compacted);
  if (after_step) after_step("merged segments removed");
  return result;
}

}  // namespace infinigen
