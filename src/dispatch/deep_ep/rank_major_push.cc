// The rank-major dispatch's data movement (rank_major_dispatch.cc makes the handle): every
// channel writes its tokens' rows straight into each receiving rank's block on this node, and
// sends one message per remote node to the forwarder there, which places them on its node.
#include <algorithm>
#include <cstring>
#include <optional>

#include "comm/tags.h"
#include "core/row_kernels.h"
#include "dispatch/deep_ep/rank_major.h"

namespace moed::deep_ep {

namespace {

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
  bool plan;  // the source index travels too (uncached mode); the top-k when num_topk > 0
  // Blocks of kStreamThresholdBytes and up take their rows with non-temporal stores: each
  // worker writes through its own copier(), finished before the receivers are told.
  bool stream;
  internal::RowCopier copier() const { return {lay->row_bytes, stream}; }
  // The top-k row comes from `topk` (token t), or from a message's entries from q.
  void write(internal::RowCopier& copier, const RecvTarget& to, int64_t row, int r,
             const void* payload, const void* scales, const int32_t src_token, const TopkView* topk,
             int64_t t, const flex::Message<const char>* msg, size_t q) const {
    char* block = to.block;
    char* dst = to.rows + size_t(row) * to.rows_stride;
    copier.copy(dst, payload);
    if (lay->scale_bytes) {
      std::memcpy(block + lay->scales_off + size_t(row) * lay->scale_bytes, scales,
                  lay->scale_bytes);
    }
    if (plan) reinterpret_cast<int32_t*>(block + lay->src_idx_off)[row] = src_token;
    const int K = lay->num_topk;
    auto* idx = reinterpret_cast<int64_t*>(block + lay->topk_idx_off) + size_t(row) * K;
    auto* w = reinterpret_cast<float*>(block + lay->weights_off) + size_t(row) * K;
    const int64_t lo = int64_t(r) * L;
    for (int k = 0; k < K; ++k) {
      int64_t e = 0;
      float wt = 0.0f;
      if (topk) {
        e = topk->at(t, k);
        wt = topk->weight(t, k);
      } else {
        const flex::MessageEntry en = msg->entry(q + size_t(k));
        e = en.expert;
        wt = en.prob;
      }
      const bool local = e >= lo && e < lo + L;
      idx[k] = local ? e - lo : -1;
      w[k] = local ? wt : 0.0f;
    }
  }
};

// One push, phase by phase (rm_push runs them in order).
struct RmPush {
  NormalBuffer::State& s;
  NormalHandle& h;
  const TokenRows& x;
  const TopkView& topk;
  const bool plan;  // the source indices and the forwarder plans travel too
  const RmSendPlan send;
  const RecvLayout lay;
  const RowWriter writer;
  std::vector<RecvTarget> target;  // [G] this node's receive blocks
  std::vector<flex::Bytes> recv_buf;  // [N] per remote node, in s.dispatch_net
  std::vector<Request> recvs, sends;

  RmPush(NormalBuffer::State& st, NormalHandle& handle, const TokenRows& rows,
         const TopkView& routing, bool with_plan)
      : s(st),
        h(handle),
        x(rows),
        topk(routing),
        plan(with_plan),
        send(make_rm_send_plan(st.topo, handle, st.world->pool())),
        lay(RecvLayout::of(st.node_cap_rows(handle, handle.num_worst_tokens),
                           flex::dtype_row_bytes(rows.x.dtype, rows.x.cols),
                           flex::scale_row_bytes(rows.x.dtype, rows.x.cols), routing.num_topk,
                           st.topo.num_ranks, with_plan ? handle.num_channels : 0)),
        writer{&lay, rows.x.cols, st.num_experts / st.topo.num_ranks, with_plan,
               size_t(lay.cap_rows) * lay.row_bytes >= internal::kStreamThresholdBytes},
        target(size_t(st.topo.ranks_per_node)) {}

  char* own() const { return target[size_t(s.topo.local_rank)].block; }

