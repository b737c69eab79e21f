// The Flex dispatcher (spec §5): the six steps and their backward on top of the phases
// (layout.cc, notify.cc, intranode_* / internode_*). Every communicating step starts with one
// collective (notify, or an agreement on the input), so a bad input is every rank's error
// before anything is written, and every rank has left the previous step before its memory is
// written again; inside the step only per-pair signals order the shared-memory traffic.
//
// NOTE (buffers): the dispatch output lives in a persistent node-shared region (DeepEP's NVL
// buffer) that grows collectively; DispatchOutput.expert_input points into it and stays valid
// until the next dispatch on this dispatcher (a replaced region is retired, not freed, so
// older outputs stay readable). token_*(async = true) runs the step on its own thread in the
// threads world; MPI calls belong to the rank's owning thread, so in the MPI world the step
// runs eagerly and returns a completed request.
// Combine reads the expert outputs where they are: in the threads world every rank's memory
// is node-shared, so they are read in place; in the MPI world they are copied into a shared
// region first (counted), unless the experts wrote them into flex_expert_output_buffer().
#include <algorithm>
#include <cstring>
#include <thread>

#include "dispatch/flex/flex.h"
#include "dispatch/flex/flex_internal.h"

namespace moed {
namespace flex {
namespace {

constexpr int kTagDispatch = 0x4d10;
constexpr int kTagCombine = 0x4d11;
constexpr int kTagDispatchBackward = 0x4d12;
constexpr int kTagCombineBackward = 0x4d13;
constexpr int kTagProbGrad = 0x4d14;

std::atomic<uint64_t> g_next_dispatcher_id{1};

// The outcome of one communicating step, read by the step after it.
struct OpState {
  bool done = false;
  Status status;
};

// token_* (async = true): the step runs on its own thread; wait() joins it.
class AsyncOp final : public PendingOp {
 public:
  AsyncOp(std::function<Status()> body, std::shared_ptr<OpState> state)
      : state_(std::move(state)), thread_([this, body = std::move(body)] { result_ = body(); }) {}
  ~AsyncOp() override {
    if (thread_.joinable()) wait().ignore();
  }
  Status wait() override {
    if (thread_.joinable()) {
      thread_.join();
      state_->status = result_;
      state_->done = true;
    }
    return state_->status;
  }

 private:
  std::shared_ptr<OpState> state_;
  Status result_;
  std::thread thread_;
};

Status check_float_rows(const char* what, const TensorView& v, int64_t rows, int64_t cols) {
  if (v.dtype != DType::kF32 && v.dtype != DType::kBF16) {
    return invalid_argument(what, " dtype is ", dtype_name(v.dtype), "; it must be f32 or bf16");
  }
  if (v.rows != rows || v.cols != cols) {
    return invalid_argument(what, " is [", v.rows, ", ", v.cols, "]; expected [", rows, ", ", cols,
                            "]");
  }
  if (v.rows > 0 && v.data == nullptr) return invalid_argument(what, ".data is null");
  if (v.row_stride < v.cols)
    return invalid_argument(what, " row_stride = ", v.row_stride, " < ", v.cols);
  return ok_status();
}

class FlexDispatcher final : public TokenDispatcher {
 public:
  FlexDispatcher(World& world, const DispatchConfig& config)
      : TokenDispatcher(world, config),
        id_(g_next_dispatcher_id.fetch_add(1)),
        topo_(Topology::of(world, config)),
        in_place_(std::strcmp(world.backend_name(), "threads") == 0) {}

  Status init() { return signals_.init(*world_); }

  // ---- dispatch ----
  Status dispatch_preprocess(const DispatchInput& input) override {
    d_op_.reset();
    d_cached_.reset();
    d_new_.reset();
    d_prepared_.reset();
    const int32_t cached = input.cached_handle ? 1 : 0;
    MOED_ASSIGN_OR_RETURN(std::vector<int32_t> modes,
                          all_gather<int32_t>(*world_, std::span<const int32_t>(&cached, 1)));
    Status local;
    for (int r = 0; r < world_->size(); ++r) {
      if (modes[size_t(r)] != modes[0]) {
        local = invalid_argument("cached_handle is ", modes[0] ? "given" : "not given",
                                 " on rank 0 but ", modes[size_t(r)] ? "given" : "not given",
                                 " on rank ", r, "; cached mode must be used by every rank");
        break;
      }
    }
    if (local.ok() && cached) {
      local = check_cached(input);
      MOED_RETURN_IF_ERROR(world_->agree(local));
      d_rows_ = input.hidden;
      return ok_status();
    }
    MOED_RETURN_IF_ERROR(world_->agree(local));
    MOED_ASSIGN_OR_RETURN(PreparedInput p, prepare_dispatch_input(*world_, config_, input));
    d_prepared_ = std::move(p);
    d_rows_ = input.hidden;
    return ok_status();
  }

