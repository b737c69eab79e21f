// The rank-major combine (DeepEP's normal-mode combine, moed/deep_ep.h): each home rank reads,
// for each of its tokens, the row of every rank that received it, in ascending rank order,
// at the place the dispatch wrote it (rank prefix + channel prefix + send_head), and sums them
// in fp32 after the biases: acc = bias_0 + bias_1, then acc += row_r, rounded once (DeepEP's
// order). Rows on another node come from the forwarder there (the rank with this rank's local
// index), which reads them from its node and sends one message per home rank. It sends the
// raw rows, not a node partial sum: a partial sum starting from 0 would change the order.
#include <algorithm>
#include <cstring>

#include "comm/agreement.h"
#include "comm/tags.h"
#include "core/row_checks.h"
#include "dispatch/deep_ep/rank_major.h"
#include "dispatch/ordered_fold.h"

namespace moed::deep_ep {

using moed::internal::check_float_rows;

namespace {

// One local rank's combine input, readable by the ranks of its node.
struct Source {
  const char* rows = nullptr;
  size_t row_stride_bytes = 0;
  const float* weights = nullptr;  // [rows, K] or null
};

// V2's order needs the dispatch's routing: every rank a token went to holds one of its slots.
Status check_order(const NormalHandle& h, const TopkView& topk) {
  if (topk.num_tokens != h.num_tokens)
    return invalid_argument("order_topk has ", topk.num_tokens, " rows; the handle's dispatch had ",
                            h.num_tokens, " tokens");
  return check_topk_in_layout(topk, h.is_token_in_rank, h.num_experts, h.num_ranks, true,
                              "order_topk", "the handle's is_token_in_rank");
}

Status check_combine(const NormalBuffer::State& s, const NormalCombineInput& in,
                     const Status& caller_error) {
  if (!caller_error.ok()) return caller_error;
  MOED_RETURN_IF_ERROR(s.check_handle(in.handle.get()));
  const NormalHandle* h = in.handle.get();
  const int64_t rows = in.x.rows == h->num_recv_tokens ? h->num_recv_tokens : h->num_rows;
  // Any hidden size (a cached dispatch may have moved rows of another width); the same on
  // every rank, which the combine's first collective checks.
  MOED_RETURN_IF_ERROR(check_float_rows("x", in.x, rows, in.x.cols));
  const int64_t H = in.x.cols;
  if (in.num_topk < 0 || (in.num_topk > 0 && rows > 0 && in.topk_weights == nullptr))
    return invalid_argument("topk_weights: num_topk = ", in.num_topk, " with ",
                            in.topk_weights ? "data" : "no data");
  for (const TensorView* b : {&in.bias_0, &in.bias_1}) {
    if (b->data == nullptr && b->rows == 0 && b->cols == 0) continue;
    MOED_RETURN_IF_ERROR(
        check_float_rows(b == &in.bias_0 ? "bias_0" : "bias_1", *b, h->num_tokens, H));
  }
  if (in.order_topk) MOED_RETURN_IF_ERROR(check_order(*h, *in.order_topk));
  if (in.out) {
    return moed::internal::check_out_buffer("out", *in.out, h->num_tokens, H, in.x.dtype, "x");
  }
  return ok_status();
}

bool has(const TensorView& b) { return !(b.data == nullptr && b.rows == 0 && b.cols == 0); }

// One combine call, phase by phase (rm_combine runs them in order).
struct RmCombine {
  NormalBuffer::State& s;
  const NormalCombineInput& in;
  const NormalHandle& h;
  const RmSendPlan plan;
  const DType dt;
  const int K, C;
  const int64_t H;
  const size_t row_bytes, wbytes, piece;  // piece: a row and its weights, as they travel
  std::vector<Source> src;                // [G] every local rank's rows
  std::vector<flex::Bytes> recv_buf, send_buf;  // [N] per remote node, in s.combine_net
  std::vector<Request> recvs, sends;

