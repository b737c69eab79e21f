// reference_moe_layer: the layer's model on every rank's tokens in one process. Token movement
// is moed's reference (reference_dispatch / reference_combine and their backward), which
// shares no code with the dispatchers; the router, expert and shared-expert arithmetic is the
// layer's own (layer_internal.h), called with the same shapes on the same rows, so a correct
// dispatcher makes the distributed layer equal to this bit for bit.
#include "moe/layer_internal.h"
#include "moed/reference.h"

namespace moed {

StatusOr<ReferenceMoEResult> reference_moe_layer(const MoEConfig& config, int world_size,
                                                 const std::vector<TensorView>& x,
                                                 const std::vector<TensorView>& grad_output) {
  MOED_RETURN_IF_ERROR(config.validate(world_size));
  const int R = world_size, P = config.etp_size, EP = R / P;
  if (int(x.size()) != R) return invalid_argument("x has ", x.size(), " ranks; world size is ", R);
  const bool with_backward = !grad_output.empty();
  if (with_backward && int(grad_output.size()) != R) {
    return invalid_argument("grad_output has ", grad_output.size(), " ranks; world size is ", R);
  }
  for (int r = 0; r < R; ++r) {
    if (x[size_t(r)].dtype != config.dtype || x[size_t(r)].cols != config.hidden) {
      return invalid_argument("x[", r, "] is not [T, ", config.hidden, "] ",
                              dtype_name(config.dtype));
    }
  }
  const int64_t H = config.hidden;
  MOED_ASSIGN_OR_RETURN(Router router, Router::create(config.router_config()));
  std::vector<MoEWeights> weights;
  for (int r = 0; r < R; ++r) weights.push_back(make_moe_weights(config, EP, r / P, r % P));

  // Route, then the reference token movement.
  std::vector<moe::RouteContext> routes(static_cast<size_t>(R));
  std::vector<Tensor> xs;
  ReferenceProblem p;
  p.num_experts = config.num_experts;
  p.ep_size = EP;
  p.etp_size = P;
  p.layout = config.layout;
  p.num_topk = config.num_topk;
  for (int s = 0; s < R; ++s) {
    xs.push_back(Tensor::copy_of(x[size_t(s)]));
    MOED_ASSIGN_OR_RETURN(routes[size_t(s)],
                          moe::route(router, weights[size_t(s)].router, xs.back().view(), nullptr));
    p.routing.push_back(routes[size_t(s)].out.routing);
    p.hidden.push_back(TokenRows{xs.back().view(), {}});
  }
  MOED_ASSIGN_OR_RETURN(std::vector<ReferenceRankDispatch> d, reference_dispatch(p));

  std::vector<moe::ExpertContext> ctx(static_cast<size_t>(R)), shared_ctx(static_cast<size_t>(R));
  std::vector<Tensor> y(static_cast<size_t>(R));
  std::vector<TensorView> yv;
  for (int r = 0; r < R; ++r) {
    const ReferenceRankDispatch& rd = d[size_t(r)];
    y[size_t(r)] = Tensor::empty(config.dtype, rd.expert_input.x.rows(), H);
    moe::expert_forward(rd.expert_input.x.view(), rd.permuted_probs,
                        moe::canonical_segments(rd.tokens_per_expert),
                        moe::views(weights[size_t(r)].fc1), moe::views(weights[size_t(r)].fc2),
                        nullptr, &ctx[size_t(r)], y[size_t(r)].view());
    yv.push_back(y[size_t(r)].view());
  }
  ReferenceMoEResult result;
  MOED_ASSIGN_OR_RETURN(result.output, reference_combine(p, yv));
  for (int s = 0; s < R; ++s) {
    if (config.shared_expert_ffn == 0) continue;
    Tensor sy = Tensor::empty(config.dtype, xs[size_t(s)].rows(), H);
    moe::shared_forward(weights[size_t(s)], xs[size_t(s)].view(), nullptr, &shared_ctx[size_t(s)],
                        sy.view());
    moe::add_rows(result.output[size_t(s)].view(), sy.view(), nullptr);
  }
  if (!with_backward) return result;

  for (int s = 0; s < R; ++s) {
    const TensorView& g = grad_output[size_t(s)];
    if (g.dtype != config.dtype || g.cols != H || g.rows != xs[size_t(s)].rows()) {
      return invalid_argument("grad_output[", s, "] does not match x[", s, "]");
    }
  }
  MOED_ASSIGN_OR_RETURN(ReferenceCombineGrad cg, reference_combine_backward(p, grad_output, {}));
  result.grads.resize(size_t(R));
  std::vector<Tensor> dx_rows(static_cast<size_t>(R));
  std::vector<TensorView> dxv;
  std::vector<std::vector<float>> dprobs(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) {
    const int64_t rows = d[size_t(r)].expert_input.x.rows();
    dx_rows[size_t(r)] = Tensor::zeros(config.dtype, rows, H);
    dprobs[size_t(r)].assign(size_t(rows), 0.0f);
    MoEGrads& g = result.grads[size_t(r)];
    moe::expert_backward(ctx[size_t(r)], cg.grad_expert_output[size_t(r)].view(),
                         moe::views(weights[size_t(r)].fc1), moe::views(weights[size_t(r)].fc2),
                         nullptr, dx_rows[size_t(r)].view(), dprobs[size_t(r)], &g.grad_fc1,
                         &g.grad_fc2);
    dxv.push_back(dx_rows[size_t(r)].view());
  }
  MOED_ASSIGN_OR_RETURN(ReferenceDispatchGrad dg, reference_dispatch_backward(p, dxv, dprobs));
  for (int s = 0; s < R; ++s) {
    MoEGrads& g = result.grads[size_t(s)];
    Tensor shared_dx;
    if (config.shared_expert_ffn > 0) {
      shared_dx = Tensor::empty(config.dtype, xs[size_t(s)].rows(), H);
      moe::shared_backward(weights[size_t(s)], shared_ctx[size_t(s)], grad_output[size_t(s)],
                           nullptr, shared_dx.view(), &g);
    }
    MOED_ASSIGN_OR_RETURN(moe::RouteGrad rg,
                          moe::route_backward(router, weights[size_t(s)].router, routes[size_t(s)],
                                              dg.grad_probs[size_t(s)], nullptr));
    g.grad_router = std::move(rg.grad_router);
    g.grad_input = moe::sum_input_grads(dg.grad_hidden[size_t(s)].view(), rg.grad_x,
                                        shared_dx.view(), nullptr);
  }
  return result;
}

}  // namespace moed