  StatusOr<Request> token_dispatch(bool async) override {
    if (!d_prepared_ && !d_cached_)
      return failed_precondition("token_dispatch before dispatch_preprocess");
    return run(async, &d_op_, [this] { return dispatch_body(); });
  }

  StatusOr<DispatchOutput> dispatch_postprocess() override {
    MOED_RETURN_IF_ERROR(finished(d_op_, "token_dispatch"));
    std::shared_ptr<const FlexHandle> h = d_cached_ ? d_cached_ : d_new_;
    DispatchOutput out;
    char* seg = dispatch_region_.local();
    out.expert_input.x = TensorView(seg, h->dtype, h->num_rows, h->hidden);
    if (h->dtype == DType::kFP8) {
      out.expert_input.scales = TensorView(seg + d_layout_.scales_off, DType::kF32, h->num_rows,
                                           h->hidden / kFp8BlockSize);
    }
    out.permuted_probs = std::span<const float>(h->permuted_probs);
    out.tokens_per_expert = std::span<const int64_t>(h->tokens_per_expert);
    // NOTE: only the threads world lets the output own its buffer; an MPI window must be
    // freed collectively, so there the dispatcher keeps it (valid until the dispatcher goes).
    if (in_place_) out.storage = dispatch_region_.buffer();
    out.handle = std::move(h);
    d_op_.reset();
    d_prepared_.reset();
    return out;
  }

  // ---- combine ----
  Status combine_preprocess(const CombineInput& input) override {
    c_op_.reset();
    MOED_ASSIGN_OR_RETURN(c_handle_, own_handle(input.handle, &c_local_));
    if (c_local_.ok()) {
      c_local_ = check_float_rows("expert_output", input.expert_output.x, c_handle_->num_rows,
                                  c_handle_->hidden);
    }
    c_rows_ = input.expert_output.x;
    return ok_status();  // agreed in token_combine, so every rank reports the same error
  }

  StatusOr<Request> token_combine(bool async) override {
    return run(async, &c_op_, [this] {
      MOED_RETURN_IF_ERROR(agree_on(c_local_, {int64_t(c_rows_.dtype)}, {"expert_output dtype"}));
      const FlexHandle& h = *c_handle_;
      c_out_ = Tensor::empty(c_rows_.dtype, h.routes.num_tokens(), h.hidden);
      PullSpec spec;
      spec.mode = PullMode::kCombine;
      spec.dtype = c_rows_.dtype;
      spec.weighted = config_.weighted_combine;
      spec.out = c_out_.view();
      return pull_step(h, c_rows_, {}, spec, kTagCombine);
    });
  }

  StatusOr<CombineOutput> combine_postprocess() override {
    MOED_RETURN_IF_ERROR(finished(c_op_, "token_combine"));
    CombineOutput out;
    out.hidden = std::move(c_out_);
    const TokenRoutes& routes = c_handle_->routes;
    out.combined_probs.resize(size_t(routes.num_tokens()));
    for (int64_t t = 0; t < routes.num_tokens(); ++t) {
      float s = 0.0f;
      for (int64_t k = routes.begin[size_t(t)]; k < routes.begin[size_t(t) + 1]; ++k)
        s += routes.prob[size_t(k)];
      out.combined_probs[size_t(t)] = s;
    }
    c_op_.reset();
    return out;
  }

