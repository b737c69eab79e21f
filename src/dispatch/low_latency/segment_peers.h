// The segment protocol (segment.h), shared by segment_dispatch.cc and segment_combine.cc:
// every rank writes only its own node-shared segment and sends messages; an in-node peer reads
// what a rank published once the rank's sequence word says the call's part is complete. Shrink
// mode runs it with no collective and masks a peer that misses a wait's deadline; otherwise
// the call's agreement comes first and a wait is the world's. A rank's words (state.h,
// SegmentWord), per kind k (dispatch, combine) and half h:
//   kSent[k][h]     the call (1-based, per kind) whose rows, counts and verdict half h holds
//   kVerdict[k][h]  its verdict: the StatusCode of this rank's input check, plus kFp8Flag
//   kDone[k][h]     the call of half h whose receive this rank has finished: in shrink mode a
//                   rank writes half h for call n only once every unmasked in-node peer is
//                   done with n - 2 (else the agreement says so)
//   kCleaned        clean() calls entered
//   kWaitUntil      while this rank is in a shrink-mode wait, until when it may wait; after
//                   it, when it ended (steady clock, ns)
//   kMask + r       1 where this rank masked rank r; rank r reading it learns it was removed
// Dispatch (shrink mode): counts[h][e] = rows this rank sends to expert e; the rows, their scales,
// source tokens and probs at (chunk e, slot i) of dispatch_x / _scales / _src / _prob[h]. Combine:
// combine_y[h] holds the expert outputs for in-node homes in the dispatch's packed layout,
// ranges[h] that layout [L][R]. Other nodes: per call, to every unmasked remote rank, a
// header [verdict, L counts] then the rows (dispatch), the verdict then one message per expert
// chunk, straight from x (combine: both sides know the sizes from the dispatch), or one word
// (clean).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "comm/wait.h"
#include "dispatch/low_latency/dispatch_rows.h"
#include "dispatch/low_latency/phases.h"
#include "dispatch/low_latency/state.h"

namespace moed::low_latency::segment {

using Clock = std::chrono::steady_clock;
using State = LowLatencyBuffer::State;

constexpr uint64_t kFp8Flag = uint64_t(1) << 32;  // in a verdict: the rows are FP8
constexpr int32_t kHeaderFp8Flag = 1 << 16;       // the same in a network header's int32

// The peer waits of one call. Shrink mode: each for at most the shrink timeout from its start;
// a peer that misses it, or that the world reports failed, is masked and the call goes on
// without it. Otherwise a wait is the world's (bounded by its timeout, ended by a failure) and
// a lost peer is every waiter's error.
// NOTE: a deadline per wait, not per call: a live peer may answer only once its own wait for a
// lost rank has run out (a message it receives after a header, say). An in-node peer says how
// long it may wait, or when its last wait ended (kWaitUntil): it is given until then plus the
// shrink timeout, so a rank held up by another node's lost rank, which its node-mates may not
// have waited for, is not lost to them. The word carries the longest wait of a chain of
// waiters (each raises its own to the peer's), without the added timeout: a cycle of waiters
// stays bounded. A wait that ended says when, not its deadline: a peer that answered its own
// wait early and then went silent gets no more than one timeout after that.
class Peers {
 public:
  Peers(State& st, const char* call) : st_(st), w_(*st.world), call_(call) {}

  bool masked(int r) const { return word(kMask + size_t(r))->load(std::memory_order_acquire) != 0; }
  bool in_node(int r) const { return w_.same_node(r, w_.rank()); }
  State& state() const { return st_; }
  const char* call() const { return call_; }

  void mask(int r, const std::string& why) {
    if (masked(r)) return;
    word(kMask + size_t(r))->store(1, std::memory_order_release);
    std::fprintf(stderr, "moed: rank %d masks rank %d in %s: %s\n", w_.rank(), r, call_,
                 why.c_str());
  }

