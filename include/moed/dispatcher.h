// TokenDispatcher: Megatron-Core's six-step dispatch / combine interface (docs/design.md §1.1),
// with one implementation per dispatcher (AllGather, AlltoAll, Flex) and the backward of each
// step. Low-latency mode is not a TokenDispatcher: its fixed per-expert slots are not the
// canonical layout, so it has its own API (moed/low_latency.h).
//
//   MOED_ASSIGN_OR_RETURN(auto d, moed::TokenDispatcher::create(world, config));
//   MOED_ASSIGN_OR_RETURN(moed::DispatchOutput out,
//                         d->dispatch({.hidden = x, .topk = moed::TopkView::of(routing)}));
//   ... experts read out.expert_input, segment j has out.tokens_per_expert[j] rows ...
//   MOED_ASSIGN_OR_RETURN(moed::CombineOutput y,
//                         d->combine({.expert_output = ey, .handle = out.handle}));
//
// Results are bitwise identical across dispatchers, worlds and EP sizes (design.md §4.2). Every
// call is collective over the world; bad input on any rank is an error on every rank. An output
// stays valid and unchanged while the caller holds it (any copy of its `storage`), whatever
// later calls do (design.md §10.1). Requests (moed/world.h) are never null.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "moed/routing.h"
#include "moed/status.h"
#include "moed/tensor.h"
#include "moed/world.h"

namespace moed {

enum class DispatcherKind : uint8_t { kAllGather = 0, kAlltoAll = 1, kFlex = 2 };
const char* dispatcher_kind_name(DispatcherKind k);  // "allgather", "alltoall", "flex"
StatusOr<DispatcherKind> parse_dispatcher_kind(std::string_view name);

// One validated configuration for every dispatcher (DeepEP's Config, Megatron's
// TransformerConfig moe_* fields). validate() is the single place options are checked.
struct DispatchConfig {
  DispatcherKind kind = DispatcherKind::kAlltoAll;
  int num_experts = 0;
  int ep_size = 0;   // 0 = world size / etp_size
  int etp_size = 1;  // expert tensor parallel size P; group rank g = (ep = g / P, p = g % P)
  LayoutOptions layout;
  bool weighted_combine = false;  // multiply each expert's term by its prob in combine

  // Flex only (others reject non-default values):
  int64_t num_worst_tokens = 0;  // > 0: size the output for this many rows up front
  int num_channels = 0;          // worker threads owning token ranges; 0 = the world's pool