  // ---- backward of dispatch: an unweighted combine of the row gradients ----
  Status dispatch_postprocess_backward(const DispatchGradInput& grad) override {
    db_op_.reset();
    MOED_ASSIGN_OR_RETURN(db_handle_, own_handle(grad.handle, &db_local_));
    if (db_local_.ok()) {
      db_local_ = check_float_rows("grad_expert_input", grad.grad_expert_input,
                                   db_handle_->num_rows, db_handle_->hidden);
    }
    if (db_local_.ok() && !grad.grad_permuted_probs.empty() &&
        int64_t(grad.grad_permuted_probs.size()) != db_handle_->num_rows) {
      db_local_ = invalid_argument("grad_permuted_probs has ", grad.grad_permuted_probs.size(),
                                   " entries; expected ", db_handle_->num_rows);
    }
    db_rows_ = grad.grad_expert_input;
    db_pprobs_ = grad.grad_permuted_probs;
    return ok_status();
  }

  StatusOr<Request> token_dispatch_backward(bool async) override {
    return run(async, &db_op_, [this] {
      MOED_RETURN_IF_ERROR(
          agree_on(db_local_, {int64_t(db_rows_.dtype)}, {"grad_expert_input dtype"}));
      // NOTE: a rank with no rows passes no grad_permuted_probs even when the others do, so
      // the prob gradients flow when any rank gives them (missing ones count as zeros).
      const int32_t given = db_pprobs_.empty() ? 0 : 1;
      MOED_ASSIGN_OR_RETURN(std::vector<int32_t> all_given,
                            all_gather<int32_t>(*world_, std::span<const int32_t>(&given, 1)));
      const bool with_scalars = std::find(all_given.begin(), all_given.end(), 1) != all_given.end();
      const FlexHandle& h = *db_handle_;
      std::vector<float> zeros;
      std::span<const float> scalars = db_pprobs_;
      if (with_scalars && scalars.empty()) {
        zeros.assign(size_t(h.num_rows), 0.0f);
        scalars = zeros;
      }
      db_out_ = Tensor::empty(db_rows_.dtype, h.routes.num_tokens(), h.hidden);
      db_probs_.assign(size_t(h.routes.num_tokens()) * topo_.num_experts, 0.0f);
      PullSpec spec;
      spec.mode = PullMode::kDispatchBackward;
      spec.dtype = db_rows_.dtype;
      spec.with_scalars = with_scalars;
      spec.out = db_out_.view();
      spec.out_probs = db_probs_.data();
      return pull_step(h, db_rows_, scalars, spec, kTagDispatchBackward);
    });
  }

  StatusOr<DispatchGrad> dispatch_preprocess_backward() override {
    MOED_RETURN_IF_ERROR(finished(db_op_, "token_dispatch_backward"));
    DispatchGrad g;
    g.grad_hidden = std::move(db_out_);
    g.grad_probs = std::move(db_probs_);
    db_op_.reset();
    return g;
  }

  // ---- backward of combine: a dispatch of grad_out (times the prob when weighted) ----
  Status combine_postprocess_backward(const CombineGradInput& grad) override {
    cb_op_.reset();
    MOED_ASSIGN_OR_RETURN(cb_handle_, own_handle(grad.handle, &cb_local_));
    if (cb_local_.ok()) {
      cb_local_ = check_float_rows("grad_hidden", grad.grad_hidden, cb_handle_->routes.num_tokens(),
                                   cb_handle_->hidden);
    }
    if (cb_local_.ok() && config_.weighted_combine) {
      cb_local_ = check_float_rows("expert_output", grad.expert_output.x, cb_handle_->num_rows,
                                   cb_handle_->hidden);
    }
    cb_grad_ = grad.grad_hidden;
    cb_rows_ = grad.expert_output.x;
    return ok_status();
  }

  StatusOr<Request> token_combine_backward(bool async) override {
    return run(async, &cb_op_, [this] { return combine_backward_body(); });
  }

  StatusOr<CombineGrad> combine_preprocess_backward() override {
    MOED_RETURN_IF_ERROR(finished(cb_op_, "token_combine_backward"));
    CombineGrad g;
    g.grad_expert_output = std::move(cb_out_);
    g.grad_probs = std::move(cb_probs_);
    cb_op_.reset();
    return g;
  }

  // flex_expert_output_buffer (moed/flex.h).
  StatusOr<TensorView> expert_output_buffer(const DispatchHandle& handle, DType dtype) {
    const auto* h = dynamic_cast<const FlexHandle*>(&handle);
    if (h == nullptr || h->dispatcher_id != id_) {
      return invalid_argument(
          "flex_expert_output_buffer: the handle was not made by this dispatcher");
    }
    if (dtype != DType::kF32 && dtype != DType::kBF16) {
      return invalid_argument("flex_expert_output_buffer: dtype ", dtype_name(dtype),
                              " is not f32 or bf16");
    }
    MOED_RETURN_IF_ERROR(pull_region_.ensure(*world_, pull_bytes(*h, dtype)));
    return TensorView(pull_region_.local(), dtype, h->num_rows, h->hidden);
  }

