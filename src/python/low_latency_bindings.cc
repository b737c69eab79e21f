// moed._C.DeepEpBuffer, low-latency mode: the C++ half of moed.deep_ep.Buffer's
// low_latency_dispatch / low_latency_combine (DeepEP's decode path) on moed::LowLatencyBuffer,
// one buffer per (max tokens, hidden, experts). One argument object in, one result object
// out; everything DeepEP does after the receive (UE8M0 packing of the scales, the packed
// layout_range, the cumulative expert counts) happens here, at once or when the hook runs.
//
// Lifetime: every returned tensor owns its memory (the dispatch's LowLatencyDispatchOutput::
// storage, or a fresh vector) for as long as torch holds it, as DeepEP's freshly allocated
// results do; the one exception is DeepEP's own: get_next_low_latency_combine_buffer is the
// buffer's memory, rewritten by the combine two after the one that reads it.
#include <pybind11/stl.h>

#include <algorithm>
#include <functional>

#include "python/bindings.h"
#include "python/deep_ep_box.h"
#include "python/interop.h"

namespace moed::python {
namespace {

struct LowLatencyHandleBox {
  std::shared_ptr<const LowLatencyHandle> h;
  DeepEpBox::Shape shape;
  int num_local_experts = 0;
  int64_t rows_per_expert = 0;  // R * M
};

struct LowLatencyDispatchArgs {
  py::object x, topk_idx, cumulative_local_expert_recv_stats;
  int64_t num_max_dispatch_tokens_per_rank = 0;
  int num_experts = 0;
  bool use_fp8 = true, round_scale = false, use_ue8m0 = false, return_recv_hook = false;
};

struct LowLatencyDispatchResult {
  py::object recv_x;         // [L, R * M, H] bf16 or fp8
  py::object recv_x_scales;  // [L, R * M, H / 128] f32, or [L, R * M, H / 512] int32 (UE8M0)
  py::object recv_count;     // [L] int32
  py::object src_info;       // [L, R * M] int32
  py::object layout_range;   // [L, R] int64: (begin << 32) | count
  py::object handle;         // LowLatencyHandleBox
  py::object hook;           // the receive, or None
};

struct LowLatencyCombineArgs {
  py::object x, topk_idx, topk_weights, handle, out, order;
  bool zero_copy = false, return_recv_hook = false;
};

struct LowLatencyCombineResult {
  py::object combined_x, hook;
};

// The combine's order keys [T, K] as int32, row-major.
std::vector<int32_t> int32_rows(const TopkView& v, const char* name) {
  std::vector<int32_t> out(size_t(v.num_tokens) * size_t(v.num_topk));
  for (int64_t t = 0; t < v.num_tokens; ++t) {
    for (int k = 0; k < v.num_topk; ++k) {
      const int64_t e = v.at(t, k);
      if (e < INT32_MIN || e > INT32_MAX)
        throw py::value_error(std::string(name) + "[" + std::to_string(t) + "][" +
                              std::to_string(k) + "] = " + std::to_string(e) +
                              " is outside int32");
      out[size_t(t) * v.num_topk + k] = int32_t(e);
    }
  }
  return out;
}

// Parse errors of the low-latency calls travel with the call's own agreement (the first thing
// every rank does in it), so every rank, this one too, raises the same ValueError naming this
// rank, the argument and the value.
Status ll_parse(const std::function<void()>& parse) {
  std::exception_ptr ignored;  // the agreed error is raised instead, on every rank alike
  return parse_collectively(parse, &ignored);
}

// hidden of x as far as it can be read, so a rank with a bad x joins the same buffer's call.
int hidden_of(py::handle x) {
  try {
    py::tuple shape = py::tuple(x.attr("shape"));
    if (shape.size() >= 1) return shape[shape.size() - 1].cast<int>();
  } catch (const std::exception&) {
  }
  return 0;
}

// A hook that runs the receive once, without the GIL, then `after` (the rest of the call); later
// calls do nothing. Its receive is registered with the box, whose close() runs it if the hook
// has not (the world may be gone by the time the hook is called or dropped).
py::object make_hook(DeepEpBox& b, Request&& r, std::function<void()> after) {
  auto pending = b.pending_receive(std::move(r));
  auto called = std::make_shared<bool>(false);
  return py::cpp_function([pending, called, after]() {
    if (*called) return;
    *called = true;
    check(nogil([&] { return pending->run(); }));
    after();
  });
}

LowLatencyDispatchResult ll_dispatch(std::shared_ptr<DeepEpBox> bp,
                                     const LowLatencyDispatchArgs& a) {
  DeepEpBox& b = *bp;
  const int R = b.world().size();
  TensorView xv;
  // The caller's tensors (int64, or a converted copy kept here), read only inside the call;
  // the C++ call checks them as every entry point checks top-k routing (validate).
  TopkView topk;
  py::object keep_idx, unused;
  int32_t* stats = nullptr;
  const Status parsed = ll_parse([&] {
    if (a.use_ue8m0 && !(a.use_fp8 && a.round_scale))
      throw py::value_error("use_ue8m0 = True needs use_fp8 = True and round_scale = True");
    xv = rows_arg(a.x, "x", {DType::kBF16});
    topk = topk_view_arg(a.topk_idx, py::none(), keep_idx, unused);
    if (topk.num_tokens != xv.rows)
      throw py::value_error("topk_idx has " + std::to_string(topk.num_tokens) + " rows but x has " +
                            std::to_string(xv.rows));
    if (!a.cumulative_local_expert_recv_stats.is_none()) {
      stats = const_cast<int32_t*>(span_arg<int32_t>(a.cumulative_local_expert_recv_stats,
                                                     "cumulative_local_expert_recv_stats",
                                                     ElemType::kI32, {a.num_experts / R})
                                       .data());
    }
  });
  const int hidden = parsed.ok() ? int(xv.cols) : hidden_of(a.x);
  const DeepEpBox::Shape shape{a.num_max_dispatch_tokens_per_rank, hidden, a.num_experts};
  LowLatencyBuffer& ll = b.low_latency(shape);
  if (!parsed.ok()) xv = TensorView(nullptr, DType::kBF16, 0, hidden);
  LowLatencyDispatchInput in{.x = xv,
                             .topk = topk,
                             .use_fp8 = a.use_fp8,
                             .round_scale = a.round_scale,
                             .return_recv_hook = a.return_recv_hook};
  LowLatencyDispatchOutput out =
      check(nogil([&] { return ll.low_latency_dispatch(in, parsed); }));
  const int L = out.num_local_experts;
  const int64_t RM = out.rows_per_expert, H = hidden;
  std::shared_ptr<void> owner = out.storage;
  LowLatencyDispatchResult r;
  r.recv_x = to_torch(out.recv.x, owner).attr("view")(L, RM, H);
  r.recv_count = array_to_torch(out.recv_count.data(), L, -1, owner);
  r.src_info = array_to_torch(out.src_info.data(), L, RM, owner);
  // Filled after the receive: DeepEP's packed layout_range and, with use_ue8m0, the scales as
  // exponent bytes (moed::deep_ep::pack_ue8m0), four blocks to an int32.
  auto ranges = std::make_shared<std::vector<int64_t>>(size_t(L) * size_t(R), 0);
  r.layout_range = array_to_torch(ranges->data(), L, R, ranges);
  std::shared_ptr<std::vector<int32_t>> packed;
  if (a.use_fp8 && a.use_ue8m0) {
    packed = std::make_shared<std::vector<int32_t>>(size_t(L * RM) * size_t(H / 512), 0);
    r.recv_x_scales =
        array_to_torch(packed->data(), L * RM, H / 512, packed).attr("view")(L, RM, H / 512);
  } else if (a.use_fp8) {
    r.recv_x_scales = to_torch(out.recv.scales, owner).attr("view")(L, RM, H / 128);
  } else {
    r.recv_x_scales = py::none();
  }
  py::object keep_stats = a.cumulative_local_expert_recv_stats;
  const std::span<const LowLatencyRange> layout = out.layout_range;
  const std::span<const int32_t> counts = out.recv_count;
  const TensorView scales = out.recv.scales;
  auto after = [layout, counts, scales, ranges, packed, stats, keep_stats, owner, L, RM]() {
    for (size_t i = 0; i < ranges->size(); ++i)
      (*ranges)[i] = (int64_t(layout[i].begin) << 32) | int64_t(uint32_t(layout[i].count));
    for (int j = 0; j < L && stats; ++j) stats[j] += counts[size_t(j)];
    if (!packed) return;
    const int64_t w = scales.cols / 4;
    for (int j = 0; j < L; ++j) {
      const int64_t begin = int64_t(j) * RM, n = counts[size_t(j)];
      check(deep_ep::pack_ue8m0(scales.slice_rows(begin, n),
                                std::span<int32_t>(packed->data() + begin * w, size_t(n * w))));
    }
  };
  r.handle = py::cast(LowLatencyHandleBox{out.handle, shape, L, RM});
  if (a.return_recv_hook) {
    r.hook = make_hook(b, std::move(out.hook), after);
  } else {
    after();
    r.hook = py::none();
  }
  return r;
}

// x of the combine: the experts' [L, R * M, H] bf16 rows as one [L * R * M, H] view.
TensorView expert_rows_arg(py::handle x, const LowLatencyHandleBox& hb) {
  const int H = std::get<1>(hb.shape);
  TensorInfo info = tensor_info(x, "x");
  if (info.ndim != 3 || info.shape[0] != hb.num_local_experts ||
      info.shape[1] != hb.rows_per_expert || info.shape[2] != H) {
    std::string got = "[";
    for (int i = 0; i < info.ndim; ++i) got += (i ? ", " : "") + std::to_string(info.shape[i]);
    throw py::value_error("x has shape " + got + "]; expected [" +
                          std::to_string(hb.num_local_experts) + ", " +
                          std::to_string(hb.rows_per_expert) + ", " + std::to_string(H) + "]");
  }
  if (info.stride[2] != 1 || info.stride[0] != info.shape[1] * info.stride[1])
    throw py::value_error("x must have dense rows, one expert after another");
  return rows_arg(x.attr("view")(-1, H), "x", {DType::kBF16});
}

LowLatencyCombineResult ll_combine(std::shared_ptr<DeepEpBox> bp, const LowLatencyCombineArgs& a) {
  DeepEpBox& b = *bp;
  // A handle of another type has no buffer to agree in: that stays a local TypeError.
  if (!py::isinstance<LowLatencyHandleBox>(a.handle))
    throw py::type_error("handle must be the one returned by this Buffer's low_latency_dispatch");
  const auto& hb = a.handle.cast<LowLatencyHandleBox&>();
  TensorView xv;
  std::optional<TensorView> outv;
  py::object keep_x = a.x;
  std::shared_ptr<Tensor> zero_copy_x;  // the buffer's memory the combine reads
  // Read inside the call (the hook reads moed's own copy), so the caller may change them after.
  TopkView topk;
  py::object keep_idx, keep_weights;
  std::vector<int32_t> order;
  const Status parsed = ll_parse([&] {
    if (a.zero_copy) {
      DeepEpBox::NextCombine& next = b.next_combine(hb.shape);
      if (!next.pending)
        throw py::value_error(
            "zero_copy = True but get_next_low_latency_combine_buffer(handle) was not called "
            "before this combine");
      zero_copy_x = next.buffers[size_t(next.next)];
      next.pending = false;
      next.next ^= 1;
      xv = zero_copy_x->view();
    } else {
      xv = expert_rows_arg(keep_x, hb);
    }
    topk = topk_view_arg(a.topk_idx, a.topk_weights, keep_idx, keep_weights);
    if (!a.out.is_none()) outv = rows_arg(a.out, "out", {DType::kF32, DType::kBF16});
    if (!a.order.is_none()) {
      py::object keep_order, unused;
      order = int32_rows(topk_view_arg(a.order, py::none(), keep_order, unused), "order");
    }
  });
  LowLatencyBuffer& ll = b.low_latency(hb.shape);
  LowLatencyCombineInput in{.x = xv,
                            .topk = topk,
                            .handle = hb.h,
                            .return_recv_hook = a.return_recv_hook,
                            .out = outv,
                            .order = order};
  LowLatencyCombineOutput out = check(nogil([&] { return ll.low_latency_combine(in, parsed); }));
  LowLatencyCombineResult r;
  if (outv) {
    r.combined_x = a.out;
  } else {
    auto result = std::make_shared<Tensor>(std::move(out.combined_x));
    r.combined_x = to_torch(result->view(), result);
  }
  // With a hook the receive writes `out` later: the hook keeps x (DeepEP's rule: the caller
  // keeps `out`).
  r.hook =
      a.return_recv_hook ? make_hook(b, std::move(out.hook), [keep_x, zero_copy_x] {}) : py::none();
  return r;
}

// DeepEP's zero-copy combine buffer: moed-owned bf16 [L, R * M, H] memory the experts write
// into; the next low_latency_combine(zero_copy=True) reads it. Two alternate, as DeepEP's do, so
// a view is rewritten by the experts of the combine two later (DeepEP's rule); it stays valid
// memory as long as torch holds it, after the Buffer too.
py::object next_combine_buffer(DeepEpBox& b, py::handle handle) {
  if (!py::isinstance<LowLatencyHandleBox>(handle))
    throw py::type_error("handle must be the one returned by this Buffer's low_latency_dispatch");
  const auto& hb = handle.cast<LowLatencyHandleBox&>();
  DeepEpBox::NextCombine& next = b.next_combine(hb.shape);
  std::shared_ptr<Tensor>& buf = next.buffers[size_t(next.next)];
  const int H = std::get<1>(hb.shape);
  if (!buf) {
    buf = std::make_shared<Tensor>(
        Tensor::empty(DType::kBF16, hb.num_local_experts * hb.rows_per_expert, H));
  }
  next.pending = true;
  return to_torch(buf->view(), buf).attr("view")(hb.num_local_experts, hb.rows_per_expert, H);
}

}  // namespace

void bind_deep_ep_low_latency(py::module_& m, DeepEpClass& buffer) {
  py::class_<LowLatencyHandleBox>(m, "DeepEpLowLatencyHandle")
      .def_property_readonly("num_local_experts",
                             [](const LowLatencyHandleBox& b) { return b.num_local_experts; })
      .def_property_readonly("rows_per_expert",
                             [](const LowLatencyHandleBox& b) { return b.rows_per_expert; });
  py::class_<LowLatencyDispatchArgs>(m, "LowLatencyDispatchArgs")
      .def(py::init([](py::object x, py::object topk_idx, int64_t m_tokens, int num_experts,
                       py::object stats, bool use_fp8, bool round_scale, bool use_ue8m0,
                       bool return_recv_hook) {
             return LowLatencyDispatchArgs{x,           topk_idx,    stats,
                                           m_tokens,    num_experts, use_fp8,
                                           round_scale, use_ue8m0,   return_recv_hook};
           }),
           py::kw_only(), py::arg("x"), py::arg("topk_idx"),
           py::arg("num_max_dispatch_tokens_per_rank"), py::arg("num_experts"),
           py::arg("cumulative_local_expert_recv_stats") = py::none(), py::arg("use_fp8") = true,
           py::arg("round_scale") = false, py::arg("use_ue8m0") = false,
           py::arg("return_recv_hook") = false);
  py::class_<LowLatencyDispatchResult>(m, "LowLatencyDispatchResult")
      .def_readonly("recv_x", &LowLatencyDispatchResult::recv_x)
      .def_readonly("recv_x_scales", &LowLatencyDispatchResult::recv_x_scales)
      .def_readonly("recv_count", &LowLatencyDispatchResult::recv_count)
      .def_readonly("src_info", &LowLatencyDispatchResult::src_info)
      .def_readonly("layout_range", &LowLatencyDispatchResult::layout_range)
      .def_readonly("handle", &LowLatencyDispatchResult::handle)
      .def_readonly("hook", &LowLatencyDispatchResult::hook);
  py::class_<LowLatencyCombineArgs>(m, "LowLatencyCombineArgs")
      .def(
          py::init([](py::object x, py::object topk_idx, py::object topk_weights, py::object handle,
                      bool zero_copy, bool return_recv_hook, py::object out, py::object order) {
            return LowLatencyCombineArgs{x,   topk_idx, topk_weights, handle,
                                         out, order,    zero_copy,    return_recv_hook};
          }),
          py::kw_only(), py::arg("x"), py::arg("topk_idx"), py::arg("topk_weights"),
          py::arg("handle"), py::arg("zero_copy") = false, py::arg("return_recv_hook") = false,
          py::arg("out") = py::none(), py::arg("order") = py::none());
  py::class_<LowLatencyCombineResult>(m, "LowLatencyCombineResult")
      .def_readonly("combined_x", &LowLatencyCombineResult::combined_x)
      .def_readonly("hook", &LowLatencyCombineResult::hook);

  buffer.def("low_latency_dispatch", &ll_dispatch, py::arg("args"))
      .def("low_latency_combine", &ll_combine, py::arg("args"))
      .def("get_next_low_latency_combine_buffer", &next_combine_buffer, py::arg("handle"))
      .def(
          "clean_low_latency_buffer",
          [](DeepEpBox& b, int64_t m, int hidden, int experts) {
            if (b.shrink()) {
              // Shrink mode keeps the buffer (making one is collective over every rank): a
              // barrier over the unmasked ranks, masking whoever does not come.
              LowLatencyBuffer& ll = b.low_latency({m, hidden, experts});
              check(nogil([&] { return ll.clean(); }));
              return;
            }
            // Collective like DeepEP's: every rank drops its buffer here, in the same order.
            World& w = b.world();
            check(nogil([&] { return w.barrier(); }));
            b.drop_low_latency({m, hidden, experts});
          },
          py::arg("num_max_dispatch_tokens_per_rank"), py::arg("hidden"), py::arg("num_experts"))
      .def("query_mask", &DeepEpBox::query_mask)
      .def("update_mask", &DeepEpBox::update_mask, py::arg("rank"), py::arg("mask"))
      .def("clean_mask", &DeepEpBox::clean_mask)
      .def_property_readonly("enable_shrink", &DeepEpBox::shrink);

  m.def("get_low_latency_rdma_size_hint",
        [](int64_t m, int hidden, int num_ranks, int num_experts) {
          return get_low_latency_size_hint(m, hidden, num_ranks, num_experts);
        });
}

}  // namespace moed::python
