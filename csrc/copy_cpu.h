// The CPU copy loop behind every flatten/unflatten of zeroshard._C (flatten.cpp's
// one-shot calls and plan.cpp's replays): a run table copied as ONE payload split
// into equal chunks across threads, so 1000 tiny tensors and 10 huge ones
// parallelize equally well. Kept out of runs.h, which nvcc also compiles.
#pragma once

#include "runs.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>

namespace zeroshard {

// Chunks are whole 4 KiB units of the payload, so thread boundaries never
// split a cache line; payloads under the grain (64 KiB) stay on the calling
// thread because an OpenMP fork/join costs more than copying them.
constexpr int64_t kUnit = 4096;
constexpr int64_t kGrainUnits = 16;

// Copies every run: tensor -> flat (to_flat) or flat -> tensor. Before a thread
// touches run i it calls enter(i, starts), where `starts` says its piece begins
// the run (a run split between two threads is entered by both, started by one);
// if enter returns false the thread skips the rest of its pieces and the call
// returns false. A CopyPlan checks each tensor there, on the thread about to
// copy it, instead of in a serial pass before the copy. Runs whose two sides are
// the same address (a parameter that already views the flat buffer) cost a
// no-op copy, which is harmless.
template <typename Enter>
bool copy_runs_cpu(const std::vector<Seg>& segs, const std::vector<int64_t>& prefix, char* flat,
                   bool to_flat, const Enter& enter) {
  const int64_t total = prefix.back();
  if (total == 0) return true;
  std::atomic<bool> all_entered{true};
  at::parallel_for(0, (total + kUnit - 1) / kUnit, kGrainUnits, [&](int64_t ub, int64_t ue) {
    int64_t pos = ub * kUnit;
    const int64_t end = std::min(ue * kUnit, total);
    // Runs are non-empty, so this lands on the run containing `pos`.
    size_t i = std::upper_bound(prefix.begin(), prefix.end(), pos) - prefix.begin() - 1;
    for (; pos < end; ++i) {
      const Seg& s = segs[i];
      const int64_t lo = pos - prefix[i];
      if (!enter(i, lo == 0)) {
        all_entered.store(false, std::memory_order_relaxed);
        return;
      }
      const int64_t n = std::min(end, prefix[i + 1]) - pos;
      char* f = flat + s.rel + lo;
      if (s.ext == nullptr) {
        std::memset(f, 0, n);
      } else if (s.ext + lo != f) {  // equal: the tensor already views the flat buffer
        if (to_flat) {
          std::memcpy(f, s.ext + lo, n);
        } else {
          std::memcpy(s.ext + lo, f, n);
        }
      }
      pos += n;
    }
  });
  return all_entered.load();
}

inline void copy_runs_cpu(const std::vector<Seg>& segs, const std::vector<int64_t>& prefix,
                          char* flat, bool to_flat) {
  copy_runs_cpu(segs, prefix, flat, to_flat, [](size_t, bool) { return true; });
}

}  // namespace zeroshard
