// The extension module moed._C: one bind_* function per area, each in its own file, called
// from module.cc. Shared pieces: interop.h (tensors, errors), world_handle.h (worlds).
#pragma once

#include <pybind11/pybind11.h>

namespace moed::python {

namespace py = pybind11;

void bind_core(py::module_& m);        // core.cc: errors, settings, tensor cache, dtypes
void bind_world(py::module_& m);       // world.cc: WorldHandle, run_threads, MPI, collectives
void bind_dispatcher(py::module_& m);  // dispatcher.cc: TokenDispatcher (the six steps, backward)
void bind_reference(py::module_& m);   // reference.cc: the single-process reference (tests)
void bind_deep_ep(py::module_& m);     // deep_ep.cc: moed.deep_ep (DeepEP's legacy Buffer)

}  // namespace moed::python
