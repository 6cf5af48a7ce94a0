// core: writing a checkpoint directory so that it appears whole or not at all.
#pragma once

#include <filesystem>
#include <functional>
#include <string>

// The files such a directory is filled with (write_text_file, staging_path, replace_file).
#include "core/file_io.h"

namespace infinigen {

// The directory named by a user for output: must not exist, or be an empty directory. Returns
// it as a path without a trailing separator ("out/" names "out"). Throws a one-line Error.
std::filesystem::path checked_output_directory(const std::string& directory);

// Runs `fill(staging)` on a fresh sibling directory of `target`, then renames it to `target`.
// On any failure the staging directory is removed and the error is rethrown, so a partial
// checkpoint never appears under the target's name.
void write_directory_atomically(const std::filesystem::path& target,
                                const std::function<void(const std::filesystem::path&)>& fill);

}  // namespace infinigen
