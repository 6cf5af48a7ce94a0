// core: files from configs/ compiled into the binary (model presets, the bundled tokenizer and
// its corpus).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace infinigen {

namespace detail {
struct EmbeddedFile {
  const char* path;  // relative to configs/, e.g. "models/opt-125m.yaml"
  const char* content;
};
extern const EmbeddedFile kEmbeddedFiles[];
extern const int kEmbeddedFileCount;
}  // namespace detail

// Contents of configs/<path>, if it was embedded at build time.
std::optional<std::string_view> embedded_config(std::string_view path);
// Paths of the embedded files under configs/<directory>/, sorted.
std::vector<std::string> embedded_configs_in(std::string_view directory);

}  // namespace infinigen
