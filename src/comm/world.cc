// Backend-independent parts of World: construction, blocking wrappers, agreement, and
// SharedBuffer's signals (shared-memory counters work the same for threads and processes).
#include "moed/world.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "comm/wait.h"

namespace moed {

namespace {
class CompletedOp final : public PendingOp {
 public:
  explicit CompletedOp(Status s) : status_(std::move(s)) {}
  Status wait() override { return status_; }
  bool ready() override { return true; }

 private:
  Status status_;
};
std::atomic<int> g_default_threads_per_rank{0};
}  // namespace

Request completed_request(Status status) {
  return std::make_unique<CompletedOp>(std::move(status));
}

Status set_default_threads_per_rank(int threads) {
  if (threads < 0) {
    return invalid_argument("default threads_per_rank = ", threads, " must be >= 0 (0 = auto)");
  }
  g_default_threads_per_rank.store(threads);
  return ok_status();
}
int default_threads_per_rank() { return g_default_threads_per_rank.load(); }

int resolve_threads_per_rank(int threads_per_rank, int ranks_on_host) {
  if (threads_per_rank > 0) return threads_per_rank;
  const int d = g_default_threads_per_rank.load();
  if (d > 0) return d;
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / std::max(1, ranks_on_host));
}

Status wait_all(std::vector<Request>& requests) {
  Status first;
  for (auto& r : requests) {
    if (!r) continue;
    Status s = r->wait();
    if (first.ok() && !s.ok()) first = s;
  }
  return first;
}

World::World(int rank, int size, int ranks_per_node, std::chrono::milliseconds timeout,
             int threads_per_rank)
    : rank_(rank),
      size_(size),
      ranks_per_node_(ranks_per_node),
      timeout_(timeout),
      pool_(std::make_unique<ThreadPool>(std::max(1, threads_per_rank))) {}

namespace {
// A send of a packed copy of its pieces: the copy lives as long as the request.
class PackedSend final : public PendingOp {
 public:
  explicit PackedSend(std::span<const World::Piece> pieces) {
    size_t total = 0;
    for (const World::Piece& p : pieces) total += p.bytes;
    bytes_.resize(total);
    char* at = bytes_.data();
    for (const World::Piece& p : pieces) {
      if (p.bytes) std::memcpy(at, p.data, p.bytes);
      at += p.bytes;
    }
  }
  Status wait() override { return send_->wait(); }
  bool ready() override { return send_->ready(); }
  Status wait_for(std::chrono::milliseconds timeout) override { return send_->wait_for(timeout); }

  std::vector<char> bytes_;
  Request send_;  // declared after bytes_: dropped (cancelled) before them
};
}  // namespace

StatusOr<Request> World::isend_gather(int dst, int tag, std::span<const Piece> pieces) {
  auto packed = std::make_unique<PackedSend>(pieces);
  MOED_ASSIGN_OR_RETURN(packed->send_,
                        isend(dst, tag, packed->bytes_.data(), packed->bytes_.size()));
  return Request(std::move(packed));
}

Status World::send(int dst, int tag, const void* data, size_t bytes) {
  MOED_ASSIGN_OR_RETURN(Request r, isend(dst, tag, data, bytes));
  return r ? r->wait() : ok_status();
}

Status World::recv(int src, int tag, void* data, size_t bytes) {
  MOED_ASSIGN_OR_RETURN(Request r, irecv(src, tag, data, bytes));
  return r ? r->wait() : ok_status();
}

SharedBuffer::SharedBuffer(World* world, size_t bytes, int local_rank, std::vector<void*> segments,
                           std::vector<std::atomic<uint64_t>*> inbox)
    : world_(world),
      bytes_(bytes),
      local_rank_(local_rank),
      segments_(std::move(segments)),
      inbox_(std::move(inbox)) {}

