// Threads backend point-to-point: a rendezvous. Whichever side posts second finds the
// other's operation in the destination's mailbox and copies sender -> receiver once (the
// threads stand-in for an RDMA write or read), then completes both.
#include <cstring>

#include "comm/threads/threads_world.h"
#include "comm/wait.h"
#include "core/row_kernels.h"

namespace moed::threads {
namespace {

void complete(P2pOp& send, P2pOp& recv) {
  Status error;
  if (send.bytes != recv.bytes) {
    error = invalid_argument("rank ", recv.dst, " receives ", recv.bytes, " bytes from rank ",
                             send.src, " with tag ", send.tag, ", which sends ", send.bytes);
  } else {
    // A message past the caches is written with non-temporal stores (no read of the
    // destination lines first), fenced before the receiver is told.
    const bool stream = send.bytes >= internal::kStreamThresholdBytes;
    auto copy = [stream](void* dst, const void* src, size_t bytes) {
      if (bytes == 0) return;
      if (stream) {
        internal::stream_copy(dst, src, bytes);
      } else {
        std::memcpy(dst, src, bytes);
      }
    };
    if (!send.pieces.empty()) {
      char* at = static_cast<char*>(recv.recv);
      for (const World::Piece& p : send.pieces) {
        copy(at, p.data, p.bytes);
        at += p.bytes;
      }
    } else {
      copy(recv.recv, send.send, send.bytes);
    }
    if (stream) internal::stream_fence();
  }
  send.error = error;
  recv.error = error;
  send.state.store(P2pOp::kDone, std::memory_order_release);
  recv.state.store(P2pOp::kDone, std::memory_order_release);
}

// Takes the oldest op in `queue` from `src` with `tag`, or returns null.
std::shared_ptr<P2pOp> take(std::deque<std::shared_ptr<P2pOp>>& queue, int src, int tag) {
  for (auto it = queue.begin(); it != queue.end(); ++it) {
    if ((*it)->src == src && (*it)->tag == tag) {
      std::shared_ptr<P2pOp> op = std::move(*it);
      queue.erase(it);
      op->state.store(P2pOp::kMatched, std::memory_order_relaxed);
      return op;
    }
  }
  return nullptr;
}

class ThreadsRequest final : public PendingOp {
 public:
  ThreadsRequest(ThreadsWorld* world, std::shared_ptr<P2pOp> op, bool is_recv)
      : world_(world), op_(std::move(op)), is_recv_(is_recv) {}
  ~ThreadsRequest() override { cancel(); }

  bool ready() override {
    return waited_ || cancelled_ || op_->state.load(std::memory_order_acquire) == P2pOp::kDone;
  }

  Status wait() override {
    return wait_with(world_->timeout(), [&] { return world_->failure(); });
  }
  Status wait_for(std::chrono::milliseconds timeout) override {
    const int peer = is_recv_ ? op_->src : op_->dst;
    return wait_with(timeout, [&] { return internal::peer_failure(*world_, peer); });
  }

 private:
  template <typename Stop>
  Status wait_with(std::chrono::milliseconds timeout, Stop&& stop) {
    if (waited_) return op_->error;
    if (cancelled_) return failed_precondition("wait() on a request that already failed");
    Status s = internal::poll(
        timeout, [&] { return op_->state.load(std::memory_order_acquire) == P2pOp::kDone; }, stop,
        [&] {
          return is_recv_ ? str_cat("rank ", op_->dst, " receiving ", op_->bytes,
                                    " bytes from rank ", op_->src, " with tag ", op_->tag)
                          : str_cat("rank ", op_->src, " sending ", op_->bytes, " bytes to rank ",
                                    op_->dst, " with tag ", op_->tag);
        });
    if (!s.ok()) {
      // A message that never arrives must not be copied into (or out of) the caller's
      // buffer later, after the caller has moved on.
      cancel();
      return s;
    }
    waited_ = true;
    return op_->error;
  }

