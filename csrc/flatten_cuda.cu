// CUDA backend of zeroshard._C (see flatten.cpp, runs.h): the ZeRO-3/FSDP
// flatten (FlatParameter / flat gradient buffer) and unflatten (state dict,
// summon_full_params) copies of many tensors in ONE kernel launch.
//
// The runs are treated as one payload cut into equal chunks, one chunk per
// warp (grid-stride), exactly like the CPU path: 10 huge tensors and 1000
// tiny ones fill the GPU alike. A warp, not a block, owns a chunk: with a
// block per chunk, a chunk of many tiny runs was copied run after run by 256
// threads each time waiting on memory; eight warps work on eight chunks at
// once. Measured on an H100 (graph-timed, 4 MB in 1000 runs): 11.9 us a warp,
// 17.7 us a block; 25 MB runs: 196.6 vs 203.5 us.
//
// Latency, not bandwidth, bounds chunks of small runs: each run's head and
// tail bytes are loaded with its words before anything is stored, and the
// next run's table entry is loaded before the current run is copied, so a
// chunk waits on memory about once per run. 64 registers, no spills (sm_90).
// H100, graph-timed plan flatten, fp32: 4 MB in 1000 runs 10.5 -> 7.2 us
// (copy_ of the same bytes 2.8, torch.cat 16.3); 256 MB in 1000 runs
// 204.7 -> 200.8 us; ten 25 MB runs 199.2 -> 197.1 (copy_ 179.4, cat 192.1).
//
// Tried and dropped (H100): 8 loads in flight per thread instead of 4, 2
// instead of 4, and cache-streaming loads/stores (no change); chunks 4x larger
// (fewer warps: 201.5 us for ten 25 MB runs); cudaMemcpyAsync for runs of 8 MB
// or more (slower: 233 us for ten 25 MB runs at 4-byte offsets).
//
// Where the run table lives:
// * one-shot calls with up to ~1300 runs pass it in the kernel's parameter
//   space (CUDA >= 12.1 allows 32 KB): no host-to-device copy, no staging
//   buffer. A warp finds its first run by binary search in the constant bank.
//   Measured on an H100 with 1000 runs: 43 us of host time a call this way,
//   80 us when the table is staged in pinned memory and uploaded instead.
// * CopyPlan (and bigger one-shot calls) upload it once, followed by the
//   first run of every chunk, so a warp starts copying after one load.
//
// Why stores are aligned on the destination: packed parameters sit at 4-byte
// (fp32) or 2-byte (bf16) offsets in the flat buffer, so source and
// destination are rarely 16-byte aligned *together*. Every warp writes whole
// 16-byte words of the destination; when the source is misaligned, each word
// is cut out of two aligned 16-byte source words with funnel shifts, so the
// loads stay 16 bytes wide too. Only the <16-byte head and tail go bytewise.
#include "runs.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace zeroshard {
namespace {

struct Run {
  int64_t ext;    // tensor address; 0: zero-fill the flat range
  int64_t rel;    // byte offset in flat
  int64_t start;  // offset of this run in the concatenated payload
};
static_assert(sizeof(Run) == 3 * sizeof(int64_t), "Run is uploaded as int64 triples");

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;  // 8 measured no faster
constexpr int kSmallRuns = 32;  // ~770 bytes of parameters: cheap to launch
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
constexpr int kLargeRuns = 1300;  // ~31 KB: under the 32764-byte parameter limit
#else
constexpr int kLargeRuns = 160;  // the classic 4 KB limit
#endif

__device__ __forceinline__ int64_t lmin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t lmax(int64_t a, int64_t b) { return a > b ? a : b; }

template <int N>
struct InlineRuns {
  Run r[N];
  __device__ const Run* runs() const { return r; }
  __device__ int64_t first(int64_t lo, int64_t /*chunk*/, int64_t nruns) const {
    int64_t a = 0, b = nruns - 1;  // the last run starting at or before lo
    while (a < b) {
      const int64_t m = (a + b + 1) / 2;
      if (r[m].start <= lo) a = m; else b = m - 1;
    }
    return a;
  }
};
struct DeviceRuns {
  const Run* r;
  const int64_t* chunk_first;  // chunk_first[c]: the run holding byte c * chunk
  __device__ const Run* runs() const { return r; }
  __device__ int64_t first(int64_t lo, int64_t chunk, int64_t) const { return chunk_first[lo / chunk]; }
};

// Lane `lane` of a warp copies words lane, lane + 32, ...
__device__ __forceinline__ void copy_words_aligned(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                                   int nw, int lane) {
  int w = lane;
  // kUnroll independent loads in flight per thread before the stores.
  for (; w + (kUnroll - 1) * 32 < nw; w += kUnroll * 32) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = src[w + u * 32];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[w + u * 32] = v[u];
  }
  for (; w < nw; w += 32) dst[w] = src[w];
}

