// The rank-major dispatch (DeepEP's normal mode, moed/deep_ep.h). One all-gather of the
// layout counts (skipped in cached mode) gives every rank the rank prefix matrix, so each
// sender knows where its rows start on every receiver; each channel (a worker owning a token
// range) knows its offset inside that block from its own channel prefix matrix, so every row
// is written once, straight into its final place, with no sort. Tokens for another node go
// over the network once per node, to the rank with the sender's local index, which writes
// them into each receiving rank of its node (rows of one source arrive in token order through
// one forwarder, so a running count per receiver is the row).
#include <algorithm>
#include <cstring>

#include "dispatch/flex/rank_major.h"
#include "dispatch/out_buffer.h"

namespace moed::deep_ep {

namespace {

constexpr int kTagDispatch = 0x4d20;
constexpr size_t kPrefix = 8;      // slots of the first exchange before E
constexpr size_t kHeld = kPrefix + 1;  // then the receive ring's held mask (OutputRing)

Status check_x(const TokenRows& x) {
  if (x.x.rows < 0 || x.x.cols <= 0) {
    return invalid_argument("x is [", x.x.rows, ", ", x.x.cols, "]; hidden must be positive");
  }
  if (x.x.rows > 0 && x.x.data == nullptr) return invalid_argument("x.data is null");
  if (x.x.row_stride < x.x.cols)
    return invalid_argument("x row_stride = ", x.x.row_stride, " < hidden = ", x.x.cols);
  if (x.x.dtype == DType::kFP8) {
    if (x.x.cols % kFp8BlockSize != 0) {
      return invalid_argument("fp8 x hidden = ", x.x.cols, " is not a multiple of ", kFp8BlockSize);
    }
    if (x.scales.dtype != DType::kF32 || x.scales.rows != x.x.rows ||
        x.scales.cols != x.x.cols / kFp8BlockSize || (x.x.rows > 0 && x.scales.data == nullptr) ||
        x.scales.row_stride < x.scales.cols) {
      return invalid_argument("fp8 x scales must be f32 [", x.x.rows, ", ",
                              x.x.cols / kFp8BlockSize, "]; got ", dtype_name(x.scales.dtype), " [",
                              x.scales.rows, ", ", x.scales.cols, "]");
    }
  }
  return ok_status();
}

Status check_uncached(const NormalBuffer::State& s, const NormalDispatchInput& in) {
  MOED_RETURN_IF_ERROR(check_x(in.x));
  const int R = s.topo.num_ranks, E = s.num_experts, L = E / R;
  const int64_t T = in.x.x.rows;
  if (in.expert_alignment < 1)
    return invalid_argument("expert_alignment = ", in.expert_alignment, " must be >= 1");
  if (in.num_worst_tokens < 0)
    return invalid_argument("num_worst_tokens = ", in.num_worst_tokens, " must be >= 0");
  const LayoutView& l = in.layout;
  if (l.num_tokens_per_rank.size() != size_t(R))
    return invalid_argument("num_tokens_per_rank has ", l.num_tokens_per_rank.size(),
                            " entries; expected num_ranks = ", R);
  if (l.num_tokens_per_expert.size() != size_t(E))
    return invalid_argument("num_tokens_per_expert has ", l.num_tokens_per_expert.size(),
                            " entries; expected num_experts = ", E);
  if (l.is_token_in_rank.size() != size_t(T) * size_t(R))
    return invalid_argument("is_token_in_rank has ", l.is_token_in_rank.size(),
                            " entries; expected [", T, ", ", R, "]");
  std::vector<int64_t> per_rank(size_t(R), 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int r = 0; r < R; ++r) per_rank[size_t(r)] += l.is_token_in_rank[size_t(t) * R + r] != 0;
  }
  for (int r = 0; r < R; ++r) {
    if (per_rank[size_t(r)] != l.num_tokens_per_rank[size_t(r)]) {
      return invalid_argument("num_tokens_per_rank[", r, "] = ", l.num_tokens_per_rank[size_t(r)],
                              " but is_token_in_rank has ", per_rank[size_t(r)],
                              " tokens for rank ", r);
    }
  }
  for (int e = 0; e < E; ++e) {
    if (l.num_tokens_per_expert[size_t(e)] < 0)
      return invalid_argument("num_tokens_per_expert[", e,
                              "] = ", l.num_tokens_per_expert[size_t(e)], " is negative");
  }
  const TopkView& k = in.topk;
  if (k.num_topk < 0) return invalid_argument("num_topk = ", k.num_topk, " is negative");
  if (k.num_topk == 0) return ok_status();
  if (k.num_tokens != T)
    return invalid_argument("topk_idx has ", k.num_tokens, " rows but x has ", T);
  if (T > 0 && (k.idx == nullptr || k.weights == nullptr))
    return invalid_argument("topk_idx and topk_weights must be given together");
  std::vector<int64_t> per_expert(size_t(E), 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int j = 0; j < k.num_topk; ++j) {
      const int64_t e = k.at(t, j);
      if (e < -1 || e >= E)
        return invalid_argument("topk_idx[", t, "][", j, "] = ", e, " is outside [-1, ", E, ")");
      if (e < 0) continue;
      ++per_expert[size_t(e)];
      if (!l.is_token_in_rank[size_t(t) * R + size_t(e / L)]) {
        return invalid_argument("topk_idx[", t, "][", j, "] = ", e, " lives on rank ", e / L,
                                " but is_token_in_rank[", t, "][", e / L, "] is false");
      }
    }
  }
  for (int e = 0; e < E; ++e) {
    if (per_expert[size_t(e)] != l.num_tokens_per_expert[size_t(e)]) {
      return invalid_argument("num_tokens_per_expert[", e,
                              "] = ", l.num_tokens_per_expert[size_t(e)], " but topk_idx routes ",
                              per_expert[size_t(e)], " tokens to it");
    }
  }
  return ok_status();
}

