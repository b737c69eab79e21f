// moed._C.ExpertReplicas: the redundant-expert map (moed/replicas.h) for moed.ExpertReplicas.
#include <pybind11/stl.h>

#include "moed/replicas.h"
#include "python/bindings.h"
#include "python/interop.h"

namespace moed::python {

void bind_replicas(py::module_& m) {
  py::class_<ExpertReplicas>(m, "ExpertReplicas")
      .def(
          py::init([](std::vector<std::vector<int32_t>> replicas, int num_physical, int num_ranks) {
            return check(ExpertReplicas::create(std::move(replicas), num_physical, num_ranks));
          }),
          py::arg("replicas"), py::arg("num_physical"), py::arg("num_ranks"))
      .def_property_readonly("num_logical", &ExpertReplicas::num_logical)
      .def_property_readonly("num_physical", &ExpertReplicas::num_physical)
      .def("replicas", &ExpertReplicas::replicas, py::arg("logical"))
      .def(
          "route",
          [](const ExpertReplicas& map, py::object topk_idx, std::vector<int32_t> masked) {
            py::object keep_idx, keep_weights;
            const TopkView v = topk_view_arg(topk_idx, py::none(), keep_idx, keep_weights);
            TopkRouting logical;
            logical.num_tokens = v.num_tokens;
            logical.num_topk = v.num_topk;
            logical.topk_idx.resize(size_t(v.num_tokens) * size_t(v.num_topk));
            for (int64_t t = 0; t < v.num_tokens; ++t) {
              for (int k = 0; k < v.num_topk; ++k)
                logical.topk_idx[size_t(t) * v.num_topk + k] = int32_t(v.at(t, k));
            }
            ReplicaRoute r = check(map.route(logical, masked));
            std::vector<int64_t> physical(r.topk.topk_idx.begin(), r.topk.topk_idx.end());
            return py::make_tuple(vector_to_torch(std::move(physical), {v.num_tokens, v.num_topk}),
                                  r.lost);
          },
          py::arg("topk_idx"), py::arg("masked"));
}

}  // namespace moed::python
