// Row exchange: the parts the AllGather and AlltoAll dispatchers share.
//
// Both learn the per-(source, expert) counts once per dispatch (exchange_counts) and describe,
// in a RowExchangePlan, how rows move between two orders:
//   - the expert side: this rank's canonical layout (design.md §3.1), chunks (local expert j,
//     source s) expert-major with padding;
//   - the home side: this rank's own tokens permuted expert-major over all E experts, no
//     padding (Megatron's permute of the effective map), so the rows for the experts of one
//     ep index are contiguous.
// The AlltoAll dispatch moves rows home side -> expert side; the combine of both dispatchers
// (and the backward of their dispatch) moves them back, expert side -> home side, through
// RowExchangeDispatcher, which implements those six steps once for both.
//
// NOTE: the forward's row work (permute, sort_chunks, unpermute) runs in the communicating
// steps (token_dispatch, token_combine), as Flex's does; the local steps check, count and hand
// out the results. A step that moves rows returns with the caches full of them, and at decode
// a Python caller pays cache misses on each such return (docs/benchmarks.md, "Measurements
// behind design choices"), so two such returns per layer instead of six. The same bits.
//
// NOTE: the combine sends each rank's per-(token, expert) rows to the token's home rank (one
// all_to_all_v; with ETP every p sends its partial) and sums there: the P partials first
// (fp32 from 0, p ascending), then the experts ascending (unpermute). A reduce-scatter of
// per-rank partial sums would group the terms differently (((a+b)+(c+d)) != (((a+b)+c)+d))
// and break design.md §4.2's bitwise promise, so neither dispatcher uses one.
//
//   MOED_ASSIGN_OR_RETURN(GlobalCounts c, exchange_counts(world, config, verdict, prepared));
//   MOED_ASSIGN_OR_RETURN(RowExchangePlan plan,
//                         make_row_exchange_plan(config, world, c, prepared.effective));
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "comm/agreement.h"
#include "dispatch/prepare.h"
#include "moed/dispatcher.h"
#include "moed/permute.h"

namespace moed {

// Where a step's state is between the six steps (each dispatcher's per-step structs use it):
// kPrepared after the preprocess step (inputs checked; rows packed in the backward), kHomeReady
// when the home-side rows of a combine backward are ready to send (AlltoAll), kExchanged once
// the communicating step has moved the rows (received / gathered).
enum class Stage : uint8_t { kIdle, kPrepared, kHomeReady, kExchanged };

// The last call of a dispatch or combine: the `result` of `state` that its communicating step
// made (stage kExchanged), `state` reset for the next call; else the error `too_early`.
template <typename State, typename Result>
StatusOr<Result> take_result(State& state, std::optional<Result>& result, const char* too_early) {
  if (state.stage != Stage::kExchanged) return failed_precondition(too_early);
  Result out = std::move(*result);
  state = State{};
  return out;
}

// What every rank learns about every other in the dispatch's one collective (agree_in_one),
// with the agreement on each rank's verdict and on hidden, dtype and num_topk.
struct GlobalCounts {
  std::vector<int64_t> counts;      // [R * E] rows source s sends to global expert e
  std::vector<int64_t> num_tokens;  // [R] T_s
  std::vector<int64_t> capacity;    // [R] C_s (0 without capacity_factor)
  std::vector<int64_t> out_rows;    // [R] rows of rank s's DispatchInput::out, -1 without one
};
// Collective: any rank's bad verdict or a shape that differs is every rank's error.
StatusOr<GlobalCounts> exchange_counts(World& world, const DispatchConfig& config,
                                       const Status& verdict, const PreparedInput& input);

struct RowExchangePlan {
  int world_size = 0;
  int num_local_experts = 0;  // L
  int etp_size = 1;           // P
  // Expert side.
  ExpertLayout layout;                  // canonical layout of this rank
  std::vector<int64_t> chunk_sizes;     // [R * L] tokens of chunk (s, j), source-major
  std::vector<int32_t> chunk_order;     // [L * R] canonical chunk (j, s) = chunk s * L + j
  std::vector<int64_t> chunk_offsets;   // [L * R] first row of canonical chunk (j, s)
  std::vector<int64_t> rows_of_source;  // [R] rows this rank holds for source s (sum over j)
  int64_t expert_rows = 0;              // sum of rows_of_source: the layout without padding
  // Home side.
  PermuteLayout home;                        // this rank's tokens, expert-major, E experts
  std::vector<int64_t> home_rows_of_rank;    // [R] home rows for the experts of ep(g)
  std::vector<int64_t> home_offset_of_rank;  // [R] where those rows start in `home`
};
StatusOr<RowExchangePlan> make_row_exchange_plan(const DispatchConfig& config, World& world,
                                                 const GlobalCounts& counts,
                                                 const SparseRouting& effective);

// The plan's two row moves, one all_to_all_v each, rows of row_bytes:
//   exchange_to_experts: home side -> expert side, the rows from source s packed source-major
//     (chunks (s, j), no padding) in `recv`: the AlltoAll dispatch and combine backward.
//   exchange_to_home: expert side packed that way -> home side, rank-major in `recv`: every
//     return (combine, dispatch backward).
// NOTE: with ETP every rank (ep, p) gets the block of ep's experts straight from the source
// (the same send offset for all P of them) instead of Megatron's all-to-all over EP then
// all-gather over ETP: one collective, the same rows on every p.
Status exchange_to_experts(World& world, const RowExchangePlan& plan, const void* send, void* recv,
                           size_t row_bytes);
Status exchange_to_home(World& world, const RowExchangePlan& plan, const void* send, void* recv,
                        size_t row_bytes);

// Bytes kept between steps and calls: they grow and are never freed in between, so the big
// per-step buffers are allocated (and page-faulted) once, not once per dispatch.
// NOTE: first-touch page faults of fresh multi-hundred-MB buffers cost more than the copies
// themselves; reusing them is what brings a dispatch near the memory-copy bound.
class ScratchBuffer {
 public:
  // A packed [rows, cols] view of `dtype` over this buffer; contents unspecified. Valid until
  // the next view() call that needs more bytes.
  TensorView view(DType dtype, int64_t rows, int64_t cols);

