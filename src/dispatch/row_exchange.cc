#include "dispatch/row_exchange.h"

#include <algorithm>
#include <utility>

#include "comm/agreement.h"

namespace moed {

std::vector<int64_t> prefix(std::span<const int64_t> n) {
  std::vector<int64_t> off(n.size() + 1, 0);
  for (size_t i = 0; i < n.size(); ++i) off[i + 1] = off[i] + n[i];
  return off;
}

namespace {

// all_to_all_v of whole rows: send_rows[d] rows at row send_offsets[d] go to rank d (offsets
// may repeat: the same rows to several ranks); rank s's rows land packed in rank order.
Status exchange_rows(World& world, const void* send, std::span<const int64_t> send_rows,
                     std::span<const int64_t> send_offsets, void* recv,
                     std::span<const int64_t> recv_rows, size_t row_bytes) {
  const size_t R = size_t(world.size());
  std::vector<size_t> sb(R), so(R), rb(R), ro(R);
  size_t r = 0;
  for (size_t i = 0; i < R; ++i) {
    sb[i] = size_t(send_rows[i]) * row_bytes;
    so[i] = size_t(send_offsets[i]) * row_bytes;
    rb[i] = size_t(recv_rows[i]) * row_bytes;
    ro[i] = r;
    r += rb[i];
  }
  return world.all_to_all_v_bytes(send, sb, so, recv, rb, ro);
}

}  // namespace

StatusOr<GlobalCounts> exchange_counts(World& world, const DispatchConfig& config,
                                       const Status& verdict, const PreparedInput& input) {
  const int R = world.size(), E = config.num_experts;
  const AgreedField fields[] = {{"hidden", input.hidden, AgreedField::kAgree},
                                {"dtype", int64_t(input.dtype), AgreedField::kAgreeDType},
                                {"num_topk", input.num_topk, AgreedField::kAgree}};
  // [counts[E], T, C_s, out rows]; zeros from a rank whose input failed (the table is not read).
  std::vector<int64_t> payload(size_t(E) + 3, 0);
  if (verdict.ok()) {
    std::copy(input.tokens_per_expert.begin(), input.tokens_per_expert.end(), payload.begin());
    payload[size_t(E)] = input.num_tokens;
    payload[size_t(E) + 1] = input.capacity;
    payload[size_t(E) + 2] = input.out_rows;
  }
  MOED_ASSIGN_OR_RETURN(AgreedTable all, agree_in_one(world, verdict, fields, payload));
  GlobalCounts c;
  c.counts.resize(size_t(R) * E);
  c.num_tokens.resize(size_t(R));
  c.capacity.resize(size_t(R));
  c.out_rows.resize(size_t(R));
  for (int s = 0; s < R; ++s) {
    const int64_t* row = all.payload(s);
    std::copy(row, row + E, c.counts.begin() + size_t(s) * E);
    c.num_tokens[size_t(s)] = row[E];
    c.capacity[size_t(s)] = row[E + 1];
    c.out_rows[size_t(s)] = row[E + 2];
  }
  return c;
}

StatusOr<RowExchangePlan> make_row_exchange_plan(const DispatchConfig& config, World& world,
                                                 const GlobalCounts& counts,
                                                 const SparseRouting& effective) {
  const int R = world.size(), L = config.num_local_experts(R), P = config.etp_size;
  RowExchangePlan plan;
  plan.world_size = R;
  plan.num_local_experts = L;
  plan.etp_size = P;
  plan.layout = compute_expert_layout(config, R, world.rank(), counts.view());
  plan.chunk_sizes.resize(size_t(R) * L);
  plan.chunk_order.resize(size_t(L) * R);
  plan.chunk_offsets.resize(size_t(L) * R);
  plan.rows_of_source.assign(size_t(R), 0);
  for (int j = 0; j < L; ++j) {
    for (int s = 0; s < R; ++s) {
      const int64_t n = plan.layout.tokens(j, s);
      plan.chunk_sizes[size_t(s) * L + j] = n;
      plan.chunk_order[size_t(j) * R + s] = s * L + j;
      plan.chunk_offsets[size_t(j) * R + s] = plan.layout.offset(j, s);
      plan.rows_of_source[size_t(s)] += n;
      plan.expert_rows += n;
    }
  }
  MOED_ASSIGN_OR_RETURN(plan.home, make_permute_layout(effective, PermuteOptions{}, world.pool()));
  plan.home_rows_of_rank.resize(size_t(R));
  plan.home_offset_of_rank.resize(size_t(R));
  for (int g = 0; g < R; ++g) {
    const int first = (g / P) * L;
    int64_t n = 0;
    for (int j = 0; j < L; ++j) n += plan.home.tokens_per_expert_unpadded[size_t(first + j)];
    plan.home_rows_of_rank[size_t(g)] = n;
    plan.home_offset_of_rank[size_t(g)] = plan.home.expert_offsets[size_t(first)];
  }
  return plan;
}

Status exchange_to_experts(World& world, const RowExchangePlan& plan, const void* send, void* recv,
                           size_t row_bytes) {
  return exchange_rows(world, send, plan.home_rows_of_rank, plan.home_offset_of_rank, recv,
                       plan.rows_of_source, row_bytes);
}

Status exchange_to_home(World& world, const RowExchangePlan& plan, const void* send, void* recv,
                        size_t row_bytes) {
  return exchange_rows(world, send, plan.rows_of_source, prefix(plan.rows_of_source), recv,
                       plan.home_rows_of_rank, row_bytes);
}

}  // namespace moed