  // The receive blocks of this node's ranks: this dispatch's slot of the ring, kept across
  // calls. A caller's recv_x buffer takes the rows: in the threads world the senders write it
  // (its address is published on the board with the block's); elsewhere it is filled from the
  // node-shared block at the end.
  Status open_targets(flex::PublishRound& round, const std::optional<TensorView>& out_rows) {
    flex::Region& recv = s.recv_ring.region(s.recv_slot);
    MOED_RETURN_IF_ERROR(recv.ensure(*s.world, lay.bytes));
    // No local rank holds an output of this slot, so nothing reads its buffer before growth.
    recv.release_retired();
    if (s.in_place) {
      RecvTarget mine{recv.local(), recv.local(), lay.row_bytes};
      if (out_rows) {
        mine.rows = static_cast<char*>(out_rows->data);
        mine.rows_stride = size_t(out_rows->row_stride) * dtype_size(x.x.dtype);
      }
      return flex::open_with_board(round, s.signals, s.topo.local_rank, mine, target);
    }
    for (int lr = 0; lr < s.topo.ranks_per_node; ++lr) {
      char* b = recv.peer(lr);
      target[size_t(lr)] = {b, b, lay.row_bytes};
    }
    return ok_status();
  }

  // Across nodes: the forwarder role's receives, then one message per remote node with every
  // token bound there (its header and K top-k entries, slot k, written by channel; its row and
  // scales gathered), and the channel prefix rows of the node's ranks as the tail.
  Status post_node_messages() {
    World& w = *s.world;
    const flex::Topology& topo = s.topo;
    const int R = topo.num_ranks, G = topo.ranks_per_node, N = topo.num_nodes;
    const int C = h.num_channels, K = lay.num_topk;
    auto layout_of = [&](int64_t n) {
      return rm_message(n, lay.row_bytes, lay.scale_bytes, K, G, C);
    };
    MOED_RETURN_IF_ERROR(flex::post_node_recvs(
        w, topo, s.dispatch_net, tags::kRankMajorDispatch,
        [&](int m) {
          const int64_t n = h.forward_tokens[size_t(m)];
          return n == 0 ? 0 : layout_of(n).bytes;
        },
        recv_buf, recvs));
    flex::NodeMessages out(topo, s.dispatch_net, {&send.node_tokens[size_t(C) * N], size_t(N)},
                           [&](int m) { return layout_of(send.node_tokens[size_t(C) * N + m]); });
    std::vector<int32_t> cpm(size_t(G) * C);
    for (int m = 0; m < N; ++m) {
      if (!out.sends_to(m)) continue;
      for (int lr = 0; lr < G; ++lr) {
        for (int c = 0; c < C; ++c) cpm[size_t(lr) * C + c] = channel_start(h, m * G + lr, c);
      }
      // NOTE: the message's sections are packed, so the tail may be unaligned.
      std::memcpy(out.at(m).tail(), cpm.data(), cpm.size() * sizeof(int32_t));
    }
    w.pool().parallel_for(C, [&](int64_t cb, int64_t ce, int) {
      std::vector<int64_t> pos(static_cast<size_t>(N));
      for (int64_t c = cb; c < ce; ++c) {
        for (int m = 0; m < N; ++m) pos[size_t(m)] = send.node_tokens[size_t(c) * N + m];
        for (int64_t t = send.channel_begin[size_t(c)]; t < send.channel_begin[size_t(c) + 1];
             ++t) {
          const uint8_t* in = &h.is_token_in_rank[size_t(t) * R];
          for (int m = 0; m < N; ++m) {
            if (m == topo.node) continue;
            uint64_t mask = 0;
            for (int lr = 0; lr < G; ++lr) mask |= uint64_t(in[m * G + lr] != 0) << lr;
            if (mask == 0) continue;
            const size_t i = size_t(pos[size_t(m)]++);
            const flex::Message<char> msg = out.at(m);
            msg.put_header(i, {int32_t(t), K, mask, {}});
            for (int k = 0; k < K; ++k) {
              msg.put_entry(i * K + size_t(k), {int32_t(topk.at(t, k)), topk.weight(t, k), k});
            }
            out.set_row(m, i, x, t);
          }
        }
      }
    });
    return out.send(w, tags::kRankMajorDispatch, sends);
  }

  // Inside the node: every channel writes its tokens' rows into the receivers' blocks.
  // Returns the rows written.
  uint64_t write_in_node() {
    World& w = *s.world;
    const flex::Topology& topo = s.topo;
    const int R = topo.num_ranks, G = topo.ranks_per_node, C = h.num_channels;
    std::vector<uint64_t> written(size_t(C), 0);
    w.pool().parallel_for(C, [&](int64_t cb, int64_t ce, int) {
      std::vector<int64_t> row(static_cast<size_t>(G));
      internal::RowCopier copier = writer.copier();
      for (int64_t c = cb; c < ce; ++c) {
        for (int lr = 0; lr < G; ++lr) {
          const int r = topo.node * G + lr;
          row[size_t(lr)] = h.rank_begin(topo.rank, r) + channel_start(h, r, int(c));
        }
        uint64_t n = 0;
        for (int64_t t = send.channel_begin[size_t(c)]; t < send.channel_begin[size_t(c) + 1];
             ++t) {
          const uint8_t* in = &h.is_token_in_rank[size_t(t) * R + size_t(topo.node) * G];
          const void* sc = lay.scale_bytes ? x.scales.row_ptr(t) : nullptr;
          for (int lr = 0; lr < G; ++lr) {
            if (!in[lr]) continue;
            writer.write(copier, target[size_t(lr)], row[size_t(lr)]++, topo.node * G + lr,
                         x.x.row_ptr(t), sc, int32_t(t), &topk, t, nullptr, 0);
            ++n;
          }
        }
        written[size_t(c)] = n;
      }
      copier.finish();
    });
    uint64_t rows = 0;
    for (uint64_t n : written) rows += n;
    return rows;
  }

