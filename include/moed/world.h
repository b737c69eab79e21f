// World: a group of ranks that dispatchers talk across (docs/design.md §9): one small virtual
// byte-level interface with three backends (threads, MPI, gloo: moed/threads_world.h,
// mpi_world.h, gloo_world.h) and typed templates over it (all_to_all_v<T>, all_gather<T>, ...).
// A node is G ranks that share memory (NVLink on a GPU box); nodes talk over the network (RDMA).
// fp32 sums add from 0 in ascending rank order. No wait is unbounded: a failed rank makes every
// other rank's calls return kAborted naming it, and a wait past the world's timeout returns
// kDeadlineExceeded (design.md §12.2).
//
//   Status body(moed::World& w) {
//     std::vector<int> mine = {w.rank()};
//     MOED_ASSIGN_OR_RETURN(std::vector<int> all, moed::all_gather<int>(w, mine));
//     ...
//   }
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "moed/status.h"
#include "moed/thread_pool.h"

namespace moed {

class World;

// Bytes a rank moved, by path. Dispatchers add what they copy through shared pointers
// themselves (add_shared_bytes); backends count their own collectives and network transfers.
struct TrafficCounters {
  uint64_t shared_bytes = 0;   // written or read through node-shared memory / intra-node copies
  uint64_t network_bytes = 0;  // sent over the network path (between nodes)
  uint64_t shared_rows = 0;    // token rows, where a dispatcher counts them
  uint64_t network_rows = 0;
  // Collective calls this rank entered: each byte-level collective of World (barrier,
  // broadcast, all-gather, all-to-all, reduce-scatter, all-reduce) and each alloc_shared
  // (collective over the node) counts one, whatever the backend. agree() is one all-gather
  // when every rank is OK. Point-to-point calls and shared-memory signals do not count.
  uint64_t collectives = 0;
};

// A non-blocking operation to wait on (network send/recv, an asynchronous dispatch, ...).
// Dropping a network request before wait() cancels it where it is still unmatched (as with
// MPI, every send and receive should be waited on).
//
// NOTE: moed never hands out a null Request: a step that ran synchronously (or eagerly, as
// the MPI world's async dispatch does) returns an already-completed one (completed_request),
// whose ready() is true and whose wait() returns the step's status at once.
class PendingOp {
 public:
  virtual ~PendingOp() = default;
  // Blocks until done. Returns an error on peer failure or timeout. Calling it again returns
  // the same status without blocking.
  virtual Status wait() = 0;
  // Non-blocking poll: true once wait() would return without blocking. Never blocks, never
  // fails (an error shows in wait()). A receive hook (moed/low_latency.h) runs its receive
  // inside wait(), so it is ready only after wait().
  virtual bool ready() = 0;
  // For callers that go on without a lost peer (the low-latency shrink mode): like wait(), but
  // bounded by `timeout` rather than the world's, ended early only by the failure of the rank
  // this operation talks to (not by another rank's), and never failing the world: on a timeout
  // it returns kDeadlineExceeded and cancels the operation. The default (a request without a
  // peer) is wait().
  virtual Status wait_for(std::chrono::milliseconds timeout) {
    (void)timeout;
    return wait();
  }
};
using Request = std::unique_ptr<PendingOp>;
// A request that is already done with `status` (ready() is true; wait() returns status).
Request completed_request(Status status = Status());
// Waits for all, returns the first error (still waits for the rest where it can).
Status wait_all(std::vector<Request>& requests);

// One collective allocation across the ranks of a node: every local rank gets a pointer to
// every other local rank's segment (DeepEP's NVLink buffers), plus per-pair signals with
// release/acquire ordering. Created by World::alloc_shared (collective over the node); freed
// locally when the last owner on this rank drops it (heap memory in the threads world, an
// munmap of the node's POSIX segments in the MPI and gloo worlds).
class SharedBuffer {
 public:
  virtual ~SharedBuffer() = default;
  size_t bytes() const { return bytes_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return int(segments_.size()); }
  // This rank's segment.
  void* local() const { return segments_[size_t(local_rank_)]; }
  // Local rank `lr`'s segment on this node, 64-byte aligned, `bytes()` long.
  void* peer(int lr) const { return segments_[size_t(lr)]; }

  // Per-pair signals, monotonically increasing counters (one per ordered pair of local ranks).
  // signal: release-store `value` into the (me -> to) counter, after this rank's writes for
  // `to` are done. wait_signal: block until the (from -> me) counter is >= value (acquire), or
  // return an error when a rank has failed or the world's timeout passes.
  void signal(int to_local_rank, uint64_t value);
  Status wait_signal(int from_local_rank, uint64_t value);
  // The (from -> me) counter now (acquire), without waiting.
  uint64_t signal_value(int from_local_rank) const {
    return inbox_[size_t(from_local_rank)]->load(std::memory_order_acquire);
  }

