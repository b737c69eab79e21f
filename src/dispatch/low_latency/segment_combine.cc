// Every combine, its in-node rows read through the segments or in place, and shrink mode's
// clean (segment.h; the protocol in segment_peers.h).
#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "core/row_kernels.h"
#include "dispatch/flex/message.h"
#include "dispatch/low_latency/segment.h"
#include "dispatch/low_latency/segment_peers.h"
#include "dispatch/sections.h"

namespace moed::low_latency {

using segment::Call;
using segment::finish_receive;
using segment::message_rows;
using segment::open_call;
using segment::Peers;
using segment::post_combine_messages;
using segment::publish;
using segment::receive_parts;
using segment::State;
using segment::word;

Status segment::post_combine_messages(Peers& peers, const LowLatencyHandle* handle,
                                      const TensorView& x, int half, uint64_t seq,
                                      const Status& local) {
  State& st = peers.state();
  World& w = *st.world;
  const SegmentLayout& lay = st.layout;
  CombineHalf& ch = st.combine_half[half];
  const int R = lay.num_ranks, L = lay.num_local_experts, H = lay.hidden;
  const size_t row_bytes = size_t(H) * sizeof(bf16);
  // What a call of this half that failed midway left (its requests) is dropped.
  ch.recvs.clear();
  ch.recvs.resize(size_t(R));
  ch.row_recvs.clear();
  ch.row_peers.clear();
  ch.requests.clear();
  ch.send_peers.clear();
  if (handle == nullptr) return ok_status();
  auto remote = [&](int r) { return !peers.in_node(r) && !peers.masked(r); };
  const int tag = tags::low_latency(seq, tags::LowLatencyKind::kCombineData);
  // Home side: from each expert rank of another node its verdict, then one message of its
  // chunks, expert by expert (sizes from this rank's dispatch), into its block.
  ch.net_block.assign(size_t(R), 0);
  std::vector<size_t> rows_bytes(size_t(R), 0);
  Sections blocks(64);
  for (int d = 0; d < R; ++d) {
    if (!remote(d)) continue;
    for (int j = 0; j < L; ++j)
      rows_bytes[size_t(d)] += size_t(handle->send_count[size_t(d) * L + j]) * row_bytes;
    ch.net_block[size_t(d)] = blocks.add(64 + rows_bytes[size_t(d)]);
  }
  ch.net_recv.resize(blocks.aligned_end());
  Status posted;
  for (int d = 0; d < R && posted.ok(); ++d) {
    if (!remote(d)) continue;
    std::byte* b = ch.net_recv.data() + ch.net_block[size_t(d)];
    posted = peers.post(d, w.irecv(d, tag, b, sizeof(uint64_t)), ch.recvs[size_t(d)]);
    if (rows_bytes[size_t(d)] == 0 || !posted.ok()) continue;
    posted = peers.post_send(d, w.irecv(d, tag, b + 64, rows_bytes[size_t(d)]), ch.row_recvs,
                             ch.row_peers);
  }
  // Expert side: to each home of another node the same, the rows gathered straight from x
  // (World::isend_gather; staged where x is strided, or holds no rows because the input was
  // bad).
  const bool stage = !local.ok() || !x.contiguous();
  size_t staged = 0;
  for (int s = 0; s < R && stage; ++s) {
    for (int j = 0; j < L && !peers.in_node(s); ++j) {
      staged += size_t(handle->layout_range[size_t(j) * R + s].count) * row_bytes;
    }
  }
  ch.verdicts.assign(size_t(R), uint64_t(uint32_t(local.code())));
  ch.net_send.resize(staged);
  std::byte* m = ch.net_send.data();
  std::vector<World::Piece> pieces;
  for (int s = 0; s < R && posted.ok(); ++s) {
    if (!remote(s)) continue;
    posted = peers.post_send(s, w.isend(s, tag, &ch.verdicts[size_t(s)], sizeof(uint64_t)),
                             ch.requests, ch.send_peers);
    pieces.clear();
    for (int j = 0; j < L; ++j) {
      const LowLatencyRange r = handle->layout_range[size_t(j) * R + s];
      if (r.count == 0) continue;
      const int64_t from = int64_t(j) * lay.rows_per_expert() + r.begin;
      const void* rows = stage ? static_cast<const void*>(m) : x.row_ptr(from);
      if (stage && local.ok()) {
        internal::copy_rows(TensorView(m, DType::kBF16, r.count, H), 0, x, from, r.count);
      }
      if (stage) m += size_t(r.count) * row_bytes;
      flex::add_piece(pieces, rows, size_t(r.count) * row_bytes);
    }
    if (pieces.empty() || !posted.ok()) continue;
    posted = peers.post_send(s, w.isend_gather(s, tag, pieces), ch.requests, ch.send_peers);
  }
  return posted;
}

uint64_t segment::message_rows(const State& st, int half, const LowLatencyHandle& handle, int d,
                               std::vector<const std::byte*>& first_row) {
  const CombineHalf& ch = st.combine_half[half];
  const int L = st.layout.num_local_experts;
  const size_t row_bytes = size_t(st.layout.hidden) * sizeof(bf16);
  const std::byte* m = ch.net_recv.data() + ch.net_block[size_t(d)];
  uint64_t verdict = 0;
  std::memcpy(&verdict, m, sizeof(verdict));
  m += 64;
  for (int j = 0; j < L; ++j) {
    first_row[size_t(d) * L + j] = m;
    m += size_t(handle.send_count[size_t(d) * L + j]) * row_bytes;
  }
  return verdict;
}

namespace {

// The rows the in-node homes read in place from this rank, counted here, by the rank whose rows
// cross the node (as when it writes them, and as the planning model counts NVLink bytes).
void count_in_node_rows(State& st, const LowLatencyHandle& handle) {
  World& w = *st.world;
  const int R = st.layout.num_ranks;
  uint64_t rows = 0;
  for (size_t c = 0; c < handle.layout_range.size(); ++c) {
    if (w.same_node(int(c % size_t(R)), w.rank())) rows += uint64_t(handle.layout_range[c].count);
  }
  add_shared_rows(w, {&rows, 1}, size_t(st.layout.hidden) * sizeof(bf16));
}

// Receive phase of combine n from `half`: out[t] = sum over t's experts e ascending of
// w * float(y[e][slot]), fp32 from 0, each product and sum rounded on its own. In-node experts'
// outputs are in their ranks' segments, or in place where `in_place` ([R]) says.
Status receive_combine(State& st, const LowLatencyHandle& handle, const TopkView& routing,
                       std::span<const int32_t> order, int half, uint64_t n, TensorView out,
                       std::span<const InPlaceRows> in_place) {
  World& w = *st.world;
  const SegmentLayout& lay = st.layout;
  CombineHalf& ch = st.combine_half[half];
  const int R = lay.num_ranks, L = lay.num_local_experts, me = w.rank(), H = lay.hidden;
  const size_t row_bytes = size_t(H) * sizeof(bf16);
  ch.pending = false;
  Peers peers(st, "low_latency_combine");
  Status bad;
  // Where each expert's rows for this rank start: in-node experts' ranks publish their layout,
  // the others' rows come in one message, local experts in order. In place, in-node rows are
  // found per term (in_node_row): at decode a token reads a few of the L experts' ranges.
  std::vector<const std::byte*> first_row(size_t(lay.num_experts), nullptr);
  std::vector<bool> from_segment(size_t(R), false);
  auto in_node_row = [&](int32_t e, int32_t slot) -> const std::byte* {
    const InPlaceRows& p = in_place[size_t(e / L)];
    const int j = e % L;
    const int64_t row = int64_t(j) * lay.rows_per_expert() + p.ranges[size_t(j) * R + me].begin;
    return p.rows + size_t(row + slot) * p.stride;
  };
  const auto read_in_place = [&](int32_t e) { return !in_place.empty() && peers.in_node(e / L); };
  auto read_rows = [&](int d, std::optional<uint64_t> published) -> StatusOr<uint64_t> {
    uint64_t verdict = 0;
    if (published && !in_place.empty()) return *published;
    if (published) {
      verdict = *published;
      const std::byte* seg = st.segment(st.local_of(d));
      const auto* ranges = reinterpret_cast<const LowLatencyRange*>(seg + lay.ranges[half]);
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
      return verdict;
    }
    return message_rows(st, half, handle, d, first_row);
  };
  MOED_RETURN_IF_ERROR(receive_parts(st, peers, CallKind::kCombine, half, n, false,
                                     !in_place.empty(), ch.recvs, from_segment, bad, read_rows,
                                     [&](int d) {
                                       for (int j = 0; j < L; ++j)
                                         first_row[size_t(d) * L + j] = nullptr;
                                     }));
  Status rows_in = peers.wait_sends(ch.row_recvs, ch.row_peers);  // masks a lost sender
  Status sent = peers.wait_sends(ch.requests, ch.send_peers);
  MOED_RETURN_IF_ERROR(rows_in);
  ch.recvs.clear();  // dropped: cancelled where a masked peer never sent
  ch.recvs.resize(size_t(R));
  MOED_RETURN_IF_ERROR(sent);

  // out[t] = sum over t's experts e of unmasked ranks, ascending, of w * y (as the normal path).
  reduce_tokens(
      w, handle, routing, order,
      [&](int32_t e) {
        return (read_in_place(e) || first_row[size_t(e)] != nullptr) && !peers.masked(e / L);
      },
      [&](int32_t e, int32_t slot) {
        return read_in_place(e) ? in_node_row(e, slot)
                                : first_row[size_t(e)] + size_t(slot) * row_bytes;
      },
      out);
  MOED_RETURN_IF_ERROR(finish_receive(st, peers, CallKind::kCombine, half, n, from_segment));
  MOED_RETURN_IF_ERROR(ch.local_check);
  return bad;
}

}  // namespace

StatusOr<LowLatencyCombineOutput> segment_combine(const std::shared_ptr<State>& sp,
                                                  const LowLatencyCombineInput& in,
                                                  const Status& local,
                                                  std::vector<InPlaceRows> in_place) {
  State& st = *sp;
  World& w = *st.world;
  Peers peers(st, "low_latency_combine");
  const SegmentLayout& lay = st.layout;
  const int R = lay.num_ranks, L = lay.num_local_experts, me = w.rank(), H = lay.hidden;
  MOED_ASSIGN_OR_RETURN(const Call call, open_call(st, peers, CallKind::kCombine, st.combines,
                                                   st.combine_half, local));
  const int half = call.half;
  const uint64_t n = call.n, seq = call.seq;
  CombineHalf& ch = st.combine_half[half];
  const bool ok = local.ok();
  // NOTE: a bad call may carry no usable handle: it then neither sends nor receives messages
  // (their sizes come from the dispatch), and the ranks of other nodes mask this rank.
  const LowLatencyHandle* handle =
      in.handle && in.handle->buffer_id == st.id && in.handle->received ? in.handle.get() : nullptr;

  // In place, the in-node homes read this rank's rows where they are, until the round closes.
  // NOTE: always read in place, round and all, even at T = 1: copying the rows into the homes'
  // slots first (8 rows of 14 KiB a rank at decode) costs more than the round it saves.
  std::optional<flex::PublishRound> round;
  if (!in_place.empty()) {
    round.emplace(w, st.combine_signals, st.combine_epoch, /*in_place=*/true,
                  flex::PublishRound::Role::kReads);
    round->opened_by_collective();
    count_in_node_rows(st, *in.handle);
  }
  auto close = [&](Status status) { return round ? round->close(status) : status; };
  // Else the rows of in-node homes into this rank's segment (the packed layout, as x), with the
  // layout; one message for each other node's home.
  std::byte* seg = st.local();
  if (ok && in_place.empty()) {
    const TensorView y(seg + lay.combine_y[half], DType::kBF16, int64_t(L) * lay.rows_per_expert(),
                       H);
    std::vector<std::pair<int64_t, int64_t>> chunks;  // (row, rows)
    int64_t rows = 0;
    for (int j = 0; j < L; ++j) {
      for (int s = 0; s < R; ++s) {
        const LowLatencyRange r = handle->layout_range[size_t(j) * R + s];
        if (r.count == 0 || !peers.in_node(s) || peers.masked(s)) continue;
        chunks.emplace_back(int64_t(j) * lay.rows_per_expert() + r.begin, r.count);
        rows += r.count;
      }
    }
    const bool stream = stream_node_copy(w, size_t(rows) * y.row_bytes());
    w.pool().parallel_for(int64_t(chunks.size()), [&](int64_t b, int64_t e, int) {
      for (int64_t c = b; c < e; ++c) {
        const auto [at, count] = chunks[size_t(c)];
        internal::copy_rows(y, at, in.x, at, count, nullptr, stream);
      }
      if (stream) internal::stream_fence();
    });
    std::memcpy(seg + lay.ranges[half], handle->layout_range.data(),
                handle->layout_range.size() * sizeof(LowLatencyRange));
  }
  publish(st, CallKind::kCombine, half, n, local, false);
  Status posted = post_combine_messages(peers, handle, in.x, half, seq, local);
  if (!posted.ok()) {
    ch.pending = false;
    return close(posted);
  }

  LowLatencyCombineOutput out;
  const int64_t T = handle != nullptr ? handle->num_tokens : 0;
  if (!in.out) out.combined_x = Tensor::empty(DType::kBF16, T, H);
  out.out = in.out;
  if (!ok) {
    // A rank with bad input still takes its messages (with a handle), then fails.
    if (handle != nullptr) {
      // Its sums are thrown away: no weights needed.
      const TopkView routing{handle->topk_idx.data(), false, nullptr, handle->num_tokens,
                             handle->num_topk};
      Tensor scratch = Tensor::empty(DType::kBF16, T, H);
      receive_combine(st, *handle, routing, {}, half, n, scratch.view(), {}).ignore();
    } else {
      ch.pending = false;
      word(st, me, kDone, CallKind::kCombine, half)->store(n, std::memory_order_release);
    }
    return close(local);
  }
  if (!in.return_recv_hook) {
    auto receive = [&] {
      return close(
          receive_combine(st, *handle, in.topk, in.order, half, n, out.result(), in_place));
    };
    MOED_RETURN_IF_ERROR(receive_now_or_hook(false, std::move(receive), out.hook));
    return out;
  }
  // The receive runs in the hook, after the caller's routing is gone: it reads a copy.
  auto receive = [sp, handle = in.handle, routing = to_topk(in.topk),
                  order = std::vector<int32_t>(in.order.begin(), in.order.end()), half, n,
                  view = out.result()] {
    return receive_combine(*sp, *handle, TopkView::of(routing), order, half, n, view, {});
  };
  MOED_RETURN_IF_ERROR(receive_now_or_hook(true, std::move(receive), out.hook));
  return out;
}

Status segment_clean(State& st) {
  World& w = *st.world;
  Peers peers(st, "clean_low_latency_buffer");
  MOED_RETURN_IF_ERROR(peers.check_removed());
  const int R = w.size(), me = w.rank();
  const uint64_t k = ++st.cleans;
  const uint64_t seq = ++st.seq;
  st.segment_word(w.local_rank(), kCleaned)->store(k, std::memory_order_release);
  std::vector<Request> recvs(static_cast<size_t>(R)), sends(static_cast<size_t>(R));
  std::vector<uint64_t> in(static_cast<size_t>(R), 0);
  for (int d = 0; d < R; ++d) {
    if (peers.in_node(d) || peers.masked(d)) continue;
    const int tag = tags::low_latency(seq, tags::LowLatencyKind::kClean);
    MOED_RETURN_IF_ERROR(peers.post(d, w.isend(d, tag, &k, sizeof(k)), sends[size_t(d)]));
    MOED_RETURN_IF_ERROR(
        peers.post(d, w.irecv(d, tag, &in[size_t(d)], sizeof(k)), recvs[size_t(d)]));
  }
  for (int p = 0; p < R; ++p) {
    if (p == me || !peers.in_node(p)) continue;
    std::atomic<uint64_t>* cleaned = st.segment_word(st.local_of(p), kCleaned);
    MOED_RETURN_IF_ERROR(
        peers.wait(p, [&] { return cleaned->load(std::memory_order_acquire) >= k; }).status());
  }
  for (int d = 0; d < R; ++d) {
    MOED_RETURN_IF_ERROR(peers.wait(d, recvs[size_t(d)]).status());
    MOED_RETURN_IF_ERROR(peers.wait(d, sends[size_t(d)]).status());
  }
  return ok_status();
}

}  // namespace moed::low_latency