 private:
  Tensor bytes_;
};

// Dispatch outputs (DispatchOutput::storage) reused once the caller has dropped every copy of
// an earlier output's storage (use_count 1: only the pool holds it, so nobody can still read
// it or copy it concurrently). A caller that keeps outputs gets fresh buffers.
class OutputPool {
 public:
  // Storage with room for [rows, cols] of dtype (+ fp8 scales); `rows_out` views into it
  // (without x: the scales only, the rows being the caller's).
  std::shared_ptr<void> acquire(DType dtype, int64_t rows, int64_t cols, TokenRows& rows_out,
                                bool with_x = true);

 private:
  struct Entry {
    ScratchBuffer x;
    ScratchBuffer scales;
  };
  std::vector<std::shared_ptr<Entry>> entries_;
};

// The handle of both dispatchers: the public fields plus the plan.
class ExchangeHandle : public DispatchHandle {
 public:
  RowExchangePlan plan;
};

// Combine, the dispatch backward and the home half of the combine backward, written once for
// the dispatchers whose expert outputs go home through a RowExchangePlan; also the handle and
// output glue of their own dispatch and combine backward steps, which differ only in between.
class RowExchangeDispatcher : public TokenDispatcher {
 public:
  Status combine_preprocess(const CombineInput& input,
                            const Status& caller_error = Status()) override;
  StatusOr<Request> token_combine(bool async) override;
  StatusOr<CombineOutput> combine_postprocess() override;

  Status dispatch_postprocess_backward(const DispatchGradInput& grad) override;
  StatusOr<Request> token_dispatch_backward(bool async) override;
  StatusOr<DispatchGrad> dispatch_preprocess_backward() override;

 protected:
  RowExchangeDispatcher(World& world, const DispatchConfig& config)
      : TokenDispatcher(world, config) {}

  // Dispatch glue, split at the step boundary as Flex's is. stage_dispatch (dispatch_preprocess:
  // local) checks the input and makes the effective routing, keeping the verdict;
  // agree_dispatch (token_dispatch: one collective) agrees on the verdict and the shapes,
  // exchanges the counts (returned), checks DispatchInput::out against them (check_dispatch_out) and
  // initialises `h` (init_handle).
  void stage_dispatch(const DispatchInput& input, const Status& caller_error);
  StatusOr<GlobalCounts> agree_dispatch(ExchangeHandle& h);
  // The plan (from the agreed counts) and the public handle fields, taking in.effective as the
  // handle's routing; and the output over a finished handle (its permuted_probs and
  // tokens_per_expert back the output's spans).
  Status init_handle(ExchangeHandle& h, const GlobalCounts& counts, PreparedInput& in) const;
  static DispatchOutput dispatch_output(std::shared_ptr<const ExchangeHandle> h,
                                        const TokenRows& expert_input,
                                        std::shared_ptr<void> storage);
  // The staged DispatchInput::out against the rows every rank receives (each rank's layout
  // from the gathered counts: the same verdict on every rank, no collective).
  Status check_dispatch_out(const GlobalCounts& counts, int64_t hidden) const;
  // Where this dispatch's expert rows go: the caller's `out` (storage holds only fp8 scales),
  // else a buffer of the output pool.
  std::shared_ptr<void> take_expert_input(const ExchangeHandle& h, TokenRows& expert_input);

