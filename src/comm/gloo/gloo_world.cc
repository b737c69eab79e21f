// The gloo backend: make_gloo_world (a gloo TCP context from the rendezvous store, hosts found
// by exchanging host identities, nodes), waits woken by the monitor, and the failure channel.
#include "comm/gloo/gloo_world.h"

#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

namespace moed {
namespace gloo_comm {
namespace {

// gloo's own timeout, far past ours: the monitor wakes every wait first.
constexpr std::chrono::milliseconds kBackstop = std::chrono::seconds(30);
// How long a rank that saw a connection close waits for the failure message that names the
// cause (a host-mate of a dead rank sends one within a few monitor ticks; on a loaded 2-core
// machine it once took longer than 2 s, and the closed connection was blamed instead), and how
// long a rank that told others of a failure waits for their acknowledgements before it closes.
constexpr std::chrono::milliseconds kCauseGrace = std::chrono::seconds(5);
// The payload of a failure message's acknowledgement.
constexpr char kFaultAck = 1;
constexpr auto kTick = std::chrono::milliseconds(5);
constexpr auto kPidCheckEvery = std::chrono::milliseconds(20);

// What one rank tells every other while the world is made.
struct SetupInfo {
  char host_id[256];
  int64_t pid;
  uint64_t random;
  int32_t ranks_per_node;
  int32_t code;  // this rank's verdict on its own options
  char message[256];
};

std::string read_first_line(const char* path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

// Ranks that can share memory: same hostname, same boot, same /dev/shm.
std::string default_host_id() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  struct stat st {};
  stat("/dev/shm", &st);
  return str_cat(name, "/", read_first_line("/proc/sys/kernel/random/boot_id"), "/",
                 uint64_t(st.st_dev));
}

// A process is gone when it no longer exists or is a zombie (dead, not yet reaped).
bool process_gone(int64_t pid) {
  if (pid <= 0) return false;
  if (::kill(pid_t(pid), 0) != 0 && errno == ESRCH) return true;
  std::string stat = read_first_line(str_cat("/proc/", pid, "/stat").c_str());
  const size_t close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return stat.empty();
  const char state = stat[close + 2];
  return state == 'Z' || state == 'X';
}

std::string gloo_what(const std::exception& e) { return e.what(); }

// The setup exchange, before the world exists: blocking gloo waits bounded by gloo's timeout
// (a timeout here closes the context, which is then thrown away).
Status exchange_setup(::gloo::Context& ctx, const SetupInfo& mine, std::vector<SetupInfo>& all) {
  const int size = ctx.size, rank = ctx.rank;
  all.assign(size_t(size), SetupInfo{});
  all[size_t(rank)] = mine;
  const uint64_t slot = make_slot(Space::kHost, 0);
  try {
    std::vector<Buffer> recvs, sends;
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      recvs.push_back(ctx.createUnboundBuffer(&all[size_t(r)], sizeof(SetupInfo)));
      recvs.back()->recv(r, slot);
      sends.push_back(ctx.createUnboundBuffer(const_cast<SetupInfo*>(&mine), sizeof(SetupInfo)));
      sends.back()->send(r, slot);
    }
    for (auto& b : recvs) b->waitRecv(ctx.getTimeout());
    for (auto& b : sends) b->waitSend(ctx.getTimeout());
  } catch (const std::exception& e) {
    return aborted("rank ", rank, ": exchanging host identities over gloo failed: ", gloo_what(e));
  }
  return ok_status();
}

}  // namespace

GlooWorld::GlooWorld(std::shared_ptr<::gloo::transport::Device> device,
                     std::shared_ptr<::gloo::Context> ctx, int rank, int size, int ranks_per_node,
                     std::chrono::milliseconds timeout, int threads_per_rank, HostLayout host)
    : World(rank, size, ranks_per_node, timeout, threads_per_rank),
      device_(std::move(device)),
      ctx_(std::move(ctx)),
      host_(std::move(host)),
      rank_failed_(size_t(size), 0),
      fault_in_(kMessageBytes + 16) {
  host_index_ = int(std::find(host_.ranks.begin(), host_.ranks.end(), rank) - host_.ranks.begin());
}

GlooWorld::~GlooWorld() {
  stopping_.store(true);
  monitor_cv_.notify_all();
  if (monitor_.joinable()) monitor_.join();
  relay_host_fault();  // in case the monitor had not yet
  // The listener goes on acknowledging the others' failure messages while this rank waits for
  // the acknowledgements of its own; then whatever it relayed meanwhile is waited for too.
  const auto until = Clock::now() + kCauseGrace;
  size_t acked = await_fault_acks(0, until);
  if (fault_recv_) fault_recv_->abortWaitRecv();
  if (listener_.joinable()) listener_.join();
  await_fault_acks(acked, until);
  if (control_ != nullptr) {
    control_->members[host_index_].state.store(kClosed, std::memory_order_release);
    munmap(control_, control_bytes_);
  }
  unmap_stages();
  if (coll_ != nullptr) munmap(coll_, sizeof(CollSlot) * host_.ranks.size());
  forget_mailbox(this);
  fault_recv_.reset();
  fault_sends_.clear();
  fault_acks_.clear();
  ctx_.reset();
  device_.reset();
}

std::vector<int> GlooWorld::all_ranks() const {
  std::vector<int> r(static_cast<size_t>(size_));
  for (int i = 0; i < size_; ++i) r[size_t(i)] = i;
  return r;
}

std::vector<int> GlooWorld::node_ranks() const {
  std::vector<int> r(static_cast<size_t>(ranks_per_node_));
  for (int i = 0; i < ranks_per_node_; ++i) r[size_t(i)] = node() * ranks_per_node_ + i;
  return r;
}

void GlooWorld::record_failure(int rank, const Status& reason) const {
  {
    std::lock_guard<std::mutex> lock(fail_mu_);
    if (rank >= 0 && rank < size_) rank_failed_[size_t(rank)] = 1;
    if (failed_.load(std::memory_order_relaxed)) return;
    const std::string prefix = str_cat("rank ", rank, " failed: ");
    failure_ =
        aborted(reason.message().rfind(prefix, 0) == 0 ? std::string() : prefix, reason.message());
    failed_.store(true, std::memory_order_release);
  }
  std::lock_guard<std::mutex> lock(wait_mu_);
  if (waiting_ != nullptr && (!waiting_peer_scope_ || waiting_->peer == rank)) {
    if (waiting_->recv)
      waiting_->buf->abortWaitRecv();
    else
      waiting_->buf->abortWaitSend();
  }
}

Status GlooWorld::failure() const {
  if (!failed_.load(std::memory_order_acquire) && control_ != nullptr &&
      control_->fault_ready.load(std::memory_order_acquire) == 1) {
    const int who = control_->fault_rank.load(std::memory_order_relaxed) - 1;
    if (who != rank_) {
      record_failure(who, Status(StatusCode(control_->fault_code),
                                 std::string(control_->fault_message,
                                             strnlen(control_->fault_message, kMessageBytes))));
    }
  }
  if (!failed_.load(std::memory_order_acquire)) return ok_status();
  std::lock_guard<std::mutex> lock(fail_mu_);
  return failure_;
}

bool GlooWorld::rank_failed(int r) const {
  (void)failure();  // the host's fault word
  return rank_failed_locked(r);
}

bool GlooWorld::rank_failed_locked(int r) const {
  std::lock_guard<std::mutex> lock(fail_mu_);
  return r >= 0 && r < size_ && rank_failed_[size_t(r)] != 0;
}

void GlooWorld::send_fault(int failed_rank, const Status& reason) {
  std::lock_guard<std::mutex> lock(fail_mu_);  // once per world, whoever notices first
  if (told_others_) return;
  told_others_ = true;
  const StatusCode code = reason.ok() ? StatusCode::kAborted : reason.code();
  const std::string text = reason.message().substr(0, kMessageBytes - 1);
  if (control_ != nullptr) {
    int32_t none = 0;
    if (control_->fault_rank.compare_exchange_strong(none, failed_rank + 1)) {
      control_->fault_code = int32_t(code);
      std::memcpy(control_->fault_message, text.c_str(), text.size() + 1);
      control_->fault_ready.store(1, std::memory_order_release);
    }
  }
  std::vector<char> msg(fault_in_.size(), 0);
  const int32_t head[3] = {failed_rank, int32_t(code), int32_t(text.size())};
  std::memcpy(msg.data(), head, sizeof(head));
  std::memcpy(msg.data() + sizeof(head), text.data(), text.size());
  fault_out_.push_back(std::move(msg));
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    try {
      Buffer b = ctx_->createUnboundBuffer(fault_out_.back().data(), fault_out_.back().size());
      b->send(r, make_slot(Space::kFault, 0));
      fault_sends_.push_back(std::move(b));
      fault_told_.push_back(r);
    } catch (const std::exception&) {
      // A closed connection: that rank learns from the closure instead.
    }
  }
}

