// apps/infinigen: a one-line progress display on stderr, drawn only when stderr is a terminal.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace infinigen::cli {

class Progress {
 public:
  explicit Progress(std::string label);
  ~Progress();  // ends the line if anything was drawn
  // `detail` follows the count (a rate); once some is done, the time left at the pace so far.
  void update(int64_t done, int64_t total, const std::string& detail = "");

 private:
  std::string label_;
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace infinigen::cli
