// The extension module moed._C: one bind_* function per area, each in its own file, called
// from module.cc. Shared pieces: interop.h (tensors, errors), world_handle.h (worlds).
#pragma once

#include <pybind11/pybind11.h>

namespace moed::python {

namespace py = pybind11;

void bind_core(py::module_& m);        // core_bindings.cc: errors, settings, tensor cache
void bind_world(py::module_& m);       // world_bindings.cc: WorldHandle, run_threads, MPI
void bind_dispatcher(py::module_& m);  // dispatcher_bindings.cc: TokenDispatcher (six steps)
void bind_reference(py::module_& m);   // reference_bindings.cc: the reference (tests)
// deep_ep_bindings.cc + low_latency_bindings.cc: moed.deep_ep.Buffer (DeepEP's legacy Buffer)
void bind_deep_ep(py::module_& m);
void bind_elastic(py::module_& m);   // elastic_bindings.cc: moed.deep_ep.ElasticBuffer (DeepEP V2)
void bind_replicas(py::module_& m);  // replicas_bindings.cc: moed.ExpertReplicas

}  // namespace moed::python
