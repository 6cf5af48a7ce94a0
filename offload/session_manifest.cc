// offload: a session's manifest.json, read back with every check and written atomically.
#include "offload/session_manifest.h"

#include <fcntl.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/file_io.h"

namespace infinigen {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kFormat = "infinigen-session";
// The version this build writes, and the oldest it reads. A change that an older build would read
// wrongly takes a new version; reading an older one either converts what it holds or refuses it
// with one line (docs/sessions.md, "Format versions").
constexpr int64_t kVersion = 1;
constexpr int64_t kOldestVersion = 1;

// Reads `path` whole and returns its CRC-32 and size (the disk read of a restore).
std::pair<uint32_t, uint64_t> checksum_file(const fs::path& path) {
  const FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  INFINIGEN_CHECK(fd, path.string(), ": missing or unreadable (the session is incomplete)");
  uint32_t crc = 0;
  uint64_t size = 0;
  const int error = read_to_end(fd.get(), [&](std::string_view piece) {
    crc = crc32_of(piece, crc);
    size += piece.size();
  });
  if (error != 0) fail(path.string(), ": cannot read");
  return {crc, size};
}

json key_json(const SessionKey& key) {
  json options = json::object();
  for (const auto& [name, value] : key.options) options[name] = value;
  return {{"model", key.model},   {"identity", key.identity},
          {"policy", key.policy}, {"kv_dtype", std::string(dtype_name(key.kv_dtype))},
          {"options", options},   {"layers", key.num_layers}};
}

// The entries of `files`: null where a file's path is empty (a layer without state).
json files_json(const std::vector<SessionFile>& files) {
  json entries = json::array();
  for (const SessionFile& file : files) {
    if (file.path.empty()) {
      entries.push_back(nullptr);
    } else {
      entries.push_back({{"path", file.path}, {"bytes", file.bytes}, {"crc32", hex32(file.crc32)}});
    }
  }
  return entries;
}

// A file entry of a manifest; its path must stay inside the session.
SessionFile file_record(const json& entry, const std::string& where) {
  SessionFile file;
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
  return crc32_of(manifest.dump());
}

}  // namespace

