// Internal: the gloo backend's World. The files beside this one each implement one part, with
// the same names as threads/ and mpi/:
//   gloo_world.cc      make_gloo_world (context, hosts, nodes), waits, the failure channel
//   collectives.cc     barrier, broadcast, all_gather_v, all_to_all_v, reduce_scatter_v, all_reduce
//   network.cc         isend / irecv (gloo unbound buffers)
//   shared_memory.cc   alloc_shared and the host's control segment (POSIX shared memory)
//   host_staging.cc    large same-host data phases through per-rank staging segments
//
// NOTE: Debian's gloo headers lack gloo/common/memory.h, so only the abstract
// UnboundBuffer interface is usable: there is no non-blocking test. A wait blocks in gloo's
// waitRecv / waitSend on the owning thread, and a monitor thread wakes it (abortWaitRecv /
// abortWaitSend) when a rank fails or the world's timeout passes. gloo's own timeout is a
// backstop only: when it fires it closes every connection of the context.
#pragma once

#include <gloo/context.h>
#include <gloo/transport/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "comm/backend.h"
#include "moed/gloo_world.h"
#include "moed/world.h"

namespace moed::gloo_comm {

using Clock = std::chrono::steady_clock;
using Buffer = std::unique_ptr<::gloo::transport::UnboundBuffer>;

// gloo slots: the top byte says whose message it is, the rest counts calls.
enum class Space : uint64_t { kFault = 1, kWorld = 2, kNode = 3, kUser = 4, kHost = 5 };
inline uint64_t make_slot(Space s, uint64_t n) {
  return (uint64_t(s) << 56) | (n & ((uint64_t(1) << 56) - 1));
}

constexpr size_t kMessageBytes = 1024;

// The host's control segment (shared memory of the ranks on one host): the first failure on
// the host and every member's pid and state, so host-mates see a failure or a death at once.
struct HostControl {
  std::atomic<int32_t> fault_rank;   // the failed rank + 1; 0 while nobody failed (set once)
  std::atomic<int32_t> fault_ready;  // 1 once fault_code and fault_message are written
  int32_t fault_code;
  char fault_message[kMessageBytes];
  struct Member {
    std::atomic<int64_t> pid;
    std::atomic<int32_t> state;  // kAlive, kClosed (ended its world on purpose)
  };
  Member members[1];  // one per rank on the host, in rank order (flexible)
  static size_t bytes(int members) {
    return sizeof(HostControl) + sizeof(Member) * size_t(members);
  }
};
// Same-host collectives (every rank on one host): each rank's slot in a shared segment. Round
// k: wait until every rank has read round k-1 (done), write, publish seq = k, read every
// rank's slot once its seq reaches k, then mark done = k.
// stage_seq publishes this rank's data for stage round k (host_staging.cc): in its staging
// segment, or, with single-copy reads, as the addresses of its own buffers (sources);
// stage_done = k once this rank has read everything it wanted in round k.
// ring_step = k * size + j once this rank holds j blocks of ring round k (host_ring_gather).
struct CollSlot {
  std::atomic<uint64_t> seq;
  char pad0[56];
  std::atomic<uint64_t> done;
  char pad1[56];
  std::atomic<uint64_t> stage_seq;
  char pad2[56];
  std::atomic<uint64_t> stage_done;
  char pad3[56];
  std::atomic<uint64_t> ring_step;
  char pad4[56];
  static constexpr size_t kBytes = 16384;
  char data[kBytes];
  static constexpr size_t kMaxSources = 256;
  uint64_t source_count;
  uint64_t sources[kMaxSources][2];  // (address in this rank's process, bytes), in stream order
};
constexpr int32_t kAlive = 1;
constexpr int32_t kClosed = 2;

// One posted send or receive of this rank.
struct Op {
  Buffer buf;
  bool recv = false;
  int peer = -1;
  size_t bytes = 0;
  bool done = false;
};

// A byte range to send to or receive from `peer`.
struct Transfer {
  int peer;
  void* data;
  size_t bytes;
};

struct HostLayout {
  std::string id;
  std::vector<int> ranks;  // the world ranks on this host, ascending
  std::vector<int64_t> pids;
  uint64_t world_id = 0;
};

// A piece of this rank's stage stream, and a part of another rank's stream to copy to `dst`.
struct StageSource {
  const void* data;
  size_t bytes;
};
struct StageWant {
  size_t offset;  // in the writer's stream
  void* dst;
  size_t bytes;
};

// Drops the world's self-message mailbox (network.cc).
void forget_mailbox(const World* w);

class GlooWorld final : public World {
 public:
  GlooWorld(std::shared_ptr<::gloo::transport::Device> device, std::shared_ptr<::gloo::Context> ctx,
            int rank, int size, int ranks_per_node, std::chrono::milliseconds timeout,
            int threads_per_rank, HostLayout host);
  ~GlooWorld() override;