  int effective_ep_size(int world_size) const {
    return ep_size > 0 ? ep_size : world_size / etp_size;
  }
  int num_local_experts(int world_size) const {
    return num_experts / effective_ep_size(world_size);
  }
  // EP * ETP == world size, E % EP == 0, layout options valid, kind-specific options, ...
  Status validate(int world_size) const;
};

// What a dispatch produced and what combine and the backward passes need. Dispatchers
// subclass it to keep their own state (prefix matrices, send layouts); the public fields are
// the same for all and are what tests and the MoE layer read.
class DispatchHandle {
 public:
  virtual ~DispatchHandle() = default;
  DispatcherKind kind = DispatcherKind::kAlltoAll;
  int hidden = 0;
  DType dtype = DType::kF32;  // payload dtype of the dispatch
  int num_topk = 0;
  // Home side (this rank's tokens), after capacity dropping and router padding, sparse (what
  // combine and the backward passes walk; to_map(routing) gives the dense map on request).
  SparseRouting routing;
  // Expert side (rows this rank received), canonical layout of design.md §3.1.
  int64_t num_rows = 0;
  std::vector<int64_t> tokens_per_expert;           // [L], padded lengths
  std::vector<int64_t> tokens_per_expert_unpadded;  // [L]
  std::vector<int32_t> row_src_rank;                // [num_rows], -1 on padding rows
  std::vector<int32_t> row_src_token;               // [num_rows], -1 on padding rows
  // [num_rows] the row's column in its source's top-k (routing.slot), -1 on padding rows and
  // where the routing has no slots; Flex only (empty elsewhere).
  std::vector<int32_t> row_src_slot;
  std::vector<float> permuted_probs;                // [num_rows], 0 on padding rows
};

// The routing comes in one of three forms (exactly one is given): top-k, as DeepEP's buffers
// and low-latency mode take it; Megatron's map; or the sparse form itself. The dispatch turns it
// into the sparse form once, on entry, and works on that (moed/routing.h).
struct DispatchInput {
  TokenRows hidden;  // [T, H] f32, bf16, or fp8 with scales; T may be 0
  TopkView topk;     // given when num_topk > 0: TopkView::of(routing), or a caller's tensors
  MapView map;       // given when num_experts > 0: MapView::of(routing_map), or a caller's tensors
  // Flex cached mode: same routing as the dispatch that made this handle; skips notify.
  std::shared_ptr<const DispatchHandle> cached_handle;
  const SparseRouting* routing = nullptr;  // the sparse form itself
  // The routing already had this config's capacity dropping and router padding applied (a
  // Router with the same LayoutOptions did it), so the dispatcher does not apply them again;
  // it still checks that no expert holds more than the capacity.
  bool layout_applied = false;
  // Optional caller-owned expert_input: [num_rows, H] of the payload dtype (fp8: the data;
  // the scales stay the dispatcher's), row_stride >= H. num_rows is what this rank receives:
  // Flex's num_worst_tokens when set, a cached handle's rows, or what the routing gives (the
  // handle of an earlier dispatch with the same routing tells it). Checked against every
  // rank's row count in the call's own count exchange, so a wrong `out` on one rank is an
  // error on every rank, naming it, and no rank's `out` is written. AllGather and AlltoAll
  // store their rows there (no extra copy); Flex copies them once out of the node-shared
  // region its peers write (the default, zero-copy expert_input, saves that copy). It must
  // stay valid until dispatch_postprocess has returned.
  std::optional<TensorView> out = std::nullopt;
};

struct DispatchOutput {
  TokenRows expert_input;  // [num_rows, H] canonical layout, payload dtype (+ scales for fp8)
  std::span<const float> permuted_probs;       // [num_rows] (owned by handle)
  std::span<const int64_t> tokens_per_expert;  // [L] (owned by handle)
  std::shared_ptr<const DispatchHandle> handle;
  std::shared_ptr<void> storage;  // holds expert_input unchanged (see the lifetime rule above)
  int64_t num_rows() const { return expert_input.x.rows; }
};

struct CombineInput {
  TokenRows expert_output;  // [num_rows, H] f32 or bf16, rows as in the dispatch output
  std::shared_ptr<const DispatchHandle> handle;
  // Optional caller-owned result: [T, H] (T = this rank's tokens of the dispatch), the dtype
  // of expert_output, row_stride >= H, not overlapping expert_output. Combine stores each
  // result row there once (the same bits it would return); a bad shape, dtype or stride is an
  // error on every rank, and then `out` is untouched. It must stay valid until
  // combine_postprocess has returned (the steps may write it in the background).
  std::optional<TensorView> out = std::nullopt;
};

struct CombineOutput {
  Tensor hidden;  // [T, H], dtype of expert_output; empty (0 x 0) when CombineInput::out is set
  std::vector<float> combined_probs;  // [T] fp32 sum of each token's kept probs (as DeepEP returns)
  std::optional<TensorView> out = std::nullopt;  // CombineInput::out, when it was given
  // Where the result is: the caller's buffer or `hidden`.
  TensorView result() const { return out ? *out : hidden.view(); }
};

// Backward of dispatch: gradients w.r.t. the dispatch outputs, back to the inputs.
struct DispatchGradInput {
  TensorView grad_expert_input;                // [num_rows, H] f32 or bf16
  std::span<const float> grad_permuted_probs;  // [num_rows] or empty
  std::shared_ptr<const DispatchHandle> handle;
};
struct DispatchGrad {
  Tensor grad_hidden;             // [T, H], dtype of grad_expert_input
  std::vector<float> grad_probs;  // [T, E] map form (zeros where not routed / no grad given)
};

// Backward of combine.
struct CombineGradInput {
  TensorView grad_hidden;   // [T, H] f32 or bf16
  TokenRows expert_output;  // the combine's input; needed only when weighted_combine
  std::shared_ptr<const DispatchHandle> handle;
};
struct CombineGrad {
  Tensor grad_expert_output;      // [num_rows, H], dtype of grad_hidden; zero on padding rows
  std::vector<float> grad_probs;  // [T, E]; non-zero only when weighted_combine
};

class TokenDispatcher {
 public:
  // Builds the dispatcher named by config.kind.
  // Validates config against the world; collective (every rank must call it).
  static StatusOr<std::unique_ptr<TokenDispatcher>> create(World& world,
                                                           const DispatchConfig& config);
  virtual ~TokenDispatcher() = default;