  // In-node peer r has masked this rank: the buffer is lost to it (every later call says so).
  Status removed_by(int r) {
    if (!in_node(r) || r == w_.rank()) return ok_status();
    if (word_of(r, kMask + size_t(w_.rank()))->load(std::memory_order_acquire) == 0)
      return ok_status();
    st_.removed = aborted("rank ", w_.rank(), " was removed by rank ", r,
                          " (masked in shrink mode: it missed a call's deadline of ",
                          st_.shrink_timeout.count(), " ms or was seen failed); its ", call_,
                          " and every later call fail");
    return st_.removed;
  }
  Status check_removed() {
    if (!st_.shrink) return ok_status();  // only shrink mode masks
    MOED_RETURN_IF_ERROR(st_.removed);
    for (int r = 0; r < w_.size(); ++r) {
      if (!masked(r)) MOED_RETURN_IF_ERROR(removed_by(r));
    }
    return ok_status();
  }

  // Waits until ready() holds for in-node peer r: true; false once r is masked.
  template <typename Ready>
  StatusOr<bool> wait(int r, Ready&& ready) {
    if (!st_.shrink) {
      MOED_RETURN_IF_ERROR(
          internal::poll_peer(w_, ready, [&] { return str_cat(call_, ": waiting for rank ", r); }));
      return true;
    }
    Waiting waiting(*this, Clock::now() + st_.shrink_timeout);
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
      const uint64_t theirs = word_of(r, kWaitUntil)->load(std::memory_order_relaxed);
      waiting.raise(theirs);
      if (Clock::now() >= std::max(waiting.own(), at(theirs) + st_.shrink_timeout)) {
        mask(r, str_cat("no answer within ", st_.shrink_timeout.count(),
                        " ms (of this wait's start, or of the end of a wait of its own)"));
        return false;
      }
      internal::backoff(i);
    }
  }

  // Waits for a message to or from rank r (another node): true when done; false once r is
  // masked (failed, or the deadline passed: the message is then cancelled).
  StatusOr<bool> wait(int r, Request& request) {
    if (masked(r) || !request) return false;
    std::optional<Waiting> waiting;
    if (st_.shrink) waiting.emplace(*this, Clock::now() + st_.shrink_timeout);
    Status s = st_.shrink ? request->wait_for(st_.shrink_timeout) : request->wait();
    request.reset();
    if (s.ok()) return true;
    if (!st_.shrink) return s;
    mask(r, s.message());
    return false;
  }

  // Posts a message; a peer that cannot take it is masked (the request stays empty).
  Status post(int r, StatusOr<Request> posted, Request& request) {
    if (posted.ok()) {
      request = std::move(posted).value();
      return ok_status();
    }
    if (!st_.shrink) return posted.status();
    mask(r, posted.status().message());
    return ok_status();
  }

  // A call's sends: each posted one kept in `requests`, its rank in `ranks`, until wait_sends
  // waits for them all (each as wait(r, request)) and forgets them.
  Status post_send(int r, StatusOr<Request> posted, std::vector<Request>& requests,
                   std::vector<int>& ranks) {
    Request request;
    MOED_RETURN_IF_ERROR(post(r, std::move(posted), request));
    if (!request) return ok_status();
    requests.push_back(std::move(request));
    ranks.push_back(r);
    return ok_status();
  }
  Status wait_sends(std::vector<Request>& requests, std::vector<int>& ranks) {
    Status first;
    for (size_t i = 0; i < requests.size(); ++i) {
      StatusOr<bool> done = wait(ranks[i], requests[i]);
      if (first.ok()) first = done.status();
    }
    requests.clear();
    ranks.clear();
    return first;
  }

 private:
  // This rank's kWaitUntil for one wait: its own deadline, raised to a waited-for peer's; then
  // the time it ended.
  class Waiting {
   public:
    Waiting(Peers& p, Clock::time_point own) : word_(p.word(kWaitUntil)), own_(own) {
      word_->store(ns(own), std::memory_order_relaxed);
    }
    ~Waiting() { word_->store(ns(Clock::now()), std::memory_order_relaxed); }
    Waiting(const Waiting&) = delete;
    Waiting& operator=(const Waiting&) = delete;
    Clock::time_point own() const { return own_; }
    void raise(uint64_t theirs) {
      if (theirs > word_->load(std::memory_order_relaxed))
        word_->store(theirs, std::memory_order_relaxed);
    }

