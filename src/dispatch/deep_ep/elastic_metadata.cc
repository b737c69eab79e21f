// ElasticBuffer's handle metadata (elastic.h): V2's EPHandle fields from the engines' handles.
// The received tokens are listed in the order moed receives them (source rank ascending, then
// source token ascending: DeepEP's deterministic order), so recv_src_metadata's rows match
// recv_x's rows in the non-expanded layout.
#include <algorithm>
#include <tuple>

#include "dispatch/deep_ep/elastic.h"

namespace moed::deep_ep {

namespace {

int32_t align_up(int64_t n, int a) { return int32_t((n + a - 1) / a * a); }

// Inclusive prefix sums of counts per source rank, grouped by the source's scale-up index.
std::vector<int32_t> psum_by_scaleup(const std::vector<int64_t>& per_source, int scaleup) {
  std::vector<int32_t> out(size_t(scaleup), 0);
  for (size_t s = 0; s < per_source.size(); ++s) out[s % size_t(scaleup)] += int32_t(per_source[s]);
  for (int i = 1; i < scaleup; ++i) out[size_t(i)] += out[size_t(i) - 1];
  return out;
}

// The counts of the local experts: aligned list (with a CPU sync), prefix sums, real counts.
void fill_expert_counts(const ElasticCall& call, const std::vector<int64_t>& counts,
                        const std::vector<int64_t>& first_row, ElasticHandle& h) {
  const size_t L = counts.size();
  h.num_unaligned_recv_tokens_per_expert.assign(counts.begin(), counts.end());
  h.num_recv_tokens_per_expert_list.clear();
  h.psum_num_recv_tokens_per_expert.assign(L, 0);
  int64_t run = 0;
  for (size_t j = 0; j < L; ++j) {
    const int32_t aligned = align_up(counts[j], call.alignment);
    if (call.cpu_sync) h.num_recv_tokens_per_expert_list.push_back(aligned);
    run += aligned;
    // Non-expanded: the inclusive prefix of the aligned counts. Expanded: the expert's first
    // row plus its real count (DeepEP's convention, so psum[j] - align(psum[j-1]) is the count).
    h.psum_num_recv_tokens_per_expert[j] =
        int32_t(call.expand ? first_row[j] + counts[j] : run);
  }
}

}  // namespace

void fill_rank_major_metadata(const ElasticCall& call, int scaleup, const NormalHandle& nh,
                              std::span<const int64_t> recv_topk_idx, const TopkView& topk,
                              ElasticHandle& h) {
  const int R = nh.num_ranks, K = call.num_topk, L = call.num_experts / R;
  const int me = nh.world->rank();
  const int64_t n = nh.num_recv_tokens, M = call.max_tokens;
  h.num_recv_tokens = n;
  h.num_expanded_tokens = nh.num_rows;
  std::vector<int64_t> per_source(size_t(R), 0), counts(size_t(L), 0);
  h.recv_src_metadata.assign(size_t(n) * size_t(K + 2), -1);
  int64_t i = 0;
  for (int s = 0; s < R; ++s) {
    const int64_t end = nh.rank_prefix_matrix[size_t(s) * R + size_t(me)];
    per_source[size_t(s)] = end - nh.rank_begin(s, me);
    for (; i < end; ++i) {
      int32_t* meta = &h.recv_src_metadata[size_t(i) * size_t(K + 2)];
      meta[0] = int32_t(s * M + nh.recv_src_idx[size_t(i)]);
      int last = -1;
      for (int k = 0; k < K; ++k) {
        const int64_t l = recv_topk_idx[size_t(i) * K + k];
        if (l < 0) continue;
        last = k;
        ++counts[size_t(l)];
      }
      meta[1] = int32_t(s * K + last);
    }
  }
  h.psum_num_recv_tokens_per_scaleup_rank = psum_by_scaleup(per_source, scaleup);
  fill_expert_counts(call, counts, {}, h);
  // Where each (token, slot) lands on its expert's rank: the rank's block of this source, the
  // channel's offset in it, the token's place in the channel (DeepEP's send_head).
  const int64_t T = nh.num_tokens;
  const int C = nh.num_channels;
  const std::vector<int64_t> bounds = flex::channel_bounds(T, C);
  h.dst_buffer_slot_idx.assign(size_t(T) * size_t(K), -1);
  int c = 0;
  for (int64_t t = 0; t < T; ++t) {
    while (t >= bounds[size_t(c) + 1]) ++c;
    for (int k = 0; k < K; ++k) {
      const int64_t e = topk.at(t, k);
      if (e < 0) continue;
      const int r = int(e / L);
      const int32_t start = c == 0 ? 0 : nh.channel_prefix_matrix[size_t(r) * C + size_t(c - 1)];
      h.dst_buffer_slot_idx[size_t(t) * K + k] =
          nh.rank_begin(me, r) + start + nh.send_head[size_t(t) * R + r];
    }
  }
}

void fill_expanded_metadata(const ElasticCall& call, int scaleup, const flex::FlexHandle& fh,
                            ElasticHandle& h) {
  const flex::Topology& topo = fh.topo;
  const int R = topo.num_ranks, K = call.num_topk, L = topo.num_local_experts;
  const int64_t M = call.max_tokens;
  // The received tokens: every real row's (source rank, token), once each, ascending.
  struct Row {
    int32_t src, token, slot;
    int64_t row;
  };
  std::vector<Row> rows;
  rows.reserve(size_t(fh.num_rows));
  for (int64_t r = 0; r < fh.num_rows; ++r) {
    if (fh.row_src_rank[size_t(r)] < 0) continue;
    rows.push_back({fh.row_src_rank[size_t(r)], fh.row_src_token[size_t(r)],
                    fh.row_src_slot[size_t(r)], r});
  }
  std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
    return std::tie(a.src, a.token, a.slot) < std::tie(b.src, b.token, b.slot);
  });
  std::vector<int64_t> per_source(size_t(R), 0);
  h.recv_src_metadata.clear();
  for (size_t i = 0; i < rows.size();) {
    const size_t first = h.recv_src_metadata.size();
    h.recv_src_metadata.resize(first + size_t(K + 2), -1);
    int32_t* meta = &h.recv_src_metadata[first];
    const Row& lead = rows[i];
    meta[0] = int32_t(lead.src * M + lead.token);
    int last = -1;
    for (; i < rows.size() && rows[i].src == lead.src && rows[i].token == lead.token; ++i) {
      if (rows[i].slot < 0 || rows[i].slot >= K) continue;
      meta[2 + rows[i].slot] = int32_t(rows[i].row);
      last = std::max(last, rows[i].slot);
    }
    meta[1] = int32_t(lead.src * K + last);
    ++per_source[size_t(lead.src)];
  }
  h.num_recv_tokens = int64_t(h.recv_src_metadata.size()) / (K + 2);
  h.num_expanded_tokens = fh.num_rows;
  h.psum_num_recv_tokens_per_scaleup_rank = psum_by_scaleup(per_source, scaleup);
  const ExpertLayout& mine = fh.notified.mine;
  std::vector<int64_t> counts(fh.tokens_per_expert_unpadded.begin(),
                              fh.tokens_per_expert_unpadded.end());
  std::vector<int64_t> first_row(mine.segment_offset.begin(), mine.segment_offset.begin() + L);
  fill_expert_counts(call, counts, first_row, h);
  // Where each (token, slot) lands: its expert's chunk of this source, in token order.
  const SparseRouting& routing = fh.routing;
  const int64_t T = routing.num_tokens();
  h.dst_buffer_slot_idx.assign(size_t(T) * size_t(K), -1);
  std::vector<int64_t> run(size_t(topo.num_experts), 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = routing.begin[size_t(t)]; k < routing.begin[size_t(t) + 1]; ++k) {
      const int e = routing.expert[size_t(k)];
      const int64_t row = fh.notified.send_chunk[size_t(e)] + run[size_t(e)]++;
      const int slot = routing.slot.empty() ? -1 : routing.slot[size_t(k)];
      if (slot >= 0 && slot < K) h.dst_buffer_slot_idx[size_t(t) * K + slot] = int32_t(row);
    }
  }
}

}  // namespace moed::deep_ep
