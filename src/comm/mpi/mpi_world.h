// Internal: the MPI backend's World. The files beside this one each implement one part, with
// the same names as threads/:
//   mpi_world.cc       make_mpi_world (nodes), failure channel, abort, request polling
//   collectives.cc     barrier, broadcast, all_gather_v, all_to_all_v, reduce_scatter_v, all_reduce
//   network.cc         isend / isend_gather / irecv (MPI point-to-point)
//   shared_memory.cc   alloc_shared (MPI shared windows, signals in the window)
#pragma once

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "comm/backend.h"
#include "moed/mpi_world.h"
#include "moed/world.h"

namespace moed::mpi {

// "MPI_Isend: <MPI's error string>" as kInternal, or OK for MPI_SUCCESS.
Status check(int rc, const char* call);

// The buffers one non-blocking collective call hands to MPI (sizes, verdicts, messages).
// NOTE: a collective can be neither cancelled nor freed, so when waiting for one fails (a
// peer failed, or the timeout passed) MPI may still write into its buffers whenever the
// missing ranks' data arrives, even after the world is gone. So on that path the buffers are
// parked (kept until the process ends) instead of freed. Caller-owned payloads are posted
// only after every rank has agreed to post them, so those collectives do complete.
class CallBuffers {
 public:
  template <typename T>
  T* make(size_t n) {
    auto v = std::make_shared<std::vector<T>>(n);
    held_.push_back(v);
    return v->data();
  }
  template <typename T>
  T* make_from(const T* data, size_t n) {
    T* p = make<T>(n);
    std::copy(data, data + n, p);
    return p;
  }
  void park();

 private:
  std::vector<std::shared_ptr<void>> held_;
};

class MpiWorld final : public World {
 public:
  MpiWorld(MPI_Comm comm, MPI_Comm node_comm, MPI_Comm fault_comm, int rank, int size,
           int ranks_per_node, std::chrono::milliseconds timeout, int threads_per_rank);
  ~MpiWorld() override;

  const char* backend_name() const override { return "mpi"; }
  bool shares_address_space() const override { return false; }
  // Where MPI was initialised with MPI_THREAD_MULTIPLE, an async step runs on its own thread
  // (so the network transfer overlaps the caller's work); otherwise MPI belongs to the
  // owning thread and async steps run eagerly.
  bool calls_from_any_thread() const override { return thread_multiple_; }
  MOED_WORLD_TRANSPORT_OVERRIDES
  StatusOr<Request> isend_gather(int dst, int tag, std::span<const Piece> pieces) override;
  // Records `reason` and sends it to every other rank over the failure channel.
  void abort(const Status& reason) override;
  Status failure() const override;
  // The failure channel carries the first failure only: rank r failed if it was that one.
  bool rank_failed(int r) const override;
  // The ranks that have not failed agree on who they are (messages on the failure channel's
  // communicator, each bounded by the timeout), then MPI_Comm_create_group, which only they
  // enter. A process that died has usually ended the job already (no ULFM).
  StatusOr<ShrunkWorld> shrink() override;
  // The census on the owner thread (any thread under MPI_THREAD_MULTIPLE); elsewhere
  // `timed_out` as is (the owner's own wait then names the silent rank).
  Status after_timeout(Status timed_out) override;

  // After a wait of this rank's (a collective's or a message's) ended in error `s`: a timeout
  // asks every rank who is there (census), so the error names the silent ranks; then this
  // rank's world is failed unless `s` is another rank's failure. Owner thread. Returns the error.
  Status after_failed_wait(Status s);
  // Waits for `request` (MPI_Test polled against failure() and the timeout). On an error
  // the request is abandoned, `buffers` (the call's MPI buffers) are parked and this rank's
  // world is marked failed.
  // kEvenAfterFailure: for a collective on caller memory that every rank has agreed to post:
  // it is waited for to its end (or the timeout), since MPI may write that memory until then.
  enum class Completion { kOrFailure, kEvenAfterFailure };
  Status wait(MPI_Request* request, const std::function<std::string()>& what, CallBuffers* buffers,
              Completion completion = Completion::kOrFailure);
  void count_send(int dst, uint64_t bytes) { internal::count_send(*this, dst, bytes); }
  MPI_Comm comm() const { return comm_; }
  int tag_ub() const { return tag_ub_; }

 private:
  // Every rank learns every rank's `local` verdict; returns the lowest failing rank's error
  // (same on every rank), so input checks never leave a rank waiting in the real call.
  Status agree_verdict(const Status& local, const char* op);
  void record_failure(int rank, const Status& reason) const;
  // Leaks what MPI may still write (posted receives, unfinished sends) and the communicators,
  // so a rank whose peer is lost can exit without a collective teardown.
  void leave_without_teardown();
  // After `timed_out`: asks every rank whether it is there and returns `timed_out` extended
  // with the ranks that gave no answer (or another rank's failure, if one arrives first).
  Status census(const Status& timed_out);
  // Answers the census requests that have arrived (owner thread; called from failure()).
  void answer_census() const;

  MPI_Comm comm_;
  MPI_Comm node_comm_;
  MPI_Comm fault_comm_ = MPI_COMM_NULL;
  int tag_ub_ = 32767;
  std::thread::id owner_;
  bool thread_multiple_ = false;
  // Serialises failure()'s polling of the failure channel, which any thread may do under
  // MPI_THREAD_MULTIPLE (the rank's calls themselves are one at a time: World's contract).
  mutable std::mutex poll_mu_;
  // Failure channel: one receive posted for the first failure message from any rank.
  mutable MPI_Request fault_request_ = MPI_REQUEST_NULL;
  mutable std::vector<char> fault_buffer_;
  std::vector<MPI_Request> fault_sends_;
  std::string fault_message_;
  mutable MPI_Request census_request_ = MPI_REQUEST_NULL;
  mutable std::vector<int> census_in_ = std::vector<int>(1);
  mutable int alive_token_ = 1;
  mutable std::vector<MPI_Request> census_sends_;
  mutable std::atomic<bool> failed_{false};
  // A peer of this world may be gone (its census went unanswered here, or a failure message
  // said so): the teardown then skips its collectives. Per world, since the next world of the
  // same processes (a test's next case) has every peer again; the process-wide flag behind
  // mpi_peer_may_be_gone() is set too, for MPI_Finalize.
  mutable std::atomic<bool> peer_lost_{false};
  mutable std::mutex fail_mu_;
  mutable Status failure_;
  mutable int failed_rank_ = -1;  // under fail_mu_
};

}  // namespace moed::mpi
