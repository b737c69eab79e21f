// Row exchange: the AllGather and AlltoAll dispatchers, one TokenDispatcher
// (row_exchange_dispatcher.cc) with a ForwardExchange for the part where they differ, how rows
// reach the experts (allgather/, alltoall/).
//
// Both learn the per-(source, expert) counts once per dispatch (exchange_counts) and describe,
// in a RowExchangePlan, how rows move between two orders:
//   - the expert side: this rank's canonical layout (design.md §3.1), chunks (local expert j,
//     source s) expert-major with padding;
//   - the home side: this rank's own tokens permuted expert-major over all E experts, no
//     padding (Megatron's permute of the effective map), so the rows for the experts of one
//     ep index are contiguous.
// The AlltoAll dispatch moves rows home side -> expert side; the combine of both (and the
// backward of their dispatch) moves them back, expert side -> home side.
//
// NOTE: the row work (permute, sort_chunks, unpermute) runs in the communicating steps
// (token_dispatch, token_combine, ...), as Flex's does; the local steps check and hand out the
// results. A step that moves rows returns with the caches full of them, and at decode a Python
// caller pays cache misses on each such return (docs/benchmarks.md, "Measurements behind
// design choices"), so two such returns per layer instead of six. The same bits.
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
#include <span>
#include <vector>

#include "dispatch/prepare.h"
#include "dispatch/scratch.h"
#include "moed/dispatcher.h"
#include "moed/permute.h"

namespace moed {

// What every rank learns about every other in the dispatch's one collective (agree_in_one),
// with the agreement on each rank's verdict and on hidden, dtype and num_topk.
struct GlobalCounts {
  std::vector<int64_t> counts;      // [R * E] rows source s sends to global expert e
  std::vector<int64_t> num_tokens;  // [R] T_s
  std::vector<int64_t> capacity;    // [R] C_s (0 without capacity_factor)
  std::vector<int64_t> out_rows;    // [R] rows of rank s's DispatchInput::out, -1 without one

  CountsView view() const {  // as compute_expert_layout reads them
    return {counts.data(), counts.size() / capacity.size(), capacity.data()};
  }
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
// [n.size() + 1]: where each of n's runs starts when they are laid back to back, then the end.
std::vector<int64_t> prefix(std::span<const int64_t> n);

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

// The handle of both dispatchers: the public fields plus the plan.
class ExchangeHandle : public DispatchHandle {
 public:
  RowExchangePlan plan;
};

// How one row-exchange dispatcher moves rows to the expert side, in its communicating steps;
// the rest (the steps, the agreement, the plan, every return home) is the dispatcher's.
class ForwardExchange {
 public:
  virtual ~ForwardExchange() = default;
  virtual DispatcherKind kind() const = 0;
  // A handle for one dispatch (AllGather's also keeps how it picked its rows).
  virtual std::shared_ptr<ExchangeHandle> new_handle() const {
    return std::make_shared<ExchangeHandle>();
  }
  // token_dispatch, after the agreement: every rank's `hidden` to the expert sides, this
  // rank's rows in the canonical layout in `expert_input` (padding zeroed), and the handle's
  // per-row fields (permuted_probs, row_src_rank, row_src_token). `h` has the plan.
  virtual Status to_experts(World& world, const DispatchConfig& config, const GlobalCounts& counts,
                            const TokenRows& hidden, ExchangeHandle& h,
                            const TokenRows& expert_input) = 0;
  // Whether grad_to_experts reads `home_rows`; when not, they are made only where the
  // weighted combine's backward needs them (for grad_probs).
  virtual bool reads_home_rows() const = 0;
  // token_combine_backward, after the agreement: the gradient of the expert outputs,
  // [num_rows, H] zero on padding rows, from grad_out [T, H] and `home_rows` (in home order,
  // the rows every expert rank must receive: grad_out, or round(prob * grad_out) when weighted).
  // expert_output: the combine's input, when weighted.
  virtual StatusOr<Tensor> grad_to_experts(World& world, const DispatchConfig& config,
                                           const ExchangeHandle& h, const TensorView& grad_out,
                                           const TensorView& expert_output,
                                           const Tensor& home_rows) = 0;
};

// The row-exchange dispatcher moving rows to the experts with `forward`. It checks the config,
// collectively like TokenDispatcher::create (which also checks), so that calling the factory
// directly is as safe.
StatusOr<std::unique_ptr<TokenDispatcher>> make_row_exchange_dispatcher(
    World& world, const DispatchConfig& config, std::unique_ptr<ForwardExchange> forward);

}  // namespace moed
