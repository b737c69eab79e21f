// bind_deep_ep: the C++ half of moed.deep_ep (python/moed/deep_ep.py, DeepEP's legacy Buffer):
// normal mode on moed::deep_ep::NormalBuffer (the rank-major receive), low-latency mode on
// moed::LowLatencyBuffer. The Python layer keeps DeepEP's signatures; this file converts
// tensors (in place, no copies of payloads) and runs every call without the GIL.
//
// Lifetime of returned tensors:
//   - normal dispatch: recv_x, its scales and recv_topk_weights are views of the dispatch's
//     storage (the DLPack capsule owns it: a block of its own in the threads world, a slot of
//     the buffer's node-shared receive ring in the MPI and gloo worlds): valid while torch
//     holds them, never overwritten, even past the buffer.
//   - low-latency dispatch: views of the buffer's current half, valid until the dispatch after
//     next, exactly DeepEP's rule ("at most 2 low-latency results at a time").
//   - handle arrays and recv_topk_idx are small copies.
#include "moed/deep_ep.h"

#include <pybind11/stl.h>

#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "moed/low_latency.h"
#include "python/bindings.h"
#include "python/interop.h"
#include "python/world_handle.h"

namespace moed::python {
namespace {

constexpr std::initializer_list<DType> kPayload = {DType::kF32, DType::kBF16, DType::kFP8};
constexpr std::initializer_list<DType> kFloatRows = {DType::kF32, DType::kBF16};

template <typename F>
auto nogil(F&& f) {
  py::gil_scoped_release release;
  return f();
}

struct NormalHandleBox {
  std::shared_ptr<const deep_ep::NormalHandle> h;
};
struct LowLatencyHandleBox {
  std::shared_ptr<const LowLatencyHandle> h;
  std::tuple<int64_t, int, int> key;  // (max tokens, hidden, experts) of its buffer
};

class DeepEpBox : public Closable {
 public:
  explicit DeepEpBox(std::shared_ptr<WorldHandle> world) : world_(std::move(world)) {
    World& w = world_->get();
    normal_ = check(nogil([&] { return deep_ep::NormalBuffer::create(w); }));
  }
  void close() override {
    std::lock_guard<std::mutex> lock(mu_);
    normal_.reset();
    ll_.clear();
  }
  World& world() { return world_->get(); }
  deep_ep::NormalBuffer& normal() {
    if (!normal_)
      throw std::runtime_error("moed.deep_ep: this Buffer was destroyed or its world has ended");
    return *normal_;
  }
  // Created on first use (collective: every rank calls the same op).
  LowLatencyBuffer& low_latency(int64_t m, int hidden, int experts) {
    const auto key = std::make_tuple(m, hidden, experts);
    auto it = ll_.find(key);
    if (it != ll_.end()) return *it->second;
    World& w = world();
    auto b = check(nogil([&] { return LowLatencyBuffer::create(w, m, hidden, experts); }));
    return *(ll_[key] = std::move(b));
  }
  void drop_low_latency(int64_t m, int hidden, int experts) {
    ll_.erase(std::make_tuple(m, hidden, experts));
  }