 private:
  StatusOr<Request> run(bool async, std::shared_ptr<OpState>* state, std::function<Status()> body) {
    *state = std::make_shared<OpState>();
    // NOTE: the MPI world allows MPI calls from its owning thread only, so there the step
    // runs eagerly and the returned request is already complete.
    if (async && in_place_) return Request(std::make_unique<AsyncOp>(std::move(body), *state));
    (*state)->status = body();
    (*state)->done = true;
    if (!(*state)->status.ok()) return (*state)->status;
    return Request();
  }

  static Status finished(const std::shared_ptr<OpState>& state, const char* step) {
    if (!state) return failed_precondition(step, " has not run");
    if (!state->done) return failed_precondition(step, "(async = true) was not waited on");
    return state->status;
  }

  // The handle as ours, or a local error (reported after the agreement).
  StatusOr<std::shared_ptr<const FlexHandle>> own_handle(
      const std::shared_ptr<const DispatchHandle>& handle, Status* local) {
    auto h = std::dynamic_pointer_cast<const FlexHandle>(handle);
    *local = ok_status();
    if (h == nullptr || h->dispatcher_id != id_) {
      *local = invalid_argument("the handle is ", handle ? "from another dispatcher" : "null",
                                "; pass the handle of this Flex dispatcher's dispatch");
    }
    return h;
  }

  Status check_cached(const DispatchInput& input) {
    auto h = std::dynamic_pointer_cast<const FlexHandle>(input.cached_handle);
    if (h == nullptr || h->dispatcher_id != id_) {
      return invalid_argument("cached_handle was not made by this Flex dispatcher");
    }
    const TokenRows& x = input.hidden;
    if (x.x.rows != h->routes.num_tokens() || x.x.cols != h->hidden || x.x.dtype != h->dtype) {
      return invalid_argument("cached mode: hidden is ", dtype_name(x.x.dtype), " [", x.x.rows,
                              ", ", x.x.cols, "] but the handle's dispatch had ",
                              dtype_name(h->dtype), " [", h->routes.num_tokens(), ", ", h->hidden,
                              "]");
    }
    if (x.x.rows > 0 && x.x.data == nullptr) return invalid_argument("hidden.x.data is null");
    if (x.x.row_stride < x.x.cols)
      return invalid_argument("hidden row_stride = ", x.x.row_stride, " < ", x.x.cols);
    if (x.has_scales() &&
        (x.scales.dtype != DType::kF32 || x.scales.rows != x.x.rows ||
         x.scales.cols != x.x.cols / kFp8BlockSize || (x.x.rows > 0 && x.scales.data == nullptr))) {
      return invalid_argument("fp8 scales must be f32 [", x.x.rows, ", ", x.x.cols / kFp8BlockSize,
                              "]");
    }
    d_cached_ = std::move(h);
    return ok_status();
  }

  // Agreement on the local verdict, then on values every rank must share (dtypes, flags).
  Status agree_on(const Status& local, std::vector<int64_t> values,
                  std::vector<const char*> names) {
    MOED_RETURN_IF_ERROR(world_->agree(local));
    MOED_ASSIGN_OR_RETURN(std::vector<int64_t> all,
                          all_gather<int64_t>(*world_, std::span<const int64_t>(values)));
    const size_t n = values.size();
    for (int r = 1; r < world_->size(); ++r) {
      for (size_t i = 0; i < n; ++i) {
        if (all[size_t(r) * n + i] != all[i]) {
          return invalid_argument(names[i], " = ", all[i], " on rank 0 but ",
                                  all[size_t(r) * n + i], " on rank ", r);
        }
      }
    }
    return ok_status();
  }