Status check_cached(const NormalBuffer::State& s, const NormalDispatchInput& in) {
  const NormalHandle* h = in.handle.get();
  if (h == nullptr || h->buffer_id != s.id)
    return invalid_argument("handle was not made by a dispatch of this buffer");
  MOED_RETURN_IF_ERROR(check_x(in.x));
  if (in.x.x.rows != h->num_tokens || in.x.x.cols != h->hidden || in.x.x.dtype != h->dtype) {
    return invalid_argument("cached dispatch: x is ", dtype_name(in.x.x.dtype), " [", in.x.x.rows,
                            ", ", in.x.x.cols, "] but the handle's dispatch had ",
                            dtype_name(h->dtype), " [", h->num_tokens, ", ", h->hidden, "]");
  }
  if (in.topk.num_topk != 0)
    return invalid_argument("cached dispatch takes no topk_idx / topk_weights (as DeepEP)");
  return ok_status();
}

// Exclusive start of channel c of the home rank inside its rows on rank r.
inline int32_t channel_start(const NormalHandle& h, int r, int c) {
  return c == 0 ? 0 : h.channel_prefix_matrix[size_t(r) * h.num_channels + size_t(c - 1)];
}
inline int32_t count_to(const NormalHandle& h, int s, int r) {
  return h.rank_prefix_matrix[size_t(s) * h.num_ranks + r] - h.rank_begin(s, r);
}

// Where one receiving rank's rows go: its receive block (scales, metadata, and the rows unless
// `rows` points elsewhere: the caller's recv_x buffer), published to the senders.
struct RecvTarget {
  char* block = nullptr;
  char* rows = nullptr;
  size_t rows_stride = 0;  // bytes
};

