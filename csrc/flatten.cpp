// zeroshard._C: batched flatten/unflatten copies for the ZeRO-3/FSDP engine.
//
// flatten builds the FlatParameter (and the flat gradient buffer handed to
// reduce-scatter) from many parameters; unflatten materializes per-parameter
// tensors for state dicts and summon_full_params. zeroshard/ext.py holds the
// pure-torch reference; both paths must produce identical bytes.
//
// Every call reduces to a table of contiguous byte runs (runs.h), copied in one
// parallel pass (copy_cpu.h) or one kernel launch. Sources or destinations
// that are not plain row-major memory (strided, conj/neg views) go through
// at::Tensor::copy_, which already handles strides. plan.cpp caches the table
// for a fixed list of tensors (CopyPlan).
#include "copy_cpu.h"
#include "py_args.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/ParallelGuard.h>
#include <c10/core/impl/COWDeleter.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <optional>
#include <utility>

namespace zeroshard {

void copy_runs(const std::vector<Seg>& segs, const at::Tensor& flat, bool to_flat) {
  if (segs.empty()) return;
  char* base = flat_bytes(flat, to_flat);
  if (flat.device().is_cpu()) return copy_runs_cpu(segs, payload_prefix(segs), base, to_flat);
#ifdef ZEROSHARD_WITH_CUDA
  copy_runs_cuda(segs, base, to_flat, flat.device());
#else
  ZS_CHECK(false, "zeroshard._C was built without CUDA support");
#endif
}

void check_flat(const at::Tensor& flat) {
  const bool strided = flat.layout() == at::kStrided;
  ZS_CHECK_VALUE(strided && flat.dim() == 1 && flat.is_contiguous(),
                 "zeroshard: flat must be a 1-D contiguous tensor, got sizes ", flat.sizes(),
                 " strides ", strided ? piece(flat.strides()) : std::string("None"));
}

namespace {

// flat's side of the checks, read once per call rather than per member.
struct FlatSide {
  c10::ScalarType dtype;
  at::Device device;
  int64_t numel, es, storage_offset;
  const c10::StorageImpl* storage;
  explicit FlatSide(const at::Tensor& flat)
      : dtype(flat.scalar_type()), device(flat.device()), numel(flat.numel()), es(flat.element_size()),
        storage_offset(flat.storage_offset()),
        storage(flat.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl()) {}
};

// One member's checks (see check_and_collect), appending its run or strided
// entry to `out`. Everything read is inlined: at 1000 members an out-of-line
// accessor per member (has_storage() behind storage(), the checks behind
// const_data_ptr(), is_cow_data_ptr) costs more than the reads themselves.
void check_one(const char* what, const at::Tensor& t, size_t i, int64_t off, const FlatSide& flat,
               bool writable, Checked& out) {
  const c10::ScalarType dtype = flat.dtype;
  const int64_t es = flat.es;
  ZS_CHECK_VALUE(t.layout() == at::kStrided, "zeroshard: ", what, "[", i,
                 "] must be a strided tensor, got layout ", t.layout());
  ZS_CHECK_VALUE(t.scalar_type() == dtype, "zeroshard: ", what, "[", i, "] has dtype ",
                 t.scalar_type(), " but flat has dtype ", dtype);
  ZS_CHECK_VALUE(t.device() == flat.device, "zeroshard: ", what, "[", i, "] is on ", t.device(),
                 " but flat is on ", flat.device);
  const int64_t n = t.numel();
  ZS_CHECK_VALUE(off >= 0 && off <= flat.numel - n, "zeroshard: ", what, "[", i, "] range [", off,
                 ", ", range_end(off, n), ") is out of bounds for flat of numel ", flat.numel);
  if (n == 0) return;
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  out.reach = std::max(out.reach, off + n);
  out.inference = out.inference || no_version_counter(t);
  // Raw pointers bypass torch's storage bounds checks, and a storage freed
  // with resize_(0) (as FSDP does on reshard) still hands out data_ptr() 0.
  int64_t last = impl->storage_offset() + n - 1;  // last element reached, in elements
  const bool contiguous = impl->is_contiguous();
  if (!contiguous) {
    last = impl->storage_offset();
    const auto sizes = impl->sizes();
    const auto strides = impl->strides();
    for (size_t d = 0; d < sizes.size(); ++d) last += (sizes[d] - 1) * strides[d];
  }
  c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl();
  const size_t have = storage ? storage->nbytes() : 0;
  ZS_CHECK(static_cast<uint64_t>((last + 1) * es) <= have, "zeroshard: ", what, "[", i, "] reaches byte ",
           (last + 1) * es, " of a storage of ", have, " bytes (was its storage freed?)");
  if (writable && storage->data_ptr().get_deleter() == &c10::impl::cow::cow_deleter) {
    // A lazy clone gets its own copy, as copy_ would give it, before any
    // write; torch refuses that inside at::parallel_for (an INTERNAL ASSERT),
    // so a parallel slice leaves it to a serial pass.
    if (c10::ParallelGuard::is_enabled()) {
      out.lazy_clone = true;
    } else {
      (void)storage->mutable_data();
    }
  }
  // In flat's own storage: exactly its range there (a parameter viewing the
  // FlatParameter) or apart from it. copy_ refuses dense partial overlaps.
  if (storage == flat.storage && impl->is_non_overlapping_and_dense()) {
    const int64_t at = flat.storage_offset + off;
    const int64_t lo = impl->storage_offset();
    ZS_CHECK(lo >= at + n || at >= lo + n || (lo == at && contiguous), "zeroshard: ", what, "[", i,
             "]: unsupported operation: some elements of the input tensor and the written-to tensor "
             "refer to a single memory location (it overlaps its own range of flat). Fix: clone() it first.");
  }
  if (is_memcpyable(t)) {
    // The storage's bytes as they are: not mutable_data_ptr, which would
    // materialize a lazy clone and is refused on inference tensors.
    char* bytes = const_cast<char*>(static_cast<const char*>(storage->data()));
    out.segs.push_back({bytes + impl->storage_offset() * es, off * es, n * es});
    out.run_member.push_back(i);
  } else {
    out.strided.push_back(i);
  }
}

// check_and_collect over members [b, e), appending to `out`, in one pass.
// Returns false, having raised nothing, if one of them is not plain: a bad
// member's error waits until the rest are known to be plain.
bool check_range(const char* what, const std::vector<const at::Tensor*>& members,
                 const std::vector<int64_t>& offsets, const at::Tensor& flat, bool writable, size_t b,
                 size_t e, Checked& out) {
  const FlatSide side(flat);
  out.segs.reserve(out.segs.size() + (e - b));
  out.run_member.reserve(out.run_member.size() + (e - b));
  // The reads chase PyObject -> TensorImpl -> StorageImpl (the copy before
  // this call evicted them to L3): prefetched ahead, they overlap.
  return visit_prefetched(b, e, [&](size_t j) { return members[j]->unsafeGetTensorImpl(); }, [&](size_t i) {
    if (!is_plain(*members[i])) return false;
    try {
      check_one(what, *members[i], i, offsets[i], side, writable, out);
    } catch (...) {
      for (size_t j = i + 1; j < e; ++j) {
        if (!is_plain(*members[j])) return false;
      }
      throw;
    }
    return true;
  });
}

template <typename T>
void append(std::vector<T>& to, const std::vector<T>& from) {
  to.insert(to.end(), from.begin(), from.end());
}

// Checks one slice per thread. Each slice stops at its first error; the first
// slice with one holds the first bad member, so the serial pass's error is raised.
bool check_in_slices(const char* what, const std::vector<const at::Tensor*>& members,
                     const std::vector<int64_t>& offsets, const at::Tensor& flat, bool writable,
                     size_t slices, Checked& out) {
  struct Slice {
    Checked found;
    bool plain = true;
    std::exception_ptr error;
  };
  std::vector<Slice> parts(slices);
  const size_t n = members.size();
  at::parallel_for(0, slices, 1, [&](int64_t sb, int64_t se) {
    for (int64_t k = sb; k < se; ++k) {
      try {
        parts[k].plain = check_range(what, members, offsets, flat, writable, n * k / slices,
                                     n * (k + 1) / slices, parts[k].found);
      } catch (...) {
        parts[k].error = std::current_exception();
      }
    }
  });
  for (const Slice& p : parts) {
    if (!p.plain) return false;
  }
  for (const Slice& p : parts) {
    if (p.error) std::rethrow_exception(p.error);
  }
  for (const Slice& p : parts) {  // rare: lazily cloned destinations in a long list
    if (p.found.lazy_clone) return check_range(what, members, offsets, flat, writable, 0, n, out);
  }
  for (const Slice& p : parts) {
    append(out.segs, p.found.segs);
    append(out.run_member, p.found.run_member);
    append(out.strided, p.found.strided);
    out.reach = std::max(out.reach, p.found.reach);
    out.inference = out.inference || p.found.inference;
  }
  return true;
}

}  // namespace

bool check_and_collect(const char* what, const std::vector<const at::Tensor*>& members,
                       const std::vector<int64_t>& offsets, const at::Tensor& flat, bool writable,
                       Checked& out) {
  // Long lists for a CPU flat are checked in slices on the copy's threads:
  // the checks read each member's TensorImpl and StorageImpl, cache misses
  // that one thread paid one after another (at 1000 tensors, ~30 us against
  // ~60 us for copying their 4 MB; ~16 us on two threads). Not for a CUDA
  // flat: no host copy follows to share the thread pool's wake-up with (H100
  // host, 16 threads, one-shot flatten of 1000 tensors: 119.5 us a call in
  // slices, 105.8 us in one).
  const size_t slices = at::in_parallel_region() || !flat.device().is_cpu()
      ? 1
      : std::min<size_t>(at::get_num_threads(), members.size() / kMembersPerSlice);
  const bool plain = slices > 1 ? check_in_slices(what, members, offsets, flat, writable, slices, out)
                                : check_range(what, members, offsets, flat, writable, 0, members.size(), out);
  if (!plain || out.reach == 0) return plain;
  const int64_t es = flat.element_size();
  const size_t have = flat.storage().nbytes();
  ZS_CHECK(static_cast<uint64_t>((flat.storage_offset() + out.reach) * es) <= have,
           "zeroshard: flat elements [0, ", out.reach, ") lie beyond its storage of ", have,
           " bytes (was its storage freed?)");
  return true;
}

void check_writable(const char* what, const std::vector<const at::Tensor*>& members, const Checked& found) {
  for (size_t m : found.strided) {
    const at::Tensor& t = *members[m];
    ZS_CHECK(!t._is_zerotensor(), "zeroshard: ", what, "[", m, "] is a ZeroTensor, which is immutable. "
             "Fix: pass a real tensor (e.g. torch.zeros) to write into.");
    ZS_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, "zeroshard: ", what, "[", m,
             "]: unsupported operation: more than one element of the written-to tensor refers to a single "
             "memory location (an expanded view?). Fix: clone() it first.");
  }
}

