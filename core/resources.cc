// core: lookup of the embedded configs/ files.
#include "core/resources.h"

namespace infinigen {

std::optional<std::string_view> embedded_config(std::string_view path) {
  for (int i = 0; i < detail::kEmbeddedFileCount; ++i) {
    if (path == detail::kEmbeddedFiles[i].path)
      return std::string_view(detail::kEmbeddedFiles[i].content);
  }
  return std::nullopt;
}

std::vector<std::string> embedded_configs_in(std::string_view directory) {
  std::vector<std::string> out;
  const std::string prefix = std::string(directory) + "/";
  for (int i = 0; i < detail::kEmbeddedFileCount; ++i) {
    std::string_view path = detail::kEmbeddedFiles[i].path;
    if (path.starts_with(prefix)) out.emplace_back(path);
  }
  return out;
}

}  // namespace infinigen
