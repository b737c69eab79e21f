// Memory the ranks of a node share and keep between steps (buffers.cc): regions that grow
// collectively, the ring of dispatch outputs, the per-pair signals, the rounds of a step that
// publishes memory, and the network messages' scratch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <type_traits>
#include <vector>

#include "dispatch/flex/message.h"
#include "dispatch/flex/topology.h"
#include "dispatch/scratch.h"
#include "moed/world.h"

namespace moed::flex {

// A node-shared region that grows collectively. Every local rank computes the same `bytes`
// from the same global counts, so growth needs no extra agreement.
//
// NOTE: a replaced buffer is kept (retired) until release_retired(), which the owner calls
// once nothing can read it, at the same point of the same step on every local rank: freeing is
// local, and one fixed point is the simplest rule that no peer is still reading.
class Region {
 public:
  Status ensure(World& world, size_t bytes);
  void release_retired() { retired_.clear(); }
  const std::shared_ptr<SharedBuffer>& buffer() const { return buffer_; }
  char* local() const { return static_cast<char*>(buffer_->local()); }
  char* peer(int lr) const { return static_cast<char*>(buffer_->peer(lr)); }

 private:
  std::shared_ptr<SharedBuffer> buffer_;
  std::vector<std::shared_ptr<SharedBuffer>> retired_;
};

// Dispatch outputs live in a ring of node-shared regions (Flex's expert-major output and the
// rank-major receive). A slot is held while any copy of an output's storage made from it is
// alive on any local rank; the next dispatch writes into the lowest slot no local rank holds
// (every rank's held mask travels in the dispatch's first collective), adding a slot when all
// are held. So an output never changes while its caller holds it. A caller holding kMaxSlots
// outputs at once (a model's many layers kept for the backward) gets each further output in a
// region of its own, allocated for it and never written again (the overflow slot).
class OutputRing {
 public:
  static constexpr int kMaxSlots = 64;  // one bit each in the agreement's held mask
  static constexpr int kOverflow = kMaxSlots;

  // Ring slots whose output this rank's caller still holds (bit i = slot i).
  uint64_t held_mask() const;
  // From every rank's held mask (held_of(r), r < R): the lowest slot free on this node, a new
  // one when every slot is held, a fresh overflow slot when kMaxSlots are; the same answer on
  // every local rank.
  int pick(const Topology& topo, const std::function<uint64_t(int)>& held_of);
  Region& region(int slot) { return slots_[size_t(slot)]->region; }
  // What an output's storage holds: the slot's token (so the slot counts as held) and the
  // buffer itself (freed locally with its last owner), so an output may outlive the dispatcher.
  std::shared_ptr<void> hold(int slot) const;
  int size() const { return int(slots_.size()); }

 private:
  struct Slot {
    Region region;
    std::shared_ptr<int> token = std::make_shared<int>(0);
  };
  std::vector<std::unique_ptr<Slot>> slots_;
};

// Per-pair completion signals with an epoch (one counter per ordered pair of local ranks).
// NOTE: each op starts with a collective (notify or an agreement), so every rank has left
// the previous op before anyone writes into its memory; the signals then only order the
// writes (or publications) of this op, pair by pair, with no global barrier.
class Signals {
 public:
  Status init(World& world);
  void signal_all(uint64_t epoch);
  Status wait_all(uint64_t epoch);
  // A small per-rank board in node-shared memory for publishing addresses (threads world).
  void* board(int lr) const { return buffer_->peer(lr); }

 private:
  friend class PublishRound;
  std::shared_ptr<SharedBuffer> buffer_;
};

// The two rounds of a step in which the local ranks read or write each other's memory where it
// is (in place: the threads world, addresses on the board), or a node-shared region (else).
// open() tells the node this rank's memory is published and waits until every local rank's is;
// close() tells the node this rank is done with theirs and waits until they are done with its
// own. Takes two epochs whichever way the step ends, so the ranks stay in step.
//
// NOTE: in place, the caller may free its memory once the step returns, so close() waits for
// every local rank that published, through a failed world too (bounded by the timeout); a rank
// leaving with an error fails the world before it looks, so that a rank which has not opened yet
// sees the failure at the end of its open() and never touches this rank's memory (a store, a
// fence and a load on each side: one of the two sees the other). The destructor closes a round
// left open on an error path.
//
// Not in place, a reader (kReads: the peers read its published region) releases even after an
// error, so no peer waits for it in vain; a writer's release (kWrites) says that its writes
// into the peers' memory are done, so after an error it sends none and the peers wait until
// they see the failure.
class PublishRound {
 public:
  enum class Role { kReads, kWrites };
  PublishRound(World& world, Signals& signals, uint64_t& epoch, bool in_place, Role role);
  PublishRound(const PublishRound&) = delete;
  PublishRound& operator=(const PublishRound&) = delete;
  ~PublishRound();
  Status open();
  // Instead of open(), in place: a collective of the step has already told every local rank
  // where the others' memory is (the low-latency combine's agreement), so close() waits for
  // every one of them.
  void opened_by_collective() { by_collective_ = true; }
  // `step`: how the step went; an error fails the world first (in place).
  Status close(const Status& step = Status());

 private:
  World& world_;
  Signals& signals_;
  const uint64_t published_, released_;  // the round's two epochs
  const bool in_place_;
  const Role role_;
  bool by_collective_ = false;
  bool closed_ = false;
};

// In place: opens `round` with this rank's `mine` posted on its board (local rank `local_rank`),
// then reads every local rank's into `all` [ranks per node]. A failed open closes the round.
template <typename T>
Status open_with_board(PublishRound& round, Signals& signals, int local_rank, const T& mine,
                       std::vector<T>& all) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 64,
                "the signal board holds one T per rank");
  std::memcpy(signals.board(local_rank), &mine, sizeof(T));
  Status opened = round.open();
  if (!opened.ok()) return round.close(opened);
  for (size_t lr = 0; lr < all.size(); ++lr) {
    std::memcpy(&all[lr], signals.board(int(lr)), sizeof(T));
  }
  return ok_status();
}