 protected:
  SharedBuffer(World* world, size_t bytes, int local_rank, std::vector<void*> segments,
               std::vector<std::atomic<uint64_t>*> inbox);
  World* world_;
  size_t bytes_;
  int local_rank_;
  std::vector<void*> segments_;
  // inbox_[from]: the counter this rank waits on for signals from local rank `from`; the
  // counter is writable by `from` through its own view (signal() looks up the peer's inbox).
  std::vector<std::atomic<uint64_t>*> inbox_;
  std::vector<std::atomic<uint64_t>*> outbox_;  // outbox_[to] = &inbox of `to` for me
  friend class World;
};

struct WorldOptions {
  // Ranks per node (G). 0 = backend default: all ranks (threads), the host (MPI, gloo).
  int ranks_per_node = 0;
  // How long any call waits for a peer before returning kDeadlineExceeded.
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
  // Worker threads per rank for hot loops (the rank's ThreadPool, World::pool()). 0 = the
  // process default: set_default_threads_per_rank() if set, else cores / ranks on this host,
  // at least 1.
  int threads_per_rank = 0;
};

// The process-wide default for WorldOptions::threads_per_rank = 0, read when a world is made
// (worlds made earlier keep their pools). 0 restores the built-in choice (cores / ranks on
// this host). Lets moed share the cores with another runtime's threads, e.g. Python's
// torch.get_num_threads(). Negative values are an error. Thread-safe.
Status set_default_threads_per_rank(int threads);
int default_threads_per_rank();  // 0 = the built-in choice
// What a world of `ranks_on_host` ranks on this host uses for threads_per_rank = 0.
int resolve_threads_per_rank(int threads_per_rank, int ranks_on_host);

// A world of the ranks of another that went on after a loss (World::shrink).
struct ShrunkWorld {
  std::unique_ptr<World> world;
  std::vector<int> members;  // members[r]: new rank r's rank in the old world (ascending)
};

class World {
 public:
  virtual ~World() = default;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int ranks_per_node() const { return ranks_per_node_; }     // G
  int num_nodes() const { return size_ / ranks_per_node_; }  // N
  int node() const { return rank_ / ranks_per_node_; }
  int local_rank() const { return rank_ % ranks_per_node_; }
  int node_of(int rank) const { return rank / ranks_per_node_; }
  bool same_node(int a, int b) const { return node_of(a) == node_of(b); }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // "threads", "mpi" or "gloo". For display only: ask capabilities below, not names.
  virtual const char* backend_name() const = 0;
  // True when every rank of the world lives in this process's address space (the threads
  // world): a pointer from one rank's memory is readable by every other rank, so node-shared
  // staging copies can be skipped. False for separate processes (MPI, gloo), where only memory
  // from alloc_shared is shared within a node.
  virtual bool shares_address_space() const = 0;
  // True when this rank's World calls may be made from a thread other than the one that made
  // the world (one at a time). The threads world allows it, and the MPI world where MPI was
  // initialised with MPI_THREAD_MULTIPLE; elsewhere calls belong to the owning thread, so an
  // "async" step runs eagerly and returns a completed request.
  virtual bool calls_from_any_thread() const { return false; }

  // This rank's worker pool for hot loops.
  ThreadPool& pool() { return *pool_; }

  // ---- collectives (byte level) ----
  virtual Status barrier() = 0;
  virtual Status broadcast_bytes(void* data, size_t bytes, int root) = 0;
  // Rank r contributes send_bytes; recv receives every rank's bytes back to back, rank order;
  // recv_bytes[r] must equal rank r's send_bytes (checked: mismatch is an error on all ranks).
  virtual Status all_gather_v_bytes(const void* send, size_t send_bytes, void* recv,
                                    std::span<const size_t> recv_bytes) = 0;
  // send_bytes[d] bytes at send + send_offsets[d] go to rank d; recv_bytes[s] bytes from rank s
  // land at recv + recv_offsets[s].
  virtual Status all_to_all_v_bytes(const void* send, std::span<const size_t> send_bytes,
                                    std::span<const size_t> send_offsets, void* recv,
                                    std::span<const size_t> recv_bytes,
                                    std::span<const size_t> recv_offsets) = 0;
  // Float32 sums, deterministic: acc = 0; for r ascending: acc += x_r.
  // send holds sum(counts) floats; rank r receives counts[r] sums (block r of every rank).
  virtual Status reduce_scatter_v_f32(const float* send, std::span<const size_t> counts,
                                      float* recv) = 0;
  virtual Status all_reduce_f32(const float* send, float* recv, size_t count) = 0;

