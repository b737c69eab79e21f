// low_latency_dispatch: the send phase writes every (token, expert) row straight into the
// receiver's fixed slot (j, s, i) in node-shared memory, or stages it for one network message
// per (source, destination) pair; then publishes each (source, expert) count with release
// ordering and signals the receiver. The receive phase waits for every source and packs each
// expert's rows (source ascending, token ascending) into memory the output owns
// (ReceiveBlock), with recv_count and layout_range.
#include <algorithm>
#include <cstring>

#include "core/row_kernels.h"
#include "dispatch/low_latency/phases.h"
#include "dispatch/low_latency/shrink.h"

namespace moed {

namespace {

using low_latency::align64;
using low_latency::DispatchHalf;
using low_latency::keep_request;
using low_latency::message_tag;
using low_latency::MessageKind;
using low_latency::SegmentLayout;

Status check_dispatch(const LowLatencyBuffer::State& st, const LowLatencyDispatchInput& in,
                      const Status& caller_error) {
  if (!caller_error.ok()) return caller_error;
  const SegmentLayout& lay = st.layout;
  const TensorView& x = in.x;
  if (x.dtype != DType::kBF16) {
    return invalid_argument("low_latency_dispatch: x must be bf16; got ", dtype_name(x.dtype));
  }
  if (x.cols != lay.hidden) {
    return invalid_argument("low_latency_dispatch: x has hidden = ", x.cols,
                            " but the buffer was made for hidden = ", lay.hidden);
  }
  if (x.rows < 0 || x.rows > lay.max_tokens) {
    return invalid_argument("low_latency_dispatch: x has ", x.rows,
                            " rows > max_tokens_per_rank = ", lay.max_tokens);
  }
  if (x.row_stride < x.cols) {
    return invalid_argument("low_latency_dispatch: x row_stride = ", x.row_stride,
                            " < hidden = ", x.cols);
  }
  if (x.rows > 0 && x.data == nullptr)
    return invalid_argument("low_latency_dispatch: x.data is null");
  if (in.use_fp8 && lay.hidden % kFp8BlockSize != 0) {
    return invalid_argument("low_latency_dispatch: use_fp8 needs hidden to be a multiple of ",
                            kFp8BlockSize, "; hidden = ", lay.hidden);
  }
  if (in.topk == nullptr) return invalid_argument("low_latency_dispatch: topk is null");
  const TopkRouting& r = *in.topk;
  if (r.num_tokens != x.rows) {
    return invalid_argument("low_latency_dispatch: topk_idx has ", r.num_tokens,
                            " tokens but x has ", x.rows, " rows");
  }
  if (r.num_topk <= 0) {
    return invalid_argument("low_latency_dispatch: num_topk = ", r.num_topk, " must be positive");
  }
  if (r.topk_idx.size() != size_t(r.num_tokens) * size_t(r.num_topk)) {
    return invalid_argument("low_latency_dispatch: topk_idx has ", r.topk_idx.size(),
                            " entries, expected ", r.num_tokens, " x ", r.num_topk);
  }
  // No weights at dispatch (as DeepEP's): only the indices are checked.
  MOED_RETURN_IF_ERROR(validate(TopkView::of(r).indices(), lay.num_experts));
  const DispatchHalf& half = st.dispatch_half[st.dispatches % 2];
  if (half.pending) {
    return failed_precondition(
        "low_latency_dispatch: two dispatches are already in flight; "
        "call the hook of dispatch #",
        st.dispatches - 2, " first");
  }
  return ok_status();
}

// Pull mode's opening collective: agrees on every rank's inputs (as World::agree, whose
// message the error path fetches) and on return_recv_hook, and gathers every rank's
// PullSource and its count per expert (`mine` null: this rank has none, as with a hook).
// Fills `sources` [R] and `count` [R][L], source s's count for this rank's expert j.
Status publish_dispatch(LowLatencyBuffer::State& st, const LowLatencyDispatchInput& in,
                        const Status& local, const low_latency::PullSource* mine,
                        std::vector<low_latency::PullSource>& sources, std::vector<int32_t>& count,
                        std::span<const int32_t> send_count = {}) {
  World& w = *st.world;
  const int R = w.size(), E = st.layout.num_experts, L = st.layout.num_local_experts;
  constexpr size_t kFields = 8;  // code, hook, pulled, acked, rows, stride, tokens, probs
  const size_t width = kFields + size_t(E);
  std::vector<int64_t> row(width, 0);
  row[0] = int64_t(local.code());
  row[1] = int64_t(in.return_recv_hook);
  if (mine != nullptr) {
    // NOTE: pointers cross ranks as integers: pull mode is one address space (state.h).
    row[2] = 1;
    row[3] = int64_t(mine->acked);
    row[4] = int64_t(reinterpret_cast<intptr_t>(mine->rows));
    row[5] = int64_t(mine->stride);
    row[6] = int64_t(reinterpret_cast<intptr_t>(mine->tokens));
    row[7] = int64_t(reinterpret_cast<intptr_t>(mine->probs));
    for (int e = 0; e < E; ++e) row[kFields + size_t(e)] = send_count[size_t(e)];
  }
  MOED_ASSIGN_OR_RETURN(std::vector<int64_t> table,
                        low_latency::gather_pull_rows(w, std::span<const int64_t>(row), local,
                                                      "low_latency_dispatch"));
  sources.assign(size_t(R), low_latency::PullSource{});
  count.assign(size_t(R) * size_t(L), 0);
  for (int r = 0; r < R; ++r) {
    const int64_t* t = table.data() + size_t(r) * width;
    low_latency::PullSource& ps = sources[size_t(r)];
    ps.pulled = t[2] != 0;
    ps.acked = t[3] != 0;
    ps.rows = reinterpret_cast<const std::byte*>(intptr_t(t[4]));
    ps.stride = size_t(t[5]);
    ps.tokens = reinterpret_cast<const int32_t*>(intptr_t(t[6]));
    ps.probs = reinterpret_cast<const float*>(intptr_t(t[7]));
    for (int j = 0; j < L; ++j) {
      count[size_t(r) * L + j] = int32_t(t[kFields + size_t(w.rank() * L + j)]);
    }
  }
  return ok_status();
}

// Receive phase of dispatch `seq` of `half`, into `rb`.
Status receive_dispatch(LowLatencyBuffer::State& st, LowLatencyHandle& handle, int half,
                        uint64_t seq, bool fp8, low_latency::ReceiveBlock& rb) {
  World& w = *st.world;
  const SegmentLayout& lay = st.layout;
  DispatchHalf& dh = st.dispatch_half[half];
  const int R = lay.num_ranks, L = lay.num_local_experts, me = w.rank();
  const size_t payload = fp8 ? size_t(lay.hidden) : size_t(lay.hidden) * sizeof(bf16);
  const size_t scale_bytes = fp8 ? size_t(lay.num_scales) * sizeof(float) : 0;
  const size_t row_bytes = sizeof(int32_t) + sizeof(float) + payload + scale_bytes;
  // Whatever happens below, this half is no longer in flight, and the peers whose rows this
  // rank reads in place learn that it is done with them.
  dh.pending = false;
  low_latency::PullRelease release(st, half, low_latency::PullKind::kDispatch, seq, dh.sources);

  // Counts of every (local expert j, source s): in-node sources published them in this rank's
  // segment before their signal; other nodes sent them as a header.
  Status status = wait_all(dh.header_requests);
  std::vector<int32_t> count(size_t(L) * R, 0);
  for (int s = 0; s < R && status.ok(); ++s) {
    if (!w.same_node(s, me)) {
      for (int j = 0; j < L; ++j) count[size_t(j) * R + s] = dh.recv_header[size_t(s) * L + j];
      continue;
    }
    if (!dh.sources.empty() && dh.sources[size_t(s)].pulled) {
      for (int j = 0; j < L; ++j) {
        count[size_t(j) * R + s] = dh.published_count[size_t(s) * L + j];
      }
      continue;
    }
    if (s != me) {
      status = st.shared->wait_signal(st.local_of(s), seq);
      if (!status.ok()) break;
    }
    const std::atomic<uint64_t>* c = st.counts(w.local_rank(), half);
    for (int j = 0; j < L; ++j) {
      const uint64_t v = c[size_t(j) * R + s].load(std::memory_order_acquire);
      MOED_CHECK(v >> 32 == (seq & 0xffffffffu), "count of (expert ", j, ", source ", s,
                 ") carries sequence ", v >> 32, ", expected ", seq);
      count[size_t(j) * R + s] = int32_t(v & 0xffffffffu);
    }
  }

  // Rows from other nodes: one message per source, its size known from the header.
  std::vector<size_t> block(size_t(R), 0);
  std::vector<Request> data_requests;
  if (status.ok()) {
    size_t total = 0;
    for (int s = 0; s < R; ++s) {
      if (w.same_node(s, me)) continue;
      block[size_t(s)] = total;
      int64_t n = 0;
      for (int j = 0; j < L; ++j) n += count[size_t(j) * R + s];
      total += align64(size_t(n) * row_bytes);
    }
    dh.net_recv.resize(total);
    for (int s = 0; s < R && status.ok(); ++s) {
      if (w.same_node(s, me)) continue;
      int64_t n = 0;
      for (int j = 0; j < L; ++j) n += count[size_t(j) * R + s];
      if (n == 0) continue;
      status = keep_request(w.irecv(s, message_tag(seq, MessageKind::kDispatchData),
                                    dh.net_recv.data() + block[size_t(s)], size_t(n) * row_bytes),
                            data_requests);
    }
  }
  // NOTE: post the data receives before waiting on this rank's own sends: a send completes
  // only once its receiver has posted the matching receive.
  Status recv_status = wait_all(data_requests);
  Status send_status = wait_all(dh.send_requests);
  dh.header_requests.clear();
  dh.send_requests.clear();
  MOED_RETURN_IF_ERROR(status);
  MOED_RETURN_IF_ERROR(recv_status);
  MOED_RETURN_IF_ERROR(send_status);

  // Packed layout: expert j's rows from source s start at begin(j, s) = rows of sources < s.
  for (int j = 0; j < L; ++j) {
    int32_t begin = 0;
    for (int s = 0; s < R; ++s) {
      const int32_t c = count[size_t(j) * R + s];
      rb.layout_range[size_t(j) * R + s] = LowLatencyRange{begin, c};
      begin += c;
    }
    rb.recv_count[size_t(j)] = begin;
  }

  // This rank's slots (in-node senders wrote there) and the output's memory.
  const std::byte* seg = st.local();
  const std::byte* slot_x = seg + lay.dispatch_x[half];
  const std::byte* slot_scales = seg + lay.dispatch_scales[half];
  const auto* slot_src = reinterpret_cast<const int32_t*>(seg + lay.dispatch_src[half]);
  const auto* slot_prob = reinterpret_cast<const float*>(seg + lay.dispatch_prob[half]);
  auto* xs = static_cast<std::byte*>(rb.x.data());
  auto* scales = static_cast<std::byte*>(rb.scales.data());
  int32_t* src = rb.src.data();
  float* prob = rb.prob.data();
  // As Flex's dispatch (flex/layout.cc): a large receive is written with non-temporal stores,
  // which skip reading the destination lines first.
  int64_t received = 0;
  for (int j = 0; j < L; ++j) received += rb.recv_count[size_t(j)];
  const bool stream = size_t(received) * payload >= internal::kStreamThresholdBytes;
  auto pulled_from = [&](int s) -> const low_latency::PullSource* {
    if (!st.pulls(s) || dh.sources.empty() || !dh.sources[size_t(s)].pulled) return nullptr;
    return &dh.sources[size_t(s)];
  };
  std::vector<const low_latency::PullSource*> pulled(size_t(R), nullptr);
  bool any_slots = false;  // rows in this rank's slots or messages, packed per expert below
  for (int s = 0; s < R; ++s) {
    pulled[size_t(s)] = pulled_from(s);
    if (pulled[size_t(s)] == nullptr) {
      for (int j = 0; j < L; ++j) any_slots |= count[size_t(j) * R + s] > 0;
    }
  }
  // A few rows (decode at T = 1) are copied on this thread: waking the pool costs more.
  const bool inline_copy = size_t(received) * payload < low_latency::kInlineBytes;
  auto pack = [&](int64_t j0, int64_t j1, int) {
    std::vector<int64_t> net_row(size_t(R), 0);  // row of (j, s) inside the source's message
    for (int j = int(j0); j < int(j1); ++j) {
      for (int s = 0; s < R; ++s) {
        net_row[size_t(s)] = 0;
        if (w.same_node(s, me)) continue;
        for (int j2 = 0; j2 < j; ++j2) net_row[size_t(s)] += count[size_t(j2) * R + s];
      }
      for (int s = 0; s < R; ++s) {
        const LowLatencyRange range = rb.layout_range[size_t(j) * R + s];
        if (range.count == 0 || pulled[size_t(s)] != nullptr) continue;
        const int64_t to = int64_t(j) * lay.rows_per_expert() + range.begin;
        const size_t n = size_t(range.count);
        if (w.same_node(s, me)) {
          const int64_t from = lay.fixed_row(j, s, 0);
          std::memcpy(xs + size_t(to) * payload, slot_x + size_t(from) * payload, n * payload);
          if (scale_bytes != 0) {
            std::memcpy(scales + size_t(to) * scale_bytes, slot_scales + size_t(from) * scale_bytes,
                        n * scale_bytes);
          }
          std::memcpy(src + to, slot_src + from, n * sizeof(int32_t));
          std::memcpy(prob + to, slot_prob + from, n * sizeof(float));
        } else {
          // Message of source s: [token index x rows][prob x rows][payload x rows][scales x rows].
          int64_t rows = 0;
          for (int j2 = 0; j2 < L; ++j2) rows += count[size_t(j2) * R + s];
          const std::byte* m = dh.net_recv.data() + block[size_t(s)];
          const size_t first = size_t(net_row[size_t(s)]);
          std::memcpy(src + to, m + first * sizeof(int32_t), n * sizeof(int32_t));
          m += size_t(rows) * sizeof(int32_t);
          std::memcpy(prob + to, m + first * sizeof(float), n * sizeof(float));
          m += size_t(rows) * sizeof(float);
          std::memcpy(xs + size_t(to) * payload, m + first * payload, n * payload);
          m += size_t(rows) * payload;
          if (scale_bytes != 0) {
            std::memcpy(scales + size_t(to) * scale_bytes, m + first * scale_bytes,
                        n * scale_bytes);
          }
        }
      }
    }
  };
  if (any_slots) w.pool().parallel_for(L, pack, inline_copy ? int64_t(L) : 1);

  // Pulled sources, straight from their rows into the packed place, in (source, token) order:
  // a token bound for several of this rank's experts is read from its source once, the later
  // copies hitting the cache (expert order would read it again from memory). After the pass
  // above, which reads the slots these rows may land on.
  struct PullRow {
    int32_t source, token;
    int64_t to;   // packed row
    size_t from;  // entry of the source's PullSource::tokens / probs
  };
  std::vector<PullRow> rows;
  std::vector<int32_t> first(size_t(lay.max_tokens) + 1);
  for (int s = 0; s < R; ++s) {
    const low_latency::PullSource* ps = pulled[size_t(s)];
    if (ps == nullptr) continue;
    // Counting sort of the source's (expert, slot) rows by token.
    std::fill(first.begin(), first.end(), 0);
    for (int j = 0; j < L; ++j) {
      const size_t chunk = size_t(me * L + j) * size_t(lay.max_tokens);
      for (int32_t i = 0; i < rb.layout_range[size_t(j) * R + s].count; ++i) {
        ++first[size_t(ps->tokens[chunk + size_t(i)]) + 1];
      }
    }
    for (size_t t = 1; t < first.size(); ++t) first[t] += first[t - 1];
    const size_t base = rows.size();
    rows.resize(base + size_t(first.back()));
    for (int j = 0; j < L; ++j) {
      const size_t chunk = size_t(me * L + j) * size_t(lay.max_tokens);
      const LowLatencyRange range = rb.layout_range[size_t(j) * R + s];
      for (int32_t i = 0; i < range.count; ++i) {
        const int32_t t = ps->tokens[chunk + size_t(i)];
        rows[base + size_t(first[size_t(t)]++)] =
            PullRow{s, t, int64_t(j) * lay.rows_per_expert() + range.begin + i, chunk + size_t(i)};
      }
    }
  }
  auto pull = [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r) {
      const PullRow& pr = rows[size_t(r)];
      const low_latency::PullSource& ps = *pulled[size_t(pr.source)];
      const std::byte* row = ps.rows + size_t(pr.token) * ps.stride;
      std::byte* to = xs + size_t(pr.to) * payload;
      if (stream) {
        internal::stream_copy(to, row, payload);
      } else {
        std::memcpy(to, row, payload);
      }
      if (scale_bytes != 0) std::memcpy(scales + size_t(pr.to) * scale_bytes, row + payload, scale_bytes);
      src[pr.to] = pr.token;
      prob[pr.to] = ps.probs[pr.from];
    }
    if (stream) internal::stream_fence();  // the caller's threads read the rows next
  };
  w.pool().parallel_for(int64_t(rows.size()), pull,
                        inline_copy ? std::max<int64_t>(1, int64_t(rows.size())) : 1);