// Bytes of one network message, inside a NetScratch.
struct Bytes {
  char* ptr = nullptr;
  size_t bytes = 0;
  char* data() const { return ptr; }
  size_t size() const { return bytes; }
  bool empty() const { return bytes == 0; }
};
// The network messages of one kind of step, kept between calls: per remote node one send and
// one receive buffer that only grow (contents unspecified), so a step allocates (and
// page-faults) its messages once, not on every call. Each step kind has its own, so steps in
// flight at once never share one.
class NetScratch {
 public:
  Bytes send(int node, size_t bytes) { return at(send_, node, bytes); }
  Bytes recv(int node, size_t bytes) { return at(recv_, node, bytes); }
  // The chain messages of the node-reduced combine (in flight with the terms' messages).
  Bytes chain_send(int node, size_t bytes) { return at(chain_send_, node, bytes); }
  Bytes chain_recv(int node, size_t bytes) { return at(chain_recv_, node, bytes); }

 private:
  static Bytes at(std::vector<ScratchBuffer>& v, int node, size_t bytes);
  std::vector<ScratchBuffer> send_, recv_, chain_send_, chain_recv_;
};

// The network leg of a two-hop step: one message per remote node, to or from the rank there
// with this rank's local index (Topology::forwarder_on). post_node_recvs posts, for each remote
// node m of bytes_of(m) > 0, a receive into net's buffer for m (bufs[m]; the others empty).
template <class BytesOf>
Status post_node_recvs(World& w, const Topology& topo, NetScratch& net, int tag, BytesOf bytes_of,
                       std::vector<Bytes>& bufs, std::vector<Request>& recvs) {
  bufs.assign(size_t(topo.num_nodes), Bytes{});
  for (int m = 0; m < topo.num_nodes; ++m) {
    const size_t bytes = m == topo.node ? 0 : size_t(bytes_of(m));
    if (bytes == 0) continue;
    bufs[size_t(m)] = net.recv(m, bytes);
    MOED_ASSIGN_OR_RETURN(Request r,
                          w.irecv(topo.forwarder_on(m), tag, bufs[size_t(m)].data(), bytes));
    recvs.push_back(std::move(r));
  }
  return ok_status();
}
// Sends one message of `rows` rows as a gather list (World::isend_gather), counted.
inline Status send_node_message(World& w, int to, int tag, std::span<const World::Piece> pieces,
                                uint64_t rows, std::vector<Request>& sends) {
  MOED_ASSIGN_OR_RETURN(Request r, w.isend_gather(to, tag, pieces));
  w.add_network_bytes(0, rows);
  sends.push_back(std::move(r));
  return ok_status();
}

// A two-hop push's messages from this rank (Flex's and the rank-major one), one to the
// forwarder on each remote node m with tokens[m] > 0, of layout layout_of(m): the headers,
// entries and tail written into net's send buffers, each token's payload and scales gathered
// by send() from where they lie (set_row), so no row is copied before the network's copy.
class NodeMessages {
 public:
  template <class LayoutOf>
  NodeMessages(const Topology& topo, NetScratch& net, std::span<const int64_t> tokens,
               LayoutOf layout_of)
      : topo_(topo), tokens_(tokens.begin(), tokens.end()) {
    const size_t N = size_t(topo.num_nodes);
    layout_.resize(N);
    buf_.resize(N);
    rows_.resize(N);
    for (int m = 0; m < topo.num_nodes; ++m) {
      if (!sends_to(m)) continue;
      const MessageLayout l = layout_of(m);
      layout_[size_t(m)] = l;
      // Headers and entries, and a tail at its place past the rows' room; no row is copied in.
      buf_[size_t(m)] = net.send(m, l.bytes > l.tail_off ? l.bytes : l.payload_off);
      rows_[size_t(m)].resize(size_t(tokens_[size_t(m)]) * (l.scale_bytes ? 2 : 1));
    }
  }
  bool sends_to(int m) const { return m != topo_.node && tokens_[size_t(m)] > 0; }
  Message<char> at(int m) const { return {buf_[size_t(m)].data(), layout_[size_t(m)]}; }
  // Token i of m's message is row t of x (its payload, and its scales when the layout has them).
  void set_row(int m, size_t i, const TokenRows& x, int64_t t) {
    std::vector<const char*>& r = rows_[size_t(m)];
    r[i] = static_cast<const char*>(x.x.row_ptr(t));
    if (layout_[size_t(m)].scale_bytes) {
      r[size_t(tokens_[size_t(m)]) + i] = static_cast<const char*>(x.scales.row_ptr(t));
    }
  }
  // Sends every message, counted; the rows stay the caller's until `sends` are done.
  Status send(World& w, int tag, std::vector<Request>& sends) const {
    std::vector<World::Piece> pieces;
    for (int m = 0; m < topo_.num_nodes; ++m) {
      if (!sends_to(m)) continue;
      const size_t n = size_t(tokens_[size_t(m)]);
      message_pieces(layout_[size_t(m)], buf_[size_t(m)].data(), rows_[size_t(m)], n, pieces);
      MOED_RETURN_IF_ERROR(send_node_message(w, topo_.forwarder_on(m), tag, pieces, n, sends));
    }
    return ok_status();
  }

 private:
  const Topology& topo_;
  std::vector<int64_t> tokens_;
  std::vector<MessageLayout> layout_;
  std::vector<Bytes> buf_;
  std::vector<std::vector<const char*>> rows_;
};

}  // namespace moed::flex