  const DispatchConfig& config() const { return config_; }
  World& world() const { return *world_; }

  // ---- the six steps (design.md §1.1). State flows from step to step inside the dispatcher, as in
  // Megatron; one dispatch and one combine may be in progress at a time.
  // Local only. caller_error: an error the caller found in its own arguments (a binding's
  // parsing); it is reported on every rank by the step after, as the step's own checks are,
  // so no rank waits for one that could not start. The same for combine_preprocess.
  virtual Status dispatch_preprocess(const DispatchInput& input,
                                     const Status& caller_error = Status()) = 0;
  // Communicates. async = true may return before the data has moved: wait on the request
  // before dispatch_postprocess (run the shared expert meanwhile). Flex's steps run in the
  // background where the world allows calls from any thread (World::calls_from_any_thread);
  // a later call on the world, from any thread, waits until the steps started before it are
  // done (World::AsyncSteps), so every rank's calls keep their order. Elsewhere, and in
  // AllGather and AlltoAll, the step runs now. async = false runs now. The request is never
  // null (ready() polls).
  // Errors in the input of the preprocess step show here (or in wait()), on every rank.
  virtual StatusOr<Request> token_dispatch(bool async) = 0;
  virtual StatusOr<DispatchOutput> dispatch_postprocess() = 0;  // local only
  virtual Status combine_preprocess(const CombineInput& input,
                                    const Status& caller_error = Status()) = 0;  // local only
  // Communicates, as token_dispatch; errors in combine_preprocess's input show here.
  virtual StatusOr<Request> token_combine(bool async) = 0;
  virtual StatusOr<CombineOutput> combine_postprocess() = 0;

  // ---- backward, step by step in reverse order (autograd through the six steps).
  // The first step of each is local, as the preprocess steps are: errors in its input show in
  // the token_* step after, on every rank.
  // Backward of dispatch: grad of expert_input -> grad of hidden (an unweighted combine).
  virtual Status dispatch_postprocess_backward(const DispatchGradInput& grad) = 0;
  virtual StatusOr<Request> token_dispatch_backward(bool async) = 0;
  virtual StatusOr<DispatchGrad> dispatch_preprocess_backward() = 0;
  // Backward of combine: grad of hidden -> grad of expert_output (a dispatch of grad_hidden).
  virtual Status combine_postprocess_backward(const CombineGradInput& grad) = 0;
  virtual StatusOr<Request> token_combine_backward(bool async) = 0;
  virtual StatusOr<CombineGrad> combine_preprocess_backward() = 0;

  // ---- one call each (the three steps in order, synchronous).
  StatusOr<DispatchOutput> dispatch(const DispatchInput& input,
                                    const Status& caller_error = Status());
  StatusOr<CombineOutput> combine(const CombineInput& input,
                                  const Status& caller_error = Status());
  StatusOr<DispatchGrad> dispatch_backward(const DispatchGradInput& grad);
  StatusOr<CombineGrad> combine_backward(const CombineGradInput& grad);

 protected:
  TokenDispatcher(World& world, const DispatchConfig& config) : world_(&world), config_(config) {}
  World* world_;
  DispatchConfig config_;
};

}  // namespace moed
