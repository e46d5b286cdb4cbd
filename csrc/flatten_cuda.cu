// CUDA backend of zeroshard._C (see flatten.cpp): the ZeRO-3/FSDP flatten
// (FlatParameter / flat gradient buffer) and unflatten (state dict,
// summon_full_params) copies of many tensors in ONE kernel launch.
//
// flatten.cpp reduces a call to contiguous byte runs (src, dst, nbytes);
// here every run is cut into pieces of about equal size so the grid fills
// all SMs whether the call has 10 huge tensors or 1000 tiny ones. One thread
// block copies one piece with the widest vector width that both addresses
// allow.
// Only c10/cuda headers: ATen/cuda/CUDAContext.h would drag in cuBLAS and
// cuSPARSE headers for nothing.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

struct Piece {
  int64_t src;  // 0: zero-fill
  int64_t dst;
  int64_t nbytes;
};

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
// Up to this many pieces travel as a kernel argument (< 4 KiB of parameter
// space), which saves a pinned-buffer H2D copy on small calls.
constexpr int kInlinePieces = 128;
struct InlinePieces {
  Piece p[kInlinePieces];
};

template <typename V>
__device__ __forceinline__ void copy_piece(const char* __restrict__ src, char* __restrict__ dst,
                                           int64_t nbytes) {
  const int64_t nw = nbytes / static_cast<int64_t>(sizeof(V));
  const int64_t step = blockDim.x;
  int64_t w = threadIdx.x;
  if (src != nullptr) {
    const V* __restrict__ s = reinterpret_cast<const V*>(src);
    V* __restrict__ d = reinterpret_cast<V*>(dst);
    // Issue kUnroll independent loads before the stores to hide latency.
    for (; w + (kUnroll - 1) * step < nw; w += kUnroll * step) {
      V r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) r[u] = s[w + u * step];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) d[w + u * step] = r[u];
    }
    for (; w < nw; w += step) d[w] = s[w];
    for (int64_t b = nw * sizeof(V) + threadIdx.x; b < nbytes; b += step) dst[b] = src[b];
  } else {
    V* d = reinterpret_cast<V*>(dst);
    const V zero{};
    for (; w < nw; w += step) d[w] = zero;
    for (int64_t b = nw * sizeof(V) + threadIdx.x; b < nbytes; b += step) dst[b] = 0;
  }
}

__device__ __forceinline__ void run_piece(const Piece& p) {
  const char* src = reinterpret_cast<const char*>(p.src);
  char* dst = reinterpret_cast<char*>(p.dst);
  // Tensor element alignment bounds the width (bf16 at an odd offset: 2 bytes).
  const uint64_t align = static_cast<uint64_t>(p.src) | static_cast<uint64_t>(p.dst);
  if (align % 16 == 0) {
    copy_piece<uint4>(src, dst, p.nbytes);
  } else if (align % 8 == 0) {
    copy_piece<uint2>(src, dst, p.nbytes);
  } else if (align % 4 == 0) {
    copy_piece<uint32_t>(src, dst, p.nbytes);
  } else if (align % 2 == 0) {
    copy_piece<uint16_t>(src, dst, p.nbytes);
  } else {
    copy_piece<uint8_t>(src, dst, p.nbytes);
  }
}

__global__ void __launch_bounds__(kThreads) copy_pieces_kernel(const Piece* pieces) {
  run_piece(pieces[blockIdx.x]);
}

__global__ void __launch_bounds__(kThreads) copy_pieces_inline_kernel(InlinePieces pieces) {
  run_piece(pieces.p[blockIdx.x]);
}

}  // namespace

void zeroshard_copy_segments_cuda(const std::vector<int64_t>& table, const at::Device& device) {
  const size_t nsegs = table.size() / 3;
  int64_t total = 0;
  for (size_t i = 0; i < nsegs; ++i) total += table[3 * i + 2];
  if (total == 0) return;

  c10::cuda::CUDAGuard guard(device);
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount,
                                        c10::cuda::current_device()));
  // ~4 pieces per SM, 16-byte multiples (keeps split points aligned), and
  // between 16 KiB and 1 MiB so neither launch overhead nor tails dominate.
  int64_t piece = (total + 4 * sms - 1) / (4 * sms);
  piece = std::clamp<int64_t>((piece + 15) / 16 * 16, int64_t{16} << 10, int64_t{1} << 20);

  std::vector<Piece> pieces;
  for (size_t i = 0; i < nsegs; ++i) {
    const int64_t src = table[3 * i], dst = table[3 * i + 1], n = table[3 * i + 2];
    for (int64_t lo = 0; lo < n; lo += piece) {
      pieces.push_back({src == 0 ? 0 : src + lo, dst + lo, std::min(piece, n - lo)});
    }
  }
  const auto npieces = static_cast<int64_t>(pieces.size());
  TORCH_CHECK(npieces < (int64_t{1} << 31), "zeroshard: too many copy pieces: ", npieces);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  if (npieces <= kInlinePieces) {
    InlinePieces arg;
    std::copy(pieces.begin(), pieces.end(), arg.p);
    copy_pieces_inline_kernel<<<static_cast<unsigned>(npieces), kThreads, 0, stream>>>(arg);
  } else {
    // The caching host allocator keeps the pinned block alive until the
    // async H2D copy that reads it has finished.
    at::Tensor host = at::empty({npieces * 3}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    std::copy(pieces.begin(), pieces.end(), reinterpret_cast<Piece*>(host.data_ptr<int64_t>()));
    at::Tensor dev = host.to(device, at::kLong, /*non_blocking=*/true);
    copy_pieces_kernel<<<static_cast<unsigned>(npieces), kThreads, 0, stream>>>(
        reinterpret_cast<const Piece*>(dev.const_data_ptr<int64_t>()));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
