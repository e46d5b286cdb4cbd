// CUDA backend of zeroshard._C (see flatten.cpp): the ZeRO-3/FSDP flatten
// (FlatParameter / flat gradient buffer) and unflatten (state dict,
// summon_full_params) copies of many tensors in ONE kernel launch.
//
// flatten.cpp reduces a call to contiguous byte runs (src, dst, nbytes). Here
// the runs are treated as one payload cut into equal chunks, one chunk per
// thread block (grid-stride), exactly like the CPU path: 10 huge tensors and
// 1000 tiny ones fill the GPU alike. A block finds the run holding its chunk
// by binary search over the runs' payload offsets.
//
// Why the table rides in the kernel's parameter space: with up to ~1300 runs
// (CUDA >= 12.1 allows 32 KB of parameters) a call needs no host-to-device
// copy of the table and no pinned staging buffer, only the launch. Larger
// calls copy the table to the device first.
//
// Why stores are aligned on the destination: packed parameters sit at 4-byte
// (fp32) or 2-byte (bf16) offsets in the flat buffer, so source and
// destination are rarely 16-byte aligned *together*. Every block writes
// whole 16-byte words of the destination and assembles each word from the
// widest loads the source allows; only the <16-byte head and tail go bytewise.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

struct Run {
  int64_t src;    // 0: zero-fill
  int64_t dst;
  int64_t start;  // offset of this run in the concatenated payload
};

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int kSmallRuns = 32;  // ~770 bytes of parameters: cheap to launch
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
constexpr int kLargeRuns = 1300;  // ~31 KB: under the 32764-byte parameter limit
#else
constexpr int kLargeRuns = 160;  // the classic 4 KB limit
#endif

template <int N>
struct InlineRuns {
  Run r[N];
  __device__ const Run* runs() const { return r; }
};
struct DeviceRuns {
  const Run* r;
  __device__ const Run* runs() const { return r; }
};

__device__ __forceinline__ int64_t lmin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t lmax(int64_t a, int64_t b) { return a > b ? a : b; }

// 16 bytes of the source read with loads of W bytes (the source's alignment).
template <typename W>
__device__ __forceinline__ uint4 load16(const char* __restrict__ src) {
  static_assert(16 % sizeof(W) == 0, "W must divide 16");
  union {
    uint4 v;
    W w[16 / sizeof(W)];
  } u;
  const W* s = reinterpret_cast<const W*>(src);
#pragma unroll
  for (int k = 0; k < 16 / static_cast<int>(sizeof(W)); ++k) u.w[k] = s[k];
  return u.v;
}

template <typename W>
__device__ __forceinline__ void copy_words(const char* __restrict__ src, uint4* __restrict__ dst,
                                           int64_t nw) {
  const int64_t step = blockDim.x;
  int64_t w = threadIdx.x;
  // kUnroll independent loads in flight per thread before the stores.
  for (; w + (kUnroll - 1) * step < nw; w += kUnroll * step) {
    uint4 r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = load16<W>(src + 16 * (w + u * step));
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[w + u * step] = r[u];
  }
  for (; w < nw; w += step) dst[w] = load16<W>(src + 16 * w);
}

