// The Python side of zeroshard._C's one-shot calls: a sequence of tensors and
// one of ints, unpacked by hand with the GIL held (pybind's std::vector<Tensor>
// caster costs ~65 ns a tensor, more than copying a small parameter).
// benchmarks/flatten_floor.cpp includes it too, so that its floor pays exactly
// the unpacking a one-shot call pays.
#pragma once

#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <string>
#include <vector>

namespace zeroshard {

// Borrowed from the Python objects, which PyTensors keeps alive.
using Tensors = std::vector<const at::Tensor*>;

// The tensors of a Python sequence, each held by a reference of our own: with
// the GIL released, another thread's lst.clear() must not free one mid-copy.
// Not a tuple of them (PySequence_Tuple): each call's tuple was a GC-tracked
// allocation, counted towards the collector's next run.
class PyTensors {
 public:
  PyTensors(py::handle seq, const char* what) {
    const std::string not_seq = std::string("zeroshard: ") + what + " must be a sequence of tensors";
    auto fast = py::reinterpret_steal<py::object>(PySequence_Fast(seq.ptr(), not_seq.c_str()));
    if (!fast) throw py::error_already_set();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.ptr());
    owned_.refs.reserve(n);
    ptrs.reserve(n);
    // No Python code runs in this loop (THPVariable_Check's isinstance is
    // type.__instancecheck__, in C), so a list cannot change under it.
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = PySequence_Fast_GET_ITEM(fast.ptr(), i);
      if (!THPVariable_Check(item)) {
        throw py::type_error(std::string("zeroshard: ") + what + "[" + std::to_string(i) + "] is not a Tensor");
      }
      Py_INCREF(item);
      owned_.refs.push_back(item);
      ptrs.push_back(&THPVariable_Unpack(item));
    }
  }

  Tensors ptrs;

 private:
  struct Refs {  // released with the GIL held: after the nogil scope, or when the constructor throws
    std::vector<PyObject*> refs;
    Refs() = default;
    Refs(const Refs&) = delete;
    Refs& operator=(const Refs&) = delete;
    ~Refs() {
      for (PyObject* o : refs) Py_DECREF(o);
    }
  } owned_;
};

inline std::vector<int64_t> unpack_ints(py::handle seq, const char* what) {
  auto fast = py::reinterpret_steal<py::object>(PySequence_Fast(seq.ptr(), what));
  if (!fast) throw py::error_already_set();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.ptr());
  PyObject** items = PySequence_Fast_ITEMS(fast.ptr());
  std::vector<int64_t> out(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (PyBool_Check(items[i])) {  // an int subclass, refused as torch's narrow refuses it
      throw py::type_error(std::string("zeroshard: ") + what + ", got a bool at [" + std::to_string(i) + "]");
    }
    out[i] = PyLong_AsLongLong(items[i]);  // accepts __index__ (numpy ints), not floats
    if (out[i] == -1 && PyErr_Occurred()) {
      if (!PyErr_ExceptionMatches(PyExc_OverflowError)) throw py::error_already_set();
      PyErr_Clear();  // the pure-torch path's bounds check says ValueError: so do we
      throw py::value_error(std::string("zeroshard: ") + what + ", got one beyond int64 at [" +
                            std::to_string(i) + "]: out of bounds");
    }
  }
  return out;
}

}  // namespace zeroshard