  // Maps the host's control segment and starts the fault listener and the monitor.
  Status start();

  const char* backend_name() const override { return "gloo"; }
  bool shares_address_space() const override { return false; }
  MOED_WORLD_TRANSPORT_OVERRIDES
  // Marks this rank failed and tells every other rank (host segment and gloo); returns.
  void abort(const Status& reason) override;
  Status failure() const override;
  bool rank_failed(int r) const override;

  // Posts a send or receive on `slot` (gloo errors become a Status).
  StatusOr<Op> post(bool recv, int peer, uint64_t slot, void* data, size_t bytes);
  // Waits for `op` until `deadline`; on an error marks this rank failed (and says so).
  Status wait(Op& op, Clock::time_point deadline, const std::function<std::string()>& what);
  // PendingOp::wait_for's wait: ended early only by op.peer's failure; a timeout returns
  // kDeadlineExceeded and leaves the world as it is; a closed connection fails op.peer.
  Status wait_peer(Op& op, Clock::time_point deadline, const std::function<std::string()>& what);
  // What wait() and wait_peer() share: gloo's wait for `op`, registered as this rank's wait
  // (so a failure seen meanwhile can end it: any one, or op.peer's only with peer_scope).
  struct OpWait {
    bool completed = false;
    bool deadline_hit = false;
    std::string error;  // gloo's, when the connection closed
    Clock::time_point start;
  };
  OpWait wait_op(Op& op, Clock::time_point deadline, bool peer_scope);
  // Posts every receive and send, then waits for all. Self transfers are the caller's.
  Status exchange(uint64_t slot, std::span<const Transfer> sends, std::span<const Transfer> recvs,
                  const std::function<std::string()>& what);
  // Every rank of `ranks` (ascending world ranks, this one among them) contributes n bytes;
  // out receives them in that order.
  Status gather(std::span<const int> ranks, uint64_t slot, const void* mine, size_t n, void* out,
                const char* op);
  // The lowest failing rank's verdict among `ranks` (the same on each of them).
  Status agree_among(std::span<const int> ranks, uint64_t slot, const Status& local,
                     const char* op);
  uint64_t next_slot() { return make_slot(Space::kWorld, world_calls_++); }
  // gather() over every rank through the host's collective slots (one host, n small).
  Status host_gather(const void* mine, size_t n, void* out, const char* op);
  // Same-host data phase (host_staging.cc; only while host_staging()): every rank r publishes
  // a stream of bytes[r] bytes (this rank's is the concatenation of `mine`), then every rank
  // copies the parts it wants (`wants(r)`) of every other rank's stream. Every rank calls it
  // with the same bytes, right after a gather() of the same call; `mine` stays unchanged
  // until it returns.
  bool host_staging() const { return coll_ != nullptr; }
  // Whether an all-gather of these per-rank bytes goes round the ring (host_ring_gather):
  // the same answer on every rank.
  bool host_ring(std::span<const uint64_t> bytes) const;
  // Same-host all-gather of large blocks (host_staging.cc): rank r's block, bytes[r] at
  // out + offsets[r] on rank r, lands at out + offsets[r] of every other rank. In place of
  // host_stage, with the same calling rules.
  Status host_ring_gather(std::span<const uint64_t> bytes, char* out,
                          std::span<const size_t> offsets, const char* op);
  Status host_stage(std::span<const uint64_t> bytes, std::span<const StageSource> mine,
                    const std::function<std::vector<StageWant>(int)>& wants, const char* op);
  uint64_t next_node_slot() { return make_slot(Space::kNode, node_calls_++); }
  std::vector<int> all_ranks() const;
  std::vector<int> node_ranks() const;
  // Maps a fresh segment of `bytes` among `ranks` (the first one creates it), unlinked before
  // return on every path. Collective over `ranks`.
  StatusOr<void*> map_segment(std::span<const int> ranks, uint64_t slot, const std::string& name,
                              size_t bytes);
  const HostLayout& host() const { return host_; }
  void count_send(int dst, uint64_t bytes) { internal::count_send(*this, dst, bytes); }

