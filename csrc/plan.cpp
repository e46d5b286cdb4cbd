// CopyPlan: the flatten/unflatten of a FIXED list of tensors, validated once
// and replayed.
//
// A FlatParamHandle copies the same parameters (or their gradients' buffers)
// into and out of a flat buffer every step. The one-shot calls in flatten.cpp
// pay per tensor, per call, to unpack Python objects, re-check dtype, device,
// bounds and storage, and (on CUDA) to ship the run table to the GPU: ~100 ns
// a tensor, more than copying a 4 KB parameter. A plan keeps the tensors, the
// checked run table (on the GPU: uploaded, with a chunk index so warps skip
// the search) and a snapshot of every tensor's storage. A replay re-checks the
// snapshot (a few loads per tensor, no Python; on CPU each tensor's by the
// thread about to copy it, so the loads overlap the copying) and the flat
// buffer (O(1)); any change (a tensor re-pointed with .data= or set_(), a
// storage resized or freed, another dtype or device for flat) rebuilds the
// table with the full checks, so a stale plan can never copy to or from the
// wrong bytes.
#include "copy_cpu.h"

#include <c10/core/impl/COWDeleter.h>

#include <algorithm>
#include <mutex>

namespace zeroshard {
namespace {

// What a run was built from. Equal snapshot => the tensor's bytes are where
// the table says, and still as many.
struct Snapshot {
  const c10::StorageImpl* storage;
  const void* data;
  size_t storage_nbytes;
  int64_t storage_offset;
  int64_t numel;
  caffe2::TypeMeta dtype;
  c10::DispatchKeySet keys;  // conj/neg/zero-tensor bits, subclass key
  // kContiguous, and kCow: lazily cloned since (a write must first give it its
  // own copy: a rebuild does). One byte, not two bools: the compiler compared
  // two bools stored a byte apart with one 2-byte load, which store forwarding
  // cannot serve (perf put 40% of the checks' samples there; one byte took
  // 10% off a replay's checks on this project's CPU box).
  uint8_t bits;
  static constexpr uint8_t kContiguous = 1, kCow = 2;

  static Snapshot of(const at::Tensor& t) {
    const c10::TensorImpl* i = t.unsafeGetTensorImpl();
    // Not has_storage(): an out-of-line call that cost a third of a replay's checks.
    const c10::StorageImpl* s = i->unsafe_storage().unsafeGetStorageImpl();
    return {s, s ? s->data() : nullptr, s ? s->nbytes() : 0, i->storage_offset(), i->numel(),
            i->dtype(), i->key_set(),
            static_cast<uint8_t>((i->is_contiguous() ? kContiguous : 0) |
                                 // is_cow_data_ptr's test, inlined: an out-of-line call per member per replay
                                 (s && s->data_ptr().get_deleter() == &c10::impl::cow::cow_deleter ? kCow : 0))};
  }
  bool operator==(const Snapshot& o) const {
    return storage == o.storage && data == o.data && storage_nbytes == o.storage_nbytes &&
           storage_offset == o.storage_offset && numel == o.numel && dtype == o.dtype &&
           keys == o.keys && bits == o.bits;
  }
};

class Plan {
 public:
  Plan(std::vector<at::Tensor> tensors, std::vector<int64_t> offsets)
      : tensors_(std::move(tensors)), offsets_(std::move(offsets)) {
    ZS_CHECK_VALUE(tensors_.size() == offsets_.size(), "zeroshard: got ", tensors_.size(),
                   " tensors but ", offsets_.size(), " offsets");
    for (const at::Tensor& t : tensors_) ptrs_.push_back(&t);
  }

  // False when a tensor or flat needs the pure-torch path (the caller's
  // fallback then writes everything).
  bool run(const at::Tensor& flat, bool to_flat) {
    std::lock_guard<std::mutex> lock(mu_);
    check_flat(flat);
    if (!flat_is_raw(flat)) return false;
    const bool cpu = flat.device().is_cpu();
    // On CPU the members with runs are checked inside the parallel copy, each
    // by the thread about to touch it: their 1000 TensorImpl/StorageImpl reads
    // (cache misses after a copy) then overlap the copying instead of
    // preceding it. Only the rest (empty or strided members) is checked here.
    // A flat too small for the table means a member changed (on CPU, possibly
    // one with a run, not yet checked) or a bad call: the rebuild's full checks
    // then raise the one-shot call's error for the first member that does not fit.
    bool checked = false;
    if (!built_ || flat.scalar_type() != dtype_ || flat.device() != device_ || !fits(flat) ||
        !fresh(cpu)) {
      if (!rebuild(flat)) return false;
      checked = true;
    }
    if (tensors_.empty()) return true;
    for (;;) {
      if (!to_flat) check_writable("tensors", ptrs_, table_);  // strided members: checked by now
      if (to_flat) flat.unsafeGetTensorImpl()->bump_version();  // in-place write, as copy_ records
      const bool bump_in_copy = cpu && !table_.inference;
      if (!to_flat) bump_versions(ptrs_, table_, /*runs=*/!bump_in_copy);
      char* base = flat_bytes(flat, to_flat);
      if (cpu) {
        const bool copied = copy_runs_cpu(table_.segs, prefix_, base, to_flat, [&](size_t i, bool starts) {
          const size_t m = table_.run_member[i];
          if (!checked && !(Snapshot::of(tensors_[m]) == snaps_[m])) return false;
          if (!to_flat && starts && bump_in_copy) tensors_[m].unsafeGetTensorImpl()->bump_version();
          return true;
        });
        if (!copied) {
          // A member changed: the ones before it may already be copied (the
          // redo or the pure-torch path overwrites them, and those bumped
          // move their version twice). Members are only touched after their
          // own check, so nothing stale was read or written.
          if (!rebuild(flat)) return false;
          checked = true;
          continue;
        }
      } else if (!table_.segs.empty()) {
#ifdef ZEROSHARD_WITH_CUDA
        launch_runs_cuda(cuda_, base, to_flat, flat.device());
#endif
      }
      copy_strided(ptrs_, offsets_, table_.strided, flat, to_flat);
      return true;
    }
  }

