// bind_core: moed.AbortedError, process-wide settings (tensor cache), dtype helpers and the
// interop round trips the tests and the overhead benchmark call.
#include <pybind11/stl.h>

#include "moed/dtype.h"
#include "moed/tensor.h"
#include "python/bindings.h"
#include "python/interop.h"

namespace moed::python {
namespace {

// The float32 rows of tensor argument `t` converted row by row to `to` with moed's rounding.
Tensor convert_f32_rows(py::handle t, DType to) {
  TensorView v = rows_arg(t, "t", {DType::kF32});
  Tensor out = Tensor::empty(to, v.rows, v.cols);
  py::gil_scoped_release nogil;
  for (int64_t r = 0; r < v.rows; ++r)
    convert_row(v.row_ptr(r), DType::kF32, out.view().row_ptr(r), to, size_t(v.cols));
  return out;
}

}  // namespace

void bind_core(py::module_& m) {
  py::object err = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
      "moed.AbortedError", "A peer rank failed, so this collective call cannot complete.",
      PyExc_RuntimeError, nullptr));
  m.attr("AbortedError") = err;
  aborted_error_type() = err;

  m.def(
      "set_tensor_cache_limit", [](size_t bytes) { set_tensor_cache_limit(bytes); },
      py::arg("bytes"),
      "Bytes of freed large Tensor blocks moed keeps for reuse (0 turns the cache off).");
  m.def("release_tensor_cache", [] {
    py::gil_scoped_release nogil;
    release_tensor_cache();
  });
  m.def("tensor_cache_stats", [] {
    TensorCacheStats s = tensor_cache_stats();
    py::dict d;
    d["cached_bytes"] = s.cached_bytes;
    d["limit_bytes"] = s.limit_bytes;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    return d;
  });
  m.def("row_kernel_isa", [] { return std::string(active_isa_name()); });
  m.def("has_fp8_dtype", [] {
    return torch_dtype(DType::kFP8).ptr() != py::module_::import("torch").attr("uint8").ptr();
  });

  // Interop round trips (tests, overhead benchmark): parse a tensor argument as moed does.
  m.def("_rows_view", [](py::handle t, const char* name) {
    TensorView v = rows_arg(t, name, {DType::kF32, DType::kBF16, DType::kFP8});
    return py::make_tuple(reinterpret_cast<uintptr_t>(v.data), dtype_name(v.dtype), v.rows, v.cols,
                          v.row_stride);
  });
  // A packed copy made by moed, returned through DLPack (owner: the moed Tensor).
  m.def("_copy_rows", [](py::handle t) {
    TensorView v = rows_arg(t, "t", {DType::kF32, DType::kBF16, DType::kFP8});
    Tensor out;
    {
      py::gil_scoped_release nogil;
      out = Tensor::copy_of(v);
    }
    return to_torch(std::move(out));
  });
  m.def("_noop", [](py::handle t) {
    TensorView v = rows_arg(t, "t", {DType::kF32, DType::kBF16, DType::kFP8});
    py::gil_scoped_release nogil;
    return v.rows;
  });
  // Bit conversions with moed's rounding (the definition of the formats, design.md §6.2).
  m.def("_to_bf16", [](py::handle t) { return to_torch(convert_f32_rows(t, DType::kBF16)); });
  // float32 -> E4M3FN (nearest even, saturating at 448) as uint8 bits, rows of any width.
  m.def("_to_fp8", [](py::handle t) {
    return to_torch(convert_f32_rows(t, DType::kFP8))
        .attr("view")(py::module_::import("torch").attr("uint8"));
  });
}

}  // namespace moed::python
