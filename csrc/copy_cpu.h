// The host loops behind every flatten/unflatten of zeroshard._C (flatten.cpp's
// one-shot calls and plan.cpp's replays): the CPU copy loop, a run table copied
// as ONE payload split into equal chunks across threads, so 1000 tiny tensors
// and 10 huge ones parallelize equally well; and the prefetching pass over many
// members that checks (or bumps) them. Kept out of runs.h, which nvcc also compiles.
#pragma once

#include "runs.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define ZEROSHARD_X86_AVX2 1
#endif

namespace zeroshard {

// --- passes over many members ------------------------------------------------
// A pass over a thousand members chases Tensor -> TensorImpl -> StorageImpl
// (and, to bump a version, -> its VersionCounter): misses that other work
// evicted, which each member's reads wait for in turn. Prefetched a few
// members ahead, in two stages (the second level's addresses are read from the
// TensorImpl fetched by the first), the misses overlap. A prefetch never
// faults, so these are hints and nothing more.
inline void prefetch_impl(const c10::TensorImpl* impl) {
  const char* p = reinterpret_cast<const char*>(impl);
  for (size_t at = 0; at < sizeof(c10::TensorImpl); at += 64) __builtin_prefetch(p + at);
}

template <bool kVersion>
inline void prefetch_behind(const c10::TensorImpl* impl) {
  const c10::StorageImpl* s = impl->unsafe_storage().unsafeGetStorageImpl();
  if (kVersion) {
    // The counter's address: VariableVersion holds one intrusive_ptr and no
    // accessor for it. A wrong guess would only prefetch the wrong line.
    static_assert(sizeof(c10::VariableVersion) == sizeof(void*), "VariableVersion is one pointer");
    const void* counter;
    std::memcpy(&counter, &impl->version_counter(), sizeof counter);
    __builtin_prefetch(counter, 1);
  } else if (s != nullptr) {
    __builtin_prefetch(s);
    __builtin_prefetch(reinterpret_cast<const char*>(s) + 64);
  }
}

// visit(i) for i in [b, e) until one returns false (then false), with member
// impl_of(i + 2k)'s TensorImpl and impl_of(i + k)'s StorageImpl (kVersion:
// VersionCounter instead) prefetched meanwhile.
template <bool kVersion = false, typename ImplOf, typename Visit>
bool visit_prefetched(size_t b, size_t e, const ImplOf& impl_of, const Visit& visit) {
  constexpr size_t kAhead = 8;
  for (size_t j = b; j < std::min(e, b + 2 * kAhead); ++j) prefetch_impl(impl_of(j));
  for (size_t i = b; i < e; ++i) {
    if (i + 2 * kAhead < e) prefetch_impl(impl_of(i + 2 * kAhead));
    if (i + kAhead < e) prefetch_behind<kVersion>(impl_of(i + kAhead));
    if (!visit(i)) return false;
  }
  return true;
}

// --- one piece's bytes ------------------------------------------------------------
// glibc's memcpy moves a piece of a few KB with `rep movsb` where the CPU
// advertises ERMS/FSRM. On this project's AMD EPYC box, 1000 runs of 4 KB on
// average copied that way reached 0.79-0.86x of one copy_ of the same bytes; an
// AVX2 load/store loop, the kind copy_ itself runs, 0.88-0.91x, and it was no
// slower for 10-1000 runs of 4-256 MB (benchmarks/flatten_bench.py --floor).
#ifdef ZEROSHARD_X86_AVX2
__attribute__((target("avx2"))) inline void copy_bytes_avx2(char* to, const char* from, int64_t n) {
  int64_t i = 0;
  for (; i + 128 <= n; i += 128) {  // four 32-byte loads, then four stores
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + i + 64));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + i + 96));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + i), a);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + i + 32), b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + i + 64), c);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + i + 96), d);
  }
  if (i < n) std::memcpy(to + i, from + i, n - i);  // under 128 bytes: no rep movsb
}

#endif

inline bool cpu_has_avx2() {
#ifdef ZEROSHARD_X86_AVX2
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
#else
  return false;
#endif
}

inline void copy_bytes(char* to, const char* from, int64_t n, bool avx2) {
#ifdef ZEROSHARD_X86_AVX2
  if (avx2) return copy_bytes_avx2(to, from, n);
#endif
  std::memcpy(to, from, n);
}

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
  const bool avx2 = cpu_has_avx2();
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
          copy_bytes(f, s.ext + lo, n, avx2);
        } else {
          copy_bytes(s.ext + lo, f, n, avx2);
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