  RmCombine(NormalBuffer::State& st, const NormalCombineInput& input)
      : s(st),
        in(input),
        h(*input.handle),
        plan(make_rm_send_plan(st.topo, h, st.world->pool())),
        dt(input.x.dtype),
        K(input.num_topk),
        C(h.num_channels),
        H(input.x.cols),
        row_bytes(flex::dtype_row_bytes(dt, H)),
        wbytes(size_t(K) * 4),
        piece(row_bytes + wbytes),
        src(size_t(st.topo.ranks_per_node)),
        recv_buf(size_t(st.topo.num_nodes)),
        send_buf(size_t(st.topo.num_nodes)) {}

  // Publishes this rank's rows to its node (in place in the threads world, else copied into a
  // node-shared region), then learns every local rank's. A failure closes the round.
  Status publish(flex::PublishRound& round) {
    World& w = *s.world;
    const flex::Topology& topo = s.topo;
    const int R = topo.num_ranks, G = topo.ranks_per_node;
    if (s.in_place) {
      const Source me{static_cast<const char*>(in.x.data),
                      size_t(in.x.row_stride) * in.x.element_size(), in.topk_weights};
      return flex::open_with_board(round, s.signals, topo.local_rank, me, src);
    }
    int64_t cap = 0;
    for (int lr = 0; lr < G; ++lr) {
      cap = std::max<int64_t>(cap, h.rank_prefix_matrix[size_t(R - 1) * R + topo.node * G + lr]);
    }
    cap = std::max(cap, h.num_worst_tokens);
    const size_t woff = (size_t(cap) * row_bytes + 63) / 64 * 64;
    Status ensured = s.pull_region.ensure(w, std::max<size_t>(64, woff + size_t(cap) * wbytes));
    if (!ensured.ok()) return round.close(ensured);
    char* seg = s.pull_region.local();
    for (int64_t i = 0; i < in.x.rows; ++i)
      std::memcpy(seg + size_t(i) * row_bytes, in.x.row_ptr(i), row_bytes);
    if (K > 0 && in.x.rows > 0)
      std::memcpy(seg + woff, in.topk_weights, size_t(in.x.rows) * wbytes);
    w.add_shared_bytes(uint64_t(in.x.rows) * row_bytes, uint64_t(in.x.rows));
    Status opened = round.open();
    if (!opened.ok()) return round.close(opened);
    for (int lr = 0; lr < G; ++lr) {
      const char* p = s.pull_region.peer(lr);
      src[size_t(lr)] = {p, row_bytes, K > 0 ? reinterpret_cast<const float*>(p + woff) : nullptr};
    }
    return ok_status();
  }

