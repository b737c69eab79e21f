// MoELayer: route -> dispatch (shared expert meanwhile) -> experts -> combine, and back.
#include "moed/moe_layer.h"

#include "moe/blas.h"
#include "moe/layer_internal.h"
#include "moed/flex.h"

namespace moed {

using Clock = std::chrono::steady_clock;
using moe::seconds_since;

MoELayer::MoELayer(std::unique_ptr<State> state) : state_(std::move(state)) {}
MoELayer::~MoELayer() = default;

const MoEConfig& MoELayer::config() const { return state_->config; }
World& MoELayer::world() const { return *state_->world; }
const MoEWeights& MoELayer::weights() const { return state_->weights; }
MoEWeights& MoELayer::mutable_weights() { return state_->weights; }
const MoEStepStats& MoELayer::last_stats() const { return state_->stats; }

StatusOr<std::unique_ptr<MoELayer>> MoELayer::create(World& world, const MoEConfig& config) {
  MOED_RETURN_IF_ERROR(world.agree(config.validate(world.size())));
  moe::init_blas();
  auto s = std::make_unique<State>();
  s->world = &world;
  s->config = config;
  s->ep_size = world.size() / config.etp_size;
  s->ep_rank = world.rank() / config.etp_size;
  s->etp_rank = world.rank() % config.etp_size;
  MOED_ASSIGN_OR_RETURN(Router router, Router::create(config.router_config()));
  s->router = std::make_unique<Router>(std::move(router));
  if (!config.low_latency) {
    DispatchConfig dc;
    dc.kind = config.dispatcher;
    dc.num_experts = config.num_experts;
    dc.etp_size = config.etp_size;
    dc.layout = config.layout;
    dc.weighted_combine = false;  // the experts already multiplied by the prob
    if (dc.kind == DispatcherKind::kFlex) {
      MOED_ASSIGN_OR_RETURN(std::unique_ptr<FlexDispatcher> flex, FlexDispatcher::make(world, dc));
      s->flex = flex.get();
      s->dispatcher = std::move(flex);
    } else {
      MOED_ASSIGN_OR_RETURN(s->dispatcher, TokenDispatcher::create(world, dc));
    }
  }
  s->weights = make_moe_weights(config, s->ep_size, s->ep_rank, s->etp_rank);
  return std::unique_ptr<MoELayer>(new MoELayer(std::move(s)));
}

namespace {

Status check_rows(const char* what, const TensorView& x, const MoEConfig& c) {
  if (x.dtype != c.dtype || x.cols != c.hidden || x.rows < 0 || (x.rows > 0 && x.data == nullptr)) {
    return invalid_argument(what, " is [", x.rows, ", ", x.cols, "] ", dtype_name(x.dtype),
                            "; the layer takes [T, ", c.hidden, "] ", dtype_name(c.dtype));
  }
  return ok_status();
}

Status wait(StatusOr<Request> r) {
  if (!r.ok()) return r.status();
  return *r ? (*r)->wait() : ok_status();
}

void fill_route_stats(const RouterOutput& out, MoEStepStats* st) {
  st->routed = 0;
  st->dropped = 0;
  for (size_t i = 0; i < out.selected.topk_idx.size(); ++i) {
    if (out.selected.topk_idx[i] < 0) continue;
    ++st->routed;
    if (!out.kept[i]) ++st->dropped;
  }
}

}  // namespace

StatusOr<Tensor> MoELayer::forward(const TensorView& x) {
  State& s = *state_;
  World& w = *s.world;
  MOED_RETURN_IF_ERROR(w.agree(check_rows("x", x, s.config)));
  s.have_forward = false;
  s.stats = MoEStepStats{};
  s.stats.row_bytes = size_t(s.config.hidden) * dtype_size(s.config.dtype);
  s.x = Tensor::copy_of(x);
  if (s.config.low_latency) {
    MOED_ASSIGN_OR_RETURN(Tensor out, moe::ll_forward(s, s.x.view()));
    s.have_forward = true;
    return out;
  }
  ThreadPool* pool = &w.pool();
  const int64_t T = x.rows, H = s.config.hidden;

  auto t0 = Clock::now();
  MOED_ASSIGN_OR_RETURN(s.route, moe::route(*s.router, s.weights.router, s.x.view(), pool));
  s.stats.route_s = seconds_since(t0);
  fill_route_stats(s.route.out, &s.stats);

  // NOTE: the shared expert runs between token_dispatch(async) and its wait, so a dispatcher
  // that moves tokens in the background overlaps it (Megatron's shared-expert overlap).
  t0 = Clock::now();
  // The previous step's output is not needed any more; dropped first, its memory is reused
  // (a held output would make the dispatcher write elsewhere: moed/dispatcher.h).
  s.dispatched = DispatchOutput{};
  // The router dropped and padded already (the same LayoutOptions): the dispatcher takes its
  // sparse routing as the effective one and does not apply them again.
  MOED_RETURN_IF_ERROR(s.dispatcher->dispatch_preprocess({.hidden = TokenRows{s.x.view(), {}},
                                                          .cached_handle = nullptr,
                                                          .routing = &s.route.out.sparse,
                                                          .layout_applied = true}));
  StatusOr<Request> pending = s.dispatcher->token_dispatch(s.config.overlap_shared_expert);
  double dispatch_s = seconds_since(t0);
  Tensor shared_y;
  if (s.config.shared_expert_ffn > 0) {
    auto ts = Clock::now();
    shared_y = Tensor::empty(s.config.dtype, T, H);
    moe::shared_forward(s.weights, s.x.view(), pool, &s.shared, shared_y.view());
    s.stats.shared_s = seconds_since(ts);
  }
  t0 = Clock::now();
  MOED_RETURN_IF_ERROR(wait(std::move(pending)));
  MOED_ASSIGN_OR_RETURN(s.dispatched, s.dispatcher->dispatch_postprocess());
  s.stats.dispatch_s = dispatch_s + seconds_since(t0);
  const DispatchHandle& handle = *s.dispatched.handle;
  s.stats.dispatch_rows = s.dispatched.num_rows();
  s.stats.tokens_per_local_expert = handle.tokens_per_expert_unpadded;

  t0 = Clock::now();
  // NOTE: with Flex the experts write straight into node-shared memory, so combine reads
  // their rows in place instead of copying them there first (MPI world).
  TensorView expert_y;
  if (s.flex != nullptr) {
    MOED_ASSIGN_OR_RETURN(expert_y, s.flex->expert_output_buffer(handle, s.config.dtype));
  } else {
    s.expert_y = Tensor::empty(s.config.dtype, s.dispatched.num_rows(), H);
    expert_y = s.expert_y.view();
  }
  moe::expert_forward(s.dispatched.expert_input.x, s.dispatched.permuted_probs,
                      moe::canonical_segments(s.dispatched.tokens_per_expert),
                      moe::views(s.weights.fc1), moe::views(s.weights.fc2), pool, &s.experts,
                      expert_y);
  s.stats.experts_s = seconds_since(t0);

  t0 = Clock::now();
  MOED_ASSIGN_OR_RETURN(CombineOutput c,
                        s.dispatcher->combine({.expert_output = TokenRows{expert_y, {}},
                                               .handle = s.dispatched.handle}));
  moe::add_rows(c.hidden.view(), shared_y.view(), pool);
  s.stats.combine_s = seconds_since(t0);
  s.have_forward = true;
  return std::move(c.hidden);
}

StatusOr<MoEGrads> MoELayer::backward(const TensorView& grad_output) {
  State& s = *state_;
  World& w = *s.world;
  Status local = check_rows("grad_output", grad_output, s.config);
  if (local.ok() && !s.have_forward) local = failed_precondition("backward before forward");
  if (local.ok() && grad_output.rows != s.x.rows()) {
    local = invalid_argument("grad_output has ", grad_output.rows, " rows; the forward had ",
                             s.x.rows());
  }
  MOED_RETURN_IF_ERROR(w.agree(local));
  auto t0 = Clock::now();
  if (s.config.low_latency) {
    MOED_ASSIGN_OR_RETURN(MoEGrads g, moe::ll_backward(s, grad_output));
    s.stats.backward_s = seconds_since(t0);
    return g;
  }
  ThreadPool* pool = &w.pool();
  const int64_t T = s.x.rows(), H = s.config.hidden;
  MoEGrads grads;

  // Backward of combine (a dispatch of grad_output), with the shared expert's backward in
  // its shadow.
  MOED_RETURN_IF_ERROR(s.dispatcher->combine_postprocess_backward(
      {.grad_hidden = grad_output, .expert_output = {}, .handle = s.dispatched.handle}));
  StatusOr<Request> pending = s.dispatcher->token_combine_backward(/*async=*/true);
  Tensor shared_dx;
  if (s.config.shared_expert_ffn > 0) {
    shared_dx = Tensor::empty(s.config.dtype, T, H);
    moe::shared_backward(s.weights, s.shared, grad_output, pool, shared_dx.view(), &grads);
  }
  MOED_RETURN_IF_ERROR(wait(std::move(pending)));
  MOED_ASSIGN_OR_RETURN(CombineGrad cg, s.dispatcher->combine_preprocess_backward());

  const int64_t rows = s.dispatched.num_rows();
  Tensor dx_rows = Tensor::zeros(s.config.dtype, rows, H);
  std::vector<float> dprobs(size_t(rows), 0.0f);
  moe::expert_backward(s.experts, cg.grad_expert_output.view(), moe::views(s.weights.fc1),
                       moe::views(s.weights.fc2), pool, dx_rows.view(), dprobs, &grads.grad_fc1,
                       &grads.grad_fc2);

  MOED_ASSIGN_OR_RETURN(DispatchGrad dg,
                        s.dispatcher->dispatch_backward({.grad_expert_input = dx_rows.view(),
                                                         .grad_permuted_probs = dprobs,
                                                         .handle = s.dispatched.handle}));
  MOED_ASSIGN_OR_RETURN(moe::RouteGrad rg, moe::route_backward(*s.router, s.weights.router, s.route,
                                                               dg.grad_probs, pool));
  grads.grad_router = std::move(rg.grad_router);
  grads.grad_input = moe::sum_input_grads(dg.grad_hidden.view(), rg.grad_x, shared_dx.view(), pool);
  s.stats.backward_s = seconds_since(t0);
  return grads;
}

}  // namespace moed
