// gloo backend collectives, made of gloo sends and receives between every pair (the worlds
// here are small: a few to tens of ranks). Sizes are exchanged and checked on every rank
// first, so a bad size is the same error everywhere instead of a gloo size mismatch on one.
// Float sums are never gloo's reductions: contributions are gathered and added here in
// ascending rank order. When every rank is on this host, the data phases go through shared
// memory instead (host_stage, host_staging.cc); the size exchanges are host_gather rounds.
#include <algorithm>
#include <cstring>

#include "comm/backend.h"
#include "comm/gloo/gloo_world.h"
#include "comm/sum_rows.h"

namespace moed::gloo_comm {
namespace {

// How every collective but the barrier starts: the world's failure check and count, the
// call's slot, and every rank's `n` words (its sizes; rank r's at words[r * n]), so every rank
// can name a disagreement.
struct Call {
  uint64_t slot;
  std::vector<int> ranks;
  std::vector<uint64_t> words;
};
StatusOr<Call> start_call(GlooWorld& w, const uint64_t* mine, size_t n, const char* op) {
  MOED_RETURN_IF_ERROR(internal::start_collective(w, op));
  Call call{w.next_slot(), w.all_ranks(), std::vector<uint64_t>(n * size_t(w.size()))};
  MOED_RETURN_IF_ERROR(
      w.gather(call.ranks, call.slot, mine, n * sizeof(uint64_t), call.words.data(), op));
  return call;
}

}  // namespace

Status GlooWorld::barrier() {
  MOED_RETURN_IF_ERROR(internal::start_collective(*this, "barrier"));
  const std::vector<int> ranks = all_ranks();
  const char mine = 1;
  std::vector<char> all(static_cast<size_t>(size_));
  return gather(ranks, next_slot(), &mine, 1, all.data(), "barrier");
}

Status GlooWorld::broadcast_bytes(void* data, size_t bytes, int root) {
  // Everyone's (root, bytes), so every rank can name the disagreement.
  const uint64_t mine[2] = {uint64_t(int64_t(root)), bytes};
  MOED_ASSIGN_OR_RETURN(const Call call, start_call(*this, mine, 2, "broadcast"));
  const std::vector<uint64_t>& all = call.words;
  MOED_RETURN_IF_ERROR(internal::check_broadcast(
      size_, root, [&](int r) { return int64_t(all[2 * size_t(r)]); },
      [&](int r) { return all[2 * size_t(r) + 1]; }));
  if (bytes == 0) return ok_status();
  if (host_staging()) {
    std::vector<uint64_t> staged(size_t(size_), 0);
    staged[size_t(root)] = bytes;
    const StageSource mine[1] = {{data, rank_ == root ? bytes : 0}};
    MOED_RETURN_IF_ERROR(host_stage(
        staged, mine, [&](int) { return std::vector<StageWant>{{0, data, bytes}}; },
        "broadcast"));
    if (rank_ == root) internal::count_send_to_all(*this, bytes);
    return ok_status();
  }
  std::vector<Transfer> sends, recvs;
  if (rank_ == root) {
    for (int d = 0; d < size_; ++d) {
      if (d == root) continue;
      sends.push_back({d, data, bytes});
      count_send(d, bytes);
    }
  } else {
    recvs.push_back({root, data, bytes});
  }
  return exchange(call.slot, sends, recvs,
                  [&] { return str_cat("rank ", rank_, " in broadcast"); });
}

Status GlooWorld::all_gather_v_bytes(const void* send, size_t send_bytes, void* recv,
                                     std::span<const size_t> recv_bytes) {
  const uint64_t mine = send_bytes;
  MOED_ASSIGN_OR_RETURN(const Call call, start_call(*this, &mine, 1, "all_gather_v"));
  const std::vector<uint64_t>& sizes = call.words;
  Status local = internal::check_all_gather_v(rank_, size_, recv_bytes,
                                              [&](int s) { return sizes[size_t(s)]; });
  MOED_RETURN_IF_ERROR(agree_among(call.ranks, call.slot, local, "all_gather_v"));
  char* out = static_cast<char*>(recv);
  std::vector<size_t> offsets(size_t(size_) + 1, 0);
  for (int s = 0; s < size_; ++s) offsets[size_t(s) + 1] = offsets[size_t(s)] + sizes[size_t(s)];
  if (host_staging() && host_ring(sizes)) {
    // The ring reads every block out of the receive buffers, this rank's own included.
    if (send_bytes > 0) std::memmove(out + offsets[size_t(rank_)], send, send_bytes);
    MOED_RETURN_IF_ERROR(host_ring_gather(sizes, out, offsets, "all_gather_v"));
    internal::count_send_to_all(*this, send_bytes);
    return ok_status();
  }
  if (host_staging()) {
    const StageSource mine[1] = {{send, send_bytes}};
    MOED_RETURN_IF_ERROR(host_stage(
        sizes, mine,
        [&](int r) {
          return std::vector<StageWant>{{0, out + offsets[size_t(r)], sizes[size_t(r)]}};
        },
        "all_gather_v"));
  } else {
    std::vector<Transfer> sends, recvs;
    for (int s = 0; s < size_; ++s) {
      if (s == rank_) continue;
      if (sizes[size_t(s)] > 0) recvs.push_back({s, out + offsets[size_t(s)], sizes[size_t(s)]});
      if (send_bytes > 0) sends.push_back({s, const_cast<void*>(send), send_bytes});
    }
    MOED_RETURN_IF_ERROR(exchange(call.slot, sends, recvs,
                                  [&] { return str_cat("rank ", rank_, " in all_gather_v"); }));
  }
  // After the others have read `send` (it may overlap this rank's part of recv).
  if (send_bytes > 0) std::memmove(out + offsets[size_t(rank_)], send, send_bytes);
  internal::count_send_to_all(*this, send_bytes);
  return ok_status();
}

Status GlooWorld::all_to_all_v_bytes(const void* send, std::span<const size_t> send_bytes,
                                     std::span<const size_t> send_offsets, void* recv,
                                     std::span<const size_t> recv_bytes,
                                     std::span<const size_t> recv_offsets) {
  const size_t n = size_t(size_);
  Status local = internal::check_exchange_lengths("all_to_all_v", rank_, n, send_bytes,
                                                  send_offsets, recv_bytes, recv_offsets);
  // Every rank's send sizes (zeros where this rank's spans are malformed; the verdict below
  // carries that error): rank s's row says what it sends to each rank.
  std::vector<uint64_t> mine(n, 0);
  if (local.ok()) std::copy(send_bytes.begin(), send_bytes.end(), mine.begin());
  MOED_ASSIGN_OR_RETURN(const Call call, start_call(*this, mine.data(), n, "all_to_all_v"));
  const std::vector<uint64_t>& all = call.words;
  if (local.ok()) {
    local = internal::check_recv_sizes(
        "all_to_all_v", rank_, size_, [&](int s) { return recv_bytes[size_t(s)]; },
        [&](int s) { return all[size_t(s) * n + size_t(rank_)]; });
  }
  MOED_RETURN_IF_ERROR(agree_among(call.ranks, call.slot, local, "all_to_all_v"));
  const char* in = static_cast<const char*>(send);
  char* out = static_cast<char*>(recv);
  const size_t me = size_t(rank_);
  if (send_bytes[me] > 0)
    std::memmove(out + recv_offsets[me], in + send_offsets[me], send_bytes[me]);
  if (host_staging()) {
    // Rank s stages its blocks for every other rank back to back, in rank order.
    std::vector<uint64_t> staged(n, 0);
    for (size_t s = 0; s < n; ++s)
      for (size_t p = 0; p < n; ++p) staged[s] += p == s ? 0 : all[s * n + p];
    std::vector<StageSource> mine;
    for (size_t p = 0; p < n; ++p) {
      if (p != me && send_bytes[p] > 0) mine.push_back({in + send_offsets[p], send_bytes[p]});
    }
    MOED_RETURN_IF_ERROR(host_stage(
        staged, mine,
        [&](int r) {
          const size_t s = size_t(r);
          size_t at = 0;
          for (size_t p = 0; p < me; ++p) at += p == s ? 0 : all[s * n + p];
          return std::vector<StageWant>{{at, out + recv_offsets[s], recv_bytes[s]}};
        },
        "all_to_all_v"));
    for (int d = 0; d < size_; ++d) count_send(d, send_bytes[size_t(d)]);
    return ok_status();
  }
  std::vector<Transfer> sends, recvs;
  for (size_t p = 0; p < n; ++p) {
    if (p == me) continue;
    if (recv_bytes[p] > 0) recvs.push_back({int(p), out + recv_offsets[p], recv_bytes[p]});
    if (send_bytes[p] > 0)
      sends.push_back({int(p), const_cast<char*>(in + send_offsets[p]), send_bytes[p]});
  }
  MOED_RETURN_IF_ERROR(exchange(call.slot, sends, recvs,
                                [&] { return str_cat("rank ", rank_, " in all_to_all_v"); }));
  for (int d = 0; d < size_; ++d) count_send(d, send_bytes[size_t(d)]);
  return ok_status();
}

Status GlooWorld::reduce_scatter_v_f32(const float* send, std::span<const size_t> counts,
                                       float* recv) {
  const size_t n = size_t(size_);
  Status local = internal::check_counts_length(rank_, counts.size(), n);
  std::vector<uint64_t> mine(n, 0);
  if (local.ok()) std::copy(counts.begin(), counts.end(), mine.begin());
  MOED_ASSIGN_OR_RETURN(const Call call, start_call(*this, mine.data(), n, "reduce_scatter_v_f32"));
  const std::vector<uint64_t>& all = call.words;
  MOED_RETURN_IF_ERROR(agree_among(call.ranks, call.slot, local, "reduce_scatter_v_f32"));
  for (size_t r = 0; r < n; ++r) {
    MOED_RETURN_IF_ERROR(internal::check_counts_match(r, all.data() + r * n, all.data(), n));
  }
  // Block d of every rank goes to rank d; rank d adds the R blocks in rank order.
  const size_t mine_count = counts[size_t(rank_)];
  std::vector<float> blocks(mine_count * n);
  if (host_staging()) {
    // Every rank stages its whole send; rank d reads block d of each.
    size_t total = 0, before = 0;
    for (size_t d = 0; d < n; ++d) {
      if (d < size_t(rank_)) before += counts[d];
      total += counts[d];
    }
    std::vector<uint64_t> staged(n, total * sizeof(float));
    std::copy(send + before, send + before + mine_count,
              blocks.data() + size_t(rank_) * mine_count);
    const StageSource mine[1] = {{send, total * sizeof(float)}};
    MOED_RETURN_IF_ERROR(host_stage(
        staged, mine,
        [&](int r) {
          return std::vector<StageWant>{{before * sizeof(float),
                                         blocks.data() + size_t(r) * mine_count,
                                         mine_count * sizeof(float)}};
        },
        "reduce_scatter_v_f32"));
    internal::sum_rows(pool(), blocks.data(), size_, mine_count, recv);
    for (int d = 0; d < size_; ++d) count_send(d, counts[size_t(d)] * sizeof(float));
    return ok_status();
  }
  std::vector<Transfer> sends, recvs;
  size_t off = 0;
  for (size_t d = 0; d < n; ++d) {
    const float* block = send + off;
    off += counts[d];
    if (int(d) == rank_) {
      std::copy(block, block + mine_count, blocks.data() + d * mine_count);
      recvs.reserve(n);
      continue;
    }
    if (counts[d] > 0) sends.push_back({int(d), const_cast<float*>(block), counts[d] * 4});
  }
  for (size_t s = 0; s < n && mine_count > 0; ++s) {
    if (int(s) != rank_) recvs.push_back({int(s), blocks.data() + s * mine_count, mine_count * 4});
  }
  MOED_RETURN_IF_ERROR(exchange(call.slot, sends, recvs, [&] {
    return str_cat("rank ", rank_, " in reduce_scatter_v_f32");
  }));
  internal::sum_rows(pool(), blocks.data(), size_, mine_count, recv);
  for (int d = 0; d < size_; ++d) count_send(d, counts[size_t(d)] * sizeof(float));
  return ok_status();
}

Status GlooWorld::all_reduce_f32(const float* send, float* recv, size_t count) {
  const uint64_t mine = count;
  MOED_ASSIGN_OR_RETURN(const Call call, start_call(*this, &mine, 1, "all_reduce_f32"));
  const std::vector<uint64_t>& counts = call.words;
  MOED_RETURN_IF_ERROR(internal::check_same_as_rank0("all_reduce_f32", "count", size_,
                                                     [&](int r) { return counts[size_t(r)]; }));
  if (count == 0) return ok_status();
  // Gathering everything costs R times the data of a reduction tree, but fixes the order.
  std::vector<float> rows(count * size_t(size_));
  if (host_staging()) {
    const size_t bytes = count * sizeof(float);
    std::memcpy(rows.data() + size_t(rank_) * count, send, bytes);
    const StageSource mine[1] = {{send, bytes}};
    MOED_RETURN_IF_ERROR(host_stage(
        std::vector<uint64_t>(size_t(size_), bytes), mine,
        [&](int r) { return std::vector<StageWant>{{0, rows.data() + size_t(r) * count, bytes}}; },
        "all_reduce_f32"));
  } else {
    MOED_RETURN_IF_ERROR(
        gather(call.ranks, call.slot, send, count * sizeof(float), rows.data(), "all_reduce_f32"));
  }
  internal::sum_rows(pool(), rows.data(), size_, count, recv);
  internal::count_send_to_all(*this, count * sizeof(float));
  return ok_status();
}

}  // namespace moed::gloo_comm