bool GlooWorld::relay_host_fault() {
  if (control_ == nullptr || control_->fault_ready.load(std::memory_order_acquire) != 1) {
    return false;
  }
  const int who = control_->fault_rank.load(std::memory_order_relaxed) - 1;
  if (who == rank_) return true;  // about this rank, which failure() does not take either
  const Status reason(
      StatusCode(control_->fault_code),
      std::string(control_->fault_message, strnlen(control_->fault_message, kMessageBytes)));
  record_failure(who, reason);
  send_fault(who, reason);
  return true;
}

void GlooWorld::abort(const Status& reason) {
  record_failure(rank_, reason);
  send_fault(rank_, reason);
}

void GlooWorld::listen_for_faults() {
  std::vector<int> peers;
  for (int r = 0; r < size_; ++r)
    if (r != rank_) peers.push_back(r);
  try {
    for (;;) {
      fault_recv_->recv(peers, make_slot(Space::kFault, 0));
      int from = -1;
      if (!fault_recv_->waitRecv(&from, std::chrono::hours(24 * 30))) return;  // aborted
      int32_t head[3];
      std::memcpy(head, fault_in_.data(), sizeof(head));
      const size_t len = std::min(size_t(std::max(head[2], 0)), kMessageBytes);
      const Status reason(StatusCode(head[1]), std::string(fault_in_.data() + sizeof(head), len));
      record_failure(head[0], reason);
      acknowledge_fault(from);
      // Passed on: the sender may end before its message reaches every rank.
      send_fault(head[0], reason);
    }
  } catch (const std::exception&) {
    // The context closed (gloo's backstop timeout): waits see it themselves.
  }
}