   private:
    std::atomic<uint64_t>* word_;
    Clock::time_point own_;
  };
  static uint64_t ns(Clock::time_point t) {
    return uint64_t(
        std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count());
  }
  static Clock::time_point at(uint64_t ns) {
    return Clock::time_point(
        std::chrono::duration_cast<Clock::duration>(std::chrono::nanoseconds(ns)));
  }
  std::atomic<uint64_t>* word(size_t index) const {
    return st_.segment_word(w_.local_rank(), index);
  }
  std::atomic<uint64_t>* word_of(int r, size_t index) const {
    return st_.segment_word(st_.local_of(r), index);
  }
  State& st_;
  World& w_;
  const char* call_;
};

inline std::atomic<uint64_t>* word(const State& st, int rank, SegmentWord w, CallKind k, int half) {
  return st.segment_word(st.local_of(rank), word_index(w, k, half));
}

// Before this rank writes half `half` for call n: every unmasked in-node peer is done with
// call n - 2 of that half.
inline Status wait_half_free(State& st, Peers& peers, CallKind kind, int half, uint64_t n) {
  World& w = *st.world;
  if (n <= 2) return ok_status();
  for (int p = 0; p < w.size(); ++p) {
    if (p == w.rank() || !peers.in_node(p)) continue;
    std::atomic<uint64_t>* done = word(st, p, kDone, kind, half);
    // A masked peer is not waited for, but what it finished reading before it was masked is
    // acquired (its kDone), so this rank's writes are ordered after those reads; one masked
    // while still reading finds itself removed and discards what it read.
    if (peers.masked(p)) {
      (void)done->load(std::memory_order_acquire);
      continue;
    }
    MOED_RETURN_IF_ERROR(
        peers.wait(p, [&] { return done->load(std::memory_order_acquire) >= n - 2; }).status());
  }
  return ok_status();
}

// The numbers of one segment call.
struct Call {
  int half;
  uint64_t n;    // the call of its kind, 1-based
  uint64_t seq;  // the operation (message tags)
};

// Opens the next call of `kind` (`calls` and `halves`: that kind's count and halves): its half
// is pending, with this rank's input check `local`, once it is free (wait_half_free).
// A failed precondition (two calls in flight): the call does not happen here, and the peers
// mask this rank if it never does.
template <typename Half>
StatusOr<Call> open_call(State& st, Peers& peers, CallKind kind, uint64_t& calls, Half (&halves)[2],
                         const Status& local) {
  if (local.code() == StatusCode::kFailedPrecondition) return local;
  MOED_RETURN_IF_ERROR(peers.check_removed());
  const int half = int(calls % 2);
  const Call call{half, ++calls, ++st.seq};
  Half& h = halves[half];
  h.pending = true;
  h.local_check = local;
  // Outside shrink mode the call's agreement said every peer has entered it, so it has received
  // the call two back: the half is free.
  if (!st.shrink) return call;
  Status freed = wait_half_free(st, peers, kind, half, call.n);
  if (!freed.ok()) {
    h.pending = false;
    return freed;
  }
  return call;
}

// Waits until in-node peer r has published its part of call n in half `half`: its verdict;
// none once r is masked.
inline StatusOr<std::optional<uint64_t>> wait_published(State& st, Peers& peers, CallKind kind,
                                                        int half, uint64_t n, int r) {
  std::atomic<uint64_t>* sent = word(st, r, kSent, kind, half);
  MOED_ASSIGN_OR_RETURN(bool ready,
                        peers.wait(r, [&] { return sent->load(std::memory_order_acquire) >= n; }));
  if (!ready) return std::optional<uint64_t>();
  if (sent->load(std::memory_order_acquire) != n) {
    MOED_RETURN_IF_ERROR(peers.removed_by(r));
    return internal_error(peers.call(), " #", n, ": rank ", r, " published call ", sent->load(),
                          " in this half");
  }
  return std::optional<uint64_t>(
      word(st, r, kVerdict, kind, half)->load(std::memory_order_relaxed));
}