  // Rows of the largest output among this node's ranks: every local segment has this many.
  int64_t node_cap_rows(const FlexHandle& h) const {
    int64_t cap = 0;
    for (int lr = 0; lr < topo_.ranks_per_node; ++lr) {
      const int r = topo_.node * topo_.ranks_per_node + lr;
      cap = std::max(cap, config_.num_worst_tokens > 0 ? config_.num_worst_tokens
                                                       : h.global->exact_rows[size_t(r)]);
    }
    return cap;
  }
  size_t pull_scalars_off(const FlexHandle& h, DType dt) const {
    return (size_t(node_cap_rows(h)) * dtype_row_bytes(dt, h.hidden) + 63) / 64 * 64;
  }
  size_t pull_bytes(const FlexHandle& h, DType dt) const {
    return std::max<size_t>(64, pull_scalars_off(h, dt) + size_t(node_cap_rows(h)) * sizeof(float));
  }

  Status dispatch_body() {
    if (!d_cached_) {
      MOED_ASSIGN_OR_RETURN(d_new_, notify(*world_, config_, std::move(*d_prepared_), id_));
    }
    const FlexHandle& h = d_cached_ ? *d_cached_ : *d_new_;
    d_layout_ = PushLayout::of(node_cap_rows(h), dtype_row_bytes(h.dtype, h.hidden),
                               scale_row_bytes(h.dtype, h.hidden), /*meta=*/true);
    MOED_RETURN_IF_ERROR(dispatch_region_.ensure(*world_, d_layout_.bytes));
    PushSpec spec{d_rows_, false, &dispatch_region_, d_layout_};
    DispatchContext ctx{world_, &config_, &h, d_cached_ ? nullptr : &d_new_->forward};
    MOED_RETURN_IF_ERROR(push_step(ctx, spec, kTagDispatch));
    if (d_new_) {
      // The owner's metadata rows, for the handle (combine and the backward passes use them).
      const char* seg = dispatch_region_.local();
      const size_t n = size_t(d_new_->num_rows);
      const auto* probs = reinterpret_cast<const float*>(seg + d_layout_.prob_off);
      const auto* src_rank = reinterpret_cast<const int32_t*>(seg + d_layout_.src_rank_off);
      const auto* src_token = reinterpret_cast<const int32_t*>(seg + d_layout_.src_token_off);
      d_new_->permuted_probs.assign(probs, probs + n);
      d_new_->row_src_rank.assign(src_rank, src_rank + n);
      d_new_->row_src_token.assign(src_token, src_token + n);
    }
    return ok_status();
  }

  // Push: remote messages out first, local copies while they travel, forwarded rows last;
  // then one signal per (writer, owner) pair.
  Status push_step(const DispatchContext& ctx, const PushSpec& spec, int tag) {
    RemoteOps remote;
    if (topo_.num_nodes > 1) {
      MOED_ASSIGN_OR_RETURN(remote, push_remote_start(ctx, spec, tag));
    }
    push_local(ctx, spec);
    zero_padding_rows(ctx, spec);
    if (topo_.num_nodes > 1) MOED_RETURN_IF_ERROR(push_remote_finish(ctx, spec, remote));
    signals_.signal_all(++epoch_);
    return signals_.wait_all(epoch_);
  }

  // Pull: publish this rank's rows (and scalars) to its node, fold, then hold the rows until
  // every local reader is done with them (the caller may free them when the step returns).
  Status pull_step(const FlexHandle& h, const TensorView& rows, std::span<const float> scalars,
                   PullSpec spec, int tag) {
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
    signals_.signal_all(++epoch_);
    MOED_RETURN_IF_ERROR(signals_.wait_all(epoch_));
    spec.sources.resize(size_t(G));
    for (int lr = 0; lr < G; ++lr) {
      if (in_place_) {
        std::memcpy(&spec.sources[size_t(lr)], signals_.board(lr), sizeof(PullSource));
      } else {
        const char* seg = pull_region_.peer(lr);
        spec.sources[size_t(lr)] = {
            seg, rows.row_bytes(),
            !spec.with_scalars
                ? nullptr
                : reinterpret_cast<const float*>(seg + pull_scalars_off(h, rows.dtype))};
      }
    }
    DispatchContext ctx{world_, &config_, &h, nullptr};
    Status s = pull(ctx, spec, tag);
    // NOTE: released even after an error, so no peer waits for this rank's release in vain.
    signals_.signal_all(++epoch_);
    MOED_RETURN_IF_ERROR(s);
    return signals_.wait_all(epoch_);
  }

