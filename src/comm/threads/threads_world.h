// Internal: the threads backend's shared state (one Context per run_threads call) and its
// World. The files beside this one each implement one part, with the same names as mpi/:
//   threads_world.cc   run_threads, failure state, barrier
//   collectives.cc     broadcast, all_gather_v, all_to_all_v, reduce_scatter_v, all_reduce
//   network.cc         isend / isend_gather / irecv (rendezvous, one copy)
//   shared_memory.cc   alloc_shared (node-shared segments and signals)
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "comm/backend.h"
#include "moed/world.h"

namespace moed::threads {

enum class Op : int {
  kBarrier,
  kBroadcast,
  kAllGatherV,
  kAllToAllV,
  kReduceScatterV,
  kAllReduce,
};
const char* op_name(Op op);

// What a rank brings to a collective. Published before the first internal barrier and read
// by the other ranks between the two barriers (the second keeps it alive while they read).
struct Slot {
  Slot() = default;
  // The call and its buffers; the sizes are set by the call.
  explicit Slot(Op call, const void* send_buffer = nullptr, void* recv_buffer = nullptr)
      : op(call), send(send_buffer), recv(recv_buffer) {}

  Op op = Op::kBarrier;
  const void* send = nullptr;
  size_t send_bytes = 0;  // broadcast / all_gather_v bytes; f32 counts for all_reduce
  std::span<const size_t> send_sizes, send_offsets, recv_sizes, recv_offsets;
  void* recv = nullptr;
  int root = 0;
};

// One posted isend, isend_gather or irecv. The thread that posts second copies (sender ->
// receiver) and completes both, so every byte is copied once.
struct P2pOp {
  enum State : int { kPosted, kMatched, kDone };
  int src = 0, dst = 0, tag = 0;
  const void* send = nullptr;
  std::vector<World::Piece> pieces;  // isend_gather's (send is null), back to back
  void* recv = nullptr;
  size_t bytes = 0;
  std::atomic<int> state{kPosted};
  Status error;  // written before state becomes kDone (release)
};

// Unmatched operations addressed to one rank, in posting order (FIFO per (src, dst, tag)).
struct Mailbox {
  std::mutex mu;
  std::deque<std::shared_ptr<P2pOp>> sends;
  std::deque<std::shared_ptr<P2pOp>> recvs;
};

// A counter on its own cache line, so signals between different pairs don't false-share.
struct alignas(64) PaddedCounter {
  std::atomic<uint64_t> value{0};
};

// One alloc_shared call on one node: each local rank allocates its own segment and inbox and
// publishes them; the last SharedBuffer dropped frees them all.
struct SharedAlloc {
  explicit SharedAlloc(int local_size);
  ~SharedAlloc();
  std::vector<size_t> requested;        // under NodeShared::mu
  std::vector<void*> segments;          // under NodeShared::mu
  std::vector<PaddedCounter*> inboxes;  // inboxes[lr][from], under NodeShared::mu
  std::atomic<int> joined{0};
  int taken = 0;  // under NodeShared::mu
};

struct NodeShared {
  std::mutex mu;
  std::map<uint64_t, std::shared_ptr<SharedAlloc>> pending;  // by per-rank call number
};

class Context {
 public:
  Context(int size, int ranks_per_node);

  // Records the first failure as the world's (every wait sees it) and every failure as its
  // rank's (rank_failed).
  void fail(int rank, const Status& reason);
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  bool rank_failed(int rank) const {
    return rank_failed_[size_t(rank)].load(std::memory_order_acquire);
  }
  Status failure() const;  // kAborted "rank r failed: <message>", or OK
  int failed_rank() const;

  const int size;
  const int ranks_per_node;
  std::vector<Slot> slots;
  // Sense-reversing barrier: arrivals count up to size, the last one bumps generation.
  std::atomic<int> arrived{0};
  std::atomic<uint64_t> generation{0};
  std::unique_ptr<std::atomic<uint64_t>[]> entered;  // barriers entered per rank (diagnostics)
  std::vector<Mailbox> mailboxes;
  std::vector<NodeShared> nodes;
  // World::shrink: who has come, and once sealed the members and the next world's context.
  std::mutex shrink_mu;
  std::condition_variable shrink_cv;
  std::vector<bool> shrink_arrived;
  bool shrink_sealed = false;
  std::vector<int> shrink_members;
  std::shared_ptr<Context> shrink_next;

 private:
  std::unique_ptr<std::atomic<bool>[]> rank_failed_;
  std::atomic<bool> failed_{false};
  mutable std::mutex fail_mu_;
  Status failure_;
  int failed_rank_ = -1;
};

class ThreadsWorld final : public World {
 public:
  ThreadsWorld(Context* ctx, int rank, std::chrono::milliseconds timeout, int threads_per_rank);

  const char* backend_name() const override { return "threads"; }
  bool shares_address_space() const override { return true; }
  bool calls_from_any_thread() const override { return true; }
  MOED_WORLD_TRANSPORT_OVERRIDES
  StatusOr<Request> isend_gather(int dst, int tag, std::span<const Piece> pieces) override;
  void abort(const Status& reason) override;
  Status failure() const override { return ctx_->failure(); }
  bool rank_failed(int r) const override { return ctx_->rank_failed(r); }
  StatusOr<ShrunkWorld> shrink() override;

  Context& context() { return *ctx_; }
  // Counts `bytes` this rank sends to `dst` (backend.h: the rule every backend follows).
  void count_send(int dst, uint64_t bytes) { internal::count_send(*this, dst, bytes); }
  // A wait that timed out leaves the collective state half-updated, so it fails the world.
  Status fail_on_timeout(const Status& s);

 private:
  // Runs one collective: publish `mine`, barrier, check (the same verdict on every rank,
  // computed from all slots), work() if OK, barrier. Returns the check's verdict.
  template <typename Check, typename Work>
  Status collective(const Slot& mine, Check&& check, Work&& work);
  Status internal_barrier(Op op);

  Context* ctx_;
  std::shared_ptr<Context> owned_ctx_;  // a shrunk world's context, shared by its ranks
  uint64_t barriers_entered_ = 0;
  uint64_t allocs_ = 0;
};

}  // namespace moed::threads