void GlooWorld::acknowledge_fault(int to) {
  if (to < 0 || to == rank_) return;
  try {
    Buffer b = ctx_->createUnboundBuffer(const_cast<char*>(&kFaultAck), 1);
    b->send(to, make_slot(Space::kFault, 1));
    fault_acks_.push_back(std::move(b));
  } catch (const std::exception&) {
    // A closed connection: the sender stops waiting for this rank.
  }
}

size_t GlooWorld::await_fault_acks(size_t first, Clock::time_point until) {
  std::vector<int> told;
  {
    std::lock_guard<std::mutex> lock(fail_mu_);
    told = fault_told_;
  }
  char byte = 0;
  for (size_t i = first; i < told.size(); ++i) {
    try {
      Buffer b = ctx_->createUnboundBuffer(&byte, 1);
      b->recv(told[i], make_slot(Space::kFault, 1));
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
      if (left.count() > 0) b->waitRecv(left);
    } catch (const std::exception&) {
      // Its connection closed (a dead or finished rank) or the grace ran out.
    }
  }
  return told.size();
}

int GlooWorld::find_dead_host_mate() const {
  for (size_t i = 0; i < host_.ranks.size(); ++i) {
    if (int(i) == host_index_) continue;
    {
      std::lock_guard<std::mutex> lock(fail_mu_);
      if (rank_failed_[size_t(host_.ranks[i])] != 0) continue;  // recorded already
    }
    const auto& m = control_->members[i];
    if (m.state.load(std::memory_order_acquire) != kAlive) continue;
    if (process_gone(m.pid.load(std::memory_order_relaxed))) return host_.ranks[i];
  }
  return -1;
}