// The block copies n bytes (or zero-fills when src is null).
__device__ __forceinline__ void copy_range(const char* src, char* dst, int64_t n) {
  const int64_t head = lmin(n, static_cast<int64_t>((16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16));
  if (threadIdx.x < head) dst[threadIdx.x] = src ? src[threadIdx.x] : 0;
  dst += head;
  n -= head;
  if (src) src += head;
  const int64_t nw = n / 16;
  uint4* d = reinterpret_cast<uint4*>(dst);
  if (src == nullptr) {
    for (int64_t w = threadIdx.x; w < nw; w += blockDim.x) d[w] = make_uint4(0, 0, 0, 0);
  } else {
    const uintptr_t a = reinterpret_cast<uintptr_t>(src);
    if (a % 16 == 0) {
      copy_words<uint4>(src, d, nw);
    } else if (a % 8 == 0) {
      copy_words<uint2>(src, d, nw);
    } else if (a % 4 == 0) {
      copy_words<uint32_t>(src, d, nw);
    } else if (a % 2 == 0) {
      copy_words<uint16_t>(src, d, nw);
    } else {
      copy_words<uint8_t>(src, d, nw);
    }
  }
  for (int64_t b = nw * 16 + threadIdx.x; b < n; b += blockDim.x) dst[b] = src ? src[b] : 0;
}

template <typename Table>
__global__ void __launch_bounds__(kThreads)
    copy_runs_kernel(const __grid_constant__ Table table, int64_t nruns, int64_t total, int64_t chunk) {
  const Run* runs = table.runs();
  for (int64_t lo = blockIdx.x * chunk; lo < total; lo += static_cast<int64_t>(gridDim.x) * chunk) {
    const int64_t hi = lmin(lo + chunk, total);
    int64_t a = 0, b = nruns - 1;  // the last run starting at or before lo
    while (a < b) {
      const int64_t m = (a + b + 1) / 2;
      if (runs[m].start <= lo) a = m; else b = m - 1;
    }
    for (int64_t i = a; i < nruns && runs[i].start < hi; ++i) {
      const Run r = runs[i];
      const int64_t end = i + 1 < nruns ? runs[i + 1].start : total;
      const int64_t s0 = lmax(lo, r.start), s1 = lmin(hi, end);
      const int64_t off = s0 - r.start;
      copy_range(r.src ? reinterpret_cast<const char*>(r.src) + off : nullptr,
                 reinterpret_cast<char*>(r.dst) + off, s1 - s0);
    }
  }
}

template <int N>
void launch_inline(const std::vector<Run>& runs, int64_t total, int64_t chunk, unsigned grid,
                   cudaStream_t stream) {
  InlineRuns<N> t;
  std::copy(runs.begin(), runs.end(), t.r);
  copy_runs_kernel<<<grid, kThreads, 0, stream>>>(t, static_cast<int64_t>(runs.size()), total, chunk);
}

}  // namespace

void zeroshard_copy_segments_cuda(const std::vector<int64_t>& table, const at::Device& device) {
  std::vector<Run> runs;
  runs.reserve(table.size() / 3);
  int64_t total = 0;
  for (size_t i = 0; i + 2 < table.size(); i += 3) {
    if (table[i + 2] <= 0) continue;  // starts must increase strictly for the search
    runs.push_back({table[i], table[i + 1], total});
    total += table[i + 2];
  }
  if (total == 0) return;

  c10::cuda::CUDAGuard guard(device);
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  // ~8 chunks per SM, multiples of 4 KiB, at most 1 MiB (then blocks loop).
  int64_t chunk = (total + 8 * sms - 1) / (8 * sms);
  chunk = std::clamp<int64_t>((chunk + 4095) / 4096 * 4096, 4096, int64_t{1} << 20);
  const int64_t nchunks = (total + chunk - 1) / chunk;
  const auto grid = static_cast<unsigned>(std::min<int64_t>(nchunks, int64_t{32} * sms));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto n = static_cast<int64_t>(runs.size());

  // Parameter bytes are copied at every launch, so the table goes in the
  // smallest tier that holds it.
  if (n <= kSmallRuns) {
    launch_inline<kSmallRuns>(runs, total, chunk, grid, stream);
  } else if (n <= 4 * kSmallRuns) {
    launch_inline<4 * kSmallRuns>(runs, total, chunk, grid, stream);
  } else if (n <= kLargeRuns) {
    constexpr int kMid = 16 * kSmallRuns;
    if constexpr (kMid < kLargeRuns) {  // only where parameters may exceed 4 KB
      if (n <= kMid) {
        launch_inline<kMid>(runs, total, chunk, grid, stream);
      } else {
        launch_inline<kLargeRuns>(runs, total, chunk, grid, stream);
      }
    } else {
      launch_inline<kLargeRuns>(runs, total, chunk, grid, stream);
    }
  } else {
    // The caching host allocator keeps the pinned block alive until the
    // async H2D copy that reads it has finished.
    at::Tensor host = at::empty({n * 3}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    std::copy(runs.begin(), runs.end(), reinterpret_cast<Run*>(host.data_ptr<int64_t>()));
    at::Tensor dev = host.to(device, at::kLong, /*non_blocking=*/true);
    DeviceRuns t{reinterpret_cast<const Run*>(dev.const_data_ptr<int64_t>())};
    copy_runs_kernel<<<grid, kThreads, 0, stream>>>(t, n, total, chunk);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
