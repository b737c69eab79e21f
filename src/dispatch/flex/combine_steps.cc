// The Flex dispatcher's combine and the backward of dispatch and combine (steps.h): each step
// checks its input locally, agrees in one collective at the start of its communicating call
// (agree_in_one, see flex_dispatcher.cc), then pushes or pulls rows.
#include <algorithm>
#include <cstring>
#include <utility>

#include "core/row_checks.h"
#include "dispatch/flex/steps.h"

namespace moed::flex {

using moed::internal::check_float_rows;

namespace {

// Per-row scalars flow when any rank gives them (the agreement's last field nonzero there):
// then a rank that gives none passes zeros for its `rows` rows, kept in `zeros`. Whether they
// flow.
bool scalars_of_any_rank(const AgreedTable& t, int world_size, int64_t rows,
                         std::span<const float>& scalars, std::vector<float>& zeros) {
  bool with_scalars = false;
  for (int r = 0; r < world_size; ++r) {
    with_scalars = with_scalars || t.field(r, t.num_fields - 1) != 0;
  }
  if (with_scalars && scalars.empty()) {
    zeros.assign(size_t(rows), 0.0f);
    scalars = zeros;
  }
  return with_scalars;
}

}  // namespace

template <class S>
void Dispatcher::start_step(S& step, const std::shared_ptr<const DispatchHandle>& handle,
                            const char* name, const TensorView& rows, bool expert_side) {
  step = S{};
  step.handle = own_handle(handle, &step.local);
  if (step.local.ok()) {
    const FlexHandle& h = *step.handle;
    step.local =
        check_float_rows(name, rows, expert_side ? h.num_rows : h.routing.num_tokens(), h.hidden);
  }
  step.staged = true;
}

// ---- combine ----

Status Dispatcher::combine_preprocess(const CombineInput& input, const Status& caller_error) {
  CombineStep& c = combine_;
  start_step(c, input.handle, "expert_output", input.expert_output.x, true);
  if (!caller_error.ok()) c.local = caller_error;
  if (c.local.ok() && input.out) {
    c.local = moed::internal::check_out_buffer("out", *input.out, c.handle->routing.num_tokens(),
                                               c.handle->hidden, input.expert_output.x.dtype,
                                               "expert_output");
  }
  c.rows = input.expert_output.x;
  c.user_out = input.out;
  return ok_status();  // agreed in token_combine, so every rank reports the same error
}

Status Dispatcher::combine_body() {
  CombineStep& c = combine_;
  const AgreedField fields[] = {
      {"expert_output dtype", int64_t(c.rows.dtype), AgreedField::kAgreeDType}};
  MOED_RETURN_IF_ERROR(agree_in_one(*world_, c.local, fields).status());
  const FlexHandle& h = *c.handle;
  // The final fp32 -> dtype store targets the caller's buffer directly when it gave one.
  if (!c.user_out) c.out = Tensor::empty(c.rows.dtype, h.routing.num_tokens(), h.hidden);
  PullSpec spec;
  spec.mode = PullMode::kCombine;
  spec.dtype = c.rows.dtype;
  spec.weighted = config_.weighted_combine;
  spec.out = c.user_out ? *c.user_out : c.out.view();
  return pull_step(h, c.rows, {}, spec, tags::kFlexCombine);
}

StatusOr<CombineOutput> Dispatcher::combine_postprocess() {
  MOED_ASSIGN_OR_RETURN(CombineStep c, finish_step(combine_, kCombineCalls));
  return CombineOutput{std::move(c.out), c.handle->routing.prob_sums(), c.user_out};
}

// ---- DeepEP V2's combine order (flex_ordered_combine) ----

StatusOr<OrderedCombineOutput> Dispatcher::ordered_combine(
    std::shared_ptr<const DispatchHandle> handle, const OrderedCombineInput& in) {
  Status local;
  std::shared_ptr<const FlexHandle> h = own_handle(handle, &local);
  if (local.ok()) local = check_float_rows("x", in.rows, h->num_rows, h->hidden);
  const int64_t T = h ? h->routing.num_tokens() : 0, H = in.rows.cols;
  if (local.ok() && topo_.etp_size != 1)
    local = unimplemented("DeepEP V2's combine order with etp_size = ", topo_.etp_size);
  if (local.ok() && !in.row_weights.empty() && int64_t(in.row_weights.size()) != h->num_rows)
    local = invalid_argument("topk_weights has ", in.row_weights.size(), " entries; expected ",
                             h->num_rows);
  for (const TensorView* b : {&in.bias_0, &in.bias_1}) {
    if (local.ok() && b->data)
      local = check_float_rows(b == &in.bias_0 ? "bias_0" : "bias_1", *b, T, H);
    if (local.ok() && b->data && b->dtype != in.rows.dtype)
      local = invalid_argument(b == &in.bias_0 ? "bias_0" : "bias_1", " is ", dtype_name(b->dtype),
                               " but x is ", dtype_name(in.rows.dtype));
  }
  if (local.ok() && in.out)
    local = moed::internal::check_out_buffer("out", *in.out, T, H, in.rows.dtype, "x");
  const AgreedField fields[] = {
      {"x dtype", int64_t(in.rows.dtype), AgreedField::kAgreeDType},
      {"hidden", H, AgreedField::kAgree},
      {"topk_weights given", in.row_weights.empty() ? 0 : 1, AgreedField::kFree}};
  MOED_ASSIGN_OR_RETURN(AgreedTable t, agree_in_one(*world_, local, fields));
  std::vector<float> zeros;
  std::span<const float> scalars = in.row_weights;
  const bool with_scalars = scalars_of_any_rank(t, world_->size(), h->num_rows, scalars, zeros);
  OrderedCombineOutput out;
  if (!in.out) out.combined = Tensor::empty(in.rows.dtype, T, H);
  if (with_scalars) out.slot_weights.assign(size_t(T) * size_t(in.num_topk), 0.0f);
  PullSpec spec;
  spec.mode = PullMode::kCombine;
  spec.dtype = in.rows.dtype;
  spec.with_scalars = with_scalars;
  spec.out = in.out ? *in.out : out.combined.view();
  spec.recipe = &in.recipe;
  spec.bias_0 = in.bias_0;
  spec.bias_1 = in.bias_1;
  spec.out_slot_weights = with_scalars ? out.slot_weights.data() : nullptr;
  spec.num_topk = in.num_topk;
  MOED_RETURN_IF_ERROR(pull_step(*h, in.rows, scalars, spec, tags::kFlexCombine));
  return out;
}

// ---- backward of dispatch: an unweighted combine of the row gradients ----

Status Dispatcher::dispatch_postprocess_backward(const DispatchGradInput& grad) {
  DispatchBackwardStep& g = dispatch_grad_;
  start_step(g, grad.handle, "grad_expert_input", grad.grad_expert_input, true);
  if (g.local.ok() && !grad.grad_permuted_probs.empty() &&
      int64_t(grad.grad_permuted_probs.size()) != g.handle->num_rows) {
    g.local = invalid_argument("grad_permuted_probs has ", grad.grad_permuted_probs.size(),
                               " entries; expected ", g.handle->num_rows);
  }
  g.rows = grad.grad_expert_input;
  g.grad_permuted_probs = grad.grad_permuted_probs;
  return ok_status();
}

Status Dispatcher::dispatch_backward_body() {
  DispatchBackwardStep& g = dispatch_grad_;
  // NOTE: a rank with no rows passes no grad_permuted_probs even when the others do, so the
  // prob gradients flow when any rank gives them (missing ones count as zeros).
  const AgreedField fields[] = {
      {"grad_expert_input dtype", int64_t(g.rows.dtype), AgreedField::kAgreeDType},
      {"grad_permuted_probs given", g.grad_permuted_probs.empty() ? 0 : 1, AgreedField::kFree}};
  MOED_ASSIGN_OR_RETURN(AgreedTable t, agree_in_one(*world_, g.local, fields));
  const FlexHandle& h = *g.handle;
  std::vector<float> zeros;
  std::span<const float> scalars = g.grad_permuted_probs;
  const bool with_scalars = scalars_of_any_rank(t, world_->size(), h.num_rows, scalars, zeros);
  g.out = Tensor::empty(g.rows.dtype, h.routing.num_tokens(), h.hidden);
  g.probs.assign(size_t(h.routing.num_tokens()) * topo_.num_experts, 0.0f);
  PullSpec spec;
  spec.mode = PullMode::kDispatchBackward;
  spec.dtype = g.rows.dtype;
  spec.with_scalars = with_scalars;
  spec.out = g.out.view();
  spec.out_probs = g.probs.data();
  return pull_step(h, g.rows, scalars, spec, tags::kFlexDispatchBackward);
}

StatusOr<DispatchGrad> Dispatcher::dispatch_preprocess_backward() {
  MOED_ASSIGN_OR_RETURN(DispatchBackwardStep g,
                        finish_step(dispatch_grad_, kDispatchBackwardCalls));
  return DispatchGrad{std::move(g.out), std::move(g.probs)};
}

// ---- backward of combine: a dispatch of grad_out (times the prob when weighted) ----

Status Dispatcher::combine_postprocess_backward(const CombineGradInput& grad) {
  CombineBackwardStep& g = combine_grad_;
  start_step(g, grad.handle, "grad_hidden", grad.grad_hidden, false);
  if (g.local.ok() && config_.weighted_combine) {
    g.local = check_float_rows("expert_output", grad.expert_output.x, g.handle->num_rows,
                               g.handle->hidden);
  }
  g.grad = grad.grad_hidden;
  g.rows = grad.expert_output.x;
  return ok_status();
}

Status Dispatcher::combine_backward_body() {
  CombineBackwardStep& g = combine_grad_;
  const bool weighted = config_.weighted_combine;
  const AgreedField fields[] = {
      {"grad_hidden dtype", int64_t(g.grad.dtype), AgreedField::kAgreeDType},
      {"expert_output dtype", weighted ? int64_t(g.rows.dtype) : -1,
       weighted ? AgreedField::kAgreeDType : AgreedField::kFree}};
  MOED_RETURN_IF_ERROR(agree_in_one(*world_, g.local, fields).status());
  const FlexHandle& h = *g.handle;
  const PushLayout layout =
      PushLayout::of(node_cap_rows(h), dtype_row_bytes(g.grad.dtype, h.hidden), 0, false);
  MOED_RETURN_IF_ERROR(grad_region_.ensure(*world_, layout.bytes));
  grad_region_.release_retired();  // read by nobody: each step copies its rows out
  PushSpec spec{TokenRows{g.grad, {}}, weighted, &grad_region_, layout};
  DispatchContext ctx{world_, &config_, &h, nullptr, net(tags::kFlexCombineBackward)};
  MOED_RETURN_IF_ERROR(push_step(ctx, spec, tags::kFlexCombineBackward));
  g.out = Tensor::copy_of(TensorView(grad_region_.local(), g.grad.dtype, h.num_rows, h.hidden));
  g.probs.assign(size_t(h.routing.num_tokens()) * topo_.num_experts, 0.0f);
  if (!weighted) return ok_status();
  // grad_prob(t, e) = dot(grad_out[t], term_e): the terms come back as in combine.
  PullSpec pspec;
  pspec.mode = PullMode::kProbGrad;
  pspec.dtype = g.rows.dtype;
  pspec.grad_out = g.grad;
  pspec.out_probs = g.probs.data();
  return pull_step(h, g.rows, {}, pspec, tags::kFlexProbGrad);
}

StatusOr<CombineGrad> Dispatcher::combine_preprocess_backward() {
  MOED_ASSIGN_OR_RETURN(CombineBackwardStep g, finish_step(combine_grad_, kCombineBackwardCalls));
  return CombineGrad{std::move(g.out), std::move(g.probs)};
}

// Pull: publish this rank's rows (and scalars) to its node, fold, then hold the rows until
// every local reader is done with them (the caller may free them when the step returns).
Status Dispatcher::pull_step(const FlexHandle& h, const TensorView& rows,
                             std::span<const float> scalars, PullSpec spec, int tag) {
  const int G = topo_.ranks_per_node, me = topo_.local_rank;
  PullSource mine;
  if (in_place_) {
    mine = {static_cast<const char*>(rows.data), size_t(rows.row_stride) * rows.element_size(),
            scalars.empty() ? nullptr : scalars.data()};
    std::memcpy(signals_.board(me), &mine, sizeof(mine));
  } else {
    MOED_RETURN_IF_ERROR(pull_region_.ensure(*world_, pull_bytes(h, rows.dtype)));
    char* seg = pull_region_.local();
    const size_t row_bytes = rows.row_bytes();
    if (!(rows.data == seg && rows.contiguous())) {
      for (int64_t i = 0; i < rows.rows; ++i)
        std::memcpy(seg + size_t(i) * row_bytes, rows.row_ptr(i), row_bytes);
      world_->add_shared_bytes(uint64_t(rows.rows) * row_bytes, uint64_t(rows.rows));
    }
    if (!scalars.empty()) {
      std::memcpy(seg + pull_scalars_off(h, rows.dtype), scalars.data(), scalars.size_bytes());
    }
  }
  PublishRound round(*world_, signals_, epoch_, in_place_, PublishRound::Role::kReads);
  Status opened = round.open();
  if (!opened.ok()) return round.close(opened);
  spec.sources.resize(size_t(G));
  for (int lr = 0; lr < G; ++lr) {
    if (in_place_) {
      std::memcpy(&spec.sources[size_t(lr)], signals_.board(lr), sizeof(PullSource));
    } else {
      const char* seg = pull_region_.peer(lr);
      spec.sources[size_t(lr)] = {seg, rows.row_bytes(),
                                  !spec.with_scalars ? nullptr
                                                     : reinterpret_cast<const float*>(
                                                           seg + pull_scalars_off(h, rows.dtype))};
    }
  }
  DispatchContext ctx{world_, &config_, &h, nullptr, net(tag)};
  MOED_RETURN_IF_ERROR(round.close(pull(ctx, spec, tag)));
  // Every local reader is done: a pull region replaced in this step (the rows may have been
  // copied out of it above) is read by nobody now.
  pull_region_.release_retired();
  return ok_status();
}

}  // namespace moed::flex