void SharedBuffer::signal(int to_local_rank, uint64_t value) {
  MOED_CHECK(to_local_rank >= 0 && to_local_rank < local_size(), "to_local_rank = ", to_local_rank,
             " is outside [0, ", local_size(), ")");
  // NOTE: release, so every write this rank made for `to` before signalling is visible to
  // `to` once its acquire load sees the value.
  outbox_[size_t(to_local_rank)]->store(value, std::memory_order_release);
}

Status SharedBuffer::wait_signal(int from_local_rank, uint64_t value) {
  if (from_local_rank < 0 || from_local_rank >= local_size()) {
    return invalid_argument("wait_signal: from_local_rank = ", from_local_rank, " is outside [0, ",
                            local_size(), ")");
  }
  const std::atomic<uint64_t>* counter = inbox_[size_t(from_local_rank)];
  return internal::poll_peer(
      *world_, [&] { return counter->load(std::memory_order_acquire) >= value; },
      [&] {
        return str_cat("rank ", world_->rank(), " waiting for signal >= ", value,
                       " from local rank ", from_local_rank, " (rank ",
                       world_->node() * world_->ranks_per_node() + from_local_rank, "), at ",
                       counter->load(std::memory_order_relaxed));
      });
}

namespace {
// The SharedBuffer World hands out: runs the backend's release hook when dropped.
class OwnedSharedBuffer final : public SharedBuffer {
 public:
  OwnedSharedBuffer(World* world, size_t bytes, int local_rank, std::vector<void*> segments,
                    std::vector<std::atomic<uint64_t>*> inbox,
                    std::vector<std::atomic<uint64_t>*> outbox, std::function<void()> on_free)
      : SharedBuffer(world, bytes, local_rank, std::move(segments), std::move(inbox)),
        on_free_(std::move(on_free)) {
    outbox_ = std::move(outbox);
  }
  ~OwnedSharedBuffer() override {
    if (on_free_) on_free_();
  }

 private:
  std::function<void()> on_free_;
};
}  // namespace

std::shared_ptr<SharedBuffer> World::make_shared_buffer(size_t bytes, std::vector<void*> segments,
                                                        std::vector<std::atomic<uint64_t>*> inbox,
                                                        std::vector<std::atomic<uint64_t>*> outbox,
                                                        std::function<void()> on_free) {
  MOED_CHECK(segments.size() == size_t(ranks_per_node_) && inbox.size() == segments.size() &&
             outbox.size() == segments.size());
  return std::make_shared<OwnedSharedBuffer>(this, bytes, local_rank(), std::move(segments),
                                             std::move(inbox), std::move(outbox),
                                             std::move(on_free));
}

StatusOr<ShrunkWorld> World::shrink() {
  return unimplemented("shrink() is not available in the ", backend_name(),
                       " world from C++; the gloo world shrinks through its rendezvous store "
                       "(moed.Group.shrink in Python)");
}

Status World::agree(const Status& local) {
  // Every rank shares its code and message; all pick the lowest failing rank's error.
  std::string mine = local.ok() ? std::string() : local.message();
  int32_t code = int32_t(local.code());
  MOED_ASSIGN_OR_RETURN(std::vector<int32_t> codes,
                        all_gather<int32_t>(*this, std::span<const int32_t>(&code, 1)));
  int bad = -1;
  for (int r = 0; r < size_; ++r) {
    if (codes[size_t(r)] != 0) {
      bad = r;
      break;
    }
  }
  if (bad < 0) return ok_status();
  // Fetch the failing rank's message so every rank can report it (the failing rank takes
  // part in both broadcasts as their root).
  uint64_t len = mine.size();
  MOED_RETURN_IF_ERROR(broadcast_bytes(&len, sizeof(len), bad));
  std::string msg = bad == rank_ ? mine : std::string(len, '\0');
  MOED_RETURN_IF_ERROR(broadcast_bytes(msg.data(), len, bad));
  return Status(StatusCode(codes[size_t(bad)]), str_cat("rank ", bad, ": ", msg));
}

}  // namespace moed