  // ---- node-shared memory ----
  // Collective over this rank's node (every local rank calls it with the same bytes).
  virtual StatusOr<std::shared_ptr<SharedBuffer>> alloc_shared(size_t bytes) = 0;

  // ---- network (point to point between any two ranks; DeepEP's RDMA) ----
  // Counted as network bytes when the peers are on different nodes, shared bytes otherwise.
  // The receiver must know the exact size. Messages between one (src, dst, tag) arrive in order.
  // Posting fails when the peer has failed; another rank's failure shows in wait().
  virtual StatusOr<Request> isend(int dst, int tag, const void* data, size_t bytes) = 0;
  virtual StatusOr<Request> irecv(int src, int tag, void* data, size_t bytes) = 0;
  // One message gathered from `pieces` laid back to back (the receiver posts one irecv of their
  // total), for a sender whose bytes already lie in several places (an RDMA gather list). The
  // threads world copies each piece straight into the receiver's buffer; MPI sends them as one
  // datatype; gloo copies them into a buffer the request owns first. The pieces stay the
  // caller's until the request is done.
  struct Piece {
    const void* data = nullptr;
    size_t bytes = 0;
  };
  virtual StatusOr<Request> isend_gather(int dst, int tag, std::span<const Piece> pieces);
  Status send(int dst, int tag, const void* data, size_t bytes);
  Status recv(int src, int tag, void* data, size_t bytes);

  // ---- faults ----
  // Marks this rank failed with `reason` and tells every other rank: their pending and later
  // calls return kAborted "rank r failed: <message>". Returns (the caller ends its own work);
  // every backend alike, the MPI world included (through its failure channel; the job goes
  // on). A failure already seen (this rank's or another's) stays the cause. Calling it before a
  // failing body returns tells the others at once, before the body's locals are torn down.
  virtual void abort(const Status& reason) = 0;
  // The first failure seen (ok() while nobody has failed). Checked by every wait.
  virtual Status failure() const = 0;
  // Whether this rank has seen rank `r` fail (returned an error, threw, aborted, its process
  // ended or its connection closed), the first failure or a later one. The low-latency shrink
  // mode masks such a rank at once instead of waiting out its deadline.
  virtual bool rank_failed(int r) const = 0;
  // A wait of this rank's on node-shared memory (a signal, an ack) ran out of time with
  // `timed_out`. A backend that can ask who is missing adds the silent ranks to the message, as
  // its own waits' timeouts do (MPI: the census), so the error names a stalled rank whichever
  // wait saw it first. The world stays as it was. The default returns `timed_out` as is.
  virtual Status after_timeout(Status timed_out) { return timed_out; }

  // A collective decision on input validation: every rank passes its local verdict; all ranks
  // return the same result: OK, or the lowest failing rank's error prefixed "rank r: ".
  Status agree(const Status& local);

  // ---- going on without lost ranks ----
  // After a rank is lost (it failed, or a wait ran out on it), the ranks that go on call
  // shrink(): collective over them, bounded by the timeout; a rank this world saw fail is not
  // waited for (one that failed and still calls it is taken). The new world holds the ranks
  // that came, renumbered in ascending order of their rank here, in nodes of G' = the gcd of
  // the survivors per node (so old nodes stay together); the same bitwise promises hold on it.
  // Dispatchers and buffers are made anew on it; this world stays failed. The threads world
  // and the MPI world (Debian's OpenMPI has no ULFM: a process that dies ends the MPI job, so
  // there it serves a rank that failed and stays alive) shrink here; the gloo world through
  // its rendezvous store (Python's moed.Group.shrink); elsewhere kUnimplemented.
  virtual StatusOr<ShrunkWorld> shrink();

  // ---- async steps ----
  // TokenDispatcher steps running on their own threads (token_*(async = true)) take tickets
  // in call order; a call on this world from any thread waits until every step ticketed
  // before it has finished, so this rank's calls keep their order (src/comm/backend.h).
  struct AsyncSteps {
    std::atomic<uint64_t> taken{0};
    std::atomic<uint64_t> finished{0};
  };
  AsyncSteps& async_steps() { return async_steps_; }

  // ---- fault injection ----
  // Runs first in every call on this world (collectives, alloc_shared, isend, irecv), from
  // whichever thread makes it, with the call's name ("barrier", "isend", ...); an error it
  // returns fails the call. Tests make a rank fail at its nth call with it (tests/faults).
  // None by default; set it while no call is in flight.
  using CallHook = std::function<Status(const char* call)>;
  void set_call_hook(CallHook hook) { call_hook_ = std::move(hook); }
  const CallHook& call_hook() const { return call_hook_; }