struct RowWriter {
  const RecvLayout* lay;
  int64_t hidden;
  int L;
  bool meta;  // source index (and top-k when num_topk > 0)
  void write(const RecvTarget& to, int64_t row, int r, const void* payload, const void* scales,
             const int32_t src_token, const TopkView* topk, int64_t t, const int64_t* msg_idx,
             const float* msg_w) const {
    char* block = to.block;
    std::memcpy(to.rows + size_t(row) * to.rows_stride, payload, lay->row_bytes);
    if (lay->scale_bytes) {
      std::memcpy(block + lay->scales_off + size_t(row) * lay->scale_bytes, scales,
                  lay->scale_bytes);
    }
    if (!meta) return;
    reinterpret_cast<int32_t*>(block + lay->src_idx_off)[row] = src_token;
    const int K = lay->num_topk;
    auto* idx = reinterpret_cast<int64_t*>(block + lay->topk_idx_off) + size_t(row) * K;
    auto* w = reinterpret_cast<float*>(block + lay->weights_off) + size_t(row) * K;
    const int64_t lo = int64_t(r) * L;
    for (int k = 0; k < K; ++k) {
      // NOTE: a network message packs its entries without padding, so read them unaligned.
      int64_t e = 0;
      float wt = 0.0f;
      if (topk) {
        e = topk->at(t, k);
        wt = topk->weights[size_t(t) * K + k];
      } else {
        std::memcpy(&e, msg_idx + k, sizeof(e));
        std::memcpy(&wt, msg_w + k, sizeof(wt));
      }
      const bool local = e >= lo && e < lo + L;
      idx[k] = local ? e - lo : -1;
      w[k] = local ? wt : 0.0f;
    }
  }
};

// Builds the handle from the gathered counts (the same tables on every rank).
StatusOr<std::shared_ptr<NormalHandle>> make_handle(NormalBuffer::State& s,
                                                    const NormalDispatchInput& in,
                                                    const std::vector<int64_t>& all, size_t width,
                                                    std::vector<int32_t>* expert_list) {
  const flex::Topology& topo = s.topo;
  const int R = topo.num_ranks, E = s.num_experts, L = E / R, N = topo.num_nodes;
  const int C = s.num_channels, me = topo.rank;
  auto h = std::make_shared<NormalHandle>();
  h->buffer_id = s.id;
  h->num_ranks = R;
  h->num_channels = C;
  h->num_experts = E;
  h->num_tokens = in.x.x.rows;
  h->hidden = int(in.x.x.cols);
  h->dtype = in.x.x.dtype;
  h->rank_prefix_matrix.resize(size_t(R) * R);
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < R; ++j) {
      h->rank_prefix_matrix[size_t(i) * R + j] =
          int32_t((i > 0 ? h->rank_prefix_matrix[size_t(i - 1) * R + j] : 0) +
                  all[size_t(i) * width + size_t(j)]);
    }
  }
  const int64_t worst = in.num_worst_tokens;
  if (worst > 0) {
    for (int r = 0; r < R; ++r) {
      const int64_t got = h->rank_prefix_matrix[size_t(R - 1) * R + r];
      if (got > worst) {
        return invalid_argument("num_worst_tokens = ", worst, " is smaller than the ", got,
                                " tokens rank ", r, " receives");
      }
    }
  }
  h->num_recv_tokens = h->rank_prefix_matrix[size_t(R - 1) * R + me];
  h->num_rows = worst > 0 ? worst : h->num_recv_tokens;
  h->num_worst_tokens = worst;
  if (worst == 0) {
    const int64_t a = in.expert_alignment;
    expert_list->assign(size_t(L), 0);
    for (int j = 0; j < L; ++j) {
      int64_t n = 0;
      for (int src = 0; src < R; ++src) n += all[size_t(src) * width + R + size_t(me) * L + j];
      (*expert_list)[size_t(j)] = int32_t((n + a - 1) / a * a);
    }
  }
  const int64_t T = h->num_tokens;
  h->is_token_in_rank.assign(in.layout.is_token_in_rank.begin(), in.layout.is_token_in_rank.end());
  for (uint8_t& b : h->is_token_in_rank) b = b != 0;
  h->send_head.assign(size_t(T) * R, -1);
  std::vector<int32_t> per_channel(size_t(R) * C, 0);
  s.world->pool().parallel_for(C, [&](int64_t cb, int64_t ce, int) {
    for (int64_t c = cb; c < ce; ++c) {
      int64_t b, e;
      ThreadPool::split(T, C, int(c), &b, &e);
      std::vector<int32_t> n(size_t(R), 0);
      for (int64_t t = b; t < e; ++t) {
        for (int r = 0; r < R; ++r) {
          if (h->is_token_in_rank[size_t(t) * R + r])
            h->send_head[size_t(t) * R + r] = n[size_t(r)]++;
        }
      }
      for (int r = 0; r < R; ++r) per_channel[size_t(r) * C + size_t(c)] = n[size_t(r)];
    }
  });
  h->channel_prefix_matrix.resize(size_t(R) * C);
  for (int r = 0; r < R; ++r) {
    int32_t acc = 0;
    for (int c = 0; c < C; ++c) {
      acc += per_channel[size_t(r) * C + c];
      h->channel_prefix_matrix[size_t(r) * C + c] = acc;
    }
  }
  h->forward_tokens.assign(size_t(N), 0);
  for (int m = 0; m < N; ++m) {
    if (m == topo.node) continue;
    const int src = topo.forwarder_on(m);
    h->forward_tokens[size_t(m)] = all[size_t(src) * width + R + E + size_t(topo.node)];
  }
  h->forward_src_token.resize(size_t(N));
  h->forward_mask.resize(size_t(N));
  return h;
}