// Bytes [delta, delta + 16) of the 32 bytes a:b, delta = 4 * Q + r / 8.
template <int Q>
__device__ __forceinline__ uint4 cut16(const uint4& a, const uint4& b, unsigned r) {
  const uint32_t l[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  return make_uint4(__funnelshift_r(l[Q], l[Q + 1], r), __funnelshift_r(l[Q + 1], l[Q + 2], r),
                    __funnelshift_r(l[Q + 2], l[Q + 3], r), __funnelshift_r(l[Q + 3], l[Q + 4], r));
}

// dst word w = source bytes [16 w + delta, 16 w + delta + 16), read as the
// aligned words a[w] and a[w + 1]. Words a[0..nw] each hold at least one
// source byte, so no load leaves the source's pages.
template <int Q>
__device__ __forceinline__ void copy_words_shifted(const uint4* __restrict__ a, uint4* __restrict__ dst,
                                                   int nw, unsigned r, int lane) {
  int w = lane;
  for (; w + (kUnroll - 1) * 32 < nw; w += kUnroll * 32) {
    uint4 lo[kUnroll], hi[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      lo[u] = a[w + u * 32];
      hi[u] = a[w + u * 32 + 1];  // the neighbouring lane's word: an L1 hit
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[w + u * 32] = cut16<Q>(lo[u], hi[u], r);
  }
  for (; w < nw; w += 32) dst[w] = cut16<Q>(a[w], a[w + 1], r);
}

// The warp copies n bytes (or zero-fills when src is null). The <16-byte head
// and tail are loaded before any word is stored and stored last: a store
// issued before a load orders that load after it (char stores may alias
// anything), and a chunk of small runs would then wait on memory up to three
// times per run instead of once.
// n <= the chunk (128 KiB), so offsets inside the range are 32-bit.
__device__ __forceinline__ void copy_range(const char* src, char* dst, int n, int lane) {
  const int head = min(n, static_cast<int>((16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16));
  const int nw = (n - head) / 16;
  const int tail_at = head + nw * 16;  // the tail is bytes [tail_at, n)
  const bool has_head = lane < head, has_tail = tail_at + lane < n;
  char hb = 0, tb = 0;
  if (src) {
    if (has_head) hb = src[lane];
    if (has_tail) tb = src[tail_at + lane];
  }
  uint4* d = reinterpret_cast<uint4*>(dst + head);
  if (src == nullptr) {
    for (int w = lane; w < nw; w += 32) d[w] = make_uint4(0, 0, 0, 0);
  } else if (nw > 0) {
    const char* s = src + head;
    const uintptr_t delta = reinterpret_cast<uintptr_t>(s) % 16;
    const uint4* a = reinterpret_cast<const uint4*>(s - delta);
    const unsigned r = 8 * (delta % 4);
    switch (delta / 4) {
      case 0:
        if (r == 0) {
          copy_words_aligned(a, d, nw, lane);
        } else {
          copy_words_shifted<0>(a, d, nw, r, lane);
        }
        break;
      case 1: copy_words_shifted<1>(a, d, nw, r, lane); break;
      case 2: copy_words_shifted<2>(a, d, nw, r, lane); break;
      default: copy_words_shifted<3>(a, d, nw, r, lane); break;
    }
  }
  if (has_head) dst[lane] = hb;
  if (has_tail) dst[tail_at + lane] = tb;
}

// Chunk c of the payload goes to warp c (grid-stride beyond the grid's warps).
// The next run's entry is loaded before the current run is copied, so table
// and data loads overlap instead of alternating.
template <typename Table>
__global__ void __launch_bounds__(kThreads)
    copy_runs_kernel(const __grid_constant__ Table table, int64_t nruns, int64_t total, int64_t chunk,
                     char* flat, bool to_flat) {
  const Run* runs = table.runs();
  const int lane = threadIdx.x % 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps * chunk;
  for (int64_t lo = (blockIdx.x * int64_t{kWarps} + threadIdx.x / 32) * chunk; lo < total; lo += stride) {
    const int64_t hi = lmin(lo + chunk, total);
    int64_t i = table.first(lo, chunk, nruns);
    Run r = runs[i];
    while (true) {
      const bool more = i + 1 < nruns;
      const Run next = more ? runs[i + 1] : Run{0, 0, total};
      const int64_t s0 = lmax(lo, r.start), s1 = lmin(hi, next.start);
      const int64_t off = s0 - r.start;
      char* f = flat + r.rel + off;
      char* e = r.ext ? reinterpret_cast<char*>(r.ext) + off : nullptr;  // null: padding (to_flat only)
      copy_range(to_flat ? e : f, to_flat ? f : e, static_cast<int>(s1 - s0), lane);
      if (!more || next.start >= hi) break;
      r = next;
      ++i;
    }
  }
}

struct Shape {
  int64_t total = 0, chunk = 0;
  unsigned grid = 0;
};

// ~64 chunks per SM (8 warps x 8 blocks' worth) of 512 B..128 KiB, so every
// SM holds several and the tail stays short.
Shape shape_for(int64_t total) {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  Shape s;
  s.total = total;
  const int64_t teams = int64_t{8} * kWarps * sms;
  s.chunk = (total + teams - 1) / teams;
  s.chunk = std::clamp<int64_t>((s.chunk + 511) / 512 * 512, 512, int64_t{128} << 10);
  const int64_t blocks = ((total + s.chunk - 1) / s.chunk + kWarps - 1) / kWarps;
  s.grid = static_cast<unsigned>(std::min<int64_t>(blocks, int64_t{32} * sms));
  return s;
}

std::vector<Run> to_runs(const std::vector<Seg>& segs, int64_t* total) {
  std::vector<Run> runs;
  runs.reserve(segs.size());
  int64_t t = 0;
  for (const Seg& s : segs) {
    runs.push_back({reinterpret_cast<int64_t>(s.ext), s.rel, t});
    t += s.nbytes;  // > 0, so starts increase strictly (the search relies on it)
  }
  *total = t;
  return runs;
}

template <typename Table>
void launch(const Table& table, int64_t nruns, const Shape& s, char* flat, bool to_flat, cudaStream_t stream) {
  copy_runs_kernel<Table><<<s.grid, kThreads, 0, stream>>>(table, nruns, s.total, s.chunk, flat, to_flat);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int N>
void launch_inline(const std::vector<Run>& runs, const Shape& s, char* flat, bool to_flat,
                   cudaStream_t stream) {
  InlineRuns<N> t;
  std::copy(runs.begin(), runs.end(), t.r);
  launch(t, static_cast<int64_t>(runs.size()), s, flat, to_flat, stream);
}

}  // namespace

CudaRuns upload_runs_cuda(const std::vector<Seg>& segs, const at::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  CudaRuns out;
  std::vector<Run> runs = to_runs(segs, &out.total);
  out.stream = c10::cuda::getCurrentCUDAStream();
  if (out.total == 0) return out;
  const Shape s = shape_for(out.total);
  out.nruns = static_cast<int64_t>(runs.size());
  out.chunk = s.chunk;
  out.grid = s.grid;
  const int64_t nchunks = (out.total + s.chunk - 1) / s.chunk;
  // The caching host allocator keeps the pinned block alive until the async
  // host-to-device copy that reads it has finished.
  at::Tensor host = at::empty({out.nruns * 3 + nchunks}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = host.data_ptr<int64_t>();
  std::copy(runs.begin(), runs.end(), reinterpret_cast<Run*>(h));
  int64_t* first = h + out.nruns * 3;
  int64_t i = 0;
  for (int64_t c = 0; c < nchunks; ++c) {
    while (i + 1 < out.nruns && runs[i + 1].start <= c * s.chunk) ++i;
    first[c] = i;
  }
  out.table = host.to(device, at::kLong, /*non_blocking=*/true);
  return out;
}

void launch_runs_cuda(const CudaRuns& runs, char* flat, bool to_flat, const at::Device& device) {
  if (runs.total == 0) return;
  c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
  // The table was allocated on the stream current at upload; tell the caching
  // allocator that this stream reads it too, or it could reuse the memory early.
  if (c10::Stream(stream) != runs.stream) runs.table.record_stream(stream);
  const int64_t* t = runs.table.const_data_ptr<int64_t>();
  launch(DeviceRuns{reinterpret_cast<const Run*>(t), t + runs.nruns * 3}, runs.nruns,
         Shape{runs.total, runs.chunk, runs.grid}, flat, to_flat, stream);
}

void copy_runs_cuda(const std::vector<Seg>& segs, char* flat, bool to_flat, const at::Device& device) {
  if (static_cast<int64_t>(segs.size()) > kLargeRuns) {
    const CudaRuns runs = upload_runs_cuda(segs, device);
    launch_runs_cuda(runs, flat, to_flat, device);
    return;  // `runs.table` is freed on this stream: later work on it is ordered after the kernel
  }
  c10::cuda::CUDAGuard guard(device);
  int64_t total = 0;
  const std::vector<Run> runs = to_runs(segs, &total);
  if (total == 0) return;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const Shape s = shape_for(total);
  // Parameter bytes are copied at every launch, so the table goes in the
  // smallest tier that holds it.
  const auto n = static_cast<int64_t>(runs.size());
  constexpr int kMid = 16 * kSmallRuns;
  if (n <= kSmallRuns) {
    launch_inline<kSmallRuns>(runs, s, flat, to_flat, stream);
  } else if (n <= 4 * kSmallRuns) {
    launch_inline<4 * kSmallRuns>(runs, s, flat, to_flat, stream);
  } else if (n <= kMid) {  // only reached where kMid < kLargeRuns
    launch_inline<std::min(kMid, kLargeRuns)>(runs, s, flat, to_flat, stream);
  } else if (n <= 2 * kMid) {  // 1000 runs: 24 KB instead of 31 (H100: 119.5 -> 116.7 us a call)
    launch_inline<std::min(2 * kMid, kLargeRuns)>(runs, s, flat, to_flat, stream);
  } else {
    launch_inline<kLargeRuns>(runs, s, flat, to_flat, stream);
  }
}

}  // namespace zeroshard
