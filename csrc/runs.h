// Shared by flatten.cpp, plan.cpp and flatten_cuda.cu: the byte-run table that
// every flatten/unflatten call of zeroshard._C reduces to, the checks that
// make raw copies safe, and the error helpers.
//
// A run is one contiguous piece of a tensor and where it sits in the flat
// buffer (the FlatParameter or flat gradient). Runs name the flat side by a
// byte offset, not an address, so one table serves any flat buffer of the
// right size and a CopyPlan can replay it against a new one.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace zeroshard {

struct Seg {
  char* ext;       // the tensor's bytes; nullptr: zero-fill the flat range (padding)
  int64_t rel;     // byte offset of the run in the flat buffer
  int64_t nbytes;  // > 0
};

// prefix[i] = payload bytes before run i; prefix.back() = total.
inline std::vector<int64_t> payload_prefix(const std::vector<Seg>& segs) {
  std::vector<int64_t> prefix(segs.size() + 1, 0);
  for (size_t i = 0; i < segs.size(); ++i) prefix[i + 1] = prefix[i] + segs[i].nbytes;
  return prefix;
}

#ifdef ZEROSHARD_WITH_CUDA
// flatten_cuda.cu. One kernel launch on the current stream.
void copy_runs_cuda(const std::vector<Seg>& segs, char* flat, bool to_flat, const at::Device& device);

// A run table uploaded once (with a chunk -> first run index, so warps need
// no search) and launched many times: CopyPlan's CUDA form.
struct CudaRuns {
  at::Tensor table;  // int64 on the device: 3 per run (ext, rel, start), then 1 per chunk
  int64_t nruns = 0, total = 0, chunk = 0;  // total: payload bytes
  unsigned grid = 0;
  c10::Stream stream{c10::Stream::DEFAULT, at::Device(at::kCPU)};  // the upload's stream
};
CudaRuns upload_runs_cuda(const std::vector<Seg>& segs, const at::Device& device);
void launch_runs_cuda(const CudaRuns& runs, char* flat, bool to_flat, const at::Device& device);
#endif

// --- errors ------------------------------------------------------------------
// Messages are assembled with std::to_string, not c10::str's ostream: a CUDA
// build with a newer host g++ than torch's crashed inside inlined ostream code
// while formatting one. pybind turns value_error into Python's ValueError and
// std::runtime_error into RuntimeError.
inline std::string piece(const char* s) { return s; }
inline std::string piece(const std::string& s) { return s; }
inline std::string piece(long v) { return std::to_string(v); }
inline std::string piece(unsigned long v) { return std::to_string(v); }
inline std::string piece(long long v) { return std::to_string(v); }
inline std::string piece(int v) { return std::to_string(v); }
inline std::string piece(c10::ScalarType t) { return c10::toString(t); }
inline std::string piece(const at::Device& d) { return d.str(); }
inline std::string piece(at::Layout l) {
  return l == at::kStrided ? "Strided" : "non-strided #" + std::to_string(static_cast<int>(l));
}
inline std::string piece(at::IntArrayRef a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + "]";
}
// The end of an element range [off, off + n) as messages print it; the python path says the same.
inline std::string range_end(int64_t off, int64_t n) {
  int64_t end = 0;
  return __builtin_add_overflow(off, n, &end) ? std::string("beyond int64") : std::to_string(end);
}
template <typename... A>
std::string cat(const A&... parts) {
  std::string s;
  ((s += piece(parts)), ...);
  return s;
}
#define ZS_CHECK_VALUE(cond, ...)                                        \
  do {                                                                   \
    if (!(cond)) throw pybind11::value_error(::zeroshard::cat(__VA_ARGS__)); \
  } while (0)
#define ZS_CHECK(cond, ...)                                                 \
  do {                                                                      \
    if (!(cond)) throw std::runtime_error(::zeroshard::cat(__VA_ARGS__));   \
  } while (0)

// --- what may be copied raw ----------------------------------------------------

inline bool device_supported(const at::Device& d) {
#ifdef ZEROSHARD_WITH_CUDA
  return d.is_cpu() || d.is_cuda();
#else
  return d.is_cpu();
#endif
}