  int64_t rebuilds() const { return rebuilds_; }

 private:
  // The table still describes the members a replay does not check in its
  // copy: on CPU those without a run (empty or strided), elsewhere all.
  bool fresh(bool cpu) const {
    const auto same = [&](size_t m) { return Snapshot::of(tensors_[m]) == snaps_[m]; };
    if (cpu) return std::all_of(unsegged_.begin(), unsegged_.end(), same);
    // No copy to overlap with here (the GPU's waits for this pass): prefetch ahead instead.
    return visit_prefetched(0, tensors_.size(), [&](size_t m) { return tensors_[m].unsafeGetTensorImpl(); }, same);
  }

  // O(1): every member's range ends by need_ elements of flat, and flat's
  // storage holds the table_.reach elements the non-empty ones cover.
  bool fits(const at::Tensor& flat) const {
    const int64_t es = flat.element_size();
    return need_ <= flat.numel() &&
           (table_.reach == 0 ||
            static_cast<uint64_t>((flat.storage_offset() + table_.reach) * es) <= flat.storage().nbytes());
  }

  bool rebuild(const at::Tensor& flat) {
    built_ = false;
    table_ = Checked{};
    // Members are treated as destinations whichever way this call copies: the
    // table serves both directions, so a lazily cloned member gets its own copy here.
    if (!check_and_collect("tensors", ptrs_, offsets_, flat, /*writable=*/true, table_)) return false;
    snaps_.clear();
    unsegged_.clear();
    need_ = 0;
    for (size_t i = 0, k = 0; i < tensors_.size(); ++i) {
      snaps_.push_back(Snapshot::of(tensors_[i]));
      need_ = std::max(need_, offsets_[i] + tensors_[i].numel());
      if (k < table_.run_member.size() && table_.run_member[k] == i) {
        ++k;
      } else {
        unsegged_.push_back(i);
      }
    }
    prefix_ = payload_prefix(table_.segs);
#ifdef ZEROSHARD_WITH_CUDA
    cuda_ = flat.device().is_cuda() && !table_.segs.empty() ? upload_runs_cuda(table_.segs, flat.device())
                                                      : CudaRuns{};
#endif
    dtype_ = flat.scalar_type();
    device_ = flat.device();
    built_ = true;
    ++rebuilds_;
    return true;
  }

  std::vector<at::Tensor> tensors_;  // owned: the plan keeps their storages alive
  std::vector<const at::Tensor*> ptrs_;
  std::vector<int64_t> offsets_;
  std::mutex mu_;
  bool built_ = false;
  int64_t rebuilds_ = 0;
  c10::ScalarType dtype_ = at::kFloat;
  at::Device device_ = at::kCPU;
  int64_t need_ = 0;  // elements of flat the members reach
  std::vector<Snapshot> snaps_;
  std::vector<size_t> unsegged_;  // members with no run: empty or strided
  Checked table_;                 // the runs and the strided members
  std::vector<int64_t> prefix_;   // payload bytes before each run
#ifdef ZEROSHARD_WITH_CUDA
  CudaRuns cuda_;
#endif
};

}  // namespace

void bind_plan(py::module& m) {
  py::class_<Plan>(m, "Plan", "A validated, replayable flatten/unflatten; use zeroshard.ext.CopyPlan")
      .def(py::init<std::vector<at::Tensor>, std::vector<int64_t>>())
      .def("flatten_into",
           [](Plan& p, const at::Tensor& flat) {
             py::gil_scoped_release nogil;
             return p.run(flat, /*to_flat=*/true);
           })
      .def("unflatten_into",
           [](Plan& p, const at::Tensor& flat) {
             py::gil_scoped_release nogil;
             return p.run(flat, /*to_flat=*/false);
           })
      .def_property_readonly("rebuilds", &Plan::rebuilds);
}

}  // namespace zeroshard