  // ---- counters ----
  TrafficCounters& counters() { return counters_; }
  void reset_counters() { counters_ = TrafficCounters{}; }
  void add_shared_bytes(uint64_t bytes, uint64_t rows = 0) {
    counters_.shared_bytes += bytes;
    counters_.shared_rows += rows;
  }
  void add_network_bytes(uint64_t bytes, uint64_t rows = 0) {
    counters_.network_bytes += bytes;
    counters_.network_rows += rows;
  }

 protected:
  World(int rank, int size, int ranks_per_node, std::chrono::milliseconds timeout,
        int threads_per_rank);
  // Builds a SharedBuffer from the segments the backend allocated: segments[lr] is local rank
  // lr's data (64-byte aligned), inbox[from] the (from -> me) counter, outbox[to] the
  // (me -> to) counter; on_free runs when the last owner on this rank drops the buffer.
  std::shared_ptr<SharedBuffer> make_shared_buffer(size_t bytes, std::vector<void*> segments,
                                                   std::vector<std::atomic<uint64_t>*> inbox,
                                                   std::vector<std::atomic<uint64_t>*> outbox,
                                                   std::function<void()> on_free);

  int rank_;
  int size_;
  int ranks_per_node_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<ThreadPool> pool_;
  TrafficCounters counters_;
  AsyncSteps async_steps_;
  CallHook call_hook_;
};

// ---- typed templates over the byte interface ----

template <typename T>
Status broadcast(World& w, std::span<T> data, int root) {
  return w.broadcast_bytes(data.data(), data.size_bytes(), root);
}

// Same count on every rank: returns size * send.size() elements in rank order.
template <typename T>
StatusOr<std::vector<T>> all_gather(World& w, std::span<const T> send) {
  std::vector<T> out(send.size() * size_t(w.size()));
  std::vector<size_t> bytes(size_t(w.size()), send.size_bytes());
  MOED_RETURN_IF_ERROR(w.all_gather_v_bytes(send.data(), send.size_bytes(), out.data(), bytes));
  return out;
}

// Varying counts: first gathers the counts, then the data. Returns per-rank vectors.
template <typename T>
StatusOr<std::vector<std::vector<T>>> all_gather_v(World& w, std::span<const T> send) {
  uint64_t n = send.size();
  MOED_ASSIGN_OR_RETURN(std::vector<uint64_t> counts,
                        all_gather<uint64_t>(w, std::span<const uint64_t>(&n, 1)));
  std::vector<size_t> bytes(counts.size());
  size_t total = 0;
  for (size_t r = 0; r < counts.size(); ++r) total += (bytes[r] = counts[r] * sizeof(T));
  std::vector<T> flat(total / sizeof(T));
  MOED_RETURN_IF_ERROR(w.all_gather_v_bytes(send.data(), send.size_bytes(), flat.data(), bytes));
  std::vector<std::vector<T>> out(counts.size());
  size_t off = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    out[r].assign(flat.begin() + off, flat.begin() + off + counts[r]);
    off += counts[r];
  }
  return out;
}

// send_counts[d] elements (contiguous, in rank order) go to rank d; the receiver must pass
// matching recv_counts (exchange counts first with all_to_all<uint64_t> if unknown).
template <typename T>
Status all_to_all_v(World& w, std::span<const T> send, std::span<const size_t> send_counts,
                    std::span<T> recv, std::span<const size_t> recv_counts) {
  const size_t R = size_t(w.size());
  std::vector<size_t> sb(R), so(R), rb(R), ro(R);
  size_t s = 0, r = 0;
  for (size_t i = 0; i < R; ++i) {
    sb[i] = send_counts[i] * sizeof(T);
    so[i] = s;
    s += sb[i];
    rb[i] = recv_counts[i] * sizeof(T);
    ro[i] = r;
    r += rb[i];
  }
  return w.all_to_all_v_bytes(send.data(), sb, so, recv.data(), rb, ro);
}

// Fixed-size all-to-all: send[d * n .. (d+1) * n) goes to rank d.
template <typename T>
StatusOr<std::vector<T>> all_to_all(World& w, std::span<const T> send) {
  const size_t R = size_t(w.size());
  const size_t n = send.size() / R;
  std::vector<T> recv(n * R);
  std::vector<size_t> counts(R, n);
  MOED_RETURN_IF_ERROR(all_to_all_v<T>(w, send, counts, recv, counts));
  return recv;
}

}  // namespace moed
