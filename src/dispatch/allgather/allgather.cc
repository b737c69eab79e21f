#include "dispatch/allgather/allgather.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "dispatch/row_exchange.h"

namespace moed {

namespace {

// The AllGather handle also keeps how this rank picked its rows out of the gathered tokens,
// for the combine backward (which all-gathers grad_out and picks the same rows).
class AllGatherHandle final : public ExchangeHandle {
 public:
  PermuteLayout expert;                 // over the gathered tokens; sorted_indices are global
  std::vector<int64_t> source_offsets;  // [R + 1] first gathered token of each source
};

// all_gather_v of `rows[s]` rows of row_bytes each; a strided view is packed first.
Status gather_rows(World& w, const TensorView& mine, std::span<const int64_t> rows, void* recv) {
  Tensor packed;
  const void* send = mine.data;
  if (!mine.contiguous() && mine.rows > 0) {
    packed = Tensor::copy_of(mine);
    send = packed.data();
  }
  std::vector<size_t> bytes(rows.size());
  for (size_t s = 0; s < rows.size(); ++s) bytes[s] = size_t(rows[s]) * mine.row_bytes();
  return w.all_gather_v_bytes(send, size_t(mine.rows) * mine.row_bytes(), recv, bytes);
}

// Every source's effective routing (after dropping and router padding), sparse, in one
// all_gather_v: source s sends [entries of each token int32 x T_s][experts int32 x n_s]
// [probs f32 x n_s], where n_s = the sum of its counts (known to every rank already).
StatusOr<SparseRouting> gather_routing(World& w, const SparseRouting& mine, const GlobalCounts& c) {
  const int R = w.size(), E = mine.num_experts;
  std::vector<size_t> words(static_cast<size_t>(R));
  size_t total = 0;
  for (int s = 0; s < R; ++s) {
    int64_t n = 0;
    for (int e = 0; e < E; ++e) n += c.counts[size_t(s) * E + e];
    words[size_t(s)] = size_t(c.num_tokens[size_t(s)] + 2 * n);
    total += words[size_t(s)];
  }
  const int64_t T = mine.num_tokens(), n = mine.num_entries();
  std::vector<int32_t> send(size_t(T + 2 * n));
  for (int64_t t = 0; t < T; ++t)
    send[size_t(t)] = int32_t(mine.begin[size_t(t) + 1] - mine.begin[size_t(t)]);
  std::copy(mine.expert.begin(), mine.expert.end(), send.begin() + T);
  // NOTE: memcpy (float bits into the int32 message) only when there are entries: with none,
  // prob.data() may be null, which memcpy must not get even for 0 bytes (UBSan).
  if (n > 0) std::memcpy(send.data() + T + n, mine.prob.data(), size_t(n) * sizeof(float));
  std::vector<int32_t> recv(total);
  std::vector<size_t> bytes(words.size());
  for (size_t s = 0; s < words.size(); ++s) bytes[s] = words[s] * sizeof(int32_t);
  MOED_RETURN_IF_ERROR(
      w.all_gather_v_bytes(send.data(), send.size() * sizeof(int32_t), recv.data(), bytes));
  SparseRouting g;
  g.num_experts = E;
  g.num_topk = mine.num_topk;
  const int32_t* p = recv.data();
  for (int s = 0; s < R; ++s) {
    const int64_t Ts = c.num_tokens[size_t(s)];
    const size_t first = g.expert.size();
    for (int64_t t = 0; t < Ts; ++t) g.begin.push_back(g.begin.back() + p[t]);
    const size_t ns = size_t(g.begin.back()) - first;
    MOED_CHECK(words[size_t(s)] == size_t(Ts) + 2 * ns, "source ", s, " sent ", ns,
               " entries; its counts say ", (words[size_t(s)] - size_t(Ts)) / 2);
    g.expert.insert(g.expert.end(), p + Ts, p + Ts + ns);
    g.prob.resize(first + ns);
    if (ns > 0) std::memcpy(g.prob.data() + first, p + Ts + ns, ns * sizeof(float));
    p += words[size_t(s)];
  }
  return g;
}

// AllGather's move: every rank's tokens, routing and probs gathered; each rank permutes its
// experts' rows out of them. Its combine backward gathers grad_out and picks the same rows.
class AllGatherForward final : public ForwardExchange {
 public:
  DispatcherKind kind() const override { return DispatcherKind::kAllGather; }
  std::shared_ptr<ExchangeHandle> new_handle() const override {
    return std::make_shared<AllGatherHandle>();
  }
  bool reads_home_rows() const override { return false; }