 private:
  // Records `reason` as the world's failure, blamed on `rank`, and wakes the current wait.
  void record_failure(int rank, const Status& reason) const;
  // Tells every other rank, once per world, that `failed_rank` failed for `reason`.
  void send_fault(int failed_rank, const Status& reason);
  // Receives the others' failure messages: records, acknowledges and passes each on.
  void listen_for_faults();
  void acknowledge_fault(int to);
  // Records a failure a host-mate wrote into the host's fault word and passes it on (its writer
  // may end before its own messages arrive); false while there is none.
  bool relay_host_fault();
  // Waits until each rank told of a failure since fault_told_[first] has acknowledged it, its
  // connection has closed, or `until`: gloo closes a connection by resetting it, which drops
  // what the peer has not read yet. Returns how many ranks were told.
  size_t await_fault_acks(size_t first, Clock::time_point until);
  void monitor();
  // Polls `word` of host-mate r until it reaches `value` (bounded; a closed rank is a failure).
  Status await_host(const std::atomic<uint64_t>& word, uint64_t value, int r, const char* op,
                    const char* what);
  // Maps (or grows) the staging segments that host_stage needs for `bytes` (collective).
  Status grow_stages(std::span<const uint64_t> bytes, const char* op);
  // Whether every rank can read every other's memory (process_vm_readv), agreed by all;
  // start() asks once. Then host_stage reads the writers' own buffers: one copy a byte.
  Status probe_single_copy();
  Status read_single_copy(int r, const StageWant& want, const char* op);
  uint64_t single_copy_min_ = UINT64_MAX;  // writers of this many bytes are read in place
  uint64_t probe_word_ = 0;
  void unmap_stages();
  // rank_failed without reading the host's fault word (the monitor, under wait_mu_).
  bool rank_failed_locked(int r) const;
  // A host-mate whose process is gone without closing its world: its rank, or -1.
  int find_dead_host_mate() const;

  std::shared_ptr<::gloo::transport::Device> device_;
  std::shared_ptr<::gloo::Context> ctx_;
  HostLayout host_;
  int host_index_ = 0;
  HostControl* control_ = nullptr;
  size_t control_bytes_ = 0;
  CollSlot* coll_ = nullptr;  // every rank's slot, when all ranks share one host
  uint64_t coll_calls_ = 0;
  // Every rank's staging segment as mapped here, and its capacity (the same on every rank).
  std::vector<char*> stage_;
  std::vector<size_t> stage_cap_;
  uint64_t stage_calls_ = 0;
  uint64_t stage_gen_ = 0;
  uint64_t world_calls_ = 0;
  uint64_t node_calls_ = 0;
  uint64_t segments_ = 0;

  // The wait in progress on the owning thread (the monitor may abort it), under wait_mu_.
  mutable std::mutex wait_mu_;
  Op* waiting_ = nullptr;
  Clock::time_point waiting_deadline_;
  bool deadline_hit_ = false;
  bool waiting_peer_scope_ = false;  // wait_peer: only waiting_->peer's failure ends it

  mutable std::atomic<bool> failed_{false};
  mutable std::mutex fail_mu_;
  mutable Status failure_;
  mutable std::vector<uint8_t> rank_failed_;  // every rank a failure was recorded for, fail_mu_
  bool told_others_ = false;

  // The failure channel: a receive from any rank on the fault slot, re-posted after each.
  std::vector<char> fault_in_;
  Buffer fault_recv_;
  std::vector<std::vector<char>> fault_out_;
  std::vector<Buffer> fault_sends_;
  std::vector<int> fault_told_;     // the ranks fault_sends_ go to, under fail_mu_
  std::vector<Buffer> fault_acks_;  // the listener's acknowledgements
  bool host_fault_relayed_ = false;  // the monitor's
  std::thread listener_;
  std::thread monitor_;
  std::atomic<bool> stopping_{false};
  std::mutex monitor_mu_;
  std::condition_variable monitor_cv_;
};

}  // namespace moed::gloo_comm