  // Across nodes: the home role's receives (one per remote node), then the forwarder role's
  // message to each remote home: q weight rows (K floats each; first, so they stay aligned),
  // then the q rows, both in (token, rank ascending) order, the order the home reads them. The
  // rows go from where they lie (a gather list, World::isend_gather; the round keeps them until
  // the sends are done), the weights from this rank's buffer. Waits for the receives.
  Status exchange() {
    World& w = *s.world;
    const flex::Topology& topo = s.topo;
    const int G = topo.ranks_per_node, N = topo.num_nodes;
    MOED_RETURN_IF_ERROR(flex::post_node_recvs(
        w, topo, s.combine_net, tags::kRankMajorCombine,
        [&](int m) { return size_t(plan.node_pairs[size_t(C) * N + m]) * piece; }, recv_buf,
        recvs));
    std::vector<World::Piece> pieces;
    for (int m = 0; m < N; ++m) {
      const int64_t n = h.forward_tokens[size_t(m)];
      if (m == topo.node || n == 0) continue;
      const int home = topo.forwarder_on(m);
      const std::vector<uint64_t>& mask = h.forward_mask[size_t(m)];
      int64_t q = 0;
      for (uint64_t mk : mask) q += popcount64(mk);
      const flex::Bytes weights = send_buf[size_t(m)] = s.combine_net.send(m, size_t(q) * wbytes);
      std::vector<int64_t> row(static_cast<size_t>(G));
      for (int lr = 0; lr < G; ++lr) row[size_t(lr)] = h.rank_begin(home, topo.node * G + lr);
      pieces.clear();
      if (K > 0) flex::add_piece(pieces, weights.data(), weights.size());
      int64_t k = 0;
      for (size_t i = 0; i < mask.size(); ++i) {
        for (int lr = 0; lr < G; ++lr) {
          if (!((mask[i] >> lr) & 1)) continue;
          const Source& sr = src[size_t(lr)];
          const int64_t rw = row[size_t(lr)]++;
          flex::add_piece(pieces, sr.rows + size_t(rw) * sr.row_stride_bytes, row_bytes);
          if (K > 0)
            std::memcpy(weights.data() + size_t(k) * wbytes, sr.weights + size_t(rw) * K, wbytes);
          ++k;
        }
      }
      w.add_shared_bytes(uint64_t(q) * row_bytes, uint64_t(q));  // read from the node's ranks
      MOED_RETURN_IF_ERROR(
          flex::send_node_message(w, home, tags::kRankMajorCombine, pieces, uint64_t(q), sends));
    }
    return wait_all(recvs);
  }

