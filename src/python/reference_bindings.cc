// bind_reference: moed's single-process reference (moed/reference.h) over torch tensors, so the
// Python tests compare the dispatchers with it bit for bit (torch.equal).
//
//   p = _C.ReferenceProblem(num_experts=8, ep_size=2, ..., routing_maps=[m0, m1], probs=[p0, p1],
//                           hidden=[x0, x1])
//   rows = _C.reference_dispatch(p)  # per rank: dict of expert_input, permuted_probs, ...
#include "moed/reference.h"

#include <pybind11/stl.h>

#include "python/bindings.h"
#include "python/interop.h"

namespace moed::python {
namespace {

// The problem plus the tensors its views point into (kept referenced).
struct PyProblem {
  ReferenceProblem p;
  std::vector<py::object> keep;
};

std::vector<TensorView> views(const py::list& ts, const char* name, int n) {
  if (int(ts.size()) != n) throw py::value_error(std::string(name) + " needs one tensor per rank");
  std::vector<TensorView> out;
  for (py::handle t : ts) {
    if (t.is_none())
      out.emplace_back();
    else
      out.push_back(rows_arg(t, name, {DType::kF32, DType::kBF16}));
  }
  return out;
}

py::list tensors(std::vector<Tensor>&& ts) {
  py::list out;
  for (Tensor& t : ts) out.append(to_torch(std::move(t)));
  return out;
}

py::list probs_list(std::vector<std::vector<float>>&& gs, const ReferenceProblem& p) {
  py::list out;
  for (size_t s = 0; s < gs.size(); ++s)
    out.append(vector_to_torch<float>(std::move(gs[s]), {p.routing[s].num_tokens, p.num_experts}));
  return out;
}

}  // namespace

void bind_reference(py::module_& m) {
  py::class_<PyProblem>(m, "ReferenceProblem")
      .def(py::init([](int num_experts, int ep_size, int etp_size, py::handle capacity_factor,
                       const std::string& drop_policy, bool pad_to_capacity, int expert_alignment,
                       int router_padding_multiple, bool weighted_combine, int num_topk,
                       const py::list& routing_maps, const py::list& probs, const py::list& hidden,
                       const py::list& scales) {
             PyProblem pp;
             ReferenceProblem& p = pp.p;
             set_dispatch_fields(p, num_experts, ep_size, etp_size, capacity_factor, drop_policy,
                                 pad_to_capacity, expert_alignment, router_padding_multiple,
                                 weighted_combine);
             p.num_topk = num_topk;
             const size_t R = routing_maps.size();
             if (probs.size() != R || hidden.size() != R || (!scales.empty() && scales.size() != R))
               throw py::value_error(
                   "routing_maps, probs, hidden (and scales) need one entry per rank");
             for (size_t r = 0; r < R; ++r) {
               p.routing.push_back(routing_map_arg(routing_maps[r], probs[r], num_topk));
               py::object kept_scales;
               p.hidden.push_back(
                   token_rows_arg(hidden[r], scales.empty() ? py::none() : py::object(scales[r]),
                                  "hidden", {DType::kF32, DType::kBF16, DType::kFP8}, kept_scales));
               pp.keep.push_back(hidden[r]);
               if (!scales.empty()) pp.keep.push_back(kept_scales);
             }
             return pp;
           }),
           py::arg("num_experts"), py::arg("ep_size"), py::arg("etp_size") = 1,
           py::arg("capacity_factor") = py::none(), py::arg("drop_policy") = "probs",
           py::arg("pad_to_capacity") = false, py::arg("expert_alignment") = 1,
           py::arg("router_padding_multiple") = 0, py::arg("weighted_combine") = false,
           py::arg("num_topk") = 0, py::arg("routing_maps"), py::arg("probs"), py::arg("hidden"),
           py::arg("scales") = py::list());

  m.def("reference_dispatch", [](const PyProblem& pp) {
    auto out = check([&] {
      py::gil_scoped_release nogil;
      return reference_dispatch(pp.p);
    }());
    py::list res;
    for (ReferenceRankDispatch& d : out) {
      py::dict r;
      bool fp8 = d.expert_input.x.dtype() == DType::kFP8;
      r["expert_input"] = to_torch(std::move(d.expert_input.x));
      r["scales"] = fp8 ? to_torch(std::move(d.expert_input.scales)) : py::none();
      r["permuted_probs"] = vector_to_torch<float>(std::vector<float>(d.permuted_probs),
                                                   {int64_t(d.permuted_probs.size())});
      r["tokens_per_expert"] = span_to_torch<int64_t>(d.tokens_per_expert);
      r["tokens_per_expert_unpadded"] = span_to_torch<int64_t>(d.tokens_per_expert_unpadded);
      r["row_src_rank"] = span_to_torch<int32_t>(d.row_src_rank);
      r["row_src_token"] = span_to_torch<int32_t>(d.row_src_token);
      res.append(r);
    }
    return res;
  });
  m.def("reference_combine", [](const PyProblem& pp, const py::list& expert_output) {
    std::vector<TensorView> eo = views(expert_output, "expert_output", pp.p.world_size());
    auto out = check([&] {
      py::gil_scoped_release nogil;
      return reference_combine(pp.p, eo);
    }());
    return tensors(std::move(out));
  });
  m.def("reference_dispatch_backward",
        [](const PyProblem& pp, const py::list& grad_rows, const py::list& grad_pprobs) {
          std::vector<TensorView> g = views(grad_rows, "grad_rows", pp.p.world_size());
          std::vector<std::vector<float>> gp(size_t(pp.p.world_size()));
          for (size_t r = 0; r < gp.size() && r < grad_pprobs.size(); ++r) {
            if (grad_pprobs[r].is_none()) continue;
            std::span<const float> s =
                span_arg<float>(grad_pprobs[r], "grad_pprobs", ElemType::kF32, {-1});
            gp[r].assign(s.begin(), s.end());
          }
          auto out = check([&] {
            py::gil_scoped_release nogil;
            return reference_dispatch_backward(pp.p, g, gp);
          }());
          return py::make_tuple(tensors(std::move(out.grad_hidden)),
                                probs_list(std::move(out.grad_probs), pp.p));
        });
  m.def("reference_combine_backward",
        [](const PyProblem& pp, const py::list& grad_out, const py::list& expert_output) {
          std::vector<TensorView> g = views(grad_out, "grad_out", int(pp.p.routing.size()));
          std::vector<TensorView> eo = views(expert_output, "expert_output", pp.p.world_size());
          auto out = check([&] {
            py::gil_scoped_release nogil;
            return reference_combine_backward(pp.p, g, eo);
          }());
          return py::make_tuple(tensors(std::move(out.grad_expert_output)),
                                probs_list(std::move(out.grad_probs), pp.p));
        });
}

}  // namespace moed::python
