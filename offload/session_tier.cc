// offload: the host-memory tier of sessions: a byte budget, eviction by look-ahead or LRU.
#include "offload/session_tier.h"

#include <unistd.h>

#include <cmath>
#include <tuple>

#include "core/device.h"

namespace infinigen {

size_t choose_victim(const std::vector<TierCandidate>& candidates, bool look_ahead) {
  size_t victim = 0;
  for (size_t i = 1; i < candidates.size(); ++i) {
    const TierCandidate& c = candidates[i];
    const TierCandidate& v = candidates[victim];
    // Furthest next use first (look-ahead), then least recently used.
    const auto rank = [&](const TierCandidate& t) {
      return std::make_tuple(look_ahead ? t.next_use : 0, -t.last_use);
    };
    if (rank(c) > rank(v)) victim = i;
  }
  return victim;
}

std::optional<uint64_t> parse_session_cache(const std::string& text) {
  if (!text.empty() && text.back() == '%') {
    const std::string number = text.substr(0, text.size() - 1);
    size_t used = 0;
    double share = 0;
    try {
      share = std::stod(number, &used);
    } catch (...) {
      return std::nullopt;
    }
    if (used != number.size() || !(share >= 0.0 && share <= 100.0)) return std::nullopt;
    const double memory =
        static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
    return static_cast<uint64_t>(std::floor(memory * share / 100.0));
  }
  const std::optional<size_t> bytes = parse_byte_size(text);
  if (!bytes) return std::nullopt;
  return static_cast<uint64_t>(*bytes);
}

void SessionTier::set_next_use(std::function<int64_t(const std::string&)> next_use) {
  std::lock_guard lock(mutex_);
  next_use_ = std::move(next_use);
}

int64_t SessionTier::next_use_locked(const std::string& directory) const {
  return next_use_ ? next_use_(directory) : kNeverUsedAgain;
}

std::shared_ptr<const SessionTier::Entry> SessionTier::find(const std::string& directory) {
  std::lock_guard lock(mutex_);
  const auto it = residents_.find(directory);
  if (it == residents_.end()) {
    ++stats_.misses;
    return nullptr;
  }
  ++stats_.hits;
  it->second.last_use = ++clock_;
  return it->second.entry;
}

bool SessionTier::holds(const std::string& directory) const {
  std::lock_guard lock(mutex_);
  return residents_.count(directory) > 0;
}

bool SessionTier::put(const std::string& directory, Entry entry, bool prefetch) {
  std::lock_guard lock(mutex_);
  // The session's older entry goes whatever happens: it no longer matches the disk.
  if (const auto it = residents_.find(directory); it != residents_.end()) {
    bytes_ -= it->second.entry->bytes;
    residents_.erase(it);
  }
  const uint64_t need = entry.bytes;
  if (need > budget_) {
    ++stats_.bypassed;
    return false;
  }
  const bool look_ahead = static_cast<bool>(next_use_);
  const int64_t own_next = next_use_locked(directory);
  // Victims chosen one at a time until the new entry fits; none evicted unless all that must go
  // may (a look-ahead tier keeps sessions needed sooner than this one, and then bypasses it).
  std::vector<std::string> victims;
  uint64_t freed = 0;
  std::vector<std::string> names;
  std::vector<TierCandidate> candidates;
  for (const auto& [name, resident] : residents_) {
    names.push_back(name);
    candidates.push_back({next_use_locked(name), resident.last_use});
  }
  while (bytes_ - freed + need > budget_) {
    const size_t v = choose_victim(candidates, look_ahead);
    if (look_ahead && candidates[v].next_use <= own_next) {
      ++stats_.bypassed;
      return false;
    }
    victims.push_back(names[v]);
    freed += residents_.at(names[v]).entry->bytes;
    names.erase(names.begin() + static_cast<std::ptrdiff_t>(v));
    candidates.erase(candidates.begin() + static_cast<std::ptrdiff_t>(v));
  }
  for (const std::string& name : victims) {
    bytes_ -= residents_.at(name).entry->bytes;
    residents_.erase(name);
    ++stats_.evictions;
  }
  residents_[directory] = {std::make_shared<const Entry>(std::move(entry)), ++clock_};
  bytes_ += need;
  ++stats_.admitted;
  if (prefetch) ++stats_.prefetched;
  stats_.peak_bytes = std::max(stats_.peak_bytes, bytes_);
  return true;
}

void SessionTier::erase(const std::string& directory) {
  std::lock_guard lock(mutex_);
  if (const auto it = residents_.find(directory); it != residents_.end()) {
    bytes_ -= it->second.entry->bytes;
    residents_.erase(it);
  }
}

uint64_t SessionTier::bytes() const {
  std::lock_guard lock(mutex_);
  return bytes_;
}

SessionTierStats SessionTier::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

std::vector<std::string> SessionTier::residents() const {
  std::lock_guard lock(mutex_);
  std::vector<std::string> names;
  for (const auto& [name, resident] : residents_) names.push_back(name);
  return names;
}

}  // namespace infinigen
