// How the bindings turn Python arguments into a C++ call's input so that a bad argument on one
// rank is every rank's error: the parsing runs inside parse_collectively, which keeps the
// Python exception (raised again on this rank after the call) and hands the C++ call a
// Status (the call's caller_error argument). The call reports that status to every other rank
// through its first collective, so nobody waits for a rank that could not even start.
#pragma once

#include <pybind11/pybind11.h>

#include <exception>
#include <utility>

#include "moed/status.h"
#include "python/interop.h"

namespace moed::python {

// Runs a C++ call without the GIL.
template <typename F>
auto nogil(F&& f) {
  py::gil_scoped_release release;
  return f();
}

// Runs `parse` (which converts arguments and may throw); returns its error as a Status and
// keeps the exception in *error for finish(). A cast error (a handle of the wrong type) reads
// `wrong_handle`.
template <typename Parse>
Status parse_collectively(Parse&& parse, std::exception_ptr* error,
                          const char* wrong_handle = "handle must be the one returned by this "
                                                     "Buffer's dispatch") {
  try {
    parse();
    return ok_status();
  } catch (const py::cast_error&) {
    *error = std::make_exception_ptr(py::type_error(wrong_handle));
    return invalid_argument(wrong_handle);
  } catch (const py::error_already_set& e) {
    *error = std::current_exception();
    return invalid_argument(e.what());
  } catch (const std::exception& e) {
    *error = std::current_exception();
    return invalid_argument(e.what());
  }
}

// The argument and result objects of DeepEP's combine: the same keywords for the legacy
// Buffer and for ElasticBuffer. Tag gives each buffer its own Python classes (pybind11 binds
// a C++ type once).
template <typename Tag>
struct CombineArgs {
  py::object x, handle, topk_weights, bias_0, bias_1, out;
};

template <typename Tag>
struct CombineResult {
  py::object combined_x, combined_topk_weights;
};

template <typename Tag>
void bind_combine_args(py::module_& m, const char* args_name, const char* result_name) {
  using Args = CombineArgs<Tag>;
  using Result = CombineResult<Tag>;
  py::class_<Args>(m, args_name)
      .def(py::init([](py::object x, py::object handle, py::object topk_weights, py::object bias_0,
                       py::object bias_1, py::object out) {
             return Args{x, handle, topk_weights, bias_0, bias_1, out};
           }),
           py::kw_only(), py::arg("x"), py::arg("handle"), py::arg("topk_weights") = py::none(),
           py::arg("bias_0") = py::none(), py::arg("bias_1") = py::none(),
           py::arg("out") = py::none());
  py::class_<Result>(m, result_name)
      .def_readonly("combined_x", &Result::combined_x)
      .def_readonly("combined_topk_weights", &Result::combined_topk_weights);
}

// Raises this rank's own exception if its parsing failed, else the call's error (if any).
template <typename T>
T finish(StatusOr<T>&& r, const std::exception_ptr& error) {
  if (error) std::rethrow_exception(error);
  return check(std::move(r));
}

}  // namespace moed::python
