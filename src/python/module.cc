// moed._C: the extension module of the Python package (python/moed wraps it).
#include "python/bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "moed's C++ API for the moed Python package (use moed, not moed._C)";
  moed::python::bind_core(m);
  moed::python::bind_world(m);
  moed::python::bind_dispatcher(m);
  moed::python::bind_reference(m);
  moed::python::bind_deep_ep(m);
  moed::python::bind_elastic(m);
  moed::python::bind_replicas(m);
}