  Status combine_backward_body() {
    const bool weighted = config_.weighted_combine;
    MOED_RETURN_IF_ERROR(
        agree_on(cb_local_, {int64_t(cb_grad_.dtype), weighted ? int64_t(cb_rows_.dtype) : -1},
                 {"grad_hidden dtype", "expert_output dtype"}));
    const FlexHandle& h = *cb_handle_;
    const PushLayout layout =
        PushLayout::of(node_cap_rows(h), dtype_row_bytes(cb_grad_.dtype, h.hidden), 0, false);
    MOED_RETURN_IF_ERROR(grad_region_.ensure(*world_, layout.bytes));
    PushSpec spec{TokenRows{cb_grad_, {}}, weighted, &grad_region_, layout};
    DispatchContext ctx{world_, &config_, &h, nullptr};
    MOED_RETURN_IF_ERROR(push_step(ctx, spec, kTagCombineBackward));
    cb_out_ =
        Tensor::copy_of(TensorView(grad_region_.local(), cb_grad_.dtype, h.num_rows, h.hidden));
    cb_probs_.assign(size_t(h.routes.num_tokens()) * topo_.num_experts, 0.0f);
    if (!weighted) return ok_status();
    // grad_prob(t, e) = dot(grad_out[t], term_e): the terms come back as in combine.
    PullSpec pspec;
    pspec.mode = PullMode::kProbGrad;
    pspec.dtype = cb_rows_.dtype;
    pspec.grad_out = cb_grad_;
    pspec.out_probs = cb_probs_.data();
    return pull_step(h, cb_rows_, {}, pspec, kTagProbGrad);
  }

  uint64_t id_;
  Topology topo_;
  bool in_place_;
  Signals signals_;
  Region dispatch_region_, pull_region_, grad_region_;
  uint64_t epoch_ = 0;

  TokenRows d_rows_;
  std::optional<PreparedInput> d_prepared_;
  std::shared_ptr<const FlexHandle> d_cached_;
  std::shared_ptr<FlexHandle> d_new_;
  PushLayout d_layout_;
  std::shared_ptr<OpState> d_op_;

  std::shared_ptr<const FlexHandle> c_handle_;
  Status c_local_;
  TensorView c_rows_;
  Tensor c_out_;
  std::shared_ptr<OpState> c_op_;

  std::shared_ptr<const FlexHandle> db_handle_;
  Status db_local_;
  TensorView db_rows_;
  std::span<const float> db_pprobs_;
  Tensor db_out_;
  std::vector<float> db_probs_;
  std::shared_ptr<OpState> db_op_;

  std::shared_ptr<const FlexHandle> cb_handle_;
  Status cb_local_;
  TensorView cb_grad_, cb_rows_;
  Tensor cb_out_;
  std::vector<float> cb_probs_;
  std::shared_ptr<OpState> cb_op_;
};

}  // namespace
}  // namespace flex

StatusOr<std::unique_ptr<TokenDispatcher>> make_flex_dispatcher(World& world,
                                                                const DispatchConfig& config) {
  const int G = world.ranks_per_node(), P = config.etp_size;
  Status local;
  if (world.num_nodes() > 1 && G % P != 0) {
    local = unimplemented("Flex across nodes needs each expert's ", P,
                          " ETP ranks inside one node; "
                          "ranks_per_node = ",
                          G, " is not a multiple of etp_size = ", P);
  } else if (world.num_nodes() > 1 && G > 64) {
    local = unimplemented(
        "Flex across nodes supports up to 64 ranks per node (the header's rank "
        "mask); ranks_per_node = ",
        G);
  }
  MOED_RETURN_IF_ERROR(world.agree(local));
  auto d = std::make_unique<flex::FlexDispatcher>(world, config);
  MOED_RETURN_IF_ERROR(d->init());
  return std::unique_ptr<TokenDispatcher>(std::move(d));
}

StatusOr<TensorView> flex_expert_output_buffer(TokenDispatcher& dispatcher,
                                               const DispatchHandle& handle, DType dtype) {
  auto* d = dynamic_cast<flex::FlexDispatcher*>(&dispatcher);
  if (d == nullptr) {
    return invalid_argument("flex_expert_output_buffer needs a Flex dispatcher, not '",
                            dispatcher_kind_name(dispatcher.config().kind), "'");
  }
  return d->expert_output_buffer(handle, dtype);
}

}  // namespace moed
