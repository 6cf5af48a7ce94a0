// apps/infinigen: progress display (redrawn at most every 100 ms, and on completion).
#include "apps/infinigen/progress.h"

#include <unistd.h>

#include <cstdio>

namespace infinigen::cli {

Progress::Progress(std::string label)
    : label_(std::move(label)),
      enabled_(isatty(STDERR_FILENO) != 0),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

Progress::~Progress() {
  if (drawn_) std::fputc('\n', stderr);
}

void Progress::update(int64_t done, int64_t total) {
  if (!enabled_ || total <= 0) return;
  const auto now = std::chrono::steady_clock::now();
  if (drawn_ && done < total && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(kWidth * done / total);
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  std::fprintf(stderr, "\r%s [%.*s%*s] %lld/%lld %.1fs", label_.c_str(), filled,
               "##############################", kWidth - filled, "", static_cast<long long>(done),
               static_cast<long long>(total), elapsed);
  std::fflush(stderr);
  drawn_ = true;
}

}  // namespace infinigen::cli
