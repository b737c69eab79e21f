// Flex phase 3, dispatch inside a node (design.md §5.3): every channel (a worker owning a
// contiguous token range) copies its tokens straight into their canonical rows in the
// receiving ranks' node-shared segments. The row of (token t, expert e) is the chunk offset
// from the rank prefix matrix plus the channel's prefix plus a running count, so channels
// never collide and the expert-major order of design.md §3.1 needs no sort and no staging copy.
#include <cstring>

#include "dispatch/flex/engines.h"

namespace moed::flex {

void RowWriter::write(char* segment, int64_t row, const void* payload, const void* scales,
                      float prob, int32_t src_rank, int32_t src_token, int32_t src_slot) {
  const PushLayout& l = spec_.layout;
  char* dst = segment + size_t(row) * l.row_bytes;
  if (spec_.scale_by_prob) {
    internal::row_kernels().scale(dst, payload, spec_.rows.x.dtype, prob,
                                  size_t(spec_.rows.x.cols));
  } else {
    copier_.copy(dst, payload);
  }
  if (l.scale_bytes) {
    std::memcpy(segment + l.scales_off + size_t(row) * l.scale_bytes, scales, l.scale_bytes);
  }
  if (l.meta) {
    reinterpret_cast<float*>(segment + l.prob_off)[row] = prob;
    reinterpret_cast<int32_t*>(segment + l.src_rank_off)[row] = src_rank;
    reinterpret_cast<int32_t*>(segment + l.src_token_off)[row] = src_token;
    reinterpret_cast<int32_t*>(segment + l.src_slot_off)[row] = src_slot;
  }
}

void push_local(const DispatchContext& ctx, const PushSpec& spec) {
  const FlexHandle& h = *ctx.handle;
  const Topology& topo = h.topo;
  const SendPlan& plan = h.send;
  const int E = topo.num_experts, P = topo.etp_size;
  const int C = plan.num_channels;
  const PushLayout& l = spec.layout;
  const size_t row_total = l.row_bytes + l.scale_bytes + (l.meta ? PushLayout::kMetaBytes : 0);
  const bool slots = !h.routing.slot.empty();
  std::vector<uint64_t> rows_written(size_t(C), 0);
  ctx.world->pool().parallel_for(C, [&](int64_t cb, int64_t ce, int) {
    std::vector<int64_t> run(static_cast<size_t>(E));
    RowWriter writer(spec);
    for (int64_t c = cb; c < ce; ++c) {
      std::copy(plan.expert_prefix.begin() + c * E, plan.expert_prefix.begin() + (c + 1) * E,
                run.begin());
      uint64_t written = 0;
      for (int64_t t = plan.channel_begin[size_t(c)]; t < plan.channel_begin[size_t(c) + 1]; ++t) {
        const void* payload = spec.rows.x.row_ptr(t);
        const void* scales = l.scale_bytes ? spec.rows.scales.row_ptr(t) : nullptr;
        for (int64_t k = h.routing.begin[size_t(t)]; k < h.routing.begin[size_t(t) + 1]; ++k) {
          const int e = h.routing.expert[size_t(k)];
          const int64_t row = h.notified.send_chunk[size_t(e)] + run[size_t(e)]++;
          if (topo.node_of_expert(e) != topo.node) continue;  // the forwarder places it
          const float prob = h.routing.prob[size_t(k)];
          const int32_t slot = slots ? h.routing.slot[size_t(k)] : -1;
          for (int p = 0; p < P; ++p) {
            const int lr = (topo.first_rank_of_expert(e) + p) % topo.ranks_per_node;
            writer.write(spec.target->peer(lr), row, payload, scales, prob, topo.rank,
                         int32_t(t), slot);
            ++written;
          }
        }
      }
      rows_written[size_t(c)] = written;
    }
    writer.finish();  // before the owners are signalled
  });
  uint64_t rows = 0;
  for (uint64_t r : rows_written) rows += r;
  ctx.world->add_shared_bytes(rows * row_total, rows);
}

void zero_padding_rows(const DispatchContext& ctx, const PushSpec& spec) {
  const FlexHandle& h = *ctx.handle;
  const ExpertLayout& my = h.notified.mine;
  const PushLayout& l = spec.layout;
  // Padding ranges: the tail of each (expert, source) chunk, the alignment tail of each
  // segment, and the num_worst_tokens tail.
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int j = 0; j < my.num_local_experts; ++j) {
    int64_t end = my.segment_offset[size_t(j)];
    for (int s = 0; s < my.world_size; ++s) {
      if (my.rows(j, s) > my.tokens(j, s)) {
        ranges.emplace_back(my.offset(j, s) + my.tokens(j, s), my.offset(j, s) + my.rows(j, s));
      }
      end = my.offset(j, s) + my.rows(j, s);
    }
    if (my.segment_offset[size_t(j) + 1] > end)
      ranges.emplace_back(end, my.segment_offset[size_t(j) + 1]);
  }
  if (h.worst_rows > h.exact_rows) ranges.emplace_back(h.exact_rows, h.worst_rows);
  char* seg = spec.target->local();
  ctx.world->pool().parallel_for(int64_t(ranges.size()), [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) {
      const auto [lo, hi] = ranges[size_t(i)];
      const size_t n = size_t(hi - lo);
      std::memset(seg + size_t(lo) * l.row_bytes, 0, n * l.row_bytes);
      if (l.scale_bytes)
        std::memset(seg + l.scales_off + size_t(lo) * l.scale_bytes, 0, n * l.scale_bytes);
      if (l.meta) {
        std::memset(seg + l.prob_off + size_t(lo) * 4, 0, n * 4);
        std::memset(seg + l.src_rank_off + size_t(lo) * 4, 0xff, n * 4);  // -1
        std::memset(seg + l.src_token_off + size_t(lo) * 4, 0xff, n * 4);
        std::memset(seg + l.src_slot_off + size_t(lo) * 4, 0xff, n * 4);
      }
    }
  });
}

}  // namespace moed::flex
