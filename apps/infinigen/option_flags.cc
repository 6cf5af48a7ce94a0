// apps/infinigen: option keys spelled as flags.
#include "apps/infinigen/option_flags.h"

#include <algorithm>

namespace infinigen::cli {

std::string flag_spelling(std::string_view key) {
  std::string flag = "--";
  flag.append(key);
  std::replace(flag.begin() + 2, flag.end(), '_', '-');
  return flag;
}

}  // namespace infinigen::cli
