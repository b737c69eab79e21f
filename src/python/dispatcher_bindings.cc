// bind_dispatcher: moed::TokenDispatcher (AllGather, AlltoAll, Flex) for the Megatron-style
// classes of python/moed/megatron.py: the six steps, one-call dispatch / combine, and both
// backward passes, over torch tensors.
//
// Lifetime of returned tensors: every dispatcher's outputs stay unchanged while their
// DispatchOutput::storage is held (moed/dispatcher.h), and the DLPack capsule holds it; the
// storage keeps the memory too (Flex: its node-shared region, in every world), so expert_input
// is zero-copy and may outlive the dispatcher. permuted_probs and tokens_per_expert are copied
// (the handle's own vectors are what a weighted combine reads, so torch must not write them).
#include <pybind11/stl.h>

#include <chrono>
#include <mutex>

#include "moed/dispatcher.h"
#include "python/bindings.h"
#include "python/collective_args.h"
#include "python/interop.h"
#include "python/world_handle.h"

namespace moed::python {
namespace {

struct HandleBox {
  std::shared_ptr<const DispatchHandle> h;
};

class DispatcherBox : public Closable {
 public:
  DispatcherBox(std::shared_ptr<WorldHandle> world, std::unique_ptr<TokenDispatcher> d)
      : world_(std::move(world)), d_(std::move(d)) {}
  void close() override {
    std::lock_guard<std::mutex> lock(mu_);
    // A step still in flight reads the dispatcher and the world: it ends first (bounded by the
    // world's timeout), as a Buffer's pending receives do.
    for (Request* r : {&d_req, &c_req}) {
      if (*r) (*r)->wait().ignore();
      r->reset();
    }
    d_.reset();
  }
  TokenDispatcher& get() {
    if (!d_) throw std::runtime_error("moed: this dispatcher's world has ended");
    return *d_;
  }
  std::shared_ptr<WorldHandle> world_;
  std::unique_ptr<TokenDispatcher> d_;
  std::mutex mu_;
  // Inputs of the dispatch / combine in flight: the tensors stay referenced (their memory is
  // read until the step's request completes); top-k routing is viewed in place (or in torch's
  // contiguous copy, kept here), a map is converted to moed's sparse form.
  py::object keep_x, keep_scales, keep_eo, keep_idx, keep_weights;
  py::object keep_out;   // DispatchInput::out's tensor: returned as expert_input
  py::object keep_cout;  // CombineInput::out's tensor: returned as the combined rows
  SparseRouting routing;
  TopkView topk;
  Request d_req, c_req;
  // A preprocess step's argument error on this rank (collective_args.h): the C++ step got it as
  // its caller_error, and it is raised here once the communicating step has told every rank.
  std::exception_ptr d_error, c_error;
};

constexpr const char* kWrongHandle = "handle must be the one returned by this dispatcher";

// A communicating step: with an argument error of this rank's preprocess pending, the step runs
// now (not in the background) so that every rank hears of it, then the error is raised here.
StatusOr<Request> communicate(TokenDispatcher& d, StatusOr<Request> (TokenDispatcher::*step)(bool),
                              bool async, std::exception_ptr& error) {
  const std::exception_ptr mine = std::exchange(error, nullptr);
  StatusOr<Request> r = nogil([&] { return (d.*step)(async && !mine); });
  if (mine) std::rethrow_exception(mine);
  return r;
}

void prepare_dispatch(DispatcherBox& b, py::handle x, py::handle scales, py::handle routing_map,
                      py::handle probs, py::handle topk_idx, py::handle topk_weights, int num_topk,
                      py::handle out, DispatchInput& in) {
  in.hidden = token_rows_arg(x, scales, "hidden_states", kPayload, b.keep_scales);
  // Shape and dtype are checked by the dispatch, on every rank (errors name both values).
  if (!out.is_none()) in.out = rows_arg(out, "out", kPayload);
  const bool has_map = !routing_map.is_none(), has_topk = !topk_idx.is_none();
  if (has_map == has_topk)
    throw py::value_error(
        "pass exactly one of routing_map (with probs) and topk_idx (with topk_weights)");
  if (has_map) {
    b.routing = sparse_routing_arg(routing_map, probs, num_topk);
    in.routing = &b.routing;
  } else {
    b.topk = topk_view_arg(topk_idx, topk_weights, b.keep_idx, b.keep_weights);
    in.topk = b.topk;
  }
  b.keep_x = py::reinterpret_borrow<py::object>(x);
  b.keep_scales = py::reinterpret_borrow<py::object>(scales);
  b.keep_out = py::reinterpret_borrow<py::object>(out);
}

// What a dispatch returns to Python: DispatchOutput's fields as torch tensors.
struct DispatchResult {
  py::object expert_input;       // [num_rows, H]: the caller's `out`, or a view of moed's rows
  py::object scales;             // fp8's [num_rows, H / 128] f32, else None
  py::object permuted_probs;     // [num_rows] f32
  py::object tokens_per_expert;  // [L] int64
  py::object handle;             // a HandleBox, for combine and the backward steps
};

DispatchResult dispatch_result(DispatcherBox& b, DispatchOutput&& out) {
  // Every dispatcher's storage holds expert_input unchanged and alive (moed/dispatcher.h).
  DispatchResult r;
  r.scales = py::none();
  if (!b.keep_out.is_none()) {
    // DispatchInput::out: the rows are in the caller's tensor; fp8 scales stay ours.
    r.expert_input = std::move(b.keep_out);
  } else {
    r.expert_input = to_torch(out.expert_input.x, out.storage);
  }
  if (out.expert_input.has_scales()) r.scales = to_torch(out.expert_input.scales, out.storage);
  b.keep_x = py::object();
  b.keep_scales = py::object();
  b.keep_idx = py::object();
  b.keep_weights = py::object();
  b.keep_out = py::object();
  r.permuted_probs = span_to_torch<float>(out.permuted_probs);
  r.tokens_per_expert = span_to_torch<int64_t>(out.tokens_per_expert);
  r.handle = py::cast(HandleBox{out.handle});
  return r;
}

std::shared_ptr<const DispatchHandle> handle_of(py::handle h) {
  auto& box = h.cast<HandleBox&>();
  if (!box.h) throw py::value_error("handle is empty");
  return box.h;
}

// out (optional): the caller's [T, H] tensor for the result (shape and dtype are checked by
// the combine, on every rank). A bad argument: an empty input, the error in *parsed and *error
// (collective_args.h).
CombineInput combine_input(py::handle eo, py::handle handle, py::handle out, Status* parsed,
                           std::exception_ptr* error) {
  CombineInput in;
  *parsed = parse_collectively(
      [&] {
        in.expert_output = TokenRows{rows_arg(eo, "expert_output", kFloatRows), {}};
        in.handle = handle_of(handle);
        if (!out.is_none()) in.out = rows_arg(out, "out", kFloatRows);
      },
      error, kWrongHandle);
  if (!parsed->ok()) in = CombineInput{};
  return in;
}

// (combined rows, combined_probs or None): the caller's `out` tensor when one was given.
py::tuple combine_result(CombineOutput&& out, py::object& keep_cout, bool combined_probs) {
  const int64_t T = out.result().rows;
  py::object probs = combined_probs ? vector_to_torch<float>(std::move(out.combined_probs), {T})
                                    : py::object(py::none());
  py::object rows = out.out ? std::move(keep_cout) : to_torch(std::move(out.hidden));
  keep_cout = py::object();
  return py::make_tuple(rows, probs);
}

// (gradient tensor, grad_probs [T, E]) of a backward pass.
py::tuple grad_result(Tensor&& grad, std::vector<float>&& grad_probs, const DispatchHandle& h) {
  return py::make_tuple(to_torch(std::move(grad)),
                        vector_to_torch<float>(std::move(grad_probs),
                                               {h.routing.num_tokens(), h.routing.num_experts}));
}

// Waits on a step's request (if any) and runs the local step after it.
template <typename F>
auto after(Request& pending, F&& step) {
  return check(nogil([&]() -> decltype(step()) {
    if (pending) {
      Request r = std::move(pending);
      MOED_RETURN_IF_ERROR(r->wait());
    }
    return step();
  }));
}

// Defines `name` taking a dispatch's arguments (hidden_states, scales, one routing form) and
// calling f(box, DispatchInput, its parse status, the parse error): dispatch_preprocess and the
// one-call dispatch. A bad argument reaches the C++ call as its caller_error, with an empty input.
template <typename Class, typename F>
void def_dispatch(Class& c, const char* name, F f) {
  c.def(
      name,
      [f](DispatcherBox& b, py::handle x, py::handle scales, py::handle routing_map,
          py::handle probs, py::handle topk_idx, py::handle topk_weights, int num_topk,
          py::handle out) {
        DispatchInput in;
        std::exception_ptr error;
        const Status parsed = parse_collectively(
            [&] {
              prepare_dispatch(b, x, scales, routing_map, probs, topk_idx, topk_weights, num_topk,
                               out, in);
            },
            &error, kWrongHandle);
        if (!parsed.ok()) in = DispatchInput{};
        return f(b, in, parsed, error);
      },
      py::arg("hidden_states"), py::arg("scales") = py::none(), py::arg("routing_map") = py::none(),
      py::arg("probs") = py::none(), py::arg("topk_idx") = py::none(),
      py::arg("topk_weights") = py::none(), py::arg("num_topk") = 0, py::arg("out") = py::none());
}

// The Megatron seam's configuration: DispatchConfig from the names megatron.py passes
// (MoEConfig's knobs); capacity_factor None is dropless.
DispatchConfig make_config(const std::string& kind, int num_experts, int ep_size, int etp_size,
                           py::handle capacity_factor, const std::string& drop_policy,
                           bool pad_to_capacity, int expert_alignment, int router_padding_multiple,
                           bool weighted_combine, int64_t num_worst_tokens, int num_channels) {
  DispatchConfig c;
  c.kind = check(parse_dispatcher_kind(kind));
  set_dispatch_fields(c, num_experts, ep_size, etp_size, capacity_factor, drop_policy,
                      pad_to_capacity, expert_alignment, router_padding_multiple, weighted_combine);
  c.num_worst_tokens = num_worst_tokens;
  c.num_channels = num_channels;
  return c;
}

std::shared_ptr<DispatcherBox> make_dispatcher(std::shared_ptr<WorldHandle> world,
                                               const DispatchConfig& c) {
  World& w = world->get();
  auto d = check(nogil([&] { return TokenDispatcher::create(w, c); }));
  auto box = std::make_shared<DispatcherBox>(world, std::move(d));
  world->add(box);
  return box;
}

void bind_config_and_result(py::module_& m) {
  py::class_<DispatchConfig>(m, "DispatchConfig")
      .def(py::init(&make_config), py::kw_only(), py::arg("kind"), py::arg("num_experts"),
           py::arg("ep_size") = 0, py::arg("etp_size") = 1,
           py::arg("capacity_factor") = py::none(), py::arg("drop_policy") = "probs",
           py::arg("pad_to_capacity") = false, py::arg("expert_alignment") = 1,
           py::arg("router_padding_multiple") = 0, py::arg("weighted_combine") = false,
           py::arg("num_worst_tokens") = 0, py::arg("num_channels") = 0)
      .def_property_readonly(
          "kind", [](const DispatchConfig& c) { return std::string(dispatcher_kind_name(c.kind)); })
      .def_readonly("num_experts", &DispatchConfig::num_experts)
      .def_readonly("ep_size", &DispatchConfig::ep_size)
      .def_readonly("etp_size", &DispatchConfig::etp_size)
      .def_readonly("weighted_combine", &DispatchConfig::weighted_combine)
      .def_readonly("num_worst_tokens", &DispatchConfig::num_worst_tokens)
      .def_readonly("num_channels", &DispatchConfig::num_channels);
  py::class_<DispatchResult>(m, "DispatchResult")
      .def_readonly("expert_input", &DispatchResult::expert_input)
      .def_readonly("scales", &DispatchResult::scales)
      .def_readonly("permuted_probs", &DispatchResult::permuted_probs)
      .def_readonly("tokens_per_expert", &DispatchResult::tokens_per_expert)
      .def_readonly("handle", &DispatchResult::handle);
}

std::vector<double> bench_dispatcher_cpp(DispatcherBox& b, py::handle x, py::handle routing_map,
                                         py::handle probs, int num_topk, int iters, int warmup,
                                         int between) {
  if (between < 0 || between > 3) {
    throw py::value_error("between = " + std::to_string(between) + " is not 0, 1, 2 or 3");
  }
  DispatchInput in;
  py::object no_scales;
  in.hidden = token_rows_arg(x, py::none(), "hidden_states", kPayload, no_scales);
  RoutingMap map = routing_map_arg(routing_map, probs, num_topk);
  in.map = MapView::of(map);
  TokenDispatcher& d = b.get();
  py::object tick = py::module_::import("time").attr("perf_counter");
  auto gap = [&] {
    if (between < 2) return;
    py::gil_scoped_acquire gil;
    if (between == 3) tick();
  };
  auto wait = [](StatusOr<Request> r) -> Status {
    if (!r.ok()) return r.status();
    return (*r)->wait();
  };
  // Both outputs live until the iteration's time is taken, as in the Python loop.
  DispatchOutput out;
  CombineOutput y;
  auto iteration = [&]() -> Status {
    if (between == 0) {
      MOED_ASSIGN_OR_RETURN(out, d.dispatch(in));
      MOED_ASSIGN_OR_RETURN(y, d.combine({out.expert_input, out.handle}));
      return ok_status();
    }
    MOED_RETURN_IF_ERROR(d.dispatch_preprocess(in));
    gap();
    MOED_RETURN_IF_ERROR(wait(d.token_dispatch(false)));
    gap();
    MOED_ASSIGN_OR_RETURN(out, d.dispatch_postprocess());
    gap();
    MOED_RETURN_IF_ERROR(d.combine_preprocess({out.expert_input, out.handle}));
    gap();
    MOED_RETURN_IF_ERROR(wait(d.token_combine(false)));
    gap();
    MOED_ASSIGN_OR_RETURN(y, d.combine_postprocess());
    return ok_status();
  };
  std::vector<double> times;
  Status st = nogil([&]() -> Status {
    for (int i = 0; i < warmup + iters; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      MOED_RETURN_IF_ERROR(iteration());
      auto t1 = std::chrono::steady_clock::now();
      out = DispatchOutput{};
      y = CombineOutput{};
      if (i >= warmup) times.push_back(std::chrono::duration<double>(t1 - t0).count());
    }
    return Status();
  });
  check(st);
  return times;
}

py::tuple dispatch_backward(DispatcherBox& b, py::handle grad_x, py::handle grad_pprobs,
                            py::handle handle) {
  DispatchGradInput g;
  g.handle = handle_of(handle);
  g.grad_expert_input =
      rows_arg(grad_x, "grad_expert_input", kFloatRows, g.handle->num_rows, g.handle->hidden);
  if (!grad_pprobs.is_none())
    g.grad_permuted_probs =
        span_arg<float>(grad_pprobs, "grad_permuted_probs", ElemType::kF32, {g.handle->num_rows});
  TokenDispatcher& d = b.get();
  DispatchGrad out = check(nogil([&] { return d.dispatch_backward(g); }));
  return grad_result(std::move(out.grad_hidden), std::move(out.grad_probs), *g.handle);
}

py::tuple combine_backward(DispatcherBox& b, py::handle grad_out, py::handle expert_output,
                           py::handle handle) {
  CombineGradInput g;
  g.handle = handle_of(handle);
  g.grad_hidden = rows_arg(grad_out, "grad_output", kFloatRows, g.handle->routing.num_tokens(),
                           g.handle->hidden);
  if (!expert_output.is_none())
    g.expert_output = TokenRows{
        rows_arg(expert_output, "expert_output", kFloatRows, g.handle->num_rows, g.handle->hidden),
        {}};
  TokenDispatcher& d = b.get();
  CombineGrad out = check(nogil([&] { return d.combine_backward(g); }));
  return grad_result(std::move(out.grad_expert_output), std::move(out.grad_probs), *g.handle);
}

// DispatchHandle: the handle's fields, read-only, as torch tensors.
void bind_dispatch_handle(py::module_& m) {
  py::class_<HandleBox>(m, "DispatchHandle")
      .def_property_readonly(
          "kind", [](const HandleBox& b) { return std::string(dispatcher_kind_name(b.h->kind)); })
      .def_property_readonly("num_rows", [](const HandleBox& b) { return b.h->num_rows; })
      .def_property_readonly("hidden", [](const HandleBox& b) { return b.h->hidden; })
      .def_property_readonly("num_tokens",
                             [](const HandleBox& b) { return b.h->routing.num_tokens(); })
      .def_property_readonly("num_experts",
                             [](const HandleBox& b) { return b.h->routing.num_experts; })
      .def_property_readonly(
          "tokens_per_expert",
          [](const HandleBox& b) { return span_to_torch<int64_t>(b.h->tokens_per_expert); })
      .def_property_readonly("tokens_per_expert_unpadded",
                             [](const HandleBox& b) {
                               return span_to_torch<int64_t>(b.h->tokens_per_expert_unpadded);
                             })
      .def_property_readonly(
          "row_src_rank",
          [](const HandleBox& b) { return span_to_torch<int32_t>(b.h->row_src_rank); })
      .def_property_readonly(
          "row_src_token",
          [](const HandleBox& b) { return span_to_torch<int32_t>(b.h->row_src_token); })
      .def_property_readonly(
          "permuted_probs",
          [](const HandleBox& b) { return span_to_torch<float>(b.h->permuted_probs); })
      // The effective routing (after dropping and router padding), as a map on request: the
      // handle keeps it sparse.
      .def_property_readonly("routing_map",
                             [](const HandleBox& b) {
                               RoutingMap r = to_map(b.h->routing);
                               return vector_to_torch<uint8_t>(std::move(r.routing_map),
                                                               {r.num_tokens, r.num_experts})
                                   .attr("bool")();
                             })
      .def_property_readonly("routing_probs", [](const HandleBox& b) {
        RoutingMap r = to_map(b.h->routing);
        return vector_to_torch<float>(std::move(r.probs), {r.num_tokens, r.num_experts});
      });
}

}  // namespace

void bind_dispatcher(py::module_& m) {
  bind_dispatch_handle(m);

  bind_config_and_result(m);

  py::class_<DispatcherBox, std::shared_ptr<DispatcherBox>> cls(m, "TokenDispatcher");
  cls.def(py::init(&make_dispatcher), py::arg("world"), py::arg("config"))
      .def_property_readonly(
          "kind",
          [](DispatcherBox& b) { return std::string(dispatcher_kind_name(b.get().config().kind)); })
      .def_property_readonly("num_local_experts",
                             [](DispatcherBox& b) {
                               return b.get().config().num_local_experts(b.get().world().size());
                             })
      .def("close", [](DispatcherBox& b) {
        nogil([&] {
          b.close();
          return 0;
        });
      });

  // ---- the six steps ----
  def_dispatch(cls, "dispatch_preprocess",
               [](DispatcherBox& b, const DispatchInput& in, const Status& parsed,
                  std::exception_ptr error) {
                 TokenDispatcher& d = b.get();
                 check(nogil([&] { return d.dispatch_preprocess(in, parsed); }));
                 b.d_error = error;
               });
  cls.def(
         "token_dispatch",
         [](DispatcherBox& b, bool async) {
           TokenDispatcher& d = b.get();
           b.d_req = check(communicate(d, &TokenDispatcher::token_dispatch, async, b.d_error));
         },
         py::arg("async_op") = false)
      .def("dispatch_postprocess",
           [](DispatcherBox& b) {
             TokenDispatcher& d = b.get();
             return dispatch_result(b, after(b.d_req, [&] { return d.dispatch_postprocess(); }));
           })
      .def(
          "combine_preprocess",
          [](DispatcherBox& b, py::handle eo, py::handle handle, py::handle out) {
            Status parsed;
            std::exception_ptr error;
            const CombineInput in = combine_input(eo, handle, out, &parsed, &error);
            b.keep_eo = py::reinterpret_borrow<py::object>(eo);
            b.keep_cout = py::reinterpret_borrow<py::object>(out);
            TokenDispatcher& d = b.get();
            check(nogil([&] { return d.combine_preprocess(in, parsed); }));
            b.c_error = error;
          },
          py::arg("expert_output"), py::arg("handle"), py::arg("out") = py::none())
      .def(
          "token_combine",
          [](DispatcherBox& b, bool async) {
            TokenDispatcher& d = b.get();
            b.c_req = check(communicate(d, &TokenDispatcher::token_combine, async, b.c_error));
          },
          py::arg("async_op") = false)
      // Returns (hidden [T, H], combined_probs [T] f32 or None unless asked for).
      .def(
          "combine_postprocess",
          [](DispatcherBox& b, bool combined_probs) {
            TokenDispatcher& d = b.get();
            CombineOutput out = after(b.c_req, [&] { return d.combine_postprocess(); });
            b.keep_eo = py::object();
            return combine_result(std::move(out), b.keep_cout, combined_probs);
          },
          py::arg("combined_probs") = false);
  // ---- one call each ----
  def_dispatch(cls, "dispatch",
               [](DispatcherBox& b, const DispatchInput& in, const Status& parsed,
                  std::exception_ptr error) {
                 TokenDispatcher& d = b.get();
                 DispatchOutput out = finish(nogil([&] { return d.dispatch(in, parsed); }), error);
                 return dispatch_result(b, std::move(out));
               });
  cls.def(
         "combine",
         [](DispatcherBox& b, py::handle eo, py::handle handle, py::handle out) {
           Status parsed;
           std::exception_ptr error;
           const CombineInput in = combine_input(eo, handle, out, &parsed, &error);
           py::object keep = py::reinterpret_borrow<py::object>(out);
           TokenDispatcher& d = b.get();
           return combine_result(finish(nogil([&] { return d.combine(in, parsed); }), error), keep,
                                 true);
         },
         py::arg("expert_output"), py::arg("handle"), py::arg("out") = py::none())
      // The C++ API's own loop, for the benchmark beside the Python steps (same process, same
      // run): per iteration dispatch(map form) then combine(expert_output = expert_input);
      // returns each iteration's seconds. `between` splits the Python path's extra (bench_python
      // --split): 0, the two calls; 1, the six steps; 2, the six steps with the GIL taken
      // between them; 3, the same with one trivial Python call (time.perf_counter) there.
      .def("_bench_cpp", &bench_dispatcher_cpp, py::arg("hidden_states"), py::arg("routing_map"),
           py::arg("probs"), py::arg("num_topk"), py::arg("iters"), py::arg("warmup"),
           py::arg("between") = 0)
      // ---- backward ----
      .def("dispatch_backward", &dispatch_backward, py::arg("grad_expert_input"),
           py::arg("grad_permuted_probs"), py::arg("handle"))
      .def("combine_backward", &combine_backward, py::arg("grad_output"), py::arg("expert_output"),
           py::arg("handle"));
}

}  // namespace moed::python