  Status to_experts(World& w, const DispatchConfig& config, const GlobalCounts& counts,
                    const TokenRows& hidden, ExchangeHandle& handle,
                    const TokenRows& expert_input) override {
    auto& h = static_cast<AllGatherHandle&>(handle);
    h.source_offsets.assign(1, 0);
    for (int64_t t : counts.num_tokens) h.source_offsets.push_back(h.source_offsets.back() + t);
    const int64_t N = h.source_offsets.back();
    TokenRows gathered;
    gathered.x = gathered_x_.view(h.dtype, N, h.hidden);
    MOED_RETURN_IF_ERROR(gather_rows(w, hidden.x, counts.num_tokens, gathered.x.data));
    if (h.dtype == DType::kFP8) {
      gathered.scales = gathered_scales_.view(DType::kF32, N, h.hidden / kFp8BlockSize);
      MOED_RETURN_IF_ERROR(gather_rows(w, hidden.scales, counts.num_tokens, gathered.scales.data));
    }
    MOED_ASSIGN_OR_RETURN(const SparseRouting routing, gather_routing(w, h.routing, counts));
    const int first = first_local_expert(config, w.size(), w.rank());
    PermuteOptions o;
    o.expert_begin = first;
    o.expert_end = first + config.num_local_experts(w.size());
    o.expert_alignment = config.layout.expert_alignment;
    o.source_offsets = h.source_offsets;
    if (config.layout.pad_to_capacity) o.source_capacities = counts.capacity;
    MOED_ASSIGN_OR_RETURN(h.expert, make_permute_layout(routing, o, w.pool()));
    MOED_CHECK(h.expert.num_rows == h.num_rows, "gathered layout has ", h.expert.num_rows,
               " rows; the counts gave ", h.num_rows);
    MOED_RETURN_IF_ERROR(permute_rows_into(gathered, h.expert, expert_input, w.pool()));
    h.permuted_probs = h.expert.permuted_probs;
    h.row_src_rank.assign(size_t(h.num_rows), -1);
    h.row_src_token.assign(size_t(h.num_rows), -1);
    for (int64_t i = 0; i < h.num_rows; ++i) {
      const int32_t g = h.expert.sorted_indices[size_t(i)];
      if (g < 0) continue;
      const int s = int(std::upper_bound(h.source_offsets.begin(), h.source_offsets.end(), g) -
                        h.source_offsets.begin()) -
                    1;
      h.row_src_rank[size_t(i)] = s;
      h.row_src_token[size_t(i)] = int32_t(g - h.source_offsets[size_t(s)]);
    }
    return ok_status();
  }

  StatusOr<Tensor> grad_to_experts(World& w, const DispatchConfig& config,
                                   const ExchangeHandle& handle, const TensorView& grad_out,
                                   const TensorView& expert_output, const Tensor&) override {
    const auto& h = static_cast<const AllGatherHandle&>(handle);
    std::vector<int64_t> T(size_t(w.size()));
    for (size_t s = 0; s < T.size(); ++s) T[s] = h.source_offsets[s + 1] - h.source_offsets[s];
    const TensorView gathered = gathered_x_.view(grad_out.dtype, h.source_offsets.back(), h.hidden);
    MOED_RETURN_IF_ERROR(gather_rows(w, grad_out, T, gathered.data));
    const bool weighted = config.weighted_combine;
    MOED_ASSIGN_OR_RETURN(
        UnpermuteGrad rows,
        unpermute_backward(
            gathered, h.expert.sorted_indices,
            weighted ? std::span<const float>(h.expert.permuted_probs) : std::span<const float>(),
            weighted ? expert_output : TensorView(), w.pool()));
    return std::move(rows.grad_rows);
  }

 private:
  // Kept across calls (see ScratchBuffer).
  ScratchBuffer gathered_x_, gathered_scales_;
};

}  // namespace

StatusOr<std::unique_ptr<TokenDispatcher>> make_allgather_dispatcher(World& world,
                                                                     const DispatchConfig& config) {
  return make_row_exchange_dispatcher(world, config, std::make_unique<AllGatherForward>());
}

}  // namespace moed
