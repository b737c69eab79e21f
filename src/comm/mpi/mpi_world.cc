// The MPI backend: make_mpi_world (nodes from the host split, G overridable), the failure
// channel that tells the other ranks about a failed rank, abort, and request polling.
#include "comm/mpi/mpi_world.h"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstring>
#include <thread>

#include "comm/wait.h"
#include "moed/mpi_world.h"

namespace moed {
namespace mpi {
namespace {

constexpr int kFaultTag = 1;
constexpr size_t kFaultBytes = 4096;  // code (int32) + message, truncated to fit
// The census after a timeout: "are you there?" from the rank that timed out, and the answer.
constexpr int kCensusTag = 2;
constexpr int kAliveTag = 3;

// Set once a census of an MPI world of this process went unanswered, here or on a rank that
// told us (mpi_peer_may_be_gone(), for MPI_Finalize); each world keeps its own (peer_lost_)
// for its teardown.
std::atomic<bool> g_peer_lost{false};
// Set in a failure message's code when its sender found a peer gone (its census went
// unanswered), so the receivers skip collective teardown too.
constexpr int32_t kPeerLostBit = 1 << 30;

// While the world is being made there is no world to poll yet: a bootstrap wait polls one
// request for at most the timeout, as every later wait does (one deadline for all the steps
// made the last step's bound depend on how slowly the earlier ones ran). On a timeout the
// buffers MPI may still write are leaked on purpose, and the process counts a peer as lost,
// so no collective teardown (nor MPI_Finalize, where the caller asks mpi_peer_may_be_gone())
// waits for it either.
struct Bootstrap {
  int rank = 0;
  std::chrono::milliseconds timeout{0};

