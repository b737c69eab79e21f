// moed._C.DeepEpBuffer, normal mode: the C++ half of moed.deep_ep.Buffer's get_dispatch_layout,
// dispatch and combine (DeepEP's legacy Buffer) on moed::deep_ep::NormalBuffer, the rank-major
// receive. Python passes one argument object (NormalDispatchArgs, NormalCombineArgs) and gets
// one result object; this file converts tensors (in place, no copies of payloads), leaves
// every check of the values to the C++ call (collectively, so one rank's bad input is every
// rank's error) and runs the call without the GIL.
//
// Lifetime of returned tensors: recv_x, its scales, recv_topk_idx and recv_topk_weights are
// views of the dispatch's storage (the DLPack capsule owns it: a block of its own in the
// threads world, a slot of the buffer's node-shared receive ring in the MPI and gloo worlds):
// valid while torch holds them, never overwritten, even past the buffer. Handle arrays are
// small copies.
#include <pybind11/stl.h>

#include <chrono>

#include "python/bindings.h"
#include "python/collective_args.h"
#include "python/deep_ep_box.h"
#include "python/interop.h"

namespace moed::python {
namespace {

struct NormalHandleBox {
  std::shared_ptr<const deep_ep::NormalHandle> h;
};

struct NormalDispatchArgs {
  py::object x, x_scales, topk_idx, topk_weights;
  py::object num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert;
  py::object handle, out;
  int expert_alignment = 1;
  int64_t num_worst_tokens = 0;
};

struct NormalDispatchResult {
  py::object recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights;
  py::object num_recv_tokens_per_expert_list;  // list, None in cached mode
  py::object handle;                           // NormalHandleBox
  // DeepEP's six handle arrays (rank_prefix_matrix, channel_prefix_matrix,
  // recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head); None when cached.
  py::object handle_arrays;
};

struct NormalCombineTag;
using NormalCombineArgs = CombineArgs<NormalCombineTag>;
using NormalCombineResult = CombineResult<NormalCombineTag>;

py::object int_matrix(const std::vector<int32_t>& v, int64_t rows, int64_t cols) {
  return vector_to_torch<int32_t>(std::vector<int32_t>(v), {rows, cols});
}

py::object handle_arrays(const deep_ep::NormalHandle& h) {
  const int64_t R = h.num_ranks, C = h.num_channels;
  return py::make_tuple(
      int_matrix(h.rank_prefix_matrix, R, R), int_matrix(h.channel_prefix_matrix, R, C),
      int_matrix(h.recv_channel_prefix_matrix, R, C),
      vector_to_torch<int32_t>(std::vector<int32_t>(h.recv_src_idx), {h.num_rows}),
      vector_to_torch<uint8_t>(std::vector<uint8_t>(h.is_token_in_rank), {h.num_tokens, R})
          .attr("bool")(),
      int_matrix(h.send_head, h.num_tokens, R));
}

NormalDispatchResult normal_dispatch(DeepEpBox& b, const NormalDispatchArgs& a) {
  const int R = b.world().size();
  deep_ep::NormalDispatchInput in;
  in.expert_alignment = a.expert_alignment;
  in.num_worst_tokens = a.num_worst_tokens;
  py::object keep_scales, keep_idx, keep_weights;
  std::exception_ptr error;
  const Status parsed = parse_collectively(
      [&] {
        in.x = token_rows_arg(a.x, a.x_scales, "x", kPayload, keep_scales);
        if (!a.out.is_none()) in.out = rows_arg(a.out, "out", kPayload);
        if (!a.handle.is_none()) {
          in.handle = a.handle.cast<NormalHandleBox&>().h;
          if (!a.topk_idx.is_none() || !a.topk_weights.is_none())
            throw py::value_error(
                "cached dispatch (handle given) takes no topk_idx / topk_weights (as DeepEP)");
          return;
        }
        if (a.num_tokens_per_rank.is_none() || a.is_token_in_rank.is_none() ||
            a.num_tokens_per_expert.is_none())
          throw py::value_error(
              "dispatch without handle needs num_tokens_per_rank, is_token_in_rank "
              "and num_tokens_per_expert (from get_dispatch_layout)");
        if (a.topk_idx.is_none() != a.topk_weights.is_none())
          throw py::value_error("topk_idx and topk_weights must be given together (as DeepEP)");
        if (!a.topk_idx.is_none())
          in.topk = topk_view_arg(a.topk_idx, a.topk_weights, keep_idx, keep_weights);
        in.layout.num_tokens_per_rank =
            span_arg<int32_t>(a.num_tokens_per_rank, "num_tokens_per_rank", ElemType::kI32, {R});
        in.layout.is_token_in_rank = span_arg<uint8_t>(a.is_token_in_rank, "is_token_in_rank",
                                                       ElemType::kBool, {in.x.x.rows, R});
        in.layout.num_tokens_per_expert = span_arg<int32_t>(
            a.num_tokens_per_expert, "num_tokens_per_expert", ElemType::kI32, {-1});
      },
      &error);
  if (error) in.handle.reset();
  deep_ep::NormalBuffer& nb = b.normal();
  deep_ep::NormalDispatchOutput out = finish(nogil([&] { return nb.dispatch(in, parsed); }), error);
  NormalDispatchResult r;
  r.recv_x = in.out ? a.out : to_torch(out.recv_x.x, out.storage);
  r.recv_x_scales = out.recv_x.has_scales() ? to_torch(out.recv_x.scales, out.storage) : py::none();
  r.recv_topk_idx = r.recv_topk_weights = r.num_recv_tokens_per_expert_list = py::none();
  r.handle = py::cast(NormalHandleBox{out.handle});
  r.handle_arrays = py::none();
  if (!a.handle.is_none()) return r;  // cached mode: no new handle (out.handle is null)
  const deep_ep::NormalHandle& h = *out.handle;
  if (in.topk.num_topk > 0) {
    const int64_t K = in.topk.num_topk;
    r.recv_topk_idx = array_to_torch(out.recv_topk_idx.data(), h.num_rows, K, out.storage);
    r.recv_topk_weights = array_to_torch(out.recv_topk_weights.data(), h.num_rows, K, out.storage);
  }
  py::list experts;
  for (int32_t n : out.num_recv_tokens_per_expert) experts.append(n);
  r.num_recv_tokens_per_expert_list = experts;
  r.handle_arrays = handle_arrays(h);
  return r;
}

NormalCombineResult normal_combine(DeepEpBox& b, const NormalCombineArgs& a) {
  deep_ep::NormalCombineInput in;
  py::object keep_weights;
  std::exception_ptr error;
  const Status parsed = parse_collectively(
      [&] {
        in.handle = a.handle.cast<NormalHandleBox&>().h;
        in.x = rows_arg(a.x, "x", kFloatRows);
        if (!a.topk_weights.is_none()) {
          TensorView w = rows_arg(a.topk_weights, "topk_weights", {DType::kF32}, in.x.rows);
          if (!w.contiguous() && w.rows > 1)
            throw py::value_error("topk_weights must be contiguous");
          in.num_topk = int(w.cols);
          in.topk_weights = static_cast<const float*>(w.data);
        }
        if (!a.bias_0.is_none()) in.bias_0 = rows_arg(a.bias_0, "bias_0", kFloatRows);
        if (!a.bias_1.is_none()) in.bias_1 = rows_arg(a.bias_1, "bias_1", kFloatRows);
        if (!a.out.is_none()) in.out = rows_arg(a.out, "out", kFloatRows);
      },
      &error);
  if (error) in.handle.reset();
  deep_ep::NormalBuffer& nb = b.normal();
  deep_ep::NormalCombineOutput out = finish(nogil([&] { return nb.combine(in, parsed); }), error);
  NormalCombineResult r;
  const int64_t T = out.result().rows;
  r.combined_topk_weights =
      in.num_topk > 0
          ? vector_to_torch<float>(std::move(out.combined_topk_weights), {T, in.num_topk})
          : py::none();
  r.combined_x = in.out ? a.out : to_torch(std::move(out.combined_x));
  return r;
}

py::tuple dispatch_layout(DeepEpBox& b, py::handle topk_idx, int num_experts) {
  py::object keep_idx, keep_weights;
  const TopkView tv = topk_view_arg(topk_idx, py::none(), keep_idx, keep_weights);
  deep_ep::NormalBuffer& nb = b.normal();
  DispatchLayout l = check(nogil([&] { return nb.get_dispatch_layout(tv, num_experts); }));
  auto to32 = [](const std::vector<int64_t>& v) {
    return std::vector<int32_t>(v.begin(), v.end());
  };
  const int64_t R = l.num_ranks, N = l.num_nodes;
  py::object per_node =
      N > 1 ? vector_to_torch<int32_t>(to32(l.num_tokens_per_node), {N}) : py::none();
  return py::make_tuple(
      vector_to_torch<int32_t>(to32(l.num_tokens_per_rank), {R}), per_node,
      vector_to_torch<int32_t>(to32(l.num_tokens_per_expert), {int64_t(num_experts)}),
      vector_to_torch<uint8_t>(std::move(l.is_token_in_rank), {tv.num_tokens, R}).attr("bool")());
}

// The C++ API's own loop, for the benchmark beside moed.deep_ep (same process, same run): per
// iteration get_dispatch_layout, dispatch, then combine(recv_x with recv_topk_weights);
// returns each iteration's seconds.
std::vector<double> bench_deep_ep_cpp(DeepEpBox& b, py::handle x, py::handle topk_idx,
                                      py::handle topk_weights, int num_experts, int iters,
                                      int warmup) {
  deep_ep::NormalDispatchInput in;
  py::object keep_scales, keep_idx, keep_weights;
  in.x = token_rows_arg(x, py::none(), "x", kFloatRows, keep_scales);
  in.topk = topk_view_arg(topk_idx, topk_weights, keep_idx, keep_weights);
  deep_ep::NormalBuffer& nb = b.normal();
  std::vector<double> times;
  check(nogil([&]() -> Status {
    for (int i = 0; i < warmup + iters; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      MOED_ASSIGN_OR_RETURN(DispatchLayout l, nb.get_dispatch_layout(in.topk, num_experts));
      in.layout = deep_ep::LayoutView::of(l);
      MOED_ASSIGN_OR_RETURN(deep_ep::NormalDispatchOutput d, nb.dispatch(in));
      deep_ep::NormalCombineInput c;
      c.x = d.recv_x.x;
      c.topk_weights = d.recv_topk_weights.data();
      c.num_topk = in.topk.num_topk;
      c.handle = d.handle;
      MOED_ASSIGN_OR_RETURN(deep_ep::NormalCombineOutput y, nb.combine(c));
      auto t1 = std::chrono::steady_clock::now();
      if (i >= warmup) times.push_back(std::chrono::duration<double>(t1 - t0).count());
    }
    return Status();
  }));
  return times;
}

}  // namespace

void bind_deep_ep_normal(py::module_& m, DeepEpClass& buffer) {
  py::class_<NormalHandleBox>(m, "DeepEpNormalHandle")
      .def_property_readonly("num_recv_tokens",
                             [](const NormalHandleBox& b) { return b.h->num_recv_tokens; })
      .def_property_readonly("num_rows", [](const NormalHandleBox& b) { return b.h->num_rows; });

  py::class_<NormalDispatchArgs>(m, "NormalDispatchArgs")
      .def(py::init([](py::object x, py::object x_scales, py::object topk_idx,
                       py::object topk_weights, py::object num_tokens_per_rank,
                       py::object is_token_in_rank, py::object num_tokens_per_expert,
                       py::object handle, int expert_alignment, int64_t num_worst_tokens,
                       py::object out) {
             return NormalDispatchArgs{x,
                                       x_scales,
                                       topk_idx,
                                       topk_weights,
                                       num_tokens_per_rank,
                                       is_token_in_rank,
                                       num_tokens_per_expert,
                                       handle,
                                       out,
                                       expert_alignment,
                                       num_worst_tokens};
           }),
           py::kw_only(), py::arg("x"), py::arg("x_scales") = py::none(),
           py::arg("topk_idx") = py::none(), py::arg("topk_weights") = py::none(),
           py::arg("num_tokens_per_rank") = py::none(), py::arg("is_token_in_rank") = py::none(),
           py::arg("num_tokens_per_expert") = py::none(), py::arg("handle") = py::none(),
           py::arg("expert_alignment") = 1, py::arg("num_worst_tokens") = 0,
           py::arg("out") = py::none());
  py::class_<NormalDispatchResult>(m, "NormalDispatchResult")
      .def_readonly("recv_x", &NormalDispatchResult::recv_x)
      .def_readonly("recv_x_scales", &NormalDispatchResult::recv_x_scales)
      .def_readonly("recv_topk_idx", &NormalDispatchResult::recv_topk_idx)
      .def_readonly("recv_topk_weights", &NormalDispatchResult::recv_topk_weights)
      .def_readonly("num_recv_tokens_per_expert_list",
                    &NormalDispatchResult::num_recv_tokens_per_expert_list)
      .def_readonly("handle", &NormalDispatchResult::handle)
      .def_readonly("handle_arrays", &NormalDispatchResult::handle_arrays);
  bind_combine_args<NormalCombineTag>(m, "NormalCombineArgs", "NormalCombineResult");

  buffer.def("get_dispatch_layout", &dispatch_layout, py::arg("topk_idx"), py::arg("num_experts"))
      .def("dispatch", &normal_dispatch, py::arg("args"))
      .def("combine", &normal_combine, py::arg("args"))
      .def("_bench_cpp", &bench_deep_ep_cpp, py::arg("x"), py::arg("topk_idx"),
           py::arg("topk_weights"), py::arg("num_experts"), py::arg("iters"), py::arg("warmup"));
}

void bind_deep_ep(py::module_& m) {
  DeepEpClass buffer(m, "DeepEpBuffer");
  buffer
      .def(py::init([](std::shared_ptr<WorldHandle> world, bool enable_shrink,
                       double shrink_timeout_s, int64_t num_rdma_bytes, int num_channels) {
             if (enable_shrink && !(shrink_timeout_s > 0))
               throw py::value_error("shrink_timeout = " + std::to_string(shrink_timeout_s) +
                                     " must be > 0 seconds");
             LowLatencyOptions ll;
             ll.enable_shrink = enable_shrink;
             ll.shrink_timeout = std::chrono::milliseconds(
                 std::max<int64_t>(1, int64_t(shrink_timeout_s * 1000.0 + 0.5)));
             auto box = std::make_shared<DeepEpBox>(
                 world, ll, size_t(std::max<int64_t>(0, num_rdma_bytes)), num_channels);
             world->add(box);
             return box;
           }),
           py::arg("world"), py::kw_only(), py::arg("enable_shrink") = false,
           py::arg("shrink_timeout") = 10.0, py::arg("num_rdma_bytes") = 0,
           py::arg("num_channels") = 0)
      .def("close", [](DeepEpBox& b) {
        nogil([&] {
          b.close();
          return 0;
        });
      });
  bind_deep_ep_normal(m, buffer);
  bind_deep_ep_low_latency(m, buffer);
}

}  // namespace moed::python
