// gloo backend point-to-point: one gloo unbound buffer per send or receive, on a slot made
// from the tag, waited on by blocking in gloo (woken by the monitor on failure or timeout).
// A send to oneself is copied through a local mailbox (gloo has no pair to self). Counted
// like the other backends: network bytes between nodes, shared bytes within a node.
//
// NOTE: gloo has no non-blocking test (see gloo_world.h), so ready() turns true only once
// wait() has returned, as for a receive hook.
#include <cstring>
#include <deque>
#include <map>
#include <mutex>

#include "comm/gloo/gloo_world.h"

namespace moed::gloo_comm {
namespace {

constexpr int64_t kMaxTag = (int64_t(1) << 31) - 1;

class GlooRequest final : public PendingOp {
 public:
  GlooRequest(GlooWorld* world, Op op, int tag) : world_(world), op_(std::move(op)), tag_(tag) {}
  bool ready() override { return finished_; }
  Status wait() override {
    if (finished_) return result_;
    result_ = world_->wait(op_, Clock::now() + world_->timeout(), [&] { return what(); });
    return finish();
  }
  Status wait_for(std::chrono::milliseconds timeout) override {
    if (finished_) return result_;
    result_ = world_->wait_peer(op_, Clock::now() + timeout, [&] { return what(); });
    return finish();
  }

 private:
  std::string what() const {
    return op_.recv ? str_cat("rank ", world_->rank(), " receiving ", op_.bytes,
                              " bytes from rank ", op_.peer, " with tag ", tag_)
                    : str_cat("rank ", world_->rank(), " sending ", op_.bytes, " bytes to rank ",
                              op_.peer, " with tag ", tag_);
  }
  Status finish() {
    finished_ = true;
    // Dropping the gloo buffer cancels what is still unmatched.
    op_.buf.reset();
    return result_;
  }

  GlooWorld* world_;
  Op op_;
  int tag_;
  bool finished_ = false;
  Status result_;
};

// Self messages: a send is copied at once; a receive takes the oldest copy of its tag.
class SelfMailbox {
 public:
  void put(int tag, const void* data, size_t bytes) {
    const char* p = static_cast<const char*>(data);
    queue_[tag].emplace_back(p, p + bytes);
  }
  Status take(int rank, int tag, void* data, size_t bytes) {
    auto it = queue_.find(tag);
    if (it == queue_.end() || it->second.empty()) {
      return failed_precondition("rank ", rank, " receives from itself with tag ", tag,
                                 " before sending it (the gloo world copies self messages at "
                                 "isend, so post the send first)");
    }
    std::vector<char> m = std::move(it->second.front());
    it->second.pop_front();
    if (m.size() != bytes) {
      return invalid_argument("rank ", rank, " receives ", bytes, " bytes from itself with tag ",
                              tag, ", which sends ", m.size());
    }
    if (bytes > 0) std::memcpy(data, m.data(), bytes);
    return ok_status();
  }

 private:
  std::map<int, std::deque<std::vector<char>>> queue_;
};

// One mailbox per world; the map is shared by the worlds of a process (their owner threads).
std::mutex g_mailbox_mu;
std::map<const World*, SelfMailbox>& mailboxes() {
  static std::map<const World*, SelfMailbox> m;
  return m;
}

Status check_p2p(const World& w, const char* op, const char* peer_name, int peer, int tag,
                 const void* data, size_t bytes) {
  if (peer < 0 || peer >= w.size()) {
    return invalid_argument(op, ": ", peer_name, " = ", peer, " is outside [0, ", w.size(), ")");
  }
  if (tag < 0 || int64_t(tag) > kMaxTag) {
    return invalid_argument(op, ": tag = ", tag, " is outside [0, ", kMaxTag, "]");
  }
  if (data == nullptr && bytes > 0) return invalid_argument(op, ": data is null");
  return ok_status();
}

}  // namespace

void forget_mailbox(const World* w) {
  std::lock_guard<std::mutex> lock(g_mailbox_mu);
  mailboxes().erase(w);
}

StatusOr<Request> GlooWorld::isend(int dst, int tag, const void* data, size_t bytes) {
  MOED_RETURN_IF_ERROR(internal::start_p2p(*this, dst, "isend"));
  MOED_RETURN_IF_ERROR(check_p2p(*this, "isend", "dst", dst, tag, data, bytes));
  if (dst == rank_) {
    std::lock_guard<std::mutex> lock(g_mailbox_mu);
    mailboxes()[this].put(tag, data, bytes);
    return completed_request();
  }
  MOED_ASSIGN_OR_RETURN(Op op, post(false, dst, make_slot(Space::kUser, uint64_t(tag)),
                                    const_cast<void*>(data), bytes));
  count_send(dst, bytes);
  return Request(std::make_unique<GlooRequest>(this, std::move(op), tag));
}

StatusOr<Request> GlooWorld::irecv(int src, int tag, void* data, size_t bytes) {
  MOED_RETURN_IF_ERROR(internal::start_p2p(*this, src, "irecv"));
  MOED_RETURN_IF_ERROR(check_p2p(*this, "irecv", "src", src, tag, data, bytes));
  if (src == rank_) {
    std::lock_guard<std::mutex> lock(g_mailbox_mu);
    return completed_request(mailboxes()[this].take(rank_, tag, data, bytes));
  }
  MOED_ASSIGN_OR_RETURN(Op op,
                        post(true, src, make_slot(Space::kUser, uint64_t(tag)), data, bytes));
  return Request(std::make_unique<GlooRequest>(this, std::move(op), tag));
}

}  // namespace moed::gloo_comm