  // Removes a still-unmatched op from its mailbox, or waits out a copy in progress.
  void cancel() {
    if (cancelled_ || op_->state.load(std::memory_order_acquire) == P2pOp::kDone) return;
    Mailbox& box = world_->context().mailboxes[size_t(op_->dst)];
    {
      // NOTE: take() marks an op kMatched under this lock, so kPosted here means it is
      // still queued.
      std::lock_guard<std::mutex> lock(box.mu);
      if (op_->state.load(std::memory_order_relaxed) == P2pOp::kPosted) {
        auto& queue = is_recv_ ? box.recvs : box.sends;
        for (auto it = queue.begin(); it != queue.end(); ++it) {
          if (it->get() == op_.get()) {
            queue.erase(it);
            break;
          }
        }
        cancelled_ = true;
        return;
      }
    }
    // Matched: the other side is copying right now; that ends without waiting on anyone.
    while (op_->state.load(std::memory_order_acquire) != P2pOp::kDone) internal::cpu_relax();
  }

  ThreadsWorld* world_;
  std::shared_ptr<P2pOp> op_;
  bool is_recv_;
  bool waited_ = false;
  bool cancelled_ = false;
};

Status check_args(const char* op, const char* peer_name, int peer, int size, int tag,
                  const void* data, size_t bytes) {
  if (peer < 0 || peer >= size) {
    return invalid_argument(op, ": ", peer_name, " = ", peer, " is outside [0, ", size, ")");
  }
  if (tag < 0) return invalid_argument(op, ": tag = ", tag, " must be >= 0");
  if (data == nullptr && bytes > 0) return invalid_argument(op, ": data is null");
  return ok_status();
}

// Posts one op: completes it with the opposite op already in the receiver's mailbox, or
// queues it there for the opposite side to find.
Request post(ThreadsWorld& w, std::shared_ptr<P2pOp> op, bool is_recv) {
  std::shared_ptr<P2pOp> peer;
  {
    Mailbox& box = w.context().mailboxes[size_t(op->dst)];
    std::lock_guard<std::mutex> lock(box.mu);
    peer = take(is_recv ? box.sends : box.recvs, op->src, op->tag);
    if (!peer) (is_recv ? box.recvs : box.sends).push_back(op);
  }
  if (peer) is_recv ? complete(*peer, *op) : complete(*op, *peer);
  return Request(std::make_unique<ThreadsRequest>(&w, std::move(op), is_recv));
}

std::shared_ptr<P2pOp> make_op(int src, int dst, int tag, size_t bytes) {
  auto op = std::make_shared<P2pOp>();
  op->src = src;
  op->dst = dst;
  op->tag = tag;
  op->bytes = bytes;
  return op;
}

}  // namespace

StatusOr<Request> ThreadsWorld::isend(int dst, int tag, const void* data, size_t bytes) {
  MOED_RETURN_IF_ERROR(internal::start_p2p(*this, dst, "isend"));
  MOED_RETURN_IF_ERROR(check_args("isend", "dst", dst, size_, tag, data, bytes));
  count_send(dst, bytes);
  std::shared_ptr<P2pOp> op = make_op(rank_, dst, tag, bytes);
  op->send = data;
  return post(*this, std::move(op), /*is_recv=*/false);
}

StatusOr<Request> ThreadsWorld::isend_gather(int dst, int tag, std::span<const Piece> pieces) {
  MOED_RETURN_IF_ERROR(internal::start_p2p(*this, dst, "isend_gather"));
  size_t bytes = 0;
  for (const Piece& p : pieces) {
    MOED_RETURN_IF_ERROR(check_args("isend_gather", "dst", dst, size_, tag, p.data, p.bytes));
    bytes += p.bytes;
  }
  count_send(dst, bytes);
  std::shared_ptr<P2pOp> op = make_op(rank_, dst, tag, bytes);
  op->pieces.assign(pieces.begin(), pieces.end());
  return post(*this, std::move(op), /*is_recv=*/false);
}

StatusOr<Request> ThreadsWorld::irecv(int src, int tag, void* data, size_t bytes) {
  MOED_RETURN_IF_ERROR(internal::start_p2p(*this, src, "irecv"));
  MOED_RETURN_IF_ERROR(check_args("irecv", "src", src, size_, tag, data, bytes));
  std::shared_ptr<P2pOp> op = make_op(src, rank_, tag, bytes);
  op->recv = data;
  return post(*this, std::move(op), /*is_recv=*/true);
}

}  // namespace moed::threads
