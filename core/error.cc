// core: errors and the option references in their messages.
#include "core/error.h"

namespace infinigen {
namespace {

// Delimiters of an option reference: ASCII unit and record separators never occur in a message.
constexpr char kOptionOpen = '\x1e';
constexpr char kOptionClose = '\x1f';

std::string spell_options(const std::string& message, const OptionSpelling& spell) {
  std::string out;
  out.reserve(message.size());
  size_t at = 0;
  while (at < message.size()) {
    const size_t open = message.find(kOptionOpen, at);
    const size_t close = open == std::string::npos ? open : message.find(kOptionClose, open);
    if (close == std::string::npos) {
      out.append(message, at);
      break;
    }
    out.append(message, at, open - at);
    const std::string_view key(message.data() + open + 1, close - open - 1);
    out += spell ? spell(key) : std::string(key);
    at = close + 1;
  }
  return out;
}

}  // namespace

std::ostream& operator<<(std::ostream& out, OptionName name) {
  return out << kOptionOpen << name.key << kOptionClose;
}

Error::Error(const std::string& message)
    : std::runtime_error(spell_options(message, nullptr)),
      message_(std::make_shared<const std::string>(message)) {}

std::string Error::render(const OptionSpelling& spell) const {
  return spell_options(*message_, spell);
}

}  // namespace infinigen