void bump_versions(const std::vector<const at::Tensor*>& members, const Checked& found, bool runs) {
  for (size_t m : found.strided) {  // first: outside InferenceMode this raises
    if (found.inference && no_version_counter(*members[m])) members[m]->unsafeGetTensorImpl()->bump_version();
  }
  if (runs) {  // each bump is a locked add (a fence): prefetched, its counter is in cache by then
    const std::vector<size_t>& rm = found.run_member;
    visit_prefetched</*kVersion=*/true>(0, rm.size(), [&](size_t j) { return members[rm[j]]->unsafeGetTensorImpl(); },
                                        [&](size_t j) {
                                          members[rm[j]]->unsafeGetTensorImpl()->bump_version();
                                          return true;
                                        });
  }
}

void copy_strided(const std::vector<const at::Tensor*>& members, const std::vector<int64_t>& offsets,
                  const std::vector<size_t>& strided, const at::Tensor& flat, bool to_flat) {
  if (strided.empty()) return;
  at::NoGradGuard no_grad;  // raw data movement, like the memcpy path: no autograd history
  for (size_t i : strided) {
    const at::Tensor& t = *members[i];
    at::Tensor part = flat.narrow(0, offsets[i], t.numel()).view(t.sizes());
    if (to_flat) {
      part.copy_(t);
    } else {
      t.copy_(part);
    }
  }
}