  // The tokens of channels [cb, ce): DeepEP's order (the two biases, then the ranks
  // ascending) or V2's (each rank's row and weights, then the fold by the recipe). Returns
  // the rows read.
  uint64_t fold_channels(int64_t cb, int64_t ce, const TensorView& dst, float* weights_out) const {
    const flex::Topology& topo = s.topo;
    const int R = topo.num_ranks, G = topo.ranks_per_node, N = topo.num_nodes;
    const int L = h.num_experts / R;
    std::vector<float> acc(static_cast<size_t>(H));
    std::vector<int64_t> cursor(static_cast<size_t>(N));
    std::vector<const char*> rank_row(static_cast<size_t>(R));
    std::vector<const float*> rank_w(static_cast<size_t>(R));
    std::vector<int> last_slot(static_cast<size_t>(R));
    std::vector<OrderedTerm> terms;
    OrderedFold fold(dt, H);
    // Node m's message (exchange): q weight rows, then its q rows from here.
    std::vector<const char*> msg_rows(static_cast<size_t>(N));
    for (int m = 0; m < N; ++m) {
      const flex::Bytes& msg = recv_buf[size_t(m)];
      if (!msg.empty()) msg_rows[size_t(m)] = msg.data() + msg.size() / piece * wbytes;
    }
    uint64_t n = 0;
    for (int64_t c = cb; c < ce; ++c) {
      for (int m = 0; m < N; ++m) cursor[size_t(m)] = plan.node_pairs[size_t(c) * N + m];
      for (int64_t t = plan.channel_begin[size_t(c)]; t < plan.channel_begin[size_t(c) + 1];
           ++t) {
        if (has(in.bias_0)) {
          convert_row(in.bias_0.row_ptr(t), in.bias_0.dtype, acc.data(), DType::kF32, size_t(H));
        } else {
          std::fill(acc.begin(), acc.end(), 0.0f);
        }
        if (has(in.bias_1))
          accumulate_row_f32(acc.data(), in.bias_1.row_ptr(t), in.bias_1.dtype, size_t(H));
        float* wout = weights_out + size_t(t) * K;
        if (in.order_topk) std::fill(rank_row.begin(), rank_row.end(), nullptr);
        for (int r = 0; r < R; ++r) {
          const int32_t head = h.send_head[size_t(t) * R + r];
          if (head < 0) continue;
          const int m = r / G;
          const char* row;
          const float* wr = nullptr;
          if (m == topo.node) {
            const Source& sr = src[size_t(r % G)];
            const int64_t rw =
                h.rank_begin(topo.rank, r) +
                (c == 0 ? 0 : h.channel_prefix_matrix[size_t(r) * C + size_t(c - 1)]) + head;
            row = sr.rows + size_t(rw) * sr.row_stride_bytes;
            if (K > 0) wr = sr.weights + size_t(rw) * K;
          } else {
            const size_t i = size_t(cursor[size_t(m)]++);
            row = msg_rows[size_t(m)] + i * row_bytes;
            if (K > 0) wr = reinterpret_cast<const float*>(recv_buf[size_t(m)].data() + i * wbytes);
          }
          ++n;
          if (in.order_topk) {
            rank_row[size_t(r)] = row;
            rank_w[size_t(r)] = wr;
            continue;
          }
          accumulate_row_f32(acc.data(), row, dt, size_t(H));
          for (int k = 0; k < K; ++k) wout[k] = wout[k] + wr[k];
        }
        if (in.order_topk) {
          const TopkView& o = *in.order_topk;
          terms.clear();
          std::fill(last_slot.begin(), last_slot.end(), -1);
          for (int k = 0; k < o.num_topk; ++k) {
            const int64_t e = o.at(t, k);
            if (e < 0) continue;
            const int r = int(e / L);
            last_slot[size_t(r)] = k;
            if (k < K) wout[k] = rank_w[size_t(r)][k];
          }
          for (int r = 0; r < R; ++r) {
            if (rank_row[size_t(r)] != nullptr)
              terms.push_back({rank_row[size_t(r)], last_slot[size_t(r)], r, r / G});
          }
          fold.fold(acc.data(), terms, in.recipe);
        }
        store_row(acc.data(), dst.row_ptr(t), dt, size_t(H));
      }
    }
    return n;
  }
};

}  // namespace

StatusOr<NormalCombineOutput> rm_combine(NormalBuffer::State& s, const NormalCombineInput& in,
                                         const Status& caller_error) {
  World& w = *s.world;
  const Status local = check_combine(s, in, caller_error);
  // One collective: the verdicts and the values every rank must share.
  using F = AgreedField;
  const AgreedField fields[] = {{"x dtype", int64_t(in.x.dtype), F::kAgreeDType},
                                {"topk_weights num_topk", in.num_topk, F::kAgree},
                                {"x hidden", in.x.cols, F::kAgree}};
  MOED_RETURN_IF_ERROR(agree_in_one(w, local, fields).status());

  RmCombine call(s, in);
  flex::PublishRound round(w, s.signals, s.epoch, s.in_place, flex::PublishRound::Role::kReads);
  MOED_RETURN_IF_ERROR(call.publish(round));
  const Status net = s.topo.num_nodes > 1 ? call.exchange() : ok_status();

  NormalCombineOutput out;
  const int64_t T = call.h.num_tokens;
  if (!in.out) out.combined_x = Tensor::empty(call.dt, T, call.H);
  out.out = in.out;
  const TensorView dst = out.result();
  out.combined_topk_weights.assign(size_t(T) * call.K, 0.0f);
  std::vector<uint64_t> reads(size_t(call.C), 0);
  if (net.ok()) {
    w.pool().parallel_for(call.C, [&](int64_t cb, int64_t ce, int) {
      reads[size_t(cb)] = call.fold_channels(cb, ce, dst, out.combined_topk_weights.data());
    });
  }
  uint64_t rows = 0;
  for (uint64_t n : reads) rows += n;
  w.add_shared_bytes(rows * call.row_bytes, rows);
  // NOTE: the rows stay untouched until every local rank has read them (PublishRound) and
  // the sends that gather them are done or dropped.
  const Status sent = wait_all(call.sends);
  call.sends.clear();  // dropped: a failed send reads no row after the round closes
  MOED_RETURN_IF_ERROR(round.close(net.ok() ? sent : net));
  return out;
}

}  // namespace moed::deep_ep