void GlooWorld::monitor() {
  auto next_pid_check = Clock::now();
  std::unique_lock<std::mutex> lk(monitor_mu_);
  while (!stopping_.load()) {
    monitor_cv_.wait_for(lk, kTick);
    const auto now = Clock::now();
    {
      std::lock_guard<std::mutex> lock(wait_mu_);
      const bool stop = waiting_ != nullptr &&
                        (waiting_peer_scope_ ? rank_failed_locked(waiting_->peer) : failed_.load());
      if (waiting_ != nullptr && (now >= waiting_deadline_ || stop)) {
        deadline_hit_ = now >= waiting_deadline_;
        if (waiting_->recv)
          waiting_->buf->abortWaitRecv();
        else
          waiting_->buf->abortWaitSend();
      }
    }
    if (!host_fault_relayed_) host_fault_relayed_ = relay_host_fault();
    // NOTE: dead host-mates are looked for after the first failure too, so that each is
    // recorded as failed (rank_failed), as the low-latency shrink mode asks.
    if (control_ != nullptr && now >= next_pid_check) {
      next_pid_check = now + kPidCheckEvery;
      const int dead = find_dead_host_mate();
      if (dead >= 0) {
        const int64_t pid =
            control_
                ->members[size_t(std::find(host_.ranks.begin(), host_.ranks.end(), dead) -
                                 host_.ranks.begin())]
                .pid.load();
        Status s = aborted("rank ", dead, " failed: its process (pid ", pid,
                           ") ended without closing its moed world (seen by rank ", rank_,
                           " on the same host)");
        record_failure(dead, s);
        send_fault(dead, s);
      }
    }
  }
}

StatusOr<Op> GlooWorld::post(bool recv, int peer, uint64_t slot, void* data, size_t bytes) {
  Op op;
  op.recv = recv;
  op.peer = peer;
  op.bytes = bytes;
  try {
    op.buf = ctx_->createUnboundBuffer(data, bytes);
    if (recv) {
      op.buf->recv(peer, slot, 0, bytes);
    } else {
      op.buf->send(peer, slot, 0, bytes);
    }
  } catch (const std::exception& e) {
    Status s = aborted("rank ", peer, " failed: rank ", rank_, " cannot ",
                       recv ? "receive from" : "send to", " it (gloo: ", gloo_what(e), ")");
    record_failure(peer, s);
    return failure();
  }
  return op;
}

GlooWorld::OpWait GlooWorld::wait_op(Op& op, Clock::time_point deadline, bool peer_scope) {
  {
    std::lock_guard<std::mutex> lock(wait_mu_);
    waiting_ = &op;
    waiting_deadline_ = deadline;
    deadline_hit_ = false;
    waiting_peer_scope_ = peer_scope;
  }
  OpWait r;
  r.start = Clock::now();
  try {
    const auto backstop =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - r.start) + kBackstop;
    r.completed =
        op.recv ? op.buf->waitRecv(nullptr, backstop) : op.buf->waitSend(nullptr, backstop);
  } catch (const std::exception& e) {
    r.error = gloo_what(e);
  }
  std::lock_guard<std::mutex> lock(wait_mu_);
  waiting_ = nullptr;
  waiting_peer_scope_ = false;
  r.deadline_hit = deadline_hit_;
  return r;
}

Status GlooWorld::wait_peer(Op& op, Clock::time_point deadline,
                            const std::function<std::string()>& what) {
  if (op.done) return ok_status();
  if (rank_failed(op.peer)) return internal::peer_failure(*this, op.peer);
  const OpWait r = wait_op(op, deadline, /*peer_scope=*/true);
  if (r.completed && r.error.empty()) {
    op.done = true;
    return ok_status();
  }
  if (rank_failed(op.peer)) return internal::peer_failure(*this, op.peer);
  if (!r.error.empty()) {
    Status s = aborted("rank ", op.peer, " failed: its connection to rank ", rank_,
                       " closed while ", what(), " (gloo: ", r.error, ")");
    record_failure(op.peer, s);
    return s;
  }
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - r.start);
  return deadline_exceeded(what(), ": waited ", waited.count(), " ms");
}