namespace {

bool flatten_into(const Tensors& tensors, const std::vector<int64_t>& offsets,
                  const at::Tensor& flat) {
  check_flat(flat);
  ZS_CHECK_VALUE(tensors.size() == offsets.size(), "zeroshard: got ", tensors.size(),
                 " tensors but ", offsets.size(), " offsets");
  if (!flat_is_raw(flat)) return false;
  Checked found;
  if (!check_and_collect("tensors", tensors, offsets, flat, /*writable=*/false, found)) return false;  // no write before
  if (tensors.empty()) return true;
  flat.unsafeGetTensorImpl()->bump_version();  // in-place write, as copy_ would record
  copy_runs(found.segs, flat, /*to_flat=*/true);
  copy_strided(tensors, offsets, found.strided, flat, /*to_flat=*/true);
  return true;
}

std::optional<at::Tensor> flatten(const Tensors& tensors, const std::vector<int64_t>& offsets,
                                  int64_t total_numel) {
  ZS_CHECK_VALUE(!tensors.empty(), "zeroshard: flatten needs at least one tensor");
  ZS_CHECK_VALUE(tensors.size() == offsets.size(), "zeroshard: got ", tensors.size(),
                 " tensors but ", offsets.size(), " offsets");
  ZS_CHECK_VALUE(total_numel >= 0, "zeroshard: total_numel must be >= 0, got ", total_numel);
  if (!is_plain(*tensors[0])) return std::nullopt;  // flat takes its device
  at::Tensor flat = at::empty({total_numel}, tensors[0]->options());
  Checked found;
  if (!check_and_collect("tensors", tensors, offsets, flat, /*writable=*/false, found)) return std::nullopt;

  // Zero only the gaps between (sorted) covered ranges, in the same parallel
  // pass as the copies, instead of a separate full-buffer memset. The ranges
  // come from the check's runs: reading 1000 TensorImpls again costs more.
  const int64_t es = flat.element_size();
  std::vector<std::pair<int64_t, int64_t>> ranges;  // (offset, end), in elements
  ranges.reserve(found.segs.size() + found.strided.size() + 1);
  for (const Seg& g : found.segs) ranges.emplace_back(g.rel / es, (g.rel + g.nbytes) / es);
  for (size_t m : found.strided) ranges.emplace_back(offsets[m], offsets[m] + tensors[m]->numel());
  std::sort(ranges.begin(), ranges.end());
  ranges.emplace_back(total_numel, total_numel);  // sentinel: trailing padding
  int64_t covered = 0;
  for (const auto& [lo, hi] : ranges) {
    if (lo > covered) found.segs.push_back({nullptr, covered * es, (lo - covered) * es});
    covered = std::max(covered, hi);
  }
  copy_runs(found.segs, flat, /*to_flat=*/true);
  copy_strided(tensors, offsets, found.strided, flat, /*to_flat=*/true);
  return flat;
}

bool unflatten_into(const at::Tensor& flat, const std::vector<int64_t>& offsets,
                    const Tensors& outs) {
  check_flat(flat);
  ZS_CHECK_VALUE(outs.size() == offsets.size(), "zeroshard: got ", outs.size(),
                 " outputs but ", offsets.size(), " offsets");
  if (!flat_is_raw(flat)) return false;
  Checked found;
  if (!check_and_collect("outs", outs, offsets, flat, /*writable=*/true, found)) return false;
  check_writable("outs", outs, found);
  const bool bump_in_copy = flat.device().is_cpu() && !found.inference;
  bump_versions(outs, found, /*runs=*/!bump_in_copy);
  if (!bump_in_copy) {
    copy_runs(found.segs, flat, /*to_flat=*/false);
  } else if (!found.segs.empty()) {
    copy_runs_cpu(found.segs, payload_prefix(found.segs), flat_bytes(flat, /*to_flat=*/false),
                  /*to_flat=*/false, [&](size_t i, bool starts) {
                    if (starts) outs[found.run_member[i]]->unsafeGetTensorImpl()->bump_version();
                    return true;
                  });
  }
  copy_strided(outs, offsets, found.strided, flat, /*to_flat=*/false);
  return true;
}

std::optional<std::vector<at::Tensor>> unflatten(const at::Tensor& flat,
                                                 const std::vector<int64_t>& offsets,
                                                 const std::vector<std::vector<int64_t>>& shapes) {
  check_flat(flat);
  ZS_CHECK_VALUE(shapes.size() == offsets.size(), "zeroshard: got ", shapes.size(),
                 " shapes but ", offsets.size(), " offsets");
  if (!flat_is_raw(flat)) return std::nullopt;
  // Every shape is checked before the first output is allocated.
  for (size_t i = 0; i < shapes.size(); ++i) {
    int64_t n = 1;
    bool overflow = false;
    for (int64_t d : shapes[i]) {
      ZS_CHECK_VALUE(d >= 0, "zeroshard: shapes[", i, "] has a negative size: ", shapes[i]);
      overflow = overflow || __builtin_mul_overflow(n, d, &n);
    }
    const int64_t off = offsets[i];
    int64_t end = 0;
    const bool fits = !overflow && !__builtin_add_overflow(off, n, &end);
    ZS_CHECK_VALUE(fits && off >= 0 && end <= flat.numel(), "zeroshard: shapes[", i, "] range [", off, ", ",
                   overflow ? std::string("beyond int64") : range_end(off, n), ") is out of bounds for flat of numel ",
                   flat.numel());
  }
  std::vector<at::Tensor> outs;
  outs.reserve(shapes.size());
  for (const auto& shape : shapes) outs.push_back(at::empty(shape, flat.options()));
  Tensors ptrs;
  for (const at::Tensor& o : outs) ptrs.push_back(&o);
  unflatten_into(flat, offsets, ptrs);
  return outs;
}

// --- Python bindings -------------------------------------------------------
// Arguments are unpacked by hand while holding the GIL; the copy itself runs
// without it.

py::object py_flatten_into(py::handle tensors, py::handle offsets, const at::Tensor& flat) {
  PyTensors ts(tensors, "tensors");
  std::vector<int64_t> offs = unpack_ints(offsets, "offsets must be a sequence of ints");
  bool done;
  {
    py::gil_scoped_release nogil;
    done = flatten_into(ts.ptrs, offs, flat);
  }
  return py::bool_(done);
}

py::object py_flatten(py::handle tensors, py::handle offsets, int64_t total_numel) {
  PyTensors ts(tensors, "tensors");
  std::vector<int64_t> offs = unpack_ints(offsets, "offsets must be a sequence of ints");
  std::optional<at::Tensor> flat;
  {
    py::gil_scoped_release nogil;
    flat = flatten(ts.ptrs, offs, total_numel);
  }
  if (!flat) return py::none();
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(*flat)));
}

