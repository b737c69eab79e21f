// gloo backend collectives, made of gloo sends and receives between every pair (the worlds
// here are small: a few to tens of ranks). Sizes are exchanged and checked on every rank
// first, so a bad size is the same error everywhere instead of a gloo size mismatch on one.
// Float sums are never gloo's reductions: contributions are gathered and added here in
// ascending rank order.
#include <algorithm>
#include <cstring>

#include "comm/gloo/gloo_world.h"
#include "comm/sum_rows.h"

namespace moed::gloo_comm {

Status GlooWorld::barrier() {
  MOED_RETURN_IF_ERROR(failure());
  ++counters_.collectives;
  const std::vector<int> ranks = all_ranks();
  const char mine = 1;
  std::vector<char> all(static_cast<size_t>(size_));
  return gather(ranks, next_slot(), &mine, 1, all.data(), "barrier");
}

Status GlooWorld::broadcast_bytes(void* data, size_t bytes, int root) {
  MOED_RETURN_IF_ERROR(failure());
  ++counters_.collectives;
  const uint64_t slot = next_slot();
  const std::vector<int> ranks = all_ranks();
  // Everyone's (root, bytes), so every rank can name the disagreement.
  const uint64_t mine[2] = {uint64_t(int64_t(root)), bytes};
  std::vector<uint64_t> all(2 * size_t(size_));
  MOED_RETURN_IF_ERROR(gather(ranks, slot, mine, sizeof(mine), all.data(), "broadcast"));
  for (int r = 0; r < size_; ++r) {
    if (all[2 * size_t(r)] != all[0]) {
      return invalid_argument("broadcast: rank ", r, " has root ", int64_t(all[2 * size_t(r)]),
                              ", rank 0 has ", int64_t(all[0]));
    }
  }
  if (root < 0 || root >= size_) {
    return invalid_argument("broadcast: root = ", root, " is outside [0, ", size_, ")");
  }
  const uint64_t root_bytes = all[2 * size_t(root) + 1];
  for (int r = 0; r < size_; ++r) {
    if (all[2 * size_t(r) + 1] != root_bytes) {
      return invalid_argument("broadcast: rank ", r, " expects ", all[2 * size_t(r) + 1],
                              " bytes, root ", root, " sends ", root_bytes);
    }
  }
  if (bytes == 0) return ok_status();
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
  return exchange(slot, sends, recvs, [&] { return str_cat("rank ", rank_, " in broadcast"); });
}

Status GlooWorld::all_gather_v_bytes(const void* send, size_t send_bytes, void* recv,
                                     std::span<const size_t> recv_bytes) {
  MOED_RETURN_IF_ERROR(failure());
  ++counters_.collectives;
  const uint64_t slot = next_slot();
  const std::vector<int> ranks = all_ranks();
  const uint64_t mine = send_bytes;
  std::vector<uint64_t> sizes(static_cast<size_t>(size_));
  MOED_RETURN_IF_ERROR(gather(ranks, slot, &mine, sizeof(mine), sizes.data(), "all_gather_v"));
  Status local;
  if (recv_bytes.size() != size_t(size_)) {
    local = invalid_argument("all_gather_v: rank ", rank_, " passed recv sizes of length ",
                             recv_bytes.size(), "; must be the world size ", size_);
  }
  for (int s = 0; s < size_ && local.ok(); ++s) {
    if (recv_bytes[size_t(s)] != sizes[size_t(s)]) {
      local = invalid_argument("all_gather_v: rank ", rank_, " expects ", recv_bytes[size_t(s)],
                               " bytes from rank ", s, ", which sends ", sizes[size_t(s)]);
    }
  }
  MOED_RETURN_IF_ERROR(agree_among(ranks, slot, local, "all_gather_v"));
  std::vector<Transfer> sends, recvs;
  char* out = static_cast<char*>(recv);
  size_t off = 0;
  for (int s = 0; s < size_; ++s) {
    const size_t n = sizes[size_t(s)];
    if (s == rank_) {
      if (n > 0) std::memmove(out + off, send, n);
    } else {
      if (n > 0) recvs.push_back({s, out + off, n});
      if (send_bytes > 0) sends.push_back({s, const_cast<void*>(send), send_bytes});
    }
    off += n;
  }
  MOED_RETURN_IF_ERROR(
      exchange(slot, sends, recvs, [&] { return str_cat("rank ", rank_, " in all_gather_v"); }));
  for (int d = 0; d < size_; ++d) count_send(d, send_bytes);
  return ok_status();
}

Status GlooWorld::all_to_all_v_bytes(const void* send, std::span<const size_t> send_bytes,
                                     std::span<const size_t> send_offsets, void* recv,
                                     std::span<const size_t> recv_bytes,
                                     std::span<const size_t> recv_offsets) {
  MOED_RETURN_IF_ERROR(failure());
  ++counters_.collectives;
  const uint64_t slot = next_slot();
  const std::vector<int> ranks = all_ranks();
  const size_t n = size_t(size_);
  Status local;
  auto length = [&](std::span<const size_t> s, const char* name) {
    if (local.ok() && s.size() != n) {
      local = invalid_argument("all_to_all_v: rank ", rank_, " passed ", name, " of length ",
                               s.size(), "; must be the world size ", n);
    }
  };
  length(send_bytes, "send sizes");
  length(send_offsets, "send offsets");
  length(recv_bytes, "recv sizes");
  length(recv_offsets, "recv offsets");
  // Every rank's send sizes (zeros where this rank's spans are malformed; the verdict below
  // carries that error): rank s's row says what it sends to each rank.
  std::vector<uint64_t> mine(n, 0), all(n * n);
  if (local.ok()) std::copy(send_bytes.begin(), send_bytes.end(), mine.begin());
  MOED_RETURN_IF_ERROR(gather(ranks, slot, mine.data(), n * sizeof(uint64_t), all.data(),
                              "all_to_all_v"));
  for (size_t s = 0; s < n && local.ok(); ++s) {
    const uint64_t sent = all[s * n + size_t(rank_)];
    if (recv_bytes[s] != sent) {
      local = invalid_argument("all_to_all_v: rank ", rank_, " expects ", recv_bytes[s],
                               " bytes from rank ", s, ", which sends ", sent);
    }
  }
  MOED_RETURN_IF_ERROR(agree_among(ranks, slot, local, "all_to_all_v"));
  std::vector<Transfer> sends, recvs;
  const char* in = static_cast<const char*>(send);
  char* out = static_cast<char*>(recv);
  for (size_t p = 0; p < n; ++p) {
    if (int(p) == rank_) {
      if (send_bytes[p] > 0) std::memmove(out + recv_offsets[p], in + send_offsets[p], send_bytes[p]);
      continue;
    }
    if (recv_bytes[p] > 0) recvs.push_back({int(p), out + recv_offsets[p], recv_bytes[p]});
    if (send_bytes[p] > 0)
      sends.push_back({int(p), const_cast<char*>(in + send_offsets[p]), send_bytes[p]});
  }
  MOED_RETURN_IF_ERROR(
      exchange(slot, sends, recvs, [&] { return str_cat("rank ", rank_, " in all_to_all_v"); }));
  for (int d = 0; d < size_; ++d) count_send(d, send_bytes[size_t(d)]);
  return ok_status();
}

Status GlooWorld::reduce_scatter_v_f32(const float* send, std::span<const size_t> counts,
                                       float* recv) {
  MOED_RETURN_IF_ERROR(failure());
  ++counters_.collectives;
  const uint64_t slot = next_slot();
  const std::vector<int> ranks = all_ranks();
  const size_t n = size_t(size_);
  Status local;
  if (counts.size() != n) {
    local = invalid_argument("reduce_scatter_v_f32: rank ", rank_, " passed ", counts.size(),
                             " counts; must be world size ", n);
  }
  std::vector<uint64_t> mine(n, 0), all(n * n);
  if (local.ok()) std::copy(counts.begin(), counts.end(), mine.begin());
  MOED_RETURN_IF_ERROR(gather(ranks, slot, mine.data(), n * sizeof(uint64_t), all.data(),
                              "reduce_scatter_v_f32"));
  MOED_RETURN_IF_ERROR(agree_among(ranks, slot, local, "reduce_scatter_v_f32"));
  for (size_t r = 0; r < n; ++r) {
    for (size_t d = 0; d < n; ++d) {
      if (all[r * n + d] != all[d]) {
        return invalid_argument("reduce_scatter_v_f32: rank ", r, " has counts[", d,
                                "] = ", all[r * n + d], ", rank 0 has ", all[d]);
      }
    }
  }
  // Block d of every rank goes to rank d; rank d adds the R blocks in rank order.
  const size_t mine_count = counts[size_t(rank_)];
  std::vector<float> blocks(mine_count * n);
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
  MOED_RETURN_IF_ERROR(exchange(slot, sends, recvs, [&] {
    return str_cat("rank ", rank_, " in reduce_scatter_v_f32");
  }));
  internal::sum_rows(pool(), blocks.data(), size_, mine_count, recv);
  for (int d = 0; d < size_; ++d) count_send(d, counts[size_t(d)] * sizeof(float));
  return ok_status();
}

Status GlooWorld::all_reduce_f32(const float* send, float* recv, size_t count) {
  MOED_RETURN_IF_ERROR(failure());
  ++counters_.collectives;
  const uint64_t slot = next_slot();
  const std::vector<int> ranks = all_ranks();
  const uint64_t mine = count;
  std::vector<uint64_t> counts(static_cast<size_t>(size_));
  MOED_RETURN_IF_ERROR(gather(ranks, slot, &mine, sizeof(mine), counts.data(), "all_reduce_f32"));
  for (int r = 0; r < size_; ++r) {
    if (counts[size_t(r)] != counts[0]) {
      return invalid_argument("all_reduce_f32: rank ", r, " has count ", counts[size_t(r)],
                              ", rank 0 has ", counts[0]);
    }
  }
  if (count == 0) return ok_status();
  // Gathering everything costs R times the data of a reduction tree, but fixes the order.
  std::vector<float> rows(count * size_t(size_));
  MOED_RETURN_IF_ERROR(gather(ranks, slot, send, count * sizeof(float), rows.data(),
                              "all_reduce_f32"));
  internal::sum_rows(pool(), rows.data(), size_, count, recv);
  for (int d = 0; d < size_; ++d) count_send(d, count * sizeof(float));
  return ok_status();
}

}  // namespace moed::gloo_comm