  std::shared_ptr<WorldHandle> world_;
  std::mutex mu_;
  std::unique_ptr<deep_ep::NormalBuffer> normal_;
  std::map<std::tuple<int64_t, int, int>, std::unique_ptr<LowLatencyBuffer>> ll_;
};

// Argument parsing whose error must be every rank's: the exception is kept (re-raised on this
// rank after the call) and passed to the call as caller_error, so the other ranks get it from
// the call's first collective instead of waiting.
template <typename Parse>
Status parse_collectively(Parse&& parse, std::exception_ptr* error) {
  try {
    parse();
    return ok_status();
  } catch (const py::cast_error&) {
    *error = std::make_exception_ptr(
        py::type_error("handle must be the one returned by this Buffer's dispatch"));
    return invalid_argument("handle must be the one returned by this Buffer's dispatch");
  } catch (const py::error_already_set& e) {
    *error = std::current_exception();
    return invalid_argument(e.what());
  } catch (const std::exception& e) {
    *error = std::current_exception();
    return invalid_argument(e.what());
  }
}

// Raises this rank's own exception if parsing failed, else the call's error (if any).
template <typename T>
T finish(StatusOr<T>&& r, const std::exception_ptr& error) {
  if (error) std::rethrow_exception(error);
  return check(std::move(r));
}

// topk_idx int64 or int32 [T, K] (contiguous) and optional topk_weights f32 [T, K].
deep_ep::TopkView topk_view(py::handle idx, py::handle weights) {
  deep_ep::TopkView v;
  if (idx.is_none()) return v;
  TensorInfo info = tensor_info(idx, "topk_idx");
  if (info.type != ElemType::kI64 && info.type != ElemType::kI32)
    throw py::type_error("topk_idx has dtype " + py::str(idx.attr("dtype")).cast<std::string>() +
                         "; expected torch.int64 (deep_ep.topk_idx_t) or torch.int32");
  if (info.ndim != 2)
    throw py::value_error("topk_idx must be 2-D [num_tokens, num_topk], got " +
                          std::to_string(info.ndim) + " dimensions");
  if (!info.contiguous()) throw py::value_error("topk_idx must be contiguous");
  v.idx = info.data;
  v.idx_int64 = info.type == ElemType::kI64;
  v.num_tokens = info.shape[0];
  v.num_topk = int(info.shape[1]);
  if (!weights.is_none())
    v.weights =
        span_arg<float>(weights, "topk_weights", ElemType::kF32, {v.num_tokens, v.num_topk}).data();
  return v;
}

TopkRouting topk_copy(const deep_ep::TopkView& v) {
  TopkRouting r;
  r.num_tokens = v.num_tokens;
  r.num_topk = v.num_topk;
  r.topk_idx.resize(size_t(v.num_tokens) * v.num_topk);
  r.topk_weights.assign(r.topk_idx.size(), 0.0f);
  for (int64_t t = 0; t < v.num_tokens; ++t) {
    for (int k = 0; k < v.num_topk; ++k) {
      const int64_t e = v.at(t, k);
      if (e < INT32_MIN || e > INT32_MAX)
        throw py::value_error("topk_idx[" + std::to_string(t) + "][" + std::to_string(k) +
                              "] = " + std::to_string(e) + " is out of range");
      r.topk_idx[size_t(t) * v.num_topk + k] = int32_t(e);
      if (v.weights)
        r.topk_weights[size_t(t) * v.num_topk + k] = v.weights[size_t(t) * v.num_topk + k];
    }
  }
  return r;
}

py::object int_matrix(const std::vector<int32_t>& v, int64_t rows, int64_t cols) {
  return vector_to_torch<int32_t>(std::vector<int32_t>(v), {rows, cols});
}

py::tuple normal_dispatch(DeepEpBox& b, py::handle x, py::handle scales, py::handle topk_idx,
                          py::handle topk_weights, py::handle num_tokens_per_rank,
                          py::handle is_token_in_rank, py::handle num_tokens_per_expert,
                          py::handle handle, int expert_alignment, int64_t num_worst_tokens,
                          py::handle out_arg) {
  const int R = b.world().size();
  deep_ep::NormalDispatchInput in;
  in.expert_alignment = expert_alignment;
  in.num_worst_tokens = num_worst_tokens;
  std::exception_ptr error;
  in.caller_error = parse_collectively(
      [&] {
        in.x = token_rows_arg(x, scales, "x", kPayload);
        // Shape and dtype are checked by the dispatch (errors name both values).
        if (!out_arg.is_none()) in.out = rows_arg(out_arg, "out", kPayload);
        if (!handle.is_none()) {
          in.handle = handle.cast<NormalHandleBox&>().h;
          return;
        }
        if (num_tokens_per_rank.is_none() || is_token_in_rank.is_none() ||
            num_tokens_per_expert.is_none())
          throw py::value_error(
              "dispatch without handle needs num_tokens_per_rank, is_token_in_rank "
              "and num_tokens_per_expert (from get_dispatch_layout)");
        if (topk_idx.is_none() != topk_weights.is_none())
          throw py::value_error("topk_idx and topk_weights must be given together (as DeepEP)");
        in.topk = topk_view(topk_idx, topk_weights);
        in.layout.num_tokens_per_rank =
            span_arg<int32_t>(num_tokens_per_rank, "num_tokens_per_rank", ElemType::kI32, {R});
        in.layout.is_token_in_rank = span_arg<uint8_t>(is_token_in_rank, "is_token_in_rank",
                                                       ElemType::kBool, {in.x.x.rows, R});
        in.layout.num_tokens_per_expert =
            span_arg<int32_t>(num_tokens_per_expert, "num_tokens_per_expert", ElemType::kI32, {-1});
      },
      &error);
  if (!error) in.caller_error = ok_status();
  deep_ep::NormalBuffer& nb = b.normal();
  deep_ep::NormalDispatchOutput out = finish(nogil([&] { return nb.dispatch(in); }), error);
  const deep_ep::NormalHandle& h = *out.handle;
  py::object rx =
      in.out ? py::reinterpret_borrow<py::object>(out_arg) : to_torch(out.recv_x.x, out.storage);
  py::object rs = out.recv_x.has_scales() ? to_torch(out.recv_x.scales, out.storage) : py::none();
  if (!handle.is_none()) return py::make_tuple(rx, rs);
  py::object ridx = py::none(), rw = py::none();
  if (in.topk.num_topk > 0) {
    const int64_t K = in.topk.num_topk;
    ridx = vector_to_torch<int64_t>(
        std::vector<int64_t>(out.recv_topk_idx.begin(), out.recv_topk_idx.end()), {h.num_rows, K});
    rw = to_torch(
        TensorView(const_cast<float*>(out.recv_topk_weights.data()), DType::kF32, h.num_rows, K),
        out.storage);
  }
  const int C = h.num_channels;
  py::list expert_list;
  for (int32_t n : out.num_recv_tokens_per_expert) expert_list.append(n);
  return py::make_tuple(
      rx, rs, ridx, rw, expert_list, NormalHandleBox{out.handle},
      int_matrix(h.rank_prefix_matrix, R, R), int_matrix(h.channel_prefix_matrix, R, C),
      int_matrix(h.recv_channel_prefix_matrix, R, C),
      vector_to_torch<int32_t>(std::vector<int32_t>(h.recv_src_idx), {h.num_rows}),
      vector_to_torch<uint8_t>(std::vector<uint8_t>(h.is_token_in_rank), {h.num_tokens, R})
          .attr("bool")(),
      int_matrix(h.send_head, h.num_tokens, R));
}

py::tuple normal_combine(DeepEpBox& b, py::handle x, py::handle handle, py::handle topk_weights,
                         py::handle bias_0, py::handle bias_1, py::handle out_arg) {
  deep_ep::NormalCombineInput in;
  std::exception_ptr error;
  in.caller_error = parse_collectively(
      [&] {
        in.handle = handle.cast<NormalHandleBox&>().h;
        const deep_ep::NormalHandle& h = *in.handle;
        in.x = rows_arg(x, "x", kFloatRows, -1, h.hidden);
        if (!topk_weights.is_none()) {
          TensorInfo info = tensor_info(topk_weights, "topk_weights");
          if (info.ndim != 2)
            throw py::value_error("topk_weights must be 2-D [num_recv_tokens, num_topk]");
          in.num_topk = int(info.shape[1]);
          in.topk_weights = span_arg<float>(topk_weights, "topk_weights", ElemType::kF32,
                                            {in.x.rows, in.num_topk})
                                .data();
        }
        if (!bias_0.is_none())
          in.bias_0 = rows_arg(bias_0, "bias_0", kFloatRows, h.num_tokens, h.hidden);
        if (!bias_1.is_none())
          in.bias_1 = rows_arg(bias_1, "bias_1", kFloatRows, h.num_tokens, h.hidden);
        // Shape and dtype are checked by the combine (errors name both values).
        if (!out_arg.is_none()) in.out = rows_arg(out_arg, "out", kFloatRows);
      },
      &error);
  if (error) in.handle.reset();
  deep_ep::NormalBuffer& nb = b.normal();
  deep_ep::NormalCombineOutput out = finish(nogil([&] { return nb.combine(in); }), error);
  const int64_t T = out.result().rows;
  py::object w = py::none();
  if (in.num_topk > 0)
    w = vector_to_torch<float>(std::move(out.combined_topk_weights), {T, in.num_topk});
  py::object y =
      in.out ? py::reinterpret_borrow<py::object>(out_arg) : to_torch(std::move(out.combined_x));
  return py::make_tuple(y, w);
}

// A hook that runs the receive phase once, without the GIL.
py::object make_hook(Request&& r) {
  auto req = std::make_shared<Request>(std::move(r));
  return py::cpp_function([req]() {
    if (!*req) return;
    Request mine = std::move(*req);
    check(nogil([&] { return mine->wait(); }));
  });
}

// Int32 memory of moed's as a torch tensor without a copy: a float32 view of the same bytes
// that the Python layer reinterprets with .view(torch.int32).
py::object int32_view(const int32_t* p, int64_t rows, int64_t cols, std::shared_ptr<void> owner) {
  return to_torch(TensorView(const_cast<int32_t*>(p), DType::kF32, rows, cols), std::move(owner));
}

// Low-latency argument errors: the call's own agreement (the first thing every rank does in
// it) carries this rank's parse error, so every rank, this one too, raises the same
// ValueError naming this rank, the argument and the value. `caller_error` (None or a message)
// is an error the Python layer found first.
Status ll_parse(py::handle caller_error, const std::function<void()>& parse) {
  std::exception_ptr ignored;  // the agreed error is raised instead, on every rank alike
  if (!caller_error.is_none()) return invalid_argument(caller_error.cast<std::string>());
  return parse_collectively(parse, &ignored);
}

// hidden of x as far as it can be read, so a rank with a bad x joins the same buffer's call.
int hidden_of(py::handle x, int fallback) {
  try {
    py::tuple shape = py::tuple(x.attr("shape"));
    if (shape.size() >= 1) return shape[shape.size() - 1].cast<int>();
  } catch (const std::exception&) {
  }
  return fallback;
}

py::tuple ll_dispatch(std::shared_ptr<DeepEpBox> bp, py::handle x, py::handle topk_idx, int64_t m,
                      int num_experts, bool use_fp8, bool round_scale, bool return_recv_hook,
                      py::handle caller_error) {
  DeepEpBox& b = *bp;
  TensorView xv;
  TopkRouting topk;
  const Status parsed = ll_parse(caller_error, [&] {
    xv = rows_arg(x, "x", {DType::kBF16});
    deep_ep::TopkView tv = topk_view(topk_idx, py::none());
    if (tv.num_tokens != xv.rows)
      throw py::value_error("topk_idx has " + std::to_string(tv.num_tokens) + " rows but x has " +
                            std::to_string(xv.rows));
    topk = topk_copy(tv);
  });
  const int hidden = parsed.ok() ? int(xv.cols) : hidden_of(x, 0);
  LowLatencyBuffer& ll = b.low_latency(m, hidden, num_experts);
  if (!parsed.ok()) xv = TensorView(nullptr, DType::kBF16, 0, hidden);
  LowLatencyDispatchInput in{.x = xv,
                             .topk = &topk,
                             .use_fp8 = use_fp8,
                             .round_scale = round_scale,
                             .return_recv_hook = return_recv_hook,
                             .caller_error = parsed};
  LowLatencyDispatchOutput out = check(nogil([&] { return ll.low_latency_dispatch(in); }));
  const int L = out.num_local_experts;
  const int64_t RM = out.rows_per_expert;
  // The views alias the buffer's current half (DeepEP's rule: valid until the dispatch after
  // next); the capsules keep the buffer object alive.
  std::shared_ptr<void> owner = bp;
  py::object rx = to_torch(out.recv.x, owner);
  py::object rs = use_fp8 ? to_torch(out.recv.scales, owner) : py::none();
  py::object hook = return_recv_hook ? make_hook(std::move(out.hook)) : py::none();
  static_assert(sizeof(LowLatencyRange) == 8);
  return py::make_tuple(rx, rs, int32_view(out.recv_count.data(), 1, L, owner),
                        int32_view(out.src_info.data(), L, RM, owner),
                        int32_view(reinterpret_cast<const int32_t*>(out.layout_range.data()),
                                   int64_t(out.layout_range.size()), 2, owner),
                        hook, LowLatencyHandleBox{out.handle, {m, hidden, num_experts}}, L, RM);
}

py::tuple ll_combine(std::shared_ptr<DeepEpBox> bp, py::handle x, py::handle topk_idx,
                     py::handle topk_weights, py::handle handle, bool return_recv_hook,
                     py::handle out_arg, py::handle caller_error) {
  DeepEpBox& b = *bp;
  // A handle of another type has no buffer to agree in: that stays a local TypeError.
  auto& hb = handle.cast<LowLatencyHandleBox&>();
  const auto [m, hidden, experts] = hb.key;
  TensorView xv;
  std::optional<TensorView> outv;
  // NOTE: the combine's hook reads the routing later; it lives as long as the hook.
  auto topk = std::make_shared<TopkRouting>();
  const Status parsed = ll_parse(caller_error, [&] {
    xv = rows_arg(x, "x", {DType::kBF16}, -1, hidden);
    *topk = topk_copy(topk_view(topk_idx, topk_weights));
    // Shape and dtype are checked by the combine (errors name both values).
    if (!out_arg.is_none()) outv = rows_arg(out_arg, "out", {DType::kF32, DType::kBF16});
  });
  LowLatencyBuffer& ll = b.low_latency(m, hidden, experts);
  LowLatencyCombineInput in{.x = xv,
                            .topk = topk.get(),
                            .handle = hb.h,
                            .return_recv_hook = return_recv_hook,
                            .caller_error = parsed,
                            .out = outv};
  LowLatencyCombineOutput out = check(nogil([&] { return ll.low_latency_combine(in); }));
  py::object y;
  if (outv) {
    y = py::reinterpret_borrow<py::object>(out_arg);
  } else {
    auto result = std::make_shared<Tensor>(std::move(out.combined_x));
    y = to_torch(result->view(), result);
  }
  // With a hook the receive writes `out` later: the hook keeps the routing (the lambda) and
  // the caller keeps `out` (DeepEP's rule).
  py::object hook = return_recv_hook ? make_hook(std::move(out.hook)) : py::none();
  return py::make_tuple(y, hook);
}

}  // namespace

void bind_deep_ep(py::module_& m) {
  py::class_<NormalHandleBox>(m, "DeepEpNormalHandle")
      .def_property_readonly("num_recv_tokens",
                             [](const NormalHandleBox& b) { return b.h->num_recv_tokens; })
      .def_property_readonly("num_rows", [](const NormalHandleBox& b) { return b.h->num_rows; });
  py::class_<LowLatencyHandleBox>(m, "DeepEpLowLatencyHandle");

  py::class_<DeepEpBox, std::shared_ptr<DeepEpBox>>(m, "DeepEpBuffer")
      .def(py::init([](std::shared_ptr<WorldHandle> world) {
             auto box = std::make_shared<DeepEpBox>(world);
             world->add(box);
             return box;
           }),
           py::arg("world"))
      .def("close",
           [](DeepEpBox& b) {
             nogil([&] {
               b.close();
               return 0;
             });
           })
      .def(
          "get_dispatch_layout",
          [](DeepEpBox& b, py::handle topk_idx, int num_experts) {
            deep_ep::TopkView tv = topk_view(topk_idx, py::none());
            deep_ep::NormalBuffer& nb = b.normal();
            DispatchLayout l =
                check(nogil([&] { return nb.get_dispatch_layout(tv, num_experts); }));
            auto to32 = [](const std::vector<int64_t>& v) {
              return std::vector<int32_t>(v.begin(), v.end());
            };
            const int64_t R = l.num_ranks, N = l.num_nodes;
            py::object per_node =
                N > 1 ? vector_to_torch<int32_t>(to32(l.num_tokens_per_node), {N}) : py::none();
            return py::make_tuple(
                vector_to_torch<int32_t>(to32(l.num_tokens_per_rank), {R}), per_node,
                vector_to_torch<int32_t>(to32(l.num_tokens_per_expert), {int64_t(num_experts)}),
                vector_to_torch<uint8_t>(std::move(l.is_token_in_rank), {tv.num_tokens, R})
                    .attr("bool")());
          },
          py::arg("topk_idx"), py::arg("num_experts"))
      // The C++ API's own loop, for the benchmark beside moed.deep_ep (same process, same
      // run): per iteration get_dispatch_layout, dispatch, then combine(recv_x with
      // recv_topk_weights); returns each iteration's seconds.
      .def(
          "_bench_cpp",
          [](DeepEpBox& b, py::handle x, py::handle topk_idx, py::handle topk_weights,
             int num_experts, int iters, int warmup) {
            deep_ep::NormalDispatchInput in;
            in.x = token_rows_arg(x, py::none(), "x", kFloatRows);
            in.topk = topk_view(topk_idx, topk_weights);
            deep_ep::NormalBuffer& nb = b.normal();
            std::vector<double> times;
            check(nogil([&]() -> Status {
              for (int i = 0; i < warmup + iters; ++i) {
                auto t0 = std::chrono::steady_clock::now();
                MOED_ASSIGN_OR_RETURN(DispatchLayout l,
                                      nb.get_dispatch_layout(in.topk, num_experts));
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
          },
          py::arg("x"), py::arg("topk_idx"), py::arg("topk_weights"), py::arg("num_experts"),
          py::arg("iters"), py::arg("warmup"))
      .def("dispatch", &normal_dispatch, py::arg("x"), py::arg("x_scales"), py::arg("topk_idx"),
           py::arg("topk_weights"), py::arg("num_tokens_per_rank"), py::arg("is_token_in_rank"),
           py::arg("num_tokens_per_expert"), py::arg("handle"), py::arg("expert_alignment"),
           py::arg("num_worst_tokens"), py::arg("out") = py::none())
      .def("combine", &normal_combine, py::arg("x"), py::arg("handle"), py::arg("topk_weights"),
           py::arg("bias_0"), py::arg("bias_1"), py::arg("out") = py::none())
      .def("low_latency_dispatch", &ll_dispatch, py::arg("x"), py::arg("topk_idx"),
           py::arg("num_max_dispatch_tokens_per_rank"), py::arg("num_experts"), py::arg("use_fp8"),
           py::arg("round_scale"), py::arg("return_recv_hook"),
           py::arg("caller_error") = py::none())
      .def("low_latency_combine", &ll_combine, py::arg("x"), py::arg("topk_idx"),
           py::arg("topk_weights"), py::arg("handle"), py::arg("return_recv_hook"),
           py::arg("out") = py::none(), py::arg("caller_error") = py::none())
      .def(
          "clean_low_latency_buffer",
          [](DeepEpBox& b, int64_t m, int hidden, int experts) {
            // Collective like DeepEP's: every rank drops its buffer here, in the same order.
            World& w = b.world();
            check(nogil([&] { return w.barrier(); }));
            nogil([&] {
              b.drop_low_latency(m, hidden, experts);
              return 0;
            });
          },
          py::arg("num_max_dispatch_tokens_per_rank"), py::arg("hidden"), py::arg("num_experts"));

  m.def("deep_ep_pack_ue8m0", [](py::handle scales, py::handle out, py::handle counts,
                                 int64_t rows_per_expert) {
    // Packs the valid rows of each expert (rows past recv_count are left 0).
    TensorView s = rows_arg(scales, "scales", {DType::kF32});
    std::span<const int32_t> o =
        span_arg<int32_t>(out, "out", ElemType::kI32, {s.rows, s.cols / 4});
    std::span<const int32_t> c = span_arg<int32_t>(counts, "recv_count", ElemType::kI32, {-1});
    auto* dst = const_cast<int32_t*>(o.data());
    check(nogil([&]() -> Status {
      const int64_t w = s.cols / 4;
      for (size_t j = 0; j < c.size(); ++j) {
        const int64_t begin = int64_t(j) * rows_per_expert;
        MOED_RETURN_IF_ERROR(
            deep_ep::pack_ue8m0(s.slice_rows(begin, c[j]),
                                std::span<int32_t>(dst + begin * w, size_t(c[j]) * size_t(w))));
      }
      return ok_status();
    }));
  });
  m.def("get_low_latency_rdma_size_hint",
        [](int64_t m, int hidden, int num_ranks, int num_experts) {
          return get_low_latency_size_hint(m, hidden, num_ranks, num_experts);
        });
}

}  // namespace moed::python