  // Receive channel prefix rows: written by the sender (or its forwarder) when it sends the
  // receiver anything, else by the receiver itself, so each row has one writer.
  void write_channel_prefixes() {
    const flex::Topology& topo = s.topo;
    const int R = topo.num_ranks, G = topo.ranks_per_node, C = h.num_channels;
    for (int lr = 0; lr < G; ++lr) {
      const int r = topo.node * G + lr;
      if (count_to(h, topo.rank, r) == 0) continue;
      auto* rcpm = reinterpret_cast<int32_t*>(target[size_t(lr)].block + lay.rcpm_off) +
                   size_t(topo.rank) * C;
      for (int c = 0; c < C; ++c) rcpm[c] = channel_start(h, r, c);
    }
    auto* rcpm = reinterpret_cast<int32_t*>(own() + lay.rcpm_off);
    for (int src = 0; src < R; ++src) {
      if (count_to(h, src, topo.rank) == 0)
        std::fill(rcpm + size_t(src) * C, rcpm + size_t(src + 1) * C, 0);
    }
  }

  // The forwarder role: places the rows other nodes' sources sent for this node. Returns the
  // rows placed.
  StatusOr<uint64_t> place_forwarded() {
    World& w = *s.world;
    const flex::Topology& topo = s.topo;
    const int R = topo.num_ranks, G = topo.ranks_per_node, N = topo.num_nodes;
    const int C = h.num_channels, K = lay.num_topk;
    MOED_RETURN_IF_ERROR(wait_all(recvs));
    uint64_t rows = 0;
    for (int m = 0; m < N; ++m) {
      const int64_t n = h.forward_tokens[size_t(m)];
      if (m == topo.node || n == 0) continue;
      const int src = topo.forwarder_on(m);
      const flex::Message<const char> msg(recv_buf[size_t(m)].data(),
                                          rm_message(n, lay.row_bytes, lay.scale_bytes, K, G, C));
      std::vector<int32_t> src_token(static_cast<size_t>(n));
      std::vector<uint64_t> mask(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        const flex::MessageHeader hd = msg.header(size_t(i));
        MOED_CHECK(hd.num_entries == K, "forwarded token ", hd.src_token, " from rank ", src,
                   " has ", hd.num_entries, " top-k entries, expected ", K);
        src_token[size_t(i)] = hd.src_token;
        mask[size_t(i)] = hd.rank_mask;
      }
      w.pool().parallel_for(G, [&](int64_t b, int64_t e, int) {
        internal::RowCopier copier = writer.copier();
        for (int64_t lr = b; lr < e; ++lr) {
          const int r = topo.node * G + int(lr);
          int64_t row = h.rank_begin(src, r);
          for (int64_t i = 0; i < n; ++i) {
            if (!((mask[size_t(i)] >> lr) & 1)) continue;
            writer.write(copier, target[size_t(lr)], row++, r, msg.payload(size_t(i)),
                         msg.scales(size_t(i)), src_token[size_t(i)], nullptr, 0, &msg,
                         size_t(i) * K);
          }
          MOED_CHECK(row == h.rank_prefix_matrix[size_t(src) * R + r], "forwarded rows of rank ",
                     src, " for rank ", r, " do not fill its block");
          if (plan && count_to(h, src, r) > 0) {
            auto* rcpm = reinterpret_cast<int32_t*>(target[size_t(lr)].block + lay.rcpm_off) +
                         size_t(src) * C;
            std::memcpy(rcpm, msg.tail() + size_t(lr) * C * 4, size_t(C) * 4);
          }
        }
        copier.finish();
      });
      for (uint64_t mk : mask) rows += uint64_t(popcount64(mk));
      if (plan) {
        h.forward_src_token[size_t(m)] = std::move(src_token);
        h.forward_mask[size_t(m)] = std::move(mask);
      }
    }
    MOED_RETURN_IF_ERROR(wait_all(sends));
    return rows;
  }