py::object py_unflatten_into(const at::Tensor& flat, py::handle offsets, py::handle outs) {
  PyTensors os(outs, "outs");
  std::vector<int64_t> offs = unpack_ints(offsets, "offsets must be a sequence of ints");
  bool done;
  {
    py::gil_scoped_release nogil;
    done = unflatten_into(flat, offs, os.ptrs);
  }
  return py::bool_(done);
}

py::object py_unflatten(const at::Tensor& flat, py::handle offsets, py::handle shapes) {
  std::vector<int64_t> offs = unpack_ints(offsets, "offsets must be a sequence of ints");
  auto fast = py::reinterpret_steal<py::object>(PySequence_Fast(shapes.ptr(), "shapes"));
  if (!fast) throw py::error_already_set();
  std::vector<std::vector<int64_t>> dims;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast.ptr()); ++i) {
    dims.push_back(unpack_ints(PySequence_Fast_GET_ITEM(fast.ptr(), i),
                               "each shape must be a sequence of ints"));
  }
  std::optional<std::vector<at::Tensor>> outs;
  {
    py::gil_scoped_release nogil;
    outs = unflatten(flat, offs, dims);
  }
  if (!outs) return py::none();
  py::list result(outs->size());
  for (size_t i = 0; i < outs->size(); ++i) {
    result[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move((*outs)[i])));
  }
  return result;
}

}  // namespace
}  // namespace zeroshard

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace zeroshard;
  m.doc() = "zeroshard batched flatten/unflatten kernels; use zeroshard.ext instead";
  m.def("flatten_into", &py_flatten_into,
        "Returns False without writing if a tensor needs the Python path.");
  m.def("flatten", &py_flatten, "Returns None if a tensor needs the Python path.");
  m.def("unflatten_into", &py_unflatten_into,
        "Returns False without writing if a tensor needs the Python path.");
  m.def("unflatten", &py_unflatten, "Returns None if a tensor needs the Python path.");
  bind_plan(m);
#ifdef ZEROSHARD_WITH_CUDA
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
}