// A source's verdict as this rank's error (OK when it checked its input fine and used the same
// FP8 setting).
inline Status verdict_error(const char* call, uint64_t n, int source, uint64_t verdict, bool fp8) {
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

// A receive's walk over the sources of call n in half `half`, in rank order: each unmasked
// in-node peer once it has published (from_segment[r] set), each other node's once its first
// message first[r] is in. read(r, published) takes the source's part and returns its verdict
// (`published`: the in-node peer's; none for another node's, whose message holds it). A source
// whose verdict is an error is dropped (drop(r)) and, the first, kept in `bad`. `in_place`: the
// call's agreement has published the in-node peers' parts (verdict 0), read where they are.
template <typename Read, typename Drop>
Status receive_parts(State& st, Peers& peers, CallKind kind, int half, uint64_t n, bool fp8,
                     bool in_place, std::vector<Request>& first, std::vector<bool>& from_segment,
                     Status& bad, Read&& read, Drop&& drop) {
  for (int r = 0; r < st.world->size(); ++r) {
    if (peers.masked(r)) continue;
    std::optional<uint64_t> published;
    if (peers.in_node(r) && in_place) {
      published = 0;
    } else if (peers.in_node(r)) {
      MOED_ASSIGN_OR_RETURN(published, wait_published(st, peers, kind, half, n, r));
      if (!published) continue;
      from_segment[size_t(r)] = true;
    } else {
      MOED_ASSIGN_OR_RETURN(const bool in, peers.wait(r, first[size_t(r)]));
      if (!in) continue;
    }
    MOED_ASSIGN_OR_RETURN(const uint64_t verdict, read(r, published));
    Status v = verdict_error(peers.call(), n, r, verdict, fp8);
    if (v.ok()) continue;
    if (bad.ok()) bad = v;
    drop(r);
  }
  return ok_status();
}

// Ends this rank's receive of call n: done with half `half`. A peer it read from (from_segment)
// that masked this rank meanwhile may have written the half again: what was read from it is
// not to be trusted, and this rank is out.
inline Status finish_receive(State& st, Peers& peers, CallKind kind, int half, uint64_t n,
                             const std::vector<bool>& from_segment) {
  for (size_t r = 0; r < from_segment.size(); ++r) {
    if (from_segment[r]) MOED_RETURN_IF_ERROR(peers.removed_by(int(r)));
  }
  word(st, st.world->rank(), kDone, kind, half)->store(n, std::memory_order_release);
  return ok_status();
}

// Publishes this rank's part of call n: its verdict, then the sequence word (release: the
// rows and counts written before it are complete for whoever reads it).
inline void publish(State& st, CallKind kind, int half, uint64_t n, const Status& local, bool fp8) {
  const int me = st.world->rank();
  word(st, me, kVerdict, kind, half)
      ->store(uint64_t(uint32_t(local.code())) | (fp8 ? kFp8Flag : 0), std::memory_order_relaxed);
  word(st, me, kSent, kind, half)->store(n, std::memory_order_release);
}

// A dispatch's messages to the unmasked ranks on other nodes (segment_dispatch.cc): to each, a
// header [verdict, L counts, tokens] (the int32 verdict: this rank's StatusCode, plus
// kHeaderFp8Flag), the rows for it in one message (NetPlan: packed, or gathered from `in`'s
// rows), and the receive of its header;
// outside shrink mode the first message that could not be posted is the error.
Status post_dispatch_messages(Peers& peers, const LowLatencyHandle& handle, int half, uint64_t seq,
                              const RowFormat& f, const NetPlan& plan, const Status& local,
                              const LowLatencyDispatchInput& in);
// Once rv.count holds every source's counts: the other nodes' rows into dh.net_recv, and this
// call's own sends waited for (a source lost meanwhile, in shrink mode, adds no rows); then
// rb's packed layout, the in-node sources' rows by in_node(stream) and the other nodes' rows
// placed into rb (with stream: non-temporal stores, for a large receive).
Status receive_dispatch_rows(Peers& peers, Received& rv, ReceiveBlock& rb,
                             const std::function<void(bool)>& in_node);
// A combine's messages with the unmasked ranks on other nodes (segment_combine.cc): from each
// expert rank its verdict, then this rank's rows of each of its experts, received into one
// block [verdict, 64 bytes][rows, expert by expert] (sizes from the dispatch); the same to each
// home, the rows straight from x. None without a handle (a bad call).
Status post_combine_messages(Peers& peers, const LowLatencyHandle* handle, const TensorView& x,
                             int half, uint64_t seq, const Status& local);
// Where expert rank d's message (in) holds this rank's rows of each of d's experts:
// first_row[d * L + j]; returns the message's verdict.
uint64_t message_rows(const State& st, int half, const LowLatencyHandle& handle, int d,
                      std::vector<const std::byte*>& first_row);

}  // namespace moed::low_latency::segment
