// What the send and receive phases of dispatch.cc and combine.cc do alike: keep the requests
// they post, count their node-shared traffic, and run their receive phase now or as a hook.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "comm/wait.h"
#include "dispatch/low_latency/state.h"

namespace moed {

namespace low_latency {

// Copies below this many bytes run on the calling thread (parallel_for's min_chunk): waking
// the pool's workers costs more than they save.
inline constexpr size_t kInlineBytes = size_t(256) << 10;
// Pull-mode dispatch: a sender whose bf16 rows total at most this many bytes copies them into
// its half first, so that its call need not wait for every receiver's ack (state.h): copying
// 64 KiB takes a few microseconds, about what one round of acks costs on a 2-core host.
inline constexpr size_t kStageBytes = size_t(64) << 10;

// Keeps a posted isend / irecv in `requests` (waited on by the receive phase), or returns the
// error of posting it.
inline Status keep_request(StatusOr<Request> posted, std::vector<Request>& requests) {
  if (!posted.ok()) return std::move(posted).status();
  requests.push_back(std::move(posted).value());
  return ok_status();
}

// Reports the rows the workers copied into node-shared segments, counted per worker so the
// parallel copies need no shared counter.
inline void add_shared_rows(World& w, std::span<const uint64_t> rows_per_worker, size_t row_bytes) {
  uint64_t rows = 0;
  for (uint64_t n : rows_per_worker) rows += n;
  w.add_shared_bytes(rows * row_bytes, rows);
}

// Pull mode, at the end of a receive: acks every in-node peer that left the caller's rows to
// be read (its PullSource says so), then, if this rank left its caller's rows, waits until
// every in-node peer has acked (so that the call may return and the caller reuse them). Ranks
// that used the hook copied their rows, and ranks that read from their own copy (acked =
// false) wait for nobody, so hooks may run in any order. `published`: every rank's
// PullSource ([R]) as the call's opening collective gathered it.
inline Status exchange_acks(LowLatencyBuffer::State& st, int half, PullKind kind, uint64_t seq,
                            std::span<const PullSource> published) {
  World& w = *st.world;
  const int G = w.ranks_per_node(), me = w.local_rank();
  MOED_CHECK(published.size() == size_t(w.size()), "exchange_acks: ", published.size(),
             " published sources for ", w.size(), " ranks");
  auto source = [&](int p) -> const PullSource& {
    return published[size_t(w.node()) * size_t(G) + size_t(p)];
  };
  for (int p = 0; p < G; ++p) {
    const PullSource& ps = source(p);
    if (p != me && ps.pulled && ps.acked) {
      st.acks(p, half, kind)[me].store(seq, std::memory_order_release);
    }
  }
  const PullSource& own = source(me);
  if (!own.pulled || !own.acked) return ok_status();
  std::atomic<uint64_t>* mine = st.acks(me, half, kind);
  for (int p = 0; p < G; ++p) {
    if (p == me) continue;
    MOED_RETURN_IF_ERROR(internal::poll_peer(
        w, [&] { return mine[p].load(std::memory_order_acquire) >= seq; },
        [&] {
          return std::string("low-latency ") +
                 (kind == PullKind::kDispatch ? "dispatch" : "combine") +
                 ": waiting for local rank " + std::to_string(p) +
                 " to read this rank's rows (every rank must pass the same return_recv_hook)";
        }));
  }
  return ok_status();
}

// The receive phase: run now (hook = an already-completed request), or handed back as `hook`
// when the caller asked for one (return_recv_hook).
template <typename Receive>
Status receive_now_or_hook(bool return_hook, Receive receive, Request& hook) {
  if (return_hook) {
    hook = make_hook(std::move(receive));
    return ok_status();
  }
  Status s = receive();
  hook = completed_request(s);
  return s;
}

}  // namespace low_latency

}  // namespace moed