  handle.layout_range = rb.layout_range;
  handle.received = true;
  return release.finish();
}

}  // namespace

StatusOr<LowLatencyDispatchOutput> LowLatencyBuffer::low_latency_dispatch(
    const LowLatencyDispatchInput& in, const Status& caller_error) {
  State& st = *state_;
  World& w = *st.world;
  const Status local = check_dispatch(st, in, caller_error);
  if (st.shrink) return low_latency::shrink_dispatch(state_, in, local);
  // Pull mode without a hook: this rank writes only its own memory (the rows and tokens its
  // in-node receivers read, the messages for other nodes), so it does so first and the
  // collective then publishes them with the counts (publish_dispatch): no signal round.
  // NOTE: its half's previous readers are done: they read it in the dispatch two back, inside
  // their own call (no hook then either, or nothing was left to read), before the agreement of
  // the dispatch one back let this rank through.
  const bool early = st.pull && !in.return_recv_hook && local.ok();
  std::vector<low_latency::PullSource> sources;
  std::vector<int32_t> published_count;
  if (!st.pull) {
    MOED_RETURN_IF_ERROR(w.agree(local));
  } else if (!early) {
    MOED_RETURN_IF_ERROR(publish_dispatch(st, in, local, nullptr, sources, published_count));
  }
  // NOTE: the agreement is also the double-buffer handshake: once it returns, every receiver
  // has entered this dispatch, so it has received (hooked) the dispatch two back and its views
  // of this half are released; senders may overwrite the half (their slots in it).

  const SegmentLayout& lay = st.layout;
  const int R = lay.num_ranks, E = lay.num_experts, L = lay.num_local_experts, me = w.rank();
  const int H = lay.hidden;
  const bool fp8 = in.use_fp8;
  const uint64_t seq = ++st.seq;
  const int half = int(st.dispatches++ % 2);
  DispatchHalf& dh = st.dispatch_half[half];
  dh.pending = true;

  const TopkRouting& routing = *in.topk;
  const int64_t T = in.x.rows;
  const int K = routing.num_topk;
  std::shared_ptr<LowLatencyHandle> handle = low_latency::new_dispatch_handle(st, routing, T);

  const size_t payload = fp8 ? size_t(H) : size_t(H) * sizeof(bf16);
  const size_t scale_bytes = fp8 ? size_t(lay.num_scales) * sizeof(float) : 0;
  const size_t row_bytes = sizeof(int32_t) + sizeof(float) + payload + scale_bytes;
  if (fp8) low_latency::cast_fp8_rows(st, in, dh.fp8_rows);

  // Network staging: one message per remote destination d, rows ordered by (j, i), laid out
  // as [token index x rows][prob x rows][payload x rows][scales x rows].
  std::vector<size_t> block(size_t(R), 0);
  std::vector<int64_t> block_rows(size_t(R), 0);
  std::vector<int64_t> chunk_row(size_t(E), 0);  // row of (d, j) chunk inside d's message
  size_t net_total = 0;
  for (int d = 0; d < R; ++d) {
    if (w.same_node(d, me)) continue;
    block[size_t(d)] = net_total;
    for (int j = 0; j < L; ++j) {
      chunk_row[size_t(d) * L + j] = block_rows[size_t(d)];
      block_rows[size_t(d)] += handle->send_count[size_t(d) * L + j];
    }
    net_total += align64(size_t(block_rows[size_t(d)]) * row_bytes);
  }
  dh.net_send.resize(net_total);

  const bool has_weights = routing.topk_weights.size() == size_t(T) * size_t(K);
  const bool pull_rows = st.pull && !in.return_recv_hook;  // see state.h, pull mode
  // Receivers read this half's own rows (no acks to wait for): the FP8 rows always, a few
  // bf16 rows once copied here; else the caller's x.
  const bool own_rows = pull_rows && (fp8 || size_t(T) * payload <= low_latency::kStageBytes);
  if (own_rows && !fp8) {
    dh.staged_rows.resize(size_t(T) * payload);
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(dh.staged_rows.data() + size_t(t) * payload, in.x.row_ptr(t), payload);
    }
  }
  std::vector<uint64_t> shared_rows(size_t(w.pool().num_threads()), 0);
  w.pool().parallel_for(T, [&](int64_t t0, int64_t t1, int worker) {
    for (int64_t t = t0; t < t1; ++t) {
      const std::byte* row = fp8 ? dh.fp8_rows.data() + size_t(t) * (payload + scale_bytes)
                                 : static_cast<const std::byte*>(in.x.row_ptr(t));
      for (int k = 0; k < K; ++k) {
        const int32_t e = routing.idx(t, k);
        if (e < 0) continue;
        const int d = e / L, j = e % L;
        const int64_t i = handle->slot[size_t(t) * K + k];
        const float p = has_weights ? routing.weight(t, k) : 0.0f;
        if (pull_rows && st.pulls(d)) {
          // d copies the row itself, from here (receive_dispatch).
          dh.pull_tokens[size_t(e) * size_t(lay.max_tokens) + size_t(i)] = int32_t(t);
          dh.pull_probs[size_t(e) * size_t(lay.max_tokens) + size_t(i)] = p;
          // NOTE: counted here, by the rank whose row crosses the node (as when it writes it
          // itself, and as the planning model counts NVLink bytes), not by the reader.
          ++shared_rows[size_t(worker)];
        } else if (w.same_node(d, me)) {
          std::byte* seg = st.segment(st.local_of(d));
          const int64_t r = lay.fixed_row(j, me, i);
          std::memcpy(seg + lay.dispatch_x[half] + size_t(r) * payload, row, payload);
          std::memcpy(seg + lay.dispatch_scales[half] + size_t(r) * scale_bytes, row + payload,
                      scale_bytes);
          const int32_t token = int32_t(t);
          std::memcpy(seg + lay.dispatch_src[half] + size_t(r) * sizeof(int32_t), &token,
                      sizeof(token));
          std::memcpy(seg + lay.dispatch_prob[half] + size_t(r) * sizeof(float), &p, sizeof(p));
          ++shared_rows[size_t(worker)];
        } else {
          std::byte* m = dh.net_send.data() + block[size_t(d)];
          const size_t rows = size_t(block_rows[size_t(d)]);
          const size_t at = size_t(chunk_row[size_t(e)] + i);
          const int32_t token = int32_t(t);
          std::memcpy(m + at * sizeof(int32_t), &token, sizeof(token));
          m += rows * sizeof(int32_t);
          std::memcpy(m + at * sizeof(float), &p, sizeof(p));
          m += rows * sizeof(float);
          std::memcpy(m + at * payload, row, payload);
          m += rows * payload;
          std::memcpy(m + at * scale_bytes, row + payload, scale_bytes);
        }
      }
    }
  });
  if (early) {
    // Where in-node receivers find this rank's rows, published with the counts.
    low_latency::PullSource ps;
    ps.pulled = true;
    ps.acked = !own_rows;
    ps.rows = fp8        ? dh.fp8_rows.data()
              : own_rows ? dh.staged_rows.data()
                         : static_cast<const std::byte*>(in.x.data);
    ps.stride = fp8        ? payload + scale_bytes
                : own_rows ? payload
                           : size_t(in.x.row_stride) * sizeof(bf16);
    ps.tokens = dh.pull_tokens.data();
    ps.probs = dh.pull_probs.data();
    Status published =
        publish_dispatch(st, in, local, &ps, sources, published_count, handle->send_count);
    if (!published.ok()) {
      // Nothing left this rank: the call never happened.
      dh.pending = false;
      --st.seq;
      --st.dispatches;
      return published;
    }
  }
  low_latency::add_shared_rows(w, shared_rows, payload + scale_bytes);
  dh.sources = std::move(sources);
  dh.published_count = std::move(published_count);
  dh.own_rows_seq = early && own_rows ? seq : 0;

  // Publish: every (me, expert) count, zero included (there is no notify), after its rows;
  // receivers that read this rank's rows in place have them from the collective.
  for (int d = 0; d < R && !pull_rows; ++d) {
    if (!w.same_node(d, me)) continue;
    std::atomic<uint64_t>* c = st.counts(st.local_of(d), half);
    for (int j = 0; j < L; ++j) {
      const uint64_t v =
          ((seq & 0xffffffffu) << 32) | uint64_t(handle->send_count[size_t(d) * L + j]);
      c[size_t(j) * R + me].store(v, std::memory_order_release);
    }
    if (d != me) st.shared->signal(st.local_of(d), seq);
  }
  // Other nodes: a header of L counts, then the rows, to every remote rank; receive headers.
  auto post_remote = [&](int d) -> Status {
    int32_t* header = dh.send_header.data() + size_t(d) * L;
    for (int j = 0; j < L; ++j) header[j] = handle->send_count[size_t(d) * L + j];
    MOED_RETURN_IF_ERROR(keep_request(w.isend(d, message_tag(seq, MessageKind::kDispatchHeader),
                                              header, size_t(L) * sizeof(int32_t)),
                                      dh.send_requests));
    if (block_rows[size_t(d)] > 0) {
      MOED_RETURN_IF_ERROR(keep_request(
          w.isend(d, message_tag(seq, MessageKind::kDispatchData),
                  dh.net_send.data() + block[size_t(d)], size_t(block_rows[size_t(d)]) * row_bytes),
          dh.send_requests));
    }
    return keep_request(w.irecv(d, message_tag(seq, MessageKind::kDispatchHeader),
                                dh.recv_header.data() + size_t(d) * L, size_t(L) * sizeof(int32_t)),
                        dh.header_requests);
  };
  Status status;
  for (int d = 0; d < R && status.ok(); ++d) {
    if (!w.same_node(d, me)) status = post_remote(d);
  }
  if (!status.ok()) {
    dh.pending = false;
    low_latency::release_pulled(st, half, low_latency::PullKind::kDispatch, seq, dh.sources)
        .ignore();
    return status;
  }

  std::shared_ptr<low_latency::ReceiveBlock> rb = low_latency::take_receive_block(st, half, fp8);
  LowLatencyDispatchOutput out;
  low_latency::view_receive_block(st, rb, out);
  out.handle = handle;

  auto receive = [state = state_, handle, half, seq, fp8, rb] {
    return receive_dispatch(*state, *handle, half, seq, fp8, *rb);
  };
  MOED_RETURN_IF_ERROR(
      low_latency::receive_now_or_hook(in.return_recv_hook, std::move(receive), out.hook));
  return out;
}

}  // namespace moed
