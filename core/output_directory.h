// core: writing a checkpoint directory so that it appears whole or not at all.
#pragma once

#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

namespace infinigen {

// The directory named by a user for output: must not exist, or be an empty directory. Returns
// it as a path without a trailing separator ("out/" names "out"). Throws a one-line Error.
std::filesystem::path checked_output_directory(const std::string& directory);

// Runs `fill(staging)` on a fresh sibling directory of `target`, then renames it to `target`.
// On any failure the staging directory is removed and the error is rethrown, so a partial
// checkpoint never appears under the target's name.
void write_directory_atomically(const std::filesystem::path& target,
                                const std::function<void(const std::filesystem::path&)>& fill);

// Writes `text` to `path`: into a hidden sibling first, renamed over `path` once complete, so a
// failure (a full disk) or an interruption never leaves a partial file under `path`. Error
// naming the path when it cannot.
void write_text_file(const std::filesystem::path& path, std::string_view text);

// The hidden sibling a file is written to before replace_file renames it to `target`.
std::filesystem::path staging_path(const std::filesystem::path& target);
void replace_file(const std::filesystem::path& staging, const std::filesystem::path& target);

}  // namespace infinigen
