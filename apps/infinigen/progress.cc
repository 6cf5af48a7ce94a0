// apps/infinigen: progress display (redrawn at most every 100 ms, and on completion).
#include "apps/infinigen/progress.h"

#include <unistd.h>

#include <cstdio>
#include <string>

namespace infinigen::cli {

Progress::Progress(std::string label)
    : label_(std::move(label)),
      enabled_(isatty(STDERR_FILENO) != 0),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

Progress::~Progress() {
  if (drawn_) std::fputc('\n', stderr);
}

void Progress::update(int64_t done, int64_t total, const std::string& detail) {
  if (!enabled_ || total <= 0) return;
  const auto now = std::chrono::steady_clock::now();
  if (drawn_ && done < total && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(kWidth * done / total);
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  std::string after = detail.empty() ? "" : " " + detail;
  if (!detail.empty() && done > 0 && done < total) {
    const double left = elapsed * static_cast<double>(total - done) / static_cast<double>(done);
    after += " ETA " + std::to_string(static_cast<long long>(left + 0.5)) + "s";
  }
  // Padded so that a shorter redraw covers the longer line before it.
  std::fprintf(stderr, "\r%s [%.*s%*s] %lld/%lld %.1fs%-28s", label_.c_str(), filled,
               "##############################", kWidth - filled, "", static_cast<long long>(done),
               static_cast<long long>(total), elapsed, after.c_str());
  std::fflush(stderr);
  drawn_ = true;
}

}  // namespace infinigen::cli