  // num_worst_tokens: the rows past the received ones are zero (-1 for indices).
  void zero_worst_rows() {
    if (h.num_rows <= h.num_recv_tokens) return;
    const int K = lay.num_topk;
    const RecvTarget& own_rows = target[size_t(s.topo.local_rank)];
    char* o = own();
    const size_t lo = size_t(h.num_recv_tokens), n = size_t(h.num_rows) - lo;
    for (size_t i = lo; i < lo + n; ++i)
      std::memset(own_rows.rows + i * own_rows.rows_stride, 0, lay.row_bytes);
    if (lay.scale_bytes)
      std::memset(o + lay.scales_off + lo * lay.scale_bytes, 0, n * lay.scale_bytes);
    if (plan) std::memset(o + lay.src_idx_off + lo * 4, 0xff, n * 4);
    std::memset(o + lay.topk_idx_off + lo * size_t(K) * 8, 0xff, n * size_t(K) * 8);
    std::memset(o + lay.weights_off + lo * size_t(K) * 4, 0, n * size_t(K) * 4);
  }

  // The output's views of this rank's block (or the caller's recv_x), and the plan's arrays.
  NormalDispatchOutput output(const std::optional<TensorView>& out_rows) {
    const DType dt = x.x.dtype;
    const int64_t H = x.x.cols, nr = h.num_rows;
    const int K = lay.num_topk;
    char* o = own();
    NormalDispatchOutput out;
    if (out_rows) {
      if (!s.in_place) {  // MPI world: the rows are in the node-shared block
        for (int64_t i = 0; i < nr; ++i)
          std::memcpy(out_rows->row_ptr(i), o + size_t(i) * lay.row_bytes, lay.row_bytes);
      }
      out.recv_x.x = *out_rows;
    } else {
      out.recv_x.x = TensorView(o, dt, nr, H);
    }
    if (dt == DType::kFP8) {
      out.recv_x.scales = TensorView(o + lay.scales_off, DType::kF32, nr, H / kFp8BlockSize);
    }
    if (plan) {
      const auto* src_idx = reinterpret_cast<const int32_t*>(o + lay.src_idx_off);
      h.recv_src_idx.assign(src_idx, src_idx + nr);
      const auto* rcpm = reinterpret_cast<const int32_t*>(o + lay.rcpm_off);
      h.recv_channel_prefix_matrix.assign(rcpm, rcpm + size_t(s.topo.num_ranks) * h.num_channels);
    }
    if (K > 0) {
      out.recv_topk_idx = {reinterpret_cast<const int64_t*>(o + lay.topk_idx_off), size_t(nr) * K};
      out.recv_topk_weights = {reinterpret_cast<const float*>(o + lay.weights_off), size_t(nr) * K};
    }
    out.storage = s.recv_ring.hold(s.recv_slot);
    return out;
  }
};

}  // namespace

StatusOr<NormalDispatchOutput> rm_push(NormalBuffer::State& s, NormalHandle& h, const TokenRows& x,
                                       const TopkView& topk, bool with_plan,
                                       const std::optional<TensorView>& out_rows) {
  World& w = *s.world;
  RmPush push(s, h, x, topk, with_plan);
  // NOTE: in place, the senders write this rank's block and the caller's recv_x, so the call
  // returns only once they are done, whichever way it ends (PublishRound).
  flex::PublishRound round(w, s.signals, s.epoch, s.in_place, flex::PublishRound::Role::kWrites);
  MOED_RETURN_IF_ERROR(push.open_targets(round, out_rows));
  const bool nodes = s.topo.num_nodes > 1;
  if (nodes) MOED_RETURN_IF_ERROR(push.post_node_messages());
  uint64_t rows = push.write_in_node();
  if (with_plan) push.write_channel_prefixes();
  if (nodes) {
    MOED_ASSIGN_OR_RETURN(const uint64_t forwarded, push.place_forwarded());
    rows += forwarded;
  }
  const RecvLayout& lay = push.lay;
  const size_t row_total =
      lay.row_bytes + lay.scale_bytes + (with_plan ? 4 : 0) + size_t(lay.num_topk) * 12;
  w.add_shared_bytes(rows * row_total, rows);
  push.zero_worst_rows();
  MOED_RETURN_IF_ERROR(round.close());
  return push.output(out_rows);
}

}  // namespace moed::deep_ep