  Status wait(MPI_Request* request, const char* step) const {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (int i = 0;; ++i) {
      int flag = 0;
      int rc = MPI_Test(request, &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) return check(rc, step);
      if (flag != 0) return ok_status();
      if (std::chrono::steady_clock::now() >= deadline) {
        g_peer_lost.store(true);
        return deadline_exceeded("make_mpi_world: rank ", rank, " in ", step,
                                 ": not every rank answered within ", timeout.count(),
                                 " ms (a rank is stopped, dead, unreachable, or has not called "
                                 "make_mpi_world)");
      }
      if (i < 1024) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
  }
  // Every rank of `comm` has reached this point (a non-blocking barrier, bounded), so the
  // blocking communicator constructor that follows has every rank in it.
  Status gate(MPI_Comm comm, const char* step) const {
    MPI_Request req;
    MOED_RETURN_IF_ERROR(check(MPI_Ibarrier(comm, &req), "MPI_Ibarrier"));
    return wait(&req, step);
  }
};

// Every rank returns the lowest failing rank's error (each wait bounded by the timeout).
// The buffers are leaked if a wait fails, since MPI may still write them.
Status agree_bootstrap(const Status& local, MPI_Comm comm, const Bootstrap& boot) {
  int size = 0, me = 0;
  MPI_Comm_size(comm, &size);
  MPI_Comm_rank(comm, &me);
  auto* codes = new std::vector<int>(static_cast<size_t>(size) + 2);
  int* code = codes->data() + size;
  int* len = code + 1;
  *code = int(local.code());
  MPI_Request req;
  MOED_RETURN_IF_ERROR(check(
      MPI_Iallgather(code, 1, MPI_INT, codes->data(), 1, MPI_INT, comm, &req), "MPI_Iallgather"));
  MOED_RETURN_IF_ERROR(boot.wait(&req, "checking options"));
  for (int r = 0; r < size; ++r) {
    const int c = (*codes)[size_t(r)];
    if (c == 0) continue;
    auto* msg = new std::string(me == r ? local.message() : std::string());
    *len = int(msg->size());
    MOED_RETURN_IF_ERROR(check(MPI_Ibcast(len, 1, MPI_INT, r, comm, &req), "MPI_Ibcast"));
    MOED_RETURN_IF_ERROR(boot.wait(&req, "checking options"));
    msg->resize(size_t(*len));
    MOED_RETURN_IF_ERROR(
        check(MPI_Ibcast(msg->data(), *len, MPI_CHAR, r, comm, &req), "MPI_Ibcast"));
    MOED_RETURN_IF_ERROR(boot.wait(&req, "checking options"));
    Status verdict(StatusCode(c), *msg);
    delete msg;
    delete codes;
    return verdict;
  }
  delete codes;
  return ok_status();
}

}  // namespace

void CallBuffers::park() {
  static std::mutex mu;
  static auto* parked = new std::vector<std::shared_ptr<void>>();  // never freed, on purpose
  std::lock_guard<std::mutex> lock(mu);
  parked->insert(parked->end(), held_.begin(), held_.end());
  held_.clear();
}

Status check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return ok_status();
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return internal_error(call, ": ", std::string(text, size_t(len)));
}

MpiWorld::MpiWorld(MPI_Comm comm, MPI_Comm node_comm, MPI_Comm fault_comm, int rank, int size,
                   int ranks_per_node, std::chrono::milliseconds timeout, int threads_per_rank)
    : World(rank, size, ranks_per_node, timeout, threads_per_rank),
      comm_(comm),
      node_comm_(node_comm),
      fault_comm_(fault_comm),
      owner_(std::this_thread::get_id()),
      fault_buffer_(kFaultBytes) {
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  thread_multiple_ = level == MPI_THREAD_MULTIPLE;
  MPI_Comm_set_errhandler(fault_comm_, MPI_ERRORS_RETURN);
  void* ub = nullptr;
  int has_ub = 0;
  MPI_Comm_get_attr(comm_, MPI_TAG_UB, &ub, &has_ub);
  if (has_ub && ub != nullptr) tag_ub_ = *static_cast<int*>(ub);
  MPI_Irecv(fault_buffer_.data(), int(kFaultBytes), MPI_CHAR, MPI_ANY_SOURCE, kFaultTag,
            fault_comm_, &fault_request_);
  MPI_Irecv(census_in_.data(), 1, MPI_INT, MPI_ANY_SOURCE, kCensusTag, fault_comm_,
            &census_request_);
}

MpiWorld::~MpiWorld() {
  // NOTE: after an unanswered census (here or on a rank that told us) a peer may be stopped,
  // dead or cut off, and every call below is collective or waits for peers: skip them and leak the
  // communicators, so this rank can always exit (mpirun then ends the job). The buffers of
  // the still-posted receives are leaked too, since MPI may yet write into them. After any
  // other failure every peer is alive and tears down with us as usual.
  if (peer_lost_.load()) {
    leave_without_teardown();
    return;
  }
  if (census_request_ != MPI_REQUEST_NULL) {
    MPI_Cancel(&census_request_);
    MPI_Wait(&census_request_, MPI_STATUS_IGNORE);
  }
  for (MPI_Request& r : census_sends_) MPI_Request_free(&r);
  // NOTE: freeing a communicator with unmatched messages lets them leak into the next one
  // that reuses its id (OpenMPI 4 crashes in ob1's add_comm). So receive every failure
  // message addressed to this rank first: one all-to-all says how many there are.
  std::vector<int> sent(static_cast<size_t>(size_), fault_sends_.empty() ? 0 : 1);
  sent[size_t(rank_)] = 0;
  // Bounded: a rank that never heard of a lost peer would otherwise wait here for it.
  std::vector<int> incoming(static_cast<size_t>(size_));
  MPI_Request req;
  int flag = 0;
  MPI_Ialltoall(sent.data(), 1, MPI_INT, incoming.data(), 1, MPI_INT, fault_comm_, &req);
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  while (MPI_Test(&req, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag == 0) {
    if (std::chrono::steady_clock::now() >= deadline) {
      peer_lost_.store(true);
      g_peer_lost.store(true);
      std::fprintf(stderr,
                   "moed: rank %d: a peer did not join the world's teardown within %lld ms; "
                   "leaving without it\n",
                   rank_, static_cast<long long>(timeout_.count()));
      CallBuffers parked;  // MPI may still write the all-to-all's buffers
      std::swap(*parked.make<std::vector<int>>(1), sent);  // swapping keeps the buffers in place
      std::swap(*parked.make<std::vector<int>>(1), incoming);
      parked.park();
      leave_without_teardown();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  int pending = 0;
  for (int n : incoming) pending += n;
  if (fault_request_ != MPI_REQUEST_NULL) {
    if (pending > 0) {
      MPI_Wait(&fault_request_, MPI_STATUS_IGNORE);
    } else {
      MPI_Cancel(&fault_request_);
      MPI_Wait(&fault_request_, MPI_STATUS_IGNORE);
    }
    if (pending > 0) --pending;
  } else if (pending > 0) {
    --pending;  // the one failure() already took
  }
  for (; pending > 0; --pending) {
    MPI_Recv(fault_buffer_.data(), int(kFaultBytes), MPI_CHAR, MPI_ANY_SOURCE, kFaultTag,
             fault_comm_, MPI_STATUS_IGNORE);
  }
  MPI_Waitall(int(fault_sends_.size()), fault_sends_.data(), MPI_STATUSES_IGNORE);
  MPI_Comm_free(&fault_comm_);
  MPI_Comm_free(&node_comm_);
  MPI_Comm_free(&comm_);
}

void MpiWorld::leave_without_teardown() {
  static auto* parked_bytes = new std::vector<std::vector<char>>();  // never freed
  static auto* parked_ints = new std::vector<std::vector<int>>();    // never freed
  static auto* parked_text = new std::vector<std::string>();         // never freed
  parked_bytes->push_back(std::move(fault_buffer_));  // moving keeps the buffer in place
  parked_ints->push_back(std::move(census_in_));
  parked_text->push_back(std::move(fault_message_));  // on the heap: see abort()
}

void MpiWorld::record_failure(int rank, const Status& reason) const {
  std::lock_guard<std::mutex> lock(fail_mu_);
  if (failed_.load(std::memory_order_relaxed)) return;
  failure_ = aborted("rank ", rank, " failed: ", reason.message());
  failed_rank_ = rank;
  failed_.store(true, std::memory_order_release);
}

StatusOr<ShrunkWorld> MpiWorld::shrink() {
  constexpr int kShrinkTag = 4;  // on fault_comm_, beside the failure channel's own tags
  std::vector<int> members;
  for (int r = 0; r < size_; ++r) {
    if (!rank_failed(r)) members.push_back(r);
  }
  // Each member tells every other its list and reads theirs: the same list everywhere, or
  // an error (a second loss while shrinking: call shrink() again).
  std::vector<int> mine(size_t(size_), 0), theirs(members.size() * size_t(size_), 0);
  for (int m : members) mine[size_t(m)] = 1;
  std::vector<MPI_Request> reqs;
  for (size_t i = 0; i < members.size(); ++i) {
    const int m = members[i];
    if (m == rank_) continue;
    MPI_Request r;
    MPI_Isend(mine.data(), size_, MPI_INT, m, kShrinkTag, fault_comm_, &r);
    reqs.push_back(r);
    MPI_Irecv(theirs.data() + i * size_t(size_), size_, MPI_INT, m, kShrinkTag, fault_comm_, &r);
    reqs.push_back(r);
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  int done = 0;
  while (!done && std::chrono::steady_clock::now() < deadline) {
    MPI_Testall(int(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE);
    if (!done) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (!done) {
    for (MPI_Request& r : reqs) {
      if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);  // parked: the job is in trouble anyway
    }
    return deadline_exceeded("shrink: rank ", rank_, " heard from not every one of the ",
                             members.size(), " ranks that have not failed within ",
                             timeout_.count(), " ms");
  }
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i] == rank_) continue;
    if (!std::equal(mine.begin(), mine.end(), theirs.begin() + i * size_t(size_))) {
      return aborted("shrink: rank ", members[i], " sees other ranks lost than rank ", rank_,
                     " does; call shrink() again");
    }
  }
  MPI_Group all, kept;
  MPI_Comm_group(comm_, &all);
  MPI_Group_incl(all, int(members.size()), members.data(), &kept);
  MPI_Comm next = MPI_COMM_NULL;
  const int rc = MPI_Comm_create_group(comm_, kept, kShrinkTag, &next);
  MPI_Group_free(&kept);
  MPI_Group_free(&all);
  MOED_RETURN_IF_ERROR(check(rc, "MPI_Comm_create_group"));
  WorldOptions o;
  o.ranks_per_node = internal::shrunk_ranks_per_node(*this, members);
  o.timeout = timeout_;
  o.threads_per_rank = pool().num_threads();
  MOED_ASSIGN_OR_RETURN(std::unique_ptr<World> w, make_mpi_world(next, o));
  MPI_Comm_free(&next);  // make_mpi_world duplicated it
  return ShrunkWorld{std::move(w), std::move(members)};
}

bool MpiWorld::rank_failed(int r) const {
  if (failure().ok()) return false;
  std::lock_guard<std::mutex> lock(fail_mu_);
  return failed_rank_ == r;
}

void MpiWorld::answer_census() const {
  while (census_request_ != MPI_REQUEST_NULL) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Test(&census_request_, &flag, &st) != MPI_SUCCESS || !flag) return;
    MPI_Request r;
    if (MPI_Isend(&alive_token_, 1, MPI_INT, st.MPI_SOURCE, kAliveTag, fault_comm_, &r) ==
        MPI_SUCCESS) {
      census_sends_.push_back(r);
    }
    MPI_Irecv(census_in_.data(), 1, MPI_INT, MPI_ANY_SOURCE, kCensusTag, fault_comm_,
              &census_request_);
  }
}

Status MpiWorld::census(const Status& timed_out) {
  using Clock = std::chrono::steady_clock;
  // Long enough for a live rank's owning thread to reach its next poll, short next to the
  // timeout that brought us here.
  const auto grace =
      std::clamp(timeout_ / 4, std::chrono::milliseconds(500), std::chrono::milliseconds(5000));
  CallBuffers buf;  // parked at the end: silent ranks' replies may still arrive
  int* token = buf.make<int>(1);
  *token = rank_;
  int* replies = buf.make<int>(size_t(size_));
  std::vector<MPI_Request> recvs(size_t(size_), MPI_REQUEST_NULL);
  std::vector<bool> alive(size_t(size_), false);
  alive[size_t(rank_)] = true;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    MPI_Request req;
    if (MPI_Isend(token, 1, MPI_INT, r, kCensusTag, fault_comm_, &req) == MPI_SUCCESS) {
      census_sends_.push_back(req);
    }
    MPI_Irecv(replies + r, 1, MPI_INT, r, kAliveTag, fault_comm_, &recvs[size_t(r)]);
  }
  const auto deadline = Clock::now() + grace;
  int pending = size_ - 1;
  while (pending > 0 && Clock::now() < deadline) {
    Status other = failure();  // also answers other ranks' censuses
    if (!other.ok()) {
      buf.park();
      return other;  // someone else failed first; their message is the cause
    }
    for (int r = 0; r < size_; ++r) {
      if (recvs[size_t(r)] == MPI_REQUEST_NULL) continue;
      int flag = 0;
      if (MPI_Test(&recvs[size_t(r)], &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag) {
        alive[size_t(r)] = true;
        --pending;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  buf.park();
  std::string silent;
  for (int r = 0; r < size_; ++r) {
    if (!alive[size_t(r)]) silent += str_cat(silent.empty() ? "" : ", ", r);
  }
  // A rank that gave no sign of life may never come to a collective again.
  if (!silent.empty()) {
    peer_lost_.store(true);
    g_peer_lost.store(true);
  }
  const auto g = std::chrono::duration_cast<std::chrono::milliseconds>(grace).count();
  if (silent.empty()) {
    return Status(timed_out.code(), str_cat(timed_out.message(), "; every rank answered within ", g,
                                            " ms (one is waiting in another call, or slow)"));
  }
  return Status(timed_out.code(),
                str_cat(timed_out.message(), "; no sign of life within ", g, " ms from rank ",
                        silent, " (stopped, dead, unreachable, or busy outside moed)"));
}

Status MpiWorld::failure() const {
  // NOTE: without MPI_THREAD_MULTIPLE only the owning thread touches MPI; pool workers
  // waiting on shared-memory signals see a failure once the owner has noticed it. With it,
  // whichever thread gets the poll lock polls; the others skip (they poll again soon).
  std::unique_lock<std::mutex> polling(poll_mu_, std::defer_lock);
  if (!failed_.load(std::memory_order_acquire) &&
      (thread_multiple_ || std::this_thread::get_id() == owner_)) {
    polling.try_lock();
  }
  if (polling.owns_lock()) answer_census();
  if (polling.owns_lock() && !failed_.load(std::memory_order_acquire) &&
      fault_request_ != MPI_REQUEST_NULL) {
    int flag = 0;
    MPI_Status st;
    // NOTE: MPI_Test's status.MPI_ERROR is undefined for a single request; use its result.
    const int rc = MPI_Test(&fault_request_, &flag, &st);
    if (rc == MPI_SUCCESS && flag) {
      int32_t code = 0;
      std::memcpy(&code, fault_buffer_.data(), sizeof(code));
      int len = 0;
      MPI_Get_count(&st, MPI_CHAR, &len);
      std::string msg(fault_buffer_.data() + sizeof(code),
                      size_t(std::max(0, len - int(sizeof(code)))));
      if (code & kPeerLostBit) {
        peer_lost_.store(true);
        g_peer_lost.store(true);
      }
      record_failure(st.MPI_SOURCE, Status(StatusCode(code & ~kPeerLostBit), msg));
    }
  }
  if (!failed_.load(std::memory_order_acquire)) return ok_status();
  std::lock_guard<std::mutex> lock(fail_mu_);
  return failure_;
}

void MpiWorld::abort(const Status& reason) {
  if (failed_.load(std::memory_order_acquire)) return;  // a failure seen first is the cause
  record_failure(rank_, reason);
  int32_t code = int32_t(reason.ok() ? StatusCode::kAborted : reason.code());
  if (peer_lost_.load()) code |= kPeerLostBit;
  fault_message_.reserve(kFaultBytes);  // on the heap, so moving it keeps the sends' buffer
  fault_message_.assign(reinterpret_cast<const char*>(&code), sizeof(code));
  fault_message_ += reason.message().substr(0, kFaultBytes - sizeof(code));
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    MPI_Request req;
    if (MPI_Isend(fault_message_.data(), int(fault_message_.size()), MPI_CHAR, r, kFaultTag,
                  fault_comm_, &req) == MPI_SUCCESS) {
      fault_sends_.push_back(req);
    }
  }
}

Status MpiWorld::wait(MPI_Request* request, const std::function<std::string()>& what,
                      CallBuffers* buffers, Completion completion) {
  MPI_Status st;
  int rc = MPI_SUCCESS;
  auto done = [&] {
    int flag = 0;
    rc = MPI_Test(request, &flag, &st);
    return rc != MPI_SUCCESS || flag != 0;
  };
  Status s;
  if (completion == Completion::kEvenAfterFailure) {
    // Every rank has posted this one, so it completes unless a rank is stalled or gone;
    // leaving at another rank's failure would let MPI write the caller's memory later.
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; !done(); ++i) {
      const auto waited = std::chrono::steady_clock::now() - start;
      if (waited >= timeout_) {
        s = deadline_exceeded(what(), ": waited ",
                              std::chrono::duration_cast<std::chrono::milliseconds>(waited).count(),
                              " ms (timeout ", timeout_.count(), " ms)");
        break;
      }
      if (i < 2048) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
  } else {
    s = internal::poll_until(*this, done, what);
  }
  if (s.ok()) s = check(rc, "MPI_Test");
  if (!s.ok()) {
    if (buffers != nullptr) buffers->park();
    s = after_failed_wait(std::move(s));
  }
  return s;
}

Status MpiWorld::after_failed_wait(Status s) {
  // Who is missing? Ask everyone, so the error (and every rank's echo of it) names them.
  if (s.code() == StatusCode::kDeadlineExceeded) s = census(s);
  // The collective or message can't complete as a whole any more: fail this rank's world
  // so later calls return at once (and the other ranks hear of it).
  if (s.code() != StatusCode::kAborted) abort(s);
  return s;
}

Status MpiWorld::after_timeout(Status timed_out) {
  if (!thread_multiple_ && std::this_thread::get_id() != owner_) return timed_out;
  return census(timed_out);
}

Status MpiWorld::agree_verdict(const Status& local, const char* op) {
  CallBuffers buf;
  int* code = buf.make<int>(1);
  *code = int(local.code());
  int* codes = buf.make<int>(size_t(size_));
  MPI_Request req;
  MOED_RETURN_IF_ERROR(
      check(MPI_Iallgather(code, 1, MPI_INT, codes, 1, MPI_INT, comm_, &req), "MPI_Iallgather"));
  auto what = [&] { return str_cat("rank ", rank_, " in ", op, " (checking arguments)"); };
  MOED_RETURN_IF_ERROR(wait(&req, what, &buf));
  int bad = -1;
  for (int r = 0; r < size_ && bad < 0; ++r) {
    if (codes[r] != 0) bad = r;
  }
  if (bad < 0) return ok_status();
  const std::string& mine = local.message();
  int* len = buf.make<int>(1);
  *len = bad == rank_ ? int(mine.size()) : 0;
  MOED_RETURN_IF_ERROR(check(MPI_Ibcast(len, 1, MPI_INT, bad, comm_, &req), "MPI_Ibcast"));
  MOED_RETURN_IF_ERROR(wait(&req, what, &buf));
  char* text = buf.make<char>(size_t(*len));
  if (bad == rank_) std::copy(mine.begin(), mine.end(), text);
  MOED_RETURN_IF_ERROR(check(MPI_Ibcast(text, *len, MPI_CHAR, bad, comm_, &req), "MPI_Ibcast"));
  MOED_RETURN_IF_ERROR(wait(&req, what, &buf));
  return Status(StatusCode(codes[bad]), std::string(text, size_t(*len)));
}

}  // namespace mpi

StatusOr<std::unique_ptr<World>> make_mpi_world(MPI_Comm comm, const WorldOptions& options) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) return failed_precondition("make_mpi_world: MPI is not initialised");
  if (comm == MPI_COMM_NULL) return invalid_argument("make_mpi_world: comm is MPI_COMM_NULL");
  int size = 0, rank = 0;
  MPI_Comm_size(comm, &size);
  MPI_Comm_rank(comm, &rank);
  // Every step below waits for the other ranks, each bounded by the timeout (a bad timeout
  // is reported on every rank by the agreement; until then the default bounds the waits).
  mpi::Bootstrap boot;
  boot.rank = rank;
  boot.timeout = options.timeout.count() > 0 ? options.timeout : WorldOptions{}.timeout;