Status GlooWorld::wait(Op& op, Clock::time_point deadline,
                       const std::function<std::string()>& what) {
  if (op.done) return ok_status();
  MOED_RETURN_IF_ERROR(failure());
  const OpWait r = wait_op(op, deadline, /*peer_scope=*/false);
  const auto& [completed, hit, error, start] = r;
  if (completed && error.empty()) {
    op.done = true;
    return ok_status();
  }
  Status s = failure();
  if (!s.ok()) return s;
  if (!error.empty()) {
    // The connection to op.peer closed: wait briefly for the message that names the cause.
    const auto until = Clock::now() + std::min(kCauseGrace, timeout_);
    while (Clock::now() < until) {
      s = failure();
      if (!s.ok()) return s;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    s = aborted("rank ", op.peer, " failed: its connection to rank ", rank_, " closed while ",
                what(), " (gloo: ", error, ")");
    record_failure(op.peer, s);
    send_fault(op.peer, s);
    return failure();
  }
  if (hit || Clock::now() >= deadline) {
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
    s = deadline_exceeded(what(), ": waited ", waited.count(), " ms (timeout ", timeout_.count(),
                          " ms)");
  } else {
    s = internal_error(what(), ": the wait was interrupted");
  }
  record_failure(rank_, s);
  send_fault(rank_, s);
  return s;
}

Status GlooWorld::exchange(uint64_t slot, std::span<const Transfer> sends,
                           std::span<const Transfer> recvs,
                           const std::function<std::string()>& what) {
  std::vector<Op> ops;
  ops.reserve(sends.size() + recvs.size());
  for (const Transfer& t : recvs) {
    MOED_ASSIGN_OR_RETURN(Op op, post(true, t.peer, slot, t.data, t.bytes));
    ops.push_back(std::move(op));
  }
  for (const Transfer& t : sends) {
    MOED_ASSIGN_OR_RETURN(Op op, post(false, t.peer, slot, t.data, t.bytes));
    ops.push_back(std::move(op));
  }
  const auto deadline = Clock::now() + timeout_;
  for (Op& op : ops) {
    MOED_RETURN_IF_ERROR(wait(op, deadline, [&] {
      return str_cat(what(), op.recv ? " (receiving from rank " : " (sending to rank ", op.peer,
                     ")");
    }));
  }
  return ok_status();
}

Status GlooWorld::gather(std::span<const int> ranks, uint64_t slot, const void* mine, size_t n,
                         void* out, const char* op) {
  // Every rank takes the same path: coll_ exists on all ranks or none, n is the same.
  if (coll_ != nullptr && ranks.size() == size_t(size_) && n <= CollSlot::kBytes) {
    return host_gather(mine, n, out, op);
  }
  std::vector<Transfer> sends, recvs;
  char* o = static_cast<char*>(out);
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] == rank_) {
      if (n > 0) std::memcpy(o + i * n, mine, n);
      continue;
    }
    sends.push_back({ranks[i], const_cast<void*>(mine), n});
    recvs.push_back({ranks[i], o + i * n, n});
  }
  return exchange(slot, sends, recvs, [&] { return str_cat("rank ", rank_, " in ", op); });
}

Status GlooWorld::agree_among(std::span<const int> ranks, uint64_t slot, const Status& local,
                              const char* op) {
  // Code and message in one fixed-size record: one round, whatever the verdict.
  struct Verdict {
    int32_t code;
    char text[508];
  };
  Verdict mine{};
  mine.code = int32_t(local.code());
  std::strncpy(mine.text, local.message().c_str(), sizeof(mine.text) - 1);
  std::vector<Verdict> all(ranks.size());
  MOED_RETURN_IF_ERROR(gather(ranks, slot, &mine, sizeof(Verdict), all.data(), op));
  for (const Verdict& v : all) {
    if (v.code != 0) return Status(StatusCode(v.code), std::string(v.text, strnlen(v.text, 508)));
  }
  return ok_status();
}

}  // namespace gloo_comm