namespace {

// The key a manifest was saved under (kv_heads is not saved).
SessionKey saved_key(const json& saved, const std::string& where) {
  SessionKey key;
  key.model = saved.at("model").get<std::string>();
  key.identity = saved.at("identity").get<std::string>();
  key.policy = saved.at("policy").get<std::string>();
  const std::string dtype = saved.at("kv_dtype").get<std::string>();
  INFINIGEN_CHECK(parse_dtype(dtype, &key.kv_dtype), where, ": unknown KV dtype ", dtype);
  for (const auto& [name, value] : saved.at("options").items()) {
    key.options.emplace_back(name, value.get<std::string>());
  }
  const json& layers = saved.at("layers");
  INFINIGEN_CHECK(layers.is_number_integer() && layers.get<int64_t>() >= 1, where,
                  ": malformed layer count");
  key.num_layers = layers.get<int64_t>();
  return key;
}

// The manifest in `directory`, its key compared with `*expected` when given, and returned in
// `*saved` when asked for.
SessionManifest read_manifest(const fs::path& directory, const SessionKey* expected_key,
                              SessionKey* saved_out) {
  const fs::path path = directory / kSessionManifest;
  const std::string where = path.string();
  INFINIGEN_CHECK(fs::is_regular_file(path), directory.string(),
                  ": no session here (no manifest.json)");
  std::string text;
  {
    const FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    INFINIGEN_CHECK(
        fd && read_to_end(fd.get(), [&](std::string_view piece) { text.append(piece); }) == 0,
        where, ": cannot read");
  }
  json manifest;
  try {
    manifest = json::parse(text);
  } catch (const json::exception&) {
    fail(where, ": not valid JSON (the session is corrupt)");
  }
  SessionManifest s;
  try {
    INFINIGEN_CHECK(manifest.is_object() && manifest.value("format", "") == kFormat, where,
                    ": not an infinigen session manifest");
    // Before the checksum: a later version may compute it another way.
    const json& version = manifest.contains("version") ? manifest["version"] : json();
    INFINIGEN_CHECK(version.is_number_integer(), where,
                    ": no session format version (the session is corrupt)");
    const std::string readable = kOldestVersion == kVersion
                                     ? cat("version ", kVersion)
                                     : cat("versions ", kOldestVersion, " to ", kVersion);
    INFINIGEN_CHECK(version.get<int64_t>() <= kVersion, where, ": session format version ",
                    version.get<int64_t>(), " was written by a newer infinigen (this build reads ",
                    readable, "); continue it with that one");
    INFINIGEN_CHECK(version.get<int64_t>() >= kOldestVersion, where, ": session format version ",
                    version.get<int64_t>(), " is older than this build reads (", readable,
                    "); start a new session");
    INFINIGEN_CHECK(
        manifest.contains("checksum") && manifest["checksum"].is_string() &&
            manifest["checksum"].get<std::string>() == hex32(manifest_checksum(manifest)),
        where, ": checksum mismatch (the session is corrupt)");
    const json saved = manifest.at("key");
    if (expected_key) {
      const SessionKey& key = *expected_key;
      const json expected = key_json(key);
      INFINIGEN_CHECK(saved.at("identity") == expected["identity"], directory.string(),
                      ": saved with another model (", saved.at("model").get<std::string>(),
                      ", identity ", saved["identity"].get<std::string>(), "), not ", key.model,
                      " (", key.identity, ")");
      INFINIGEN_CHECK(saved.at("policy") == expected["policy"], directory.string(), ": saved with ",
                      option("policy"), " ", saved["policy"].get<std::string>(), ", not ",
                      key.policy);
      INFINIGEN_CHECK(saved.at("kv_dtype") == expected["kv_dtype"], directory.string(),
                      ": saved with KV dtype ", saved["kv_dtype"].get<std::string>(), ", not ",
                      expected["kv_dtype"].get<std::string>());
      const json& saved_options = saved.at("options");
      for (size_t i = 0; i < key.options.size(); ++i) {
        const auto& [name, value] = key.options[i];
        // A session written before the option was recorded was written with its default.
        const std::string was = saved_options.contains(name)
                                    ? saved_options.at(name).get<std::string>()
                                : i < key.option_defaults.size() ? key.option_defaults[i]
                                                                 : std::string();
        INFINIGEN_CHECK(was == value, directory.string(), ": saved with ", option(name), " ", was,
                        "; this run has ", value);
      }
      INFINIGEN_CHECK(saved.at("layers") == key.num_layers, where, ": layer count differs");
    }
    const SessionKey key = saved_key(saved, where);
    if (saved_out) *saved_out = key;
    const int64_t L = key.num_layers;
    for (const json& sequence : manifest.at("sequences")) {
      s.tokens.push_back(int32_list(sequence, where, "a sequence's tokens"));
      INFINIGEN_CHECK(!s.tokens.back().empty(), where, ": a sequence without tokens");
    }
    const size_t B = s.tokens.size();
    INFINIGEN_CHECK(B >= 1, where, ": no sequences");
    std::vector<int64_t> stored(B, 0);
    if (manifest.contains("prefix")) {
      const json& entry = manifest.at("prefix");
      s.prefix.rows = int32_list(entry.at("rows"), where, "the shared prefixes' rows");
      const int64_t G = std::ssize(s.prefix.rows);
      // Each sequence's group; a session saved before groups shares one prefix with the batch.
      const std::vector<int32_t> groups =
          entry.contains("groups")
              ? int32_list(entry.at("groups"), where, "the prefix groups", true)
              : std::vector<int32_t>(B, 0);
      INFINIGEN_CHECK(G >= 1 && groups.size() == B, where, ": malformed shared prefixes");
      std::vector<int64_t> lengths;
      std::vector<int64_t> leader(static_cast<size_t>(G), -1);
      for (int32_t rows : s.prefix.rows) {
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
        const auto& tokens = s.tokens[b];
        const auto& first = s.tokens[static_cast<size_t>(leader[static_cast<size_t>(g)])];
        INFINIGEN_CHECK(
            std::ssize(tokens) > P && std::equal(tokens.begin(), tokens.begin() + P, first.begin()),
            where, ": sequence ", b + 1, " does not start with the ", P,
            "-token prefix it shares (the session is corrupt)");
        stored[b] += P;
      }
      INFINIGEN_CHECK(std::none_of(leader.begin(), leader.end(), [](int64_t b) { return b < 0; }),
                      where, ": a shared prefix no sequence shares");
      s.shared = SharedPrefixes(groups, lengths);
      for (const json& file : entry.at("files"))
        s.prefix.layers.push_back(file_record(file, where));
      INFINIGEN_CHECK(static_cast<int64_t>(s.prefix.layers.size()) == L, where,
                      ": the shared prefix has ", s.prefix.layers.size(), " layer files for ", L,
                      " layers");
    }
    for (const json& entry : manifest.at("segments")) {
      SessionSegment segment;
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
      s.segments.push_back(std::move(segment));
    }
    for (const json& file : manifest.at("state")) s.state.push_back(file_record(file, where));
    INFINIGEN_CHECK(static_cast<int64_t>(s.state.size()) == L, where, ": state for ",
                    s.state.size(), " of ", L, " layers");
    // A store saved as its state alone (KvStore::saves_state_each_turn) has no segments of rows.
    const bool state_only =
        s.segments.empty() && std::any_of(s.state.begin(), s.state.end(),
                                          [](const SessionFile& f) { return !f.path.empty(); });
    for (size_t b = 0; b < B && !state_only; ++b) {
      // Every token but the last generated one has its rows stored.
      INFINIGEN_CHECK(stored[b] + 1 == static_cast<int64_t>(s.tokens[b].size()), where,
                      ": sequence ", b + 1, " has ", s.tokens[b].size(), " tokens but ", stored[b],
                      " stored rows");
    }
    const json& next = manifest.at("next_segment");
    INFINIGEN_CHECK(
        next.is_number_integer() && next.get<int64_t>() >= 1 && next.get<int64_t>() < 1000000,
        where, ": malformed next_segment");
    s.next_segment = next.get<int64_t>();
    if (manifest.contains("turn")) {
      s.turn_label = manifest["turn"].at("label").get<std::string>();
      s.turn_record = manifest["turn"].at("record").get<std::string>();
    }
    // Every file the manifest names must be there, whole, before anything is computed.
    std::vector<const SessionSegment*> named = {&s.prefix};
    for (const SessionSegment& segment : s.segments) named.push_back(&segment);
    for (const SessionSegment* segment : named) {
      for (const SessionFile& file : segment->layers) {
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
  return s;
}

}  // namespace

std::string session_segment_name(int64_t index) {
  char name[32];
  std::snprintf(name, sizeof name, "seg-%06lld", static_cast<long long>(index));
  return name;
}

std::string session_layer_file(const std::string& prefix, int64_t layer) {
  char name[48];
  std::snprintf(name, sizeof name, "%s-%03lld.safetensors", prefix.c_str(),
                static_cast<long long>(layer));
  return name;
}

SessionManifest read_session_manifest(const fs::path& directory, const SessionKey& key) {
  return read_manifest(directory, &key, nullptr);
}

SavedSession read_saved_session(const fs::path& directory) {
  SavedSession session;
  session.manifest = read_manifest(directory, nullptr, &session.key);
  return session;
}

void write_session_manifest(const fs::path& directory, const SessionKey& key,
                            const SessionManifest& manifest) {
  json record = {{"format", kFormat}, {"version", kVersion}, {"key", key_json(key)}};
  record["sequences"] = manifest.tokens;
  json segments = json::array();
  for (const SessionSegment& segment : manifest.segments) {
    segments.push_back({{"rows", segment.rows}, {"files", files_json(segment.layers)}});
  }
  record["segments"] = segments;
  if (!manifest.prefix.layers.empty()) {
    record["prefix"] = {{"rows", manifest.prefix.rows},
                        {"groups", manifest.shared.groups()},
                        {"files", files_json(manifest.prefix.layers)}};
  }
  record["state"] = files_json(manifest.state);
  record["next_segment"] = manifest.next_segment;
  if (!manifest.turn_label.empty()) {
    record["turn"] = {{"label", manifest.turn_label}, {"record", manifest.turn_record}};
  }
  record["checksum"] = hex32(manifest_checksum(record));
  write_text_file(directory / kSessionManifest, record.dump(1) + "\n");
  fsync_directory(directory);
}

SessionFile session_file(const fs::path& directory, const std::string& relative) {
  const auto [crc, bytes] = checksum_file(directory / relative);
  return {relative, bytes, crc};
}

void remove_unnamed_session_files(const fs::path& directory,
                                  const SessionManifest& manifest) noexcept {
  // Every file the manifest names, and every directory on the way to one.
  std::set<fs::path> named;
  const auto name = [&](const SessionFile& file) {
    for (fs::path path = fs::path(file.path).lexically_normal(); !path.empty();
         path = path.parent_path()) {
      named.insert(path);
    }
  };
  for (const SessionSegment& segment : manifest.segments) {
    for (const SessionFile& file : segment.layers) name(file);
  }
  for (const SessionFile& file : manifest.prefix.layers) name(file);
  for (const SessionFile& file : manifest.state) {
    if (!file.path.empty()) name(file);
  }
  std::error_code error;
  for (fs::directory_iterator entry(directory, error), end; !error && entry != end;
       entry.increment(error)) {
    const fs::path relative = entry->path().filename();
    const std::string text = relative.string();
    if (text.rfind(".manifest.json.", 0) == 0) {
      remove_quietly(entry->path());
      continue;
    }
    if (text.rfind("seg-", 0) != 0) continue;
    if (!named.count(relative)) {
      remove_quietly(entry->path());
      continue;
    }
    // A segment directory the manifest names a file in: what it does not name goes.
    std::error_code inner;
    for (fs::directory_iterator file(entry->path(), inner), last; !inner && file != last;
         file.increment(inner)) {
      if (!named.count(relative / file->path().filename())) remove_quietly(file->path());
    }
  }
}

uint64_t check_session_file(const fs::path& directory, const SessionFile& file) {
  const fs::path path = directory / file.path;
  const auto [crc, bytes] = checksum_file(path);
  INFINIGEN_CHECK(bytes == file.bytes && crc == file.crc32, path.string(),
                  ": checksum mismatch (the session is corrupt)");
  return bytes;
}

}  // namespace infinigen