  // Expert rows on their way home: packed source-major (padding dropped), sent, received.
  // reset() keeps the buffers for the next call.
  struct ReturnState {
    std::shared_ptr<const ExchangeHandle> handle;
    TensorView packed;
    std::vector<float> packed_values;
    TensorView received;                 // [sum of home_rows_of_rank, H], rank-major
    std::vector<float> received_values;  // when values were sent
    bool has_values = false;
    std::optional<TensorView> out;  // combine: the caller's buffer (CombineInput::out)
    Stage stage = Stage::kIdle;     // kPrepared: packed; kExchanged: received
    ScratchBuffer packed_buffer;
    ScratchBuffer received_buffer;

    void reset() {
      handle.reset();
      packed = TensorView();
      received = TensorView();
      packed_values.clear();
      received_values.clear();
      has_values = false;
      out.reset();
      stage = Stage::kIdle;
    }
  };
  // Local: sorts rows (canonical layout of handle) back source-major, without padding.
  Status pack_return(ReturnState& st, std::shared_ptr<const ExchangeHandle> handle,
                     const TensorView& rows, std::span<const float> values);
  Status send_return(ReturnState& st);
  // fp32 terms of design.md §4.1 in home order (0 + partials in p order): [home.num_rows, H] f32.
  // With P = 1 returns an empty tensor: the received rows are the terms (see .cc).
  Tensor sum_partials(const ReturnState& st) const;
  std::vector<float> sum_partial_values(const ReturnState& st) const;
  // The received rows as the fp32-equivalent terms: sum_partials when P > 1, else `received`.
  TensorView terms(const ReturnState& st, const Tensor& summed) const;

  // Checks a handle given to a later step (non-null, made by this kind of dispatcher).
  StatusOr<std::shared_ptr<const ExchangeHandle>> check_handle(
      const std::shared_ptr<const DispatchHandle>& handle, const char* step) const;
  // Checks rows shaped like the handle's expert side (f32 / bf16).
  static Status check_expert_rows(const char* what, const TensorView& rows,
                                  const DispatchHandle& handle);

  // Combine backward, shared half. start_combine_backward checks the input (agreed on every
  // rank), keeps the views, and when weighted packs the expert outputs for their trip home.
  // home_combine_backward (collective when weighted: the expert outputs go home so the fp32
  // terms of design.md §4.1 can be dotted with grad_out there) returns, in home order, the rows
  // every expert rank must receive (grad_out, or round(prob * grad_out) when weighted) and, when
  // weighted, grad_row_probs.
  struct CombineGradState {
    std::shared_ptr<const ExchangeHandle> handle;
    TensorView grad_out;       // [T, H], caller-owned until combine_preprocess_backward
    TensorView expert_output;  // when weighted
    ReturnState y;
    Stage stage = Stage::kIdle;

    void reset() {
      handle.reset();
      grad_out = TensorView();
      expert_output = TensorView();
      y.reset();
      stage = Stage::kIdle;
    }
  };
  Status start_combine_backward(const CombineGradInput& grad);
  StatusOr<UnpermuteGrad> home_combine_backward();
  // Last step: out.grad_probs, the home rows' grad_row_probs as a [T, E] map when weighted
  // (zeros otherwise: the probs did not weigh the output); then the shared state is cleared.
  Status finish_combine_backward(std::span<const float> grad_row_probs, CombineGrad& out);

  ReturnState combine_;
  // The combine in progress: its input, checked by combine_preprocess (locally: `verdict`);
  // token_combine agrees on the verdict, moves and sums it (see row_exchange.cc) and keeps the
  // result for combine_postprocess.
  struct CombineStep {
    Status verdict;
    std::shared_ptr<const ExchangeHandle> handle;
    TensorView expert_output;  // caller-owned until token_combine has returned
    std::optional<TensorView> out;
    std::optional<CombineOutput> result;
    Stage stage = Stage::kIdle;  // kPrepared: checked; kExchanged: result made
  };
  CombineStep combine_step_;
  ReturnState dispatch_grad_;
  std::vector<float> grad_pprobs_;
  CombineGradState combine_grad_;
  OutputPool outputs_;  // dispatch outputs (see OutputPool)
  // The dispatch between its two first steps (stage_dispatch): the local verdict, the input
  // prepared, and DispatchInput::out (kept for take_expert_input).
  Status staged_verdict_;
  PreparedInput staged_;
  std::optional<TensorView> dispatch_out_;
};

// The factory of row-exchange dispatcher D as `kind`. It checks the config, collectively like
// TokenDispatcher::create (which also checks), so that calling the factory directly is as safe.
template <typename D>
StatusOr<std::unique_ptr<TokenDispatcher>> make_row_exchange_dispatcher(
    World& world, const DispatchConfig& config, DispatcherKind kind) {
  MOED_RETURN_IF_ERROR(world.agree(config.validate(world.size())));
  DispatchConfig c = config;
  c.kind = kind;
  return std::unique_ptr<TokenDispatcher>(new D(world, c));
}

}  // namespace moed