  MPI_Comm world_comm = MPI_COMM_NULL;
  MPI_Request req;
  MOED_RETURN_IF_ERROR(mpi::check(MPI_Comm_idup(comm, &world_comm, &req), "MPI_Comm_idup"));
  MOED_RETURN_IF_ERROR(boot.wait(&req, "MPI_Comm_idup"));
  MPI_Comm_set_errhandler(world_comm, MPI_ERRORS_RETURN);

  // The host: the ranks that can share memory with this one.
  MOED_RETURN_IF_ERROR(boot.gate(world_comm, "MPI_Comm_split_type (finding the host)"));
  MPI_Comm host = MPI_COMM_NULL;
  MPI_Comm_split_type(world_comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &host);
  int host_size = 0;
  MPI_Comm_size(host, &host_size);
  const int g = options.ranks_per_node == 0 ? host_size : options.ranks_per_node;

  Status local;
  if (options.timeout.count() <= 0) {
    local = invalid_argument("timeout = ", options.timeout.count(), " ms must be > 0");
  } else if (options.threads_per_rank < 0) {
    local = invalid_argument("threads_per_rank = ", options.threads_per_rank, " must be >= 0");
  } else if (g < 1 || size % g != 0) {
    local = invalid_argument("ranks_per_node = ", g, " must divide the world size ", size);
  } else if (host_size % g != 0) {
    local = invalid_argument("ranks_per_node = ", g, " must divide the ", host_size,
                             " ranks on rank ", rank, "'s host");
  } else {
    // Node n is ranks [n*G, (n+1)*G): they must all be on this rank's host.
    MPI_Group world_group, host_group;
    MPI_Comm_group(world_comm, &world_group);
    MPI_Comm_group(host, &host_group);
    std::vector<int> node_ranks(static_cast<size_t>(g)), in_host(static_cast<size_t>(g));
    for (int i = 0; i < g; ++i) node_ranks[size_t(i)] = rank / g * g + i;
    MPI_Group_translate_ranks(world_group, g, node_ranks.data(), host_group, in_host.data());
    for (int i = 0; i < g && local.ok(); ++i) {
      if (in_host[size_t(i)] == MPI_UNDEFINED) {
        local = invalid_argument("ranks_per_node = ", g, ": rank ", node_ranks[size_t(i)],
                                 " of node ", rank / g, " is not on the same host as rank ", rank);
      }
    }
    MPI_Group_free(&world_group);
    MPI_Group_free(&host_group);
  }
  MPI_Comm_free(&host);
  // The agreement is also the gate of the node split below.
  Status verdict = mpi::agree_bootstrap(local, world_comm, boot);
  if (!verdict.ok()) {
    if (!mpi_peer_may_be_gone()) MPI_Comm_free(&world_comm);
    return verdict;
  }
  MPI_Comm node_comm = MPI_COMM_NULL;
  MPI_Comm_split(world_comm, rank / g, rank, &node_comm);
  MPI_Comm_set_errhandler(node_comm, MPI_ERRORS_RETURN);
  // The failure channel's own communicator, so its messages never match a data receive.
  MPI_Comm fault_comm = MPI_COMM_NULL;
  MOED_RETURN_IF_ERROR(mpi::check(MPI_Comm_idup(world_comm, &fault_comm, &req), "MPI_Comm_idup"));
  MOED_RETURN_IF_ERROR(boot.wait(&req, "MPI_Comm_idup (failure channel)"));
  const int threads = resolve_threads_per_rank(options.threads_per_rank, host_size);
  return std::unique_ptr<World>(std::make_unique<mpi::MpiWorld>(
      world_comm, node_comm, fault_comm, rank, size, g, options.timeout, threads));
}

bool mpi_peer_may_be_gone() { return mpi::g_peer_lost.load(); }

}  // namespace moed
