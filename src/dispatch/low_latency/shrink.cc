// Shrink mode (moed/low_latency.h, shrink.h). No collective: every rank writes only its own
// node-shared segment and sends messages; an in-node peer reads what a rank published once
// the rank's sequence word says the call's part is complete. A rank's shrink words (state.h,
// ShrinkWord), per kind k (dispatch, combine) and half h:
//   kSent[k][h]     the call (1-based, per kind) whose rows, counts and verdict half h holds
//   kVerdict[k][h]  its verdict: the StatusCode of this rank's input check, plus kFp8Flag
//   kDone[k][h]     the call of half h whose receive this rank has finished: a rank writes
//                   half h for call n only once every unmasked in-node peer is done with n - 2
//   kCleaned        clean() calls entered
//   kMask + r       1 where this rank masked rank r; rank r reading it learns it was removed
// Dispatch: counts[h][e] = rows this rank sends to expert e; the rows, their scales, source
// tokens and probs at (chunk e, slot i) of dispatch_x / _scales / _src / _prob[h]. Combine:
// combine_y[h] holds the expert outputs for in-node homes in the dispatch's packed layout,
// shrink_ranges[h] that layout [L][R]. Other nodes: per call, to every unmasked remote rank, a
// header [verdict, L counts] then the rows (dispatch), one message [verdict, rows] (combine:
// both sides know its size from the dispatch), or one word (clean).
#include "dispatch/low_latency/shrink.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "core/row_kernels.h"
#include "dispatch/low_latency/phases.h"

namespace moed::low_latency {

namespace {

using Clock = std::chrono::steady_clock;
using State = LowLatencyBuffer::State;

constexpr uint64_t kFp8Flag = uint64_t(1) << 32;  // in a verdict: the rows are FP8
constexpr int32_t kHeaderFp8Flag = 1 << 16;       // the same in a network header's int32

// The peer waits of one call: each for at most the shrink timeout from its start. A peer that
// misses it, or that the world reports failed, is masked and the call goes on without it.
// NOTE: a deadline per wait, not per call: a live peer may answer only once its own wait for a
// lost rank has run out (a message it receives after a header, say).
class Peers {
 public:
  Peers(State& st, const char* call) : st_(st), w_(*st.world), call_(call) {}

  bool masked(int r) const { return word(kMask + size_t(r))->load(std::memory_order_acquire) != 0; }
  bool in_node(int r) const { return w_.same_node(r, w_.rank()); }

  void mask(int r, const std::string& why) {
    if (masked(r)) return;
    word(kMask + size_t(r))->store(1, std::memory_order_release);
    std::fprintf(stderr, "moed: rank %d masks rank %d in %s: %s\n", w_.rank(), r, call_,
                 why.c_str());
  }

  // In-node peer r has masked this rank: the buffer is lost to it (every later call says so).
  Status removed_by(int r) {
    if (!in_node(r) || r == w_.rank()) return ok_status();
    if (st_.shrink_word(st_.local_of(r), kMask + size_t(w_.rank()))
            ->load(std::memory_order_acquire) == 0) {
      return ok_status();
    }
    st_.removed = aborted("rank ", w_.rank(), " was removed by rank ", r,
                          " (masked in shrink mode: it missed a call's deadline of ",
                          st_.shrink_timeout.count(), " ms or was seen failed); its ", call_,
                          " and every later call fail");
    return st_.removed;
  }
  Status check_removed() {
    MOED_RETURN_IF_ERROR(st_.removed);
    for (int r = 0; r < w_.size(); ++r) {
      if (!masked(r)) MOED_RETURN_IF_ERROR(removed_by(r));
    }
    return ok_status();
  }

  // Waits until ready() holds for in-node peer r: true; false once r is masked.
  template <typename Ready>
  StatusOr<bool> wait(int r, Ready&& ready) {
    const auto deadline = Clock::now() + st_.shrink_timeout;
    for (int i = 0;; ++i) {
      if (masked(r)) return false;
      if (ready()) return true;
      if (i < 64) {
        internal::cpu_relax();
        continue;
      }
      MOED_RETURN_IF_ERROR(removed_by(r));
      if (w_.rank_failed(r)) {
        mask(r, "the world reports it failed");
        return false;
      }
      if (Clock::now() >= deadline) {
        mask(r, str_cat("no answer within ", st_.shrink_timeout.count(), " ms"));
        return false;
      }
      internal::backoff(i);
    }
  }

