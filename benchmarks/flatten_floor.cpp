// The floor under zeroshard._C's CPU copies, for benchmarks/flatten_bench.py --floor.
//
// Table(tensors, offsets, flat) builds the run table of a list of contiguous
// tensors once, with no checks at all (a benchmark, never a library path: the
// caller promises the tensors and flat stay as they are), and copies it with
// csrc/copy_cpu.h's loop, the one every one-shot call and CopyPlan replay runs.
//   copy(to_flat)                  the copy alone: the fastest any flatten of
//                                  these tensors can be with that loop
//   unpack_copy(tensors, offsets, to_flat)
//                                  first unpacks the Python lists as a one-shot
//                                  call must (csrc/py_args.h), then the copy:
//                                  the fastest any one-shot call can be
// The difference to `copy` is what the layout (a thousand separate allocations,
// a memcpy per run) and the unpacking cost before any check is made.
#include "copy_cpu.h"
#include "py_args.h"

namespace zeroshard {
namespace {

class Table {
 public:
  Table(py::handle tensors, py::handle offsets, const at::Tensor& flat) : flat_(flat) {
    PyTensors ts(tensors, "tensors");
    const std::vector<int64_t> offs = unpack_ints(offsets, "offsets");
    TORCH_CHECK(offs.size() == ts.ptrs.size(), "flatten_floor: ", ts.ptrs.size(), " tensors but ", offs.size(), " offsets");
    const int64_t es = flat.element_size();
    for (size_t i = 0; i < ts.ptrs.size(); ++i) {
      const at::Tensor& t = *ts.ptrs[i];
      TORCH_CHECK(t.is_contiguous() && t.scalar_type() == flat.scalar_type() && t.device().is_cpu(),
                  "flatten_floor: tensors[", i, "] must be contiguous CPU tensors of flat's dtype");
      TORCH_CHECK(offs[i] >= 0 && offs[i] + t.numel() <= flat.numel(), "flatten_floor: offsets[", i, "] out of bounds");
      keep_.push_back(t);
      if (t.numel() > 0) segs_.push_back({static_cast<char*>(t.data_ptr()), offs[i] * es, t.numel() * es});
    }
    prefix_ = payload_prefix(segs_);
  }

  void copy(bool to_flat) {
    py::gil_scoped_release nogil;
    copy_runs_cpu(segs_, prefix_, static_cast<char*>(flat_.data_ptr()), to_flat);
  }

  void unpack_copy(py::handle tensors, py::handle offsets, bool to_flat) {
    PyTensors ts(tensors, "tensors");
    const std::vector<int64_t> offs = unpack_ints(offsets, "offsets");
    TORCH_CHECK(ts.ptrs.size() == keep_.size() && offs.size() == keep_.size(),
                "flatten_floor: not the table's list");
    copy(to_flat);
  }

 private:
  at::Tensor flat_;
  std::vector<at::Tensor> keep_;  // the table's tensors, alive as long as it is
  std::vector<Seg> segs_;
  std::vector<int64_t> prefix_;
};

}  // namespace
}  // namespace zeroshard

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<zeroshard::Table>(m, "Table")
      .def(py::init<py::handle, py::handle, const at::Tensor&>())
      .def("copy", &zeroshard::Table::copy)
      .def("unpack_copy", &zeroshard::Table::unpack_copy);
}
