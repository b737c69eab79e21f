// Threads backend node-shared memory: every local rank allocates its own segment (as a large
// Tensor's block: huge pages from 4 MiB up, which peers' scattered row writes need) and signal
// inbox, publishes them under the node's lock, and waits for the other local ranks; then each
// sees all of them. The last SharedBuffer dropped frees the lot.
#include <cstdlib>
#include <new>

#include "comm/threads/threads_world.h"
#include "comm/wait.h"
#include "core/block_cache.h"

namespace moed::threads {

SharedAlloc::SharedAlloc(int local_size)
    : requested(size_t(local_size), 0),
      segments(size_t(local_size), nullptr),
      inboxes(size_t(local_size), nullptr) {}

SharedAlloc::~SharedAlloc() {
  for (void* p : segments) std::free(p);
  for (PaddedCounter* p : inboxes) delete[] p;
}

StatusOr<std::shared_ptr<SharedBuffer>> ThreadsWorld::alloc_shared(size_t bytes) {
  MOED_RETURN_IF_ERROR(internal::start_collective(*this, "alloc_shared"));
  const int g = ranks_per_node_;
  const int lr = local_rank();
  const uint64_t call = ++allocs_;
  void* segment = internal::allocate_uncached(std::max<size_t>(64, bytes));
  if (segment == nullptr)
    return internal_error("alloc_shared: out of memory for ", bytes, " bytes");
  auto* inbox = new PaddedCounter[size_t(g)];

  NodeShared& node_state = ctx_->nodes[size_t(node())];
  std::shared_ptr<SharedAlloc> alloc;
  {
    std::lock_guard<std::mutex> lock(node_state.mu);
    auto& slot = node_state.pending[call];
    if (!slot) slot = std::make_shared<SharedAlloc>(g);
    alloc = slot;
    alloc->requested[size_t(lr)] = bytes;
    alloc->segments[size_t(lr)] = segment;
    alloc->inboxes[size_t(lr)] = inbox;
  }
  alloc->joined.fetch_add(1, std::memory_order_acq_rel);
  Status s = internal::poll_until(
      *this, [&] { return alloc->joined.load(std::memory_order_acquire) == g; },
      [&] {
        return str_cat("rank ", rank_, " in alloc_shared #", call, " waiting for the ", g,
                       " ranks of node ", node());
      });
  // Everything below reads what the other local ranks published before they joined.
  std::vector<void*> segments;
  std::vector<std::atomic<uint64_t>*> in(static_cast<size_t>(g)), out(static_cast<size_t>(g));
  {
    std::lock_guard<std::mutex> lock(node_state.mu);
    if (s.ok()) {
      for (int r = 0; r < g; ++r) {
        if (alloc->requested[size_t(r)] != alloc->requested[0]) {
          s = invalid_argument("alloc_shared: local rank ", r, " of node ", node(), " asked for ",
                               alloc->requested[size_t(r)], " bytes, local rank 0 for ",
                               alloc->requested[0]);
          break;
        }
      }
    }
    if (s.ok()) {
      segments = alloc->segments;
      for (int r = 0; r < g; ++r) {
        in[size_t(r)] = &alloc->inboxes[size_t(lr)][r].value;   // r -> me
        out[size_t(r)] = &alloc->inboxes[size_t(r)][lr].value;  // me -> r
      }
    }
    if (++alloc->taken == g) node_state.pending.erase(call);
  }
  if (!s.ok()) {
    if (s.code() == StatusCode::kDeadlineExceeded) {
      // The other ranks of the node never came: drop our entry so nothing leaks.
      std::lock_guard<std::mutex> lock(node_state.mu);
      node_state.pending.erase(call);
    }
    return fail_on_timeout(s);
  }
  return make_shared_buffer(bytes, std::move(segments), std::move(in), std::move(out), [alloc] {});
}

}  // namespace moed::threads