  // Waits for a message to or from rank r (another node): true when done; false once r is
  // masked (failed, or the deadline passed: the message is then cancelled).
  bool wait(int r, Request& request) {
    if (masked(r) || !request) return false;
    Status s = request->wait_for(st_.shrink_timeout);
    request.reset();
    if (s.ok()) return true;
    mask(r, s.message());
    return false;
  }

  // Posts a message; a peer that cannot take it is masked (the request stays empty).
  void post(int r, StatusOr<Request> posted, Request& request) {
    if (posted.ok()) {
      request = std::move(posted).value();
    } else {
      mask(r, posted.status().message());
    }
  }

 private:
  std::atomic<uint64_t>* word(size_t index) const {
    return st_.shrink_word(w_.local_rank(), index);
  }
  State& st_;
  World& w_;
  const char* call_;
};

std::atomic<uint64_t>* word(const State& st, int rank, ShrinkWord w, PullKind k, int half) {
  return st.shrink_word(st.local_of(rank), shrink_index(w, k, half));
}

// Before this rank writes half `half` for call n: every unmasked in-node peer is done with
// call n - 2 of that half.
Status wait_half_free(State& st, Peers& peers, PullKind kind, int half, uint64_t n) {
  World& w = *st.world;
  if (n <= 2) return ok_status();
  for (int p = 0; p < w.size(); ++p) {
    if (p == w.rank() || !peers.in_node(p)) continue;
    std::atomic<uint64_t>* done = word(st, p, kDone, kind, half);
    MOED_RETURN_IF_ERROR(
        peers.wait(p, [&] { return done->load(std::memory_order_acquire) >= n - 2; }).status());
  }
  return ok_status();
}

// Publishes this rank's part of call n: its verdict, then the sequence word (release: the
// rows and counts written before it are complete for whoever reads it).
void publish(State& st, PullKind kind, int half, uint64_t n, const Status& local, bool fp8) {
  const int me = st.world->rank();
  word(st, me, kVerdict, kind, half)
      ->store(uint64_t(uint32_t(local.code())) | (fp8 ? kFp8Flag : 0), std::memory_order_relaxed);
  word(st, me, kSent, kind, half)->store(n, std::memory_order_release);
}

// A source's verdict as this rank's error (OK when it checked its input fine and used the same
// FP8 setting).
Status verdict_error(const char* call, uint64_t n, int source, uint64_t verdict, bool fp8) {
  const auto code = StatusCode(uint32_t(verdict & 0xffffffffu));
  if (code != StatusCode::kOk) {
    return Status(code, str_cat("rank ", source, ": its input of ", call, " #", n,
                                " was rejected there (see that rank's error)"));
  }
  if (((verdict & kFp8Flag) != 0) != fp8) {
    return invalid_argument(call, " #", n, ": use_fp8 = ", (verdict & kFp8Flag) != 0, " on rank ",
                            source, " but ", fp8, " here; it must be the same on every rank");
  }
  return ok_status();
}

// Rows of the dispatch's network message: [token index x n][prob x n][payload x n][scales x n].
struct NetRows {
  std::byte* base;
  size_t rows, payload, scale_bytes;
  std::byte* token(size_t i) const { return base + i * sizeof(int32_t); }
  std::byte* prob(size_t i) const { return base + rows * sizeof(int32_t) + i * sizeof(float); }
  std::byte* data(size_t i) const {
    return base + rows * (sizeof(int32_t) + sizeof(float)) + i * payload;
  }
  std::byte* scales(size_t i) const {
    return base + rows * (sizeof(int32_t) + sizeof(float) + payload) + i * scale_bytes;
  }
};

Status receive_dispatch(State& st, LowLatencyHandle& handle, int half, uint64_t n, uint64_t seq,
                        bool fp8) {
  World& w = *st.world;
  const SegmentLayout& lay = st.layout;
  DispatchHalf& dh = st.dispatch_half[half];
  const int R = lay.num_ranks, L = lay.num_local_experts, me = w.rank();
  const int64_t M = lay.max_tokens;
  const size_t payload = fp8 ? size_t(lay.hidden) : size_t(lay.hidden) * sizeof(bf16);
  const size_t scale_bytes = fp8 ? size_t(lay.num_scales) * sizeof(float) : 0;
  const size_t row_bytes = sizeof(int32_t) + sizeof(float) + payload + scale_bytes;
  dh.pending = false;
  Peers peers(st, "low_latency_dispatch");
  Status bad;  // the first source whose verdict is an error

  // Counts of every (local expert j, source s): in-node sources in their segment, the others
  // in their header; then the rows of other nodes.
  std::vector<int32_t> count(size_t(L) * R, 0);
  std::vector<bool> from_segment(size_t(R), false);
  std::vector<size_t> block(size_t(R), 0);
  std::vector<Request> data(static_cast<size_t>(R));
  size_t net_total = 0;
  for (int s = 0; s < R; ++s) {
    if (peers.masked(s)) continue;
    uint64_t verdict = 0;
    if (peers.in_node(s)) {
      std::atomic<uint64_t>* sent = word(st, s, kSent, PullKind::kDispatch, half);
      MOED_ASSIGN_OR_RETURN(
          bool ready, peers.wait(s, [&] { return sent->load(std::memory_order_acquire) >= n; }));
      if (!ready) continue;
      if (sent->load(std::memory_order_acquire) != n) {
        MOED_RETURN_IF_ERROR(peers.removed_by(s));
        return internal_error("low_latency_dispatch #", n, ": rank ", s, " published call ",
                              sent->load(), " in this half");
      }
      verdict = word(st, s, kVerdict, PullKind::kDispatch, half)->load(std::memory_order_relaxed);
      const auto* c = reinterpret_cast<const std::atomic<uint64_t>*>(st.segment(st.local_of(s)) +
                                                                     lay.counts[half]);
      for (int j = 0; j < L; ++j) {
        count[size_t(j) * R + s] = int32_t(c[size_t(me) * L + j].load(std::memory_order_relaxed));
      }
      from_segment[size_t(s)] = true;
    } else {
      if (!peers.wait(s, dh.header_requests[size_t(s)])) continue;
      const int32_t* header = dh.recv_header.data() + size_t(s) * (L + 1);
      verdict = uint64_t(uint32_t(header[0] & ~kHeaderFp8Flag)) |
                ((header[0] & kHeaderFp8Flag) != 0 ? kFp8Flag : 0);
      int64_t rows = 0;
      for (int j = 0; j < L; ++j) rows += (count[size_t(j) * R + s] = header[1 + j]);
      block[size_t(s)] = net_total;
      net_total += align64(size_t(rows) * row_bytes);
    }
    Status v = verdict_error("low_latency_dispatch", n, s, verdict, fp8);
    if (!v.ok()) {
      if (bad.ok()) bad = v;
      for (int j = 0; j < L; ++j) count[size_t(j) * R + s] = 0;
    }
  }
  dh.net_recv.resize(net_total);
  for (int s = 0; s < R; ++s) {
    int64_t rows = 0;
    for (int j = 0; j < L && !peers.in_node(s); ++j) rows += count[size_t(j) * R + s];
    if (rows == 0 || peers.masked(s)) continue;
    peers.post(s,
               w.irecv(s, message_tag(seq, MessageKind::kDispatchData),
                       dh.net_recv.data() + block[size_t(s)], size_t(rows) * row_bytes),
               data[size_t(s)]);
  }
  for (int s = 0; s < R; ++s) {
    if (data[size_t(s)] && !peers.wait(s, data[size_t(s)])) {
      for (int j = 0; j < L; ++j) count[size_t(j) * R + s] = 0;
    }
  }
  for (size_t i = 0; i < dh.send_requests.size(); ++i) {
    peers.wait(dh.send_peers[i], dh.send_requests[i]);
  }
  dh.send_requests.clear();
  dh.send_peers.clear();
  dh.header_requests.clear();  // dropped: cancelled where a masked peer never sent
  dh.header_requests.resize(size_t(R));

  // Packed layout: expert j's rows from source s start at begin(j, s) = rows of sources < s;
  // a source masked above after its counts were read adds none.
  for (int j = 0; j < L; ++j) {
    int32_t begin = 0;
    for (int s = 0; s < R; ++s) {
      const int32_t c = peers.masked(s) ? 0 : count[size_t(j) * R + s];
      dh.layout_range[size_t(j) * R + s] = LowLatencyRange{begin, c};
      begin += c;
    }
    dh.recv_count[size_t(j)] = begin;
  }
  std::byte* rows_out = dh.shrink_rows.data();
  w.pool().parallel_for(int64_t(L) * R, [&](int64_t c0, int64_t c1, int) {
    for (int64_t c = c0; c < c1; ++c) {
      const int j = int(c / R), s = int(c % R);
      const LowLatencyRange range = dh.layout_range[size_t(c)];
      if (range.count == 0) continue;
      const int64_t to = int64_t(j) * lay.rows_per_expert() + range.begin;
      const size_t k = size_t(range.count);
      if (from_segment[size_t(s)]) {
        const std::byte* seg = st.segment(st.local_of(s));
        const int64_t from = (int64_t(me) * L + j) * M;
        std::memcpy(rows_out + size_t(to) * payload,
                    seg + lay.dispatch_x[half] + size_t(from) * payload, k * payload);
        std::memcpy(dh.shrink_scales.data() + size_t(to) * lay.num_scales,
                    seg + lay.dispatch_scales[half] + size_t(from) * scale_bytes, k * scale_bytes);
        std::memcpy(dh.shrink_src.data() + to, seg + lay.dispatch_src[half] + size_t(from) * 4,
                    k * 4);
        std::memcpy(dh.shrink_prob.data() + to, seg + lay.dispatch_prob[half] + size_t(from) * 4,
                    k * 4);
        continue;
      }
      int64_t rows = 0, first = 0;
      for (int j2 = 0; j2 < L; ++j2) {
        if (j2 < j) first += count[size_t(j2) * R + s];
        rows += count[size_t(j2) * R + s];
      }
      const NetRows m{dh.net_recv.data() + block[size_t(s)], size_t(rows), payload, scale_bytes};
      std::memcpy(dh.shrink_src.data() + to, m.token(size_t(first)), k * 4);
      std::memcpy(dh.shrink_prob.data() + to, m.prob(size_t(first)), k * 4);
      std::memcpy(rows_out + size_t(to) * payload, m.data(size_t(first)), k * payload);
      std::memcpy(dh.shrink_scales.data() + size_t(to) * lay.num_scales, m.scales(size_t(first)),
                  k * scale_bytes);
    }
  });
  // A source that masked this rank meanwhile may have written the half again: what was read
  // from it is not to be trusted, and this rank is out.
  for (int s = 0; s < R; ++s) {
    if (from_segment[size_t(s)]) MOED_RETURN_IF_ERROR(peers.removed_by(s));
  }
  word(st, me, kDone, PullKind::kDispatch, half)->store(n, std::memory_order_release);
  handle.layout_range = dh.layout_range;
  handle.received = true;
  MOED_RETURN_IF_ERROR(dh.shrink_local);
  return bad;
}

}  // namespace

StatusOr<LowLatencyDispatchOutput> shrink_dispatch(const std::shared_ptr<State>& sp,
                                                   const LowLatencyDispatchInput& in,
                                                   const Status& local) {
  State& st = *sp;
  World& w = *st.world;
  // A failed precondition (two dispatches in flight): the call does not happen here, and the
  // peers mask this rank if it never does.
  if (local.code() == StatusCode::kFailedPrecondition) return local;
  Peers peers(st, "low_latency_dispatch");
  MOED_RETURN_IF_ERROR(peers.check_removed());
  const SegmentLayout& lay = st.layout;
  const int R = lay.num_ranks, L = lay.num_local_experts, me = w.rank(), H = lay.hidden;
  const int64_t M = lay.max_tokens;
  const int half = int(st.dispatches % 2);
  const uint64_t n = ++st.dispatches;
  const uint64_t seq = ++st.seq;
  DispatchHalf& dh = st.dispatch_half[half];
  dh.pending = true;
  dh.shrink_local = local;
  Status freed = wait_half_free(st, peers, PullKind::kDispatch, half, n);
  if (!freed.ok()) {
    dh.pending = false;
    return freed;
  }

  const bool ok = local.ok(), fp8 = in.use_fp8;
  const int64_t T = ok ? in.x.rows : 0;
  TopkRouting none;
  none.num_topk = in.topk ? in.topk->num_topk : 1;
  std::shared_ptr<LowLatencyHandle> handle = new_dispatch_handle(st, ok ? *in.topk : none, T);
  const size_t payload = fp8 ? size_t(H) : size_t(H) * sizeof(bf16);
  const size_t scale_bytes = fp8 ? size_t(lay.num_scales) * sizeof(float) : 0;
  const size_t row_bytes = sizeof(int32_t) + sizeof(float) + payload + scale_bytes;
  if (ok && fp8) cast_fp8_rows(st, in, dh.fp8_rows);

  // Counts and rows for in-node ranks in this rank's segment; one message per other node's rank.
  std::byte* seg = st.local();
  auto* counts = reinterpret_cast<std::atomic<uint64_t>*>(seg + lay.counts[half]);
  std::vector<size_t> block(size_t(R), 0);
  std::vector<int64_t> block_rows(size_t(R), 0), chunk_row(size_t(lay.num_experts), 0);
  size_t net_total = 0;
  for (int d = 0; d < R; ++d) {
    const bool live = !peers.masked(d);
    for (int j = 0; j < L; ++j) {
      const int e = d * L + j;
      const int32_t c = live ? handle->send_count[size_t(e)] : 0;
      if (peers.in_node(d)) {
        counts[e].store(uint64_t(c), std::memory_order_relaxed);
      } else {
        chunk_row[size_t(e)] = block_rows[size_t(d)];
        block_rows[size_t(d)] += c;
      }
    }
    if (!peers.in_node(d)) {
      block[size_t(d)] = net_total;
      net_total += align64(size_t(block_rows[size_t(d)]) * row_bytes);
    }
  }
  dh.net_send.resize(net_total);
  const bool has_weights =
      ok && in.topk->topk_weights.size() == size_t(T) * size_t(in.topk->num_topk);
  w.pool().parallel_for(T, [&](int64_t t0, int64_t t1, int) {
    const TopkRouting& routing = *in.topk;
    for (int64_t t = t0; t < t1; ++t) {
      const std::byte* row = fp8 ? dh.fp8_rows.data() + size_t(t) * (payload + scale_bytes)
                                 : static_cast<const std::byte*>(in.x.row_ptr(t));
      for (int k = 0; k < routing.num_topk; ++k) {
        const int32_t e = routing.idx(t, k);
        if (e < 0 || peers.masked(e / L)) continue;
        const int d = e / L;
        const int64_t i = handle->slot[size_t(t) * routing.num_topk + k];
        const float p = has_weights ? routing.weight(t, k) : 0.0f;
        const int32_t token = int32_t(t);
        if (peers.in_node(d)) {
          const size_t r = size_t(int64_t(e) * M + i);
          std::memcpy(seg + lay.dispatch_x[half] + r * payload, row, payload);
          std::memcpy(seg + lay.dispatch_scales[half] + r * scale_bytes, row + payload,
                      scale_bytes);
          std::memcpy(seg + lay.dispatch_src[half] + r * sizeof(int32_t), &token, sizeof(token));
          std::memcpy(seg + lay.dispatch_prob[half] + r * sizeof(float), &p, sizeof(p));
        } else {
          const NetRows m{dh.net_send.data() + block[size_t(d)], size_t(block_rows[size_t(d)]),
                          payload, scale_bytes};
          const size_t at = size_t(chunk_row[size_t(e)] + i);
          std::memcpy(m.token(at), &token, sizeof(token));
          std::memcpy(m.prob(at), &p, sizeof(p));
          std::memcpy(m.data(at), row, payload);
          std::memcpy(m.scales(at), row + payload, scale_bytes);
        }
      }
    }
  });
  publish(st, PullKind::kDispatch, half, n, local, fp8);
  for (int d = 0; d < R; ++d) {
    if (peers.in_node(d) || peers.masked(d)) continue;
    int32_t* header = dh.send_header.data() + size_t(d) * (L + 1);
    header[0] = int32_t(local.code()) | (fp8 ? kHeaderFp8Flag : 0);
    for (int j = 0; j < L; ++j) header[1 + j] = ok ? handle->send_count[size_t(d) * L + j] : 0;
    auto send = [&](const void* data, size_t bytes, MessageKind kind) {
      Request r;
      peers.post(d, w.isend(d, message_tag(seq, kind), data, bytes), r);
      if (!r) return;
      dh.send_requests.push_back(std::move(r));
      dh.send_peers.push_back(d);
    };
    send(header, size_t(L + 1) * sizeof(int32_t), MessageKind::kDispatchHeader);
    if (block_rows[size_t(d)] > 0) {
      send(dh.net_send.data() + block[size_t(d)], size_t(block_rows[size_t(d)]) * row_bytes,
           MessageKind::kDispatchData);
    }
    peers.post(
        d,
        w.irecv(d, message_tag(seq, MessageKind::kDispatchHeader),
                dh.recv_header.data() + size_t(d) * (L + 1), size_t(L + 1) * sizeof(int32_t)),
        dh.header_requests[size_t(d)]);
  }
  uint64_t shared_rows = 0;
  for (int e = 0; e < lay.num_experts; ++e) {
    if (peers.in_node(e / L) && !peers.masked(e / L))
      shared_rows += uint64_t(handle->send_count[size_t(e)]);
  }
  w.add_shared_bytes(shared_rows * (payload + scale_bytes), shared_rows);

  LowLatencyDispatchOutput out;
  out.num_local_experts = L;
  out.rows_per_expert = lay.rows_per_expert();
  const int64_t rows = int64_t(L) * lay.rows_per_expert();
  out.recv.x = TensorView(dh.shrink_rows.data(), fp8 ? DType::kFP8 : DType::kBF16, rows, H);
  if (fp8) out.recv.scales = TensorView(dh.shrink_scales.data(), DType::kF32, rows, lay.num_scales);
  out.recv_count = std::span<const int32_t>(dh.recv_count);
  out.src_info = std::span<const int32_t>(dh.shrink_src);
  out.recv_probs = std::span<const float>(dh.shrink_prob);
  out.layout_range = std::span<const LowLatencyRange>(dh.layout_range);
  out.handle = handle;
  auto receive = [sp, handle, half, n, seq, fp8] {
    return receive_dispatch(*sp, *handle, half, n, seq, fp8);
  };
  // A rank with bad input receives at once (the peers' messages must not linger) and fails.
  if (!ok) {
    Status received = receive();
    return received.ok() ? local : received;
  }
  MOED_RETURN_IF_ERROR(receive_now_or_hook(in.return_recv_hook, std::move(receive), out.hook));
  return out;
}

namespace {

Status receive_combine(State& st, const LowLatencyHandle& handle, const TopkRouting& routing,
                       std::span<const int32_t> order, int half, uint64_t n, TensorView out) {
  World& w = *st.world;
  const SegmentLayout& lay = st.layout;
  CombineHalf& ch = st.combine_half[half];
  const int R = lay.num_ranks, L = lay.num_local_experts, me = w.rank(), H = lay.hidden;
  const size_t row_bytes = size_t(H) * sizeof(bf16);
  ch.pending = false;
  Peers peers(st, "low_latency_combine");
  Status bad;
  // Where each expert's rows for this rank start: in-node experts' ranks publish their layout,
  // the others' rows come in one message, local experts in order.
  std::vector<const std::byte*> first_row(size_t(lay.num_experts), nullptr);
  std::vector<bool> from_segment(size_t(R), false);
  for (int d = 0; d < R; ++d) {
    if (peers.masked(d)) continue;
    uint64_t verdict = 0;
    if (peers.in_node(d)) {
      std::atomic<uint64_t>* sent = word(st, d, kSent, PullKind::kCombine, half);
      MOED_ASSIGN_OR_RETURN(
          bool ready, peers.wait(d, [&] { return sent->load(std::memory_order_acquire) >= n; }));
      if (!ready) continue;
      if (sent->load(std::memory_order_acquire) != n) {
        MOED_RETURN_IF_ERROR(peers.removed_by(d));
        return internal_error("low_latency_combine #", n, ": rank ", d, " published call ",
                              sent->load(), " in this half");
      }
      verdict = word(st, d, kVerdict, PullKind::kCombine, half)->load(std::memory_order_relaxed);
      const std::byte* seg = st.segment(st.local_of(d));
      const auto* ranges = reinterpret_cast<const LowLatencyRange*>(seg + lay.shrink_ranges[half]);
      for (int j = 0; j < L && verdict == 0; ++j) {
        const LowLatencyRange r = ranges[size_t(j) * R + me];
        if (r.count != handle.send_count[size_t(d) * L + j]) {
          MOED_RETURN_IF_ERROR(peers.removed_by(d));
          if (bad.ok()) {
            bad = internal_error("low_latency_combine #", n, ": rank ", d, " holds ", r.count,
                                 " rows of expert ", d * L + j, " from this rank, which sent ",
                                 handle.send_count[size_t(d) * L + j]);
          }
        }
        first_row[size_t(d) * L + j] =
            seg + lay.combine_y[half] +
            size_t(int64_t(j) * lay.rows_per_expert() + r.begin) * row_bytes;
      }
      from_segment[size_t(d)] = true;
    } else {
      if (!peers.wait(d, ch.recvs[size_t(d)])) continue;
      const std::byte* m = ch.net_recv.data() + ch.net_block[size_t(d)];
      std::memcpy(&verdict, m, sizeof(verdict));
      m += 64;
      for (int j = 0; j < L; ++j) {
        first_row[size_t(d) * L + j] = m;
        m += size_t(handle.send_count[size_t(d) * L + j]) * row_bytes;
      }
    }
    Status v = verdict_error("low_latency_combine", n, d, verdict, false);
    if (!v.ok()) {
      if (bad.ok()) bad = v;
      for (int j = 0; j < L; ++j) first_row[size_t(d) * L + j] = nullptr;
    }
  }
  for (size_t i = 0; i < ch.requests.size(); ++i) peers.wait(ch.send_peers[i], ch.requests[i]);
  ch.requests.clear();
  ch.send_peers.clear();
  ch.recvs.clear();  // dropped: cancelled where a masked peer never sent
  ch.recvs.resize(size_t(R));

  // out[t] = sum over t's experts e of unmasked ranks, ascending, of w * y (as the normal path).
  w.pool().parallel_for(handle.num_tokens, [&](int64_t t0, int64_t t1, int) {
    std::vector<Term> terms;
    internal::FoldAhead fold(DType::kBF16, DType::kBF16, size_t(H), /*weighted=*/true,
                             /*stream=*/false);
    auto live = [&](int32_t e) { return first_row[size_t(e)] != nullptr && !peers.masked(e / L); };
    for (int64_t t = t0; t < t1; ++t) {
      token_terms(handle, routing, order, t, live, terms);
      for (const Term& term : terms) {
        fold.add(first_row[size_t(term.e)] + size_t(term.slot) * row_bytes, term.weight);
      }
      fold.push(out.row<bf16>(t));
    }
    fold.flush();
  });
  for (int d = 0; d < R; ++d) {
    if (from_segment[size_t(d)]) MOED_RETURN_IF_ERROR(peers.removed_by(d));
  }
  word(st, me, kDone, PullKind::kCombine, half)->store(n, std::memory_order_release);
  MOED_RETURN_IF_ERROR(ch.shrink_local);
  return bad;
}

}  // namespace

StatusOr<LowLatencyCombineOutput> shrink_combine(const std::shared_ptr<State>& sp,
                                                 const LowLatencyCombineInput& in,
                                                 const Status& local) {
  State& st = *sp;
  World& w = *st.world;
  if (local.code() == StatusCode::kFailedPrecondition) return local;
  Peers peers(st, "low_latency_combine");
  MOED_RETURN_IF_ERROR(peers.check_removed());
  const SegmentLayout& lay = st.layout;
  const int R = lay.num_ranks, L = lay.num_local_experts, me = w.rank(), H = lay.hidden;
  const size_t row_bytes = size_t(H) * sizeof(bf16);
  const int half = int(st.combines % 2);
  const uint64_t n = ++st.combines;
  const uint64_t seq = ++st.seq;
  CombineHalf& ch = st.combine_half[half];
  ch.pending = true;
  ch.shrink_local = local;
  Status freed = wait_half_free(st, peers, PullKind::kCombine, half, n);
  if (!freed.ok()) {
    ch.pending = false;
    return freed;
  }
  const bool ok = local.ok();
  // NOTE: a bad call may carry no usable handle: it then neither sends nor receives messages
  // (their sizes come from the dispatch), and the ranks of other nodes mask this rank.
  const LowLatencyHandle* handle =
      in.handle && in.handle->buffer_id == st.id && in.handle->received ? in.handle.get() : nullptr;

  // Home side: one message from each unmasked expert rank of another node, its size known from
  // this rank's dispatch.
  ch.net_block.assign(size_t(R), 0);
  size_t total = 0;
  for (int d = 0; d < R && handle != nullptr; ++d) {
    if (peers.in_node(d) || peers.masked(d)) continue;
    int64_t rows = 0;
    for (int j = 0; j < L; ++j) rows += handle->send_count[size_t(d) * L + j];
    ch.net_block[size_t(d)] = total;
    total += 64 + align64(size_t(rows) * row_bytes);
  }
  ch.net_recv.resize(total);
  for (int d = 0; d < R && handle != nullptr; ++d) {
    if (peers.in_node(d) || peers.masked(d)) continue;
    int64_t rows = 0;
    for (int j = 0; j < L; ++j) rows += handle->send_count[size_t(d) * L + j];
    peers.post(d,
               w.irecv(d, message_tag(seq, MessageKind::kCombineData),
                       ch.net_recv.data() + ch.net_block[size_t(d)], 64 + size_t(rows) * row_bytes),
               ch.recvs[size_t(d)]);
  }

  // Expert side: the rows of in-node homes into this rank's segment (the packed layout, as x),
  // with the layout; one message for each other node's home.
  std::byte* seg = st.local();
  if (ok) {
    const TensorView y(seg + lay.combine_y[half], DType::kBF16, int64_t(L) * lay.rows_per_expert(),
                       H);
    for (int j = 0; j < L; ++j) {
      for (int s = 0; s < R; ++s) {
        const LowLatencyRange r = handle->layout_range[size_t(j) * R + s];
        if (r.count == 0 || !peers.in_node(s) || peers.masked(s)) continue;
        const int64_t at = int64_t(j) * lay.rows_per_expert() + r.begin;
        internal::copy_rows(y, at, in.x, at, r.count);
      }
    }
    std::memcpy(seg + lay.shrink_ranges[half], handle->layout_range.data(),
                handle->layout_range.size() * sizeof(LowLatencyRange));
  }
  publish(st, PullKind::kCombine, half, n, local, false);
  size_t staged = 0;
  for (int s = 0; s < R && handle != nullptr; ++s) {
    if (!peers.in_node(s)) {
      for (int j = 0; j < L; ++j) staged += size_t(handle->layout_range[size_t(j) * R + s].count);
    }
  }
  ch.net_send.resize(64 * size_t(R) + staged * row_bytes);
  size_t at = 0;
  for (int s = 0; s < R && handle != nullptr; ++s) {
    if (peers.in_node(s) || peers.masked(s)) continue;
    std::byte* m = ch.net_send.data() + at;
    const uint64_t verdict = uint64_t(uint32_t(local.code()));
    std::memcpy(m, &verdict, sizeof(verdict));
    size_t rows = 0;
    for (int j = 0; j < L; ++j) {
      const LowLatencyRange r = handle->layout_range[size_t(j) * R + s];
      if (ok) {
        internal::copy_rows(TensorView(m + 64 + rows * row_bytes, DType::kBF16, r.count, H), 0,
                            in.x, int64_t(j) * lay.rows_per_expert() + r.begin, r.count);
      }
      rows += size_t(r.count);
    }
    Request req;
    peers.post(s, w.isend(s, message_tag(seq, MessageKind::kCombineData), m, 64 + rows * row_bytes),
               req);
    if (req) {
      ch.requests.push_back(std::move(req));
      ch.send_peers.push_back(s);
    }
    at += 64 + rows * row_bytes;
  }

  LowLatencyCombineOutput out;
  const int64_t T = handle != nullptr ? handle->num_tokens : 0;
  if (!in.out) out.combined_x = Tensor::empty(DType::kBF16, T, H);
  out.out = in.out;
  if (!ok) {
    // A rank with bad input still takes its messages (with a handle), then fails.
    if (handle != nullptr) {
      TopkRouting routing;  // its sums are thrown away: no weights needed
      routing.num_tokens = handle->num_tokens;
      routing.num_topk = handle->num_topk;
      routing.topk_idx = handle->topk_idx;
      routing.topk_weights.assign(routing.topk_idx.size(), 0.0f);
      Tensor scratch = Tensor::empty(DType::kBF16, T, H);
      receive_combine(st, *handle, routing, {}, half, n, scratch.view()).ignore();
    } else {
      ch.pending = false;
      word(st, me, kDone, PullKind::kCombine, half)->store(n, std::memory_order_release);
    }
    return local;
  }
  auto receive = [sp, handle = in.handle, routing = *in.topk,
                  order = std::vector<int32_t>(in.order.begin(), in.order.end()), half, n,
                  view = out.result()] {
    return receive_combine(*sp, *handle, routing, order, half, n, view);
  };
  MOED_RETURN_IF_ERROR(receive_now_or_hook(in.return_recv_hook, std::move(receive), out.hook));
  return out;
}

Status shrink_clean(State& st) {
  World& w = *st.world;
  Peers peers(st, "clean_low_latency_buffer");
  MOED_RETURN_IF_ERROR(peers.check_removed());
  const int R = w.size(), me = w.rank();
  const uint64_t k = ++st.cleans;
  const uint64_t seq = ++st.seq;
  st.shrink_word(w.local_rank(), kCleaned)->store(k, std::memory_order_release);
  std::vector<Request> recvs(static_cast<size_t>(R)), sends(static_cast<size_t>(R));
  std::vector<uint64_t> in(static_cast<size_t>(R), 0);
  for (int d = 0; d < R; ++d) {
    if (peers.in_node(d) || peers.masked(d)) continue;
    peers.post(d, w.isend(d, message_tag(seq, MessageKind::kClean), &k, sizeof(k)),
               sends[size_t(d)]);
    peers.post(d, w.irecv(d, message_tag(seq, MessageKind::kClean), &in[size_t(d)], sizeof(k)),
               recvs[size_t(d)]);
  }
  for (int p = 0; p < R; ++p) {
    if (p == me || !peers.in_node(p)) continue;
    std::atomic<uint64_t>* cleaned = st.shrink_word(st.local_of(p), kCleaned);
    MOED_RETURN_IF_ERROR(
        peers.wait(p, [&] { return cleaned->load(std::memory_order_acquire) >= k; }).status());
  }
  for (int d = 0; d < R; ++d) {
    peers.wait(d, recvs[size_t(d)]);
    peers.wait(d, sends[size_t(d)]);
  }
  return ok_status();
}

}  // namespace moed::low_latency