// Dense CPU/CUDA tensors, autograd-tracked or not, conj/neg views and zero
// tensors (is_memcpyable sorts those out). Any other dispatch key marks a
// tensor whose raw memory we may not touch: a subclass (Python key: FakeTensor,
// DTensor), a C++ wrapper (functionalize, vmap's Batched, grad's TensorWrapper,
// whose storage is absent or not the values), nested or quantized tensors.
// The caller then falls back to the pure-torch path, which torch's own ops serve.
inline bool is_plain(const at::Tensor& t) {
  using K = c10::DispatchKey;
  static const c10::DispatchKeySet plain{K::CPU,         K::CUDA,        K::AutogradCPU, K::AutogradCUDA,
                                         K::ADInplaceOrView, K::AutocastCPU, K::AutocastCUDA,
                                         K::Conjugate,   K::Negative,    K::ZeroTensor};
  // `-` removes functionality bits only (backend bits stay): nothing beyond them may be left.
  return (t.key_set() - plain).highestFunctionalityKey() == K::Undefined && device_supported(t.device());
}

// Row-major memory whose bytes are the logical values (a conj/neg view's
// bytes are not), so a memcpy is exact.
inline bool is_memcpyable(const at::Tensor& t) {
  return t.is_contiguous() && !t.is_conj() && !t.is_neg() && !t._is_zerotensor();
}

// An inference tensor, or a tensor that got one's .data: its version bump
// raises outside InferenceMode.
inline bool no_version_counter(const at::Tensor& t) {
  return !t.unsafeGetTensorImpl()->version_counter().enabled();
}

void check_flat(const at::Tensor& flat);

// flat itself must be plain row-major memory: a conj/neg view or a zero tensor
// (whose data pointer is null) goes to the pure-torch path whole.
inline bool flat_is_raw(const at::Tensor& flat) { return is_plain(flat) && is_memcpyable(flat); }

// flat's bytes: for writing, its own (a lazily cloned flat gets its own copy
// first, as copy_ would); for reading, as they are (never materialized).
inline char* flat_bytes(const at::Tensor& flat, bool to_flat) {
  return to_flat ? static_cast<char*>(flat.mutable_data_ptr())
                 : const_cast<char*>(static_cast<const char*>(flat.const_data_ptr()));
}

// What check_and_collect found in a list of members.
struct Checked {
  std::vector<Seg> segs;           // a run per non-empty memcpy-able member, in member order
  std::vector<size_t> run_member;  // the member of each run
  std::vector<size_t> strided;     // non-empty members that are not memcpy-able (copy_ moves them)
  int64_t reach = 0;               // elements of flat the members cover
  // A non-empty member has no version counter: an inference tensor, or a
  // tensor that got one's .data. Its bump must run on the calling thread.
  bool inference = false;
  // A writable member is a lazy clone met inside a parallel slice, which may
  // not give it its own copy: the slices' result is redone on the calling thread.
  bool lazy_clone = false;
};

// Checks members (sources of flatten, destinations of unflatten) against the
// flat buffer: layout, dtype, device, bounds, that both storages still hold
// the bytes a raw copy will touch, and that a member sharing flat's storage is
// either exactly its own range there or disjoint from it (copy_ refuses a
// partial overlap). Appends what it finds to `out`: strided members go through
// at::Tensor::copy_. With `writable`, members are destinations: a
// copy-on-write storage gets its own copy first (as copy_ would), so the
// write does not reach the tensor it was lazily cloned from. Returns false,
// having raised nothing, if any member is not plain (the caller falls back to
// the pure-torch path); otherwise raises the first bad member's error before
// anything is written. Lists of 2 * kMembersPerSlice members or more are
// checked in parallel slices of at least kMembersPerSlice, one per thread
// (none inside another parallel region, and none for a CUDA flat).
constexpr size_t kMembersPerSlice = 256;
bool check_and_collect(const char* what, const std::vector<const at::Tensor*>& members,
                       const std::vector<int64_t>& offsets, const at::Tensor& flat, bool writable,
                       Checked& out);

// Raises copy_'s error, before anything is written, for a destination it would
// refuse mid-way: a zero tensor, or one whose elements share memory (an
// expanded view). Only strided members can be either.
void check_writable(const char* what, const std::vector<const at::Tensor*>& members, const Checked& found);

// Version bumps for an unflatten's destinations, as copy_ records an in-place
// write. Run members are bumped here if `runs` (else the CPU copy bumps each on
// the thread that starts it); copy_strided's copy_ bumps the strided ones.
// Inference members are bumped here, before any write: their bump raises
// torch's error outside InferenceMode, a thread-local the copy's workers lack.
void bump_versions(const std::vector<const at::Tensor*>& members, const Checked& found, bool runs);

// copy_ for the members that are not plain row-major memory.
void copy_strided(const std::vector<const at::Tensor*>& members, const std::vector<int64_t>& offsets,
                  const std::vector<size_t>& strided, const at::Tensor& flat, bool to_flat);

void copy_runs(const std::vector<Seg>& segs, const at::Tensor& flat, bool to_flat);

void bind_plan(pybind11::module& m);  // plan.cpp

}  // namespace zeroshard