StatusOr<std::unique_ptr<World>> make_gloo_world(gloo::rendezvous::Store& store, int rank, int size,
                                                 const GlooWorldOptions& options) {
  using namespace gloo_comm;
  if (size < 1) return invalid_argument("make_gloo_world: size = ", size, " must be >= 1");
  if (rank < 0 || rank >= size)
    return invalid_argument("make_gloo_world: rank = ", rank, " is outside [0, ", size, ")");
  const WorldOptions& o = options.world;
  Status local;
  if (o.timeout.count() <= 0) {
    local = invalid_argument("timeout = ", o.timeout.count(), " ms must be > 0");
  } else if (o.threads_per_rank < 0) {
    local = invalid_argument("threads_per_rank = ", o.threads_per_rank, " must be >= 0");
  } else if (o.ranks_per_node < 0) {
    local = invalid_argument("ranks_per_node = ", o.ranks_per_node, " must be >= 0");
  }
  const auto gloo_timeout = o.timeout.count() > 0 ? o.timeout : std::chrono::milliseconds(1000);

  std::shared_ptr<::gloo::transport::Device> device;
  std::shared_ptr<::gloo::rendezvous::Context> ctx;
  try {
    ::gloo::transport::tcp::attr attr;
    if (options.address.empty()) {
      char name[256] = {};
      gethostname(name, sizeof(name) - 1);
      attr.hostname = name;
    } else {
      attr.hostname = options.address;
    }
    device = ::gloo::transport::tcp::CreateDevice(attr);
    ctx = std::make_shared<::gloo::rendezvous::Context>(rank, size);
    ctx->setTimeout(gloo_timeout);
    ctx->connectFullMesh(store, device);
  } catch (const std::exception& e) {
    return aborted("rank ", rank, ": connecting the gloo context failed: ", gloo_what(e));
  }

  SetupInfo mine{};
  const std::string host_id = options.host_id.empty() ? default_host_id() : options.host_id;
  std::strncpy(mine.host_id, host_id.c_str(), sizeof(mine.host_id) - 1);
  mine.pid = int64_t(getpid());
  mine.random = std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32);
  mine.ranks_per_node = o.ranks_per_node;
  mine.code = int32_t(local.code());
  std::strncpy(mine.message, local.message().c_str(), sizeof(mine.message) - 1);
  std::vector<SetupInfo> all;
  MOED_RETURN_IF_ERROR(exchange_setup(*ctx, mine, all));

  // Every rank sees every rank's record, so each reaches the same verdict on its own.
  for (int r = 0; r < size; ++r) {
    const SetupInfo& x = all[size_t(r)];
    if (x.code != 0) return Status(StatusCode(x.code), str_cat("rank ", r, ": ", x.message));
    if (x.ranks_per_node != all[0].ranks_per_node) {
      return invalid_argument("ranks_per_node = ", x.ranks_per_node, " on rank ", r, " but ",
                              all[0].ranks_per_node, " on rank 0");
    }
  }
  auto host_of = [&](int r) { return std::string(all[size_t(r)].host_id); };
  HostLayout host;
  host.id = host_id;
  host.world_id = all[0].random;
  for (int r = 0; r < size; ++r) {
    if (host_of(r) == host_id) {
      host.ranks.push_back(r);
      host.pids.push_back(all[size_t(r)].pid);
    }
  }
  int rank0_host = 0;
  for (int r = 0; r < size; ++r) rank0_host += host_of(r) == host_of(0);
  const int g = o.ranks_per_node == 0 ? rank0_host : o.ranks_per_node;
  if (size % g != 0) {
    return invalid_argument("ranks_per_node = ", g, " must divide the world size ", size);
  }
  for (int r = 0; r < size; ++r) {
    if (host_of(r) != host_of(r / g * g)) {
      return invalid_argument("ranks_per_node = ", g, ": rank ", r, " of node ", r / g,
                              " is not on the same host as rank ", r / g * g,
                              " (ranks of one node must share a host; hosts: ", host_of(r / g * g),
                              " and ", host_of(r), ")");
    }
  }
  const int threads = resolve_threads_per_rank(o.threads_per_rank, int(host.ranks.size()));
  auto w = std::make_unique<GlooWorld>(std::move(device), std::move(ctx), rank, size, g, o.timeout,
                                       threads, std::move(host));
  MOED_RETURN_IF_ERROR(w->start());
  return std::unique_ptr<World>(std::move(w));
}

}  // namespace moed