// The data movement, for both modes. `meta`: top-k, source indices and the receive channel
// prefix matrix travel too (uncached mode); then the forwarder plans are stored in h.
StatusOr<NormalDispatchOutput> push(NormalBuffer::State& s, NormalHandle& h, const TokenRows& x,
                                    const TopkView& topk, bool meta,
                                    const std::optional<TensorView>& out_rows) {
  World& w = *s.world;
  const flex::Topology& topo = s.topo;
  const int R = topo.num_ranks, G = topo.ranks_per_node, N = topo.num_nodes, C = h.num_channels;
  const int me = topo.rank, L = s.num_experts / R;
  const int64_t H = h.hidden;
  const int64_t worst = h.num_worst_tokens;
  const RmSendPlan plan = make_rm_send_plan(topo, h, w.pool());
  const RecvLayout lay =
      RecvLayout::of(s.node_cap_rows(h, worst), flex::dtype_row_bytes(h.dtype, H),
                     flex::scale_row_bytes(h.dtype, H), meta ? topk.num_topk : 0, R, meta ? C : 0);
  const int K = lay.num_topk;

  // The receive blocks of this node's ranks. A caller's recv_x buffer takes the rows: in the
  // threads world the senders write it (its address is published with the block's); in the
  // MPI world it is filled from the node-shared block at the end.
  std::shared_ptr<Tensor> block;
  std::vector<RecvTarget> target(static_cast<size_t>(G));
  if (s.in_place) {
    block = std::make_shared<Tensor>(Tensor::empty(DType::kFP8, 1, int64_t(lay.bytes)));
    RecvTarget mine{static_cast<char*>(block->data()), static_cast<char*>(block->data()),
                    lay.row_bytes};
    if (out_rows) {
      mine.rows = static_cast<char*>(out_rows->data);
      mine.rows_stride = size_t(out_rows->row_stride) * dtype_size(h.dtype);
    }
    static_assert(sizeof(RecvTarget) <= 64, "the signal board holds one RecvTarget per rank");
    std::memcpy(s.signals.board(topo.local_rank), &mine, sizeof(mine));
    MOED_RETURN_IF_ERROR(s.sync_round());
    for (int lr = 0; lr < G; ++lr)
      std::memcpy(&target[size_t(lr)], s.signals.board(lr), sizeof(RecvTarget));
  } else {
    flex::Region& recv = s.recv_ring.region(s.recv_slot);
    MOED_RETURN_IF_ERROR(recv.ensure(w, lay.bytes));
    // No local rank holds an output of this slot, so nothing reads its buffer before growth.
    recv.release_retired();
    for (int lr = 0; lr < G; ++lr) {
      char* b = recv.peer(lr);
      target[size_t(lr)] = {b, b, lay.row_bytes};
    }
  }
  char* own = target[size_t(topo.local_rank)].block;
  const RecvTarget& own_rows = target[size_t(topo.local_rank)];
  const RowWriter writer{&lay, H, L, meta};

  // Network: the forwarder role's receives, then one message per remote node.
  std::vector<std::vector<char>> recv_buf(static_cast<size_t>(N)), send_buf(static_cast<size_t>(N));
  std::vector<Request> recvs, sends;
  const RmMessage none;
  std::vector<RmMessage> out_msg(size_t(N), none);
  if (N > 1) {
    for (int m = 0; m < N; ++m) {
      const int64_t n = h.forward_tokens[size_t(m)];
      if (m == topo.node || n == 0) continue;
      recv_buf[size_t(m)].resize(RmMessage::of(n, lay.row_bytes, lay.scale_bytes, K, G, C).bytes);
      MOED_ASSIGN_OR_RETURN(Request r,
                            w.irecv(topo.forwarder_on(m), kTagDispatch, recv_buf[size_t(m)].data(),
                                    recv_buf[size_t(m)].size()));
      recvs.push_back(std::move(r));
    }
    for (int m = 0; m < N; ++m) {
      const int64_t n = plan.node_tokens[size_t(C) * N + m];
      if (m == topo.node || n == 0) continue;
      out_msg[size_t(m)] = RmMessage::of(n, lay.row_bytes, lay.scale_bytes, K, G, C);
      send_buf[size_t(m)].resize(out_msg[size_t(m)].bytes);
      auto* cpm =
          reinterpret_cast<int32_t*>(send_buf[size_t(m)].data() + out_msg[size_t(m)].cpm_off);
      for (int lr = 0; lr < G; ++lr) {
        for (int c = 0; c < C; ++c) cpm[size_t(lr) * C + c] = channel_start(h, m * G + lr, c);
      }
    }
    w.pool().parallel_for(C, [&](int64_t cb, int64_t ce, int) {
      std::vector<int64_t> pos(static_cast<size_t>(N));
      for (int64_t c = cb; c < ce; ++c) {
        for (int m = 0; m < N; ++m) pos[size_t(m)] = plan.node_tokens[size_t(c) * N + m];
        for (int64_t t = plan.channel_begin[size_t(c)]; t < plan.channel_begin[size_t(c) + 1];
             ++t) {
          const uint8_t* in = &h.is_token_in_rank[size_t(t) * R];
          for (int m = 0; m < N; ++m) {
            if (m == topo.node) continue;
            uint64_t mask = 0;
            for (int lr = 0; lr < G; ++lr) mask |= uint64_t(in[m * G + lr] != 0) << lr;
            if (mask == 0) continue;
            const RmMessage& ml = out_msg[size_t(m)];
            char* msg = send_buf[size_t(m)].data();
            const size_t i = size_t(pos[size_t(m)]++);
            const RmHeader hd{int32_t(t), 0, mask};
            std::memcpy(msg + i * sizeof(RmHeader), &hd, sizeof(hd));
            std::memcpy(msg + ml.rows_off + i * lay.row_bytes, x.x.row_ptr(t), lay.row_bytes);
            if (lay.scale_bytes) {
              std::memcpy(msg + ml.scales_off + i * lay.scale_bytes, x.scales.row_ptr(t),
                          lay.scale_bytes);
            }
            for (int k = 0; k < K; ++k) {
              const int64_t e = topk.at(t, k);
              std::memcpy(msg + ml.idx_off + (i * K + k) * 8, &e, 8);
              std::memcpy(msg + ml.weights_off + (i * K + k) * 4, &topk.weights[size_t(t) * K + k],
                          4);
            }
          }
        }
      }
    });
    for (int m = 0; m < N; ++m) {
      if (send_buf[size_t(m)].empty()) continue;
      MOED_ASSIGN_OR_RETURN(Request r,
                            w.isend(topo.forwarder_on(m), kTagDispatch, send_buf[size_t(m)].data(),
                                    send_buf[size_t(m)].size()));
      w.add_network_bytes(0, uint64_t(plan.node_tokens[size_t(C) * N + m]));
      sends.push_back(std::move(r));
    }
  }

  // Inside the node: every channel writes its tokens' rows into the receivers' blocks.
  std::vector<uint64_t> written(size_t(C), 0);
  w.pool().parallel_for(C, [&](int64_t cb, int64_t ce, int) {
    std::vector<int64_t> row(static_cast<size_t>(G));
    for (int64_t c = cb; c < ce; ++c) {
      for (int lr = 0; lr < G; ++lr) {
        const int r = topo.node * G + lr;
        row[size_t(lr)] = h.rank_begin(me, r) + channel_start(h, r, int(c));
      }
      uint64_t n = 0;
      for (int64_t t = plan.channel_begin[size_t(c)]; t < plan.channel_begin[size_t(c) + 1]; ++t) {
        const uint8_t* in = &h.is_token_in_rank[size_t(t) * R + size_t(topo.node) * G];
        const void* sc = lay.scale_bytes ? x.scales.row_ptr(t) : nullptr;
        for (int lr = 0; lr < G; ++lr) {
          if (!in[lr]) continue;
          writer.write(target[size_t(lr)], row[size_t(lr)]++, topo.node * G + lr, x.x.row_ptr(t),
                       sc, int32_t(t), &topk, t, nullptr, nullptr);
          ++n;
        }
      }
      written[size_t(c)] = n;
    }
  });
  uint64_t rows = 0;
  for (uint64_t n : written) rows += n;
  const size_t row_total = lay.row_bytes + lay.scale_bytes + (meta ? 4 + size_t(K) * 12 : 0);
  if (meta) {
    // Receive channel prefix rows: written by the sender (or its forwarder) when it sends the
    // receiver anything, else by the receiver itself, so each row has one writer.
    for (int lr = 0; lr < G; ++lr) {
      const int r = topo.node * G + lr;
      if (count_to(h, me, r) == 0) continue;
      auto* rcpm =
          reinterpret_cast<int32_t*>(target[size_t(lr)].block + lay.rcpm_off) + size_t(me) * C;
      for (int c = 0; c < C; ++c) rcpm[c] = channel_start(h, r, c);
    }
    auto* rcpm = reinterpret_cast<int32_t*>(own + lay.rcpm_off);
    for (int src = 0; src < R; ++src) {
      if (count_to(h, src, me) == 0)
        std::fill(rcpm + size_t(src) * C, rcpm + size_t(src + 1) * C, 0);
    }
  }

  // The forwarder role: place the rows other nodes' sources sent for this node.
  if (N > 1) {
    MOED_RETURN_IF_ERROR(wait_all(recvs));
    for (int m = 0; m < N; ++m) {
      const int64_t n = h.forward_tokens[size_t(m)];
      if (m == topo.node || n == 0) continue;
      const int src = topo.forwarder_on(m);
      const char* msg = recv_buf[size_t(m)].data();
      const RmMessage ml = RmMessage::of(n, lay.row_bytes, lay.scale_bytes, K, G, C);
      std::vector<int32_t> src_token(static_cast<size_t>(n));
      std::vector<uint64_t> mask(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        RmHeader hd;
        std::memcpy(&hd, msg + size_t(i) * sizeof(RmHeader), sizeof(hd));
        src_token[size_t(i)] = hd.src_token;
        mask[size_t(i)] = hd.rank_mask;
      }
      w.pool().parallel_for(G, [&](int64_t b, int64_t e, int) {
        for (int64_t lr = b; lr < e; ++lr) {
          const int r = topo.node * G + int(lr);
          int64_t row = h.rank_begin(src, r);
          for (int64_t i = 0; i < n; ++i) {
            if (!((mask[size_t(i)] >> lr) & 1)) continue;
            writer.write(
                target[size_t(lr)], row++, r, msg + ml.rows_off + size_t(i) * lay.row_bytes,
                lay.scale_bytes ? msg + ml.scales_off + size_t(i) * lay.scale_bytes : nullptr,
                src_token[size_t(i)], nullptr, 0,
                reinterpret_cast<const int64_t*>(msg + ml.idx_off) + size_t(i) * K,
                reinterpret_cast<const float*>(msg + ml.weights_off) + size_t(i) * K);
          }
          MOED_CHECK(row == h.rank_prefix_matrix[size_t(src) * R + r], "forwarded rows of rank ",
                     src, " for rank ", r, " do not fill its block");
          if (meta && count_to(h, src, r) > 0) {
            auto* rcpm = reinterpret_cast<int32_t*>(target[size_t(lr)].block + lay.rcpm_off) +
                         size_t(src) * C;
            std::memcpy(rcpm, msg + ml.cpm_off + size_t(lr) * C * 4, size_t(C) * 4);
          }
        }
      });
      uint64_t q = 0;
      for (uint64_t mk : mask) q += uint64_t(popcount64(mk));
      rows += q;
      if (meta) {
        h.forward_src_token[size_t(m)] = std::move(src_token);
        h.forward_mask[size_t(m)] = std::move(mask);
      }
    }
    MOED_RETURN_IF_ERROR(wait_all(sends));
  }
  w.add_shared_bytes(rows * row_total, rows);

  // num_worst_tokens: the rows past the received ones are zero (-1 for indices).
  if (h.num_rows > h.num_recv_tokens) {
    const size_t lo = size_t(h.num_recv_tokens), n = size_t(h.num_rows) - lo;
    for (size_t i = lo; i < lo + n; ++i)
      std::memset(own_rows.rows + i * own_rows.rows_stride, 0, lay.row_bytes);
    if (lay.scale_bytes)
      std::memset(own + lay.scales_off + lo * lay.scale_bytes, 0, n * lay.scale_bytes);
    if (meta) {
      std::memset(own + lay.src_idx_off + lo * 4, 0xff, n * 4);
      std::memset(own + lay.topk_idx_off + lo * size_t(K) * 8, 0xff, n * size_t(K) * 8);
      std::memset(own + lay.weights_off + lo * size_t(K) * 4, 0, n * size_t(K) * 4);
    }
  }
  MOED_RETURN_IF_ERROR(s.sync_round());

  NormalDispatchOutput out;
  const int64_t nr = h.num_rows;
  if (out_rows) {
    if (!s.in_place) {  // MPI world: the rows are in the node-shared block
      for (int64_t i = 0; i < nr; ++i)
        std::memcpy(out_rows->row_ptr(i), own + size_t(i) * lay.row_bytes, lay.row_bytes);
    }
    out.recv_x.x = *out_rows;
  } else {
    out.recv_x.x = TensorView(own, h.dtype, nr, H);
  }
  if (h.dtype == DType::kFP8) {
    out.recv_x.scales = TensorView(own + lay.scales_off, DType::kF32, nr, H / kFp8BlockSize);
  }
  if (meta) {
    const auto* src_idx = reinterpret_cast<const int32_t*>(own + lay.src_idx_off);
    h.recv_src_idx.assign(src_idx, src_idx + nr);
    const auto* rcpm = reinterpret_cast<const int32_t*>(own + lay.rcpm_off);
    h.recv_channel_prefix_matrix.assign(rcpm, rcpm + size_t(R) * C);
    if (K > 0) {
      out.recv_topk_idx = {reinterpret_cast<const int64_t*>(own + lay.topk_idx_off),
                           size_t(nr) * K};
      out.recv_topk_weights = {reinterpret_cast<const float*>(own + lay.weights_off),
                               size_t(nr) * K};
    }
  }
  out.storage = s.in_place ? std::shared_ptr<void>(block) : s.recv_ring.hold(s.recv_slot);
  return out;
}

// NormalDispatchInput::out: the rows must be known before the count exchange.
Status check_out_rows(const NormalDispatchInput& in) {
  const int64_t rows = in.handle ? in.handle->num_rows : in.num_worst_tokens;
  if (rows <= 0 && !in.handle) {
    return invalid_argument(
        "out needs num_worst_tokens > 0 or a cached handle (num_worst_tokens = ",
        in.num_worst_tokens,
        "): without them recv_x's rows are known only after the count exchange");
  }
  return moed::internal::check_out_buffer("out", *in.out, rows, in.x.x.cols, in.x.x.dtype, "x");
}

}  // namespace

StatusOr<NormalDispatchOutput> rm_dispatch(NormalBuffer::State& s, const NormalDispatchInput& in) {
  World& w = *s.world;
  const int R = s.topo.num_ranks, N = s.topo.num_nodes;
  const bool cached = in.handle != nullptr;
  // E of this call: the layout's (or the handle's); checked against the other ranks below.
  s.num_experts = cached ? (in.handle ? in.handle->num_experts : 0)
                         : int(in.layout.num_tokens_per_expert.size());
  const int E = s.num_experts;
  // First exchange, fixed size, so it works whatever a bad input looks like: [bad, cached, T,
  // H, dtype, K, alignment, worst, E]. Cached mode stops here (no count exchange).
  Status local = in.caller_error;
  if (local.ok() && !cached && (E <= 0 || E % R != 0))
    local =
        invalid_argument("num_tokens_per_expert has ", E,
                         " entries; num_experts must be a positive multiple of the ", R, " ranks");
  if (local.ok()) local = cached ? check_cached(s, in) : check_uncached(s, in);
  if (local.ok() && in.out) local = check_out_rows(in);
  std::vector<int64_t> mine(kHeld + 1, 0);
  mine[0] = local.ok() ? 0 : 1;
  mine[1] = cached ? 1 : 0;
  if (local.ok() && !cached) {
    mine[2] = in.x.x.rows;
    mine[3] = in.x.x.cols;
    mine[4] = int64_t(in.x.x.dtype);
    mine[5] = in.topk.num_topk;
    mine[6] = in.expert_alignment;
    mine[7] = in.num_worst_tokens;
    mine[8] = E;
  }
  if (!s.in_place) mine[kHeld] = int64_t(s.recv_ring.held_mask());
  const size_t fixed = kHeld + 1;
  MOED_ASSIGN_OR_RETURN(std::vector<int64_t> head,
                        all_gather<int64_t>(w, std::span<const int64_t>(mine)));
  bool any_bad = false;
  for (int r = 0; r < R; ++r) any_bad |= head[size_t(r) * fixed] != 0;
  if (any_bad) {
    MOED_RETURN_IF_ERROR(w.agree(local));
    return internal_error("rank-major dispatch: a rank reported bad input but agree passed");
  }
  for (int r = 1; r < R; ++r) {
    if (head[size_t(r) * fixed + 1] != head[1]) {
      return invalid_argument("handle is ", head[1] ? "given" : "not given", " on rank 0 but ",
                              head[size_t(r) * fixed + 1] ? "given" : "not given", " on rank ", r,
                              "; cached dispatch must be used by every rank");
    }
  }
  if (!s.in_place) {
    MOED_ASSIGN_OR_RETURN(
        s.recv_slot,
        s.recv_ring.pick(s.topo, [&](int r) { return uint64_t(head[size_t(r) * fixed + kHeld]); },
                         "rank-major dispatch"));
  }
  if (cached) {
    // NOTE: the handle is shared with earlier outputs; the cached push writes no metadata
    // into it (meta = false), it only reads it.
    auto& h = const_cast<NormalHandle&>(*in.handle);
    return push(s, h, in.x, TopkView{}, /*meta=*/false, in.out);
  }
  static const char* kNames[] = {
      "",           "", "", "hidden", "x dtype", "num_topk", "expert_alignment", "num_worst_tokens",
      "num_experts"};
  for (int r = 1; r < R; ++r) {
    for (size_t i = 3; i < kHeld; ++i) {
      if (head[size_t(r) * fixed + i] != head[i]) {
        return invalid_argument(kNames[i], " = ", head[i], " on rank 0 but ",
                                head[size_t(r) * fixed + i], " on rank ", r);
      }
    }
  }
  // Second exchange, the counts: [per rank, per expert, per node] (DeepEP's notify).
  const size_t width = size_t(R) + size_t(E) + size_t(N);
  std::vector<int64_t> counts(width, 0);
  for (int r = 0; r < R; ++r) counts[size_t(r)] = in.layout.num_tokens_per_rank[size_t(r)];
  for (int e = 0; e < E; ++e) counts[R + size_t(e)] = in.layout.num_tokens_per_expert[size_t(e)];
  const int G = s.topo.ranks_per_node;
  for (int64_t t = 0; t < in.x.x.rows; ++t) {
    for (int m = 0; m < N; ++m) {
      bool any = false;
      for (int lr = 0; lr < G; ++lr)
        any |= in.layout.is_token_in_rank[size_t(t) * R + m * G + lr] != 0;
      counts[R + E + size_t(m)] += any;
    }
  }
  MOED_ASSIGN_OR_RETURN(std::vector<int64_t> all,
                        all_gather<int64_t>(w, std::span<const int64_t>(counts)));
  std::vector<int32_t> expert_list;
  MOED_ASSIGN_OR_RETURN(std::shared_ptr<NormalHandle> h,
                        make_handle(s, in, all, width, &expert_list));
  MOED_ASSIGN_OR_RETURN(NormalDispatchOutput out,
                        push(s, *h, in.x, in.topk, /*meta=*/true, in.out));
  out.num_recv_tokens_per_expert = std::move(expert_list);
  out.handle = std::move(h);
  return out;
}

}  // namespace moed::deep_ep
