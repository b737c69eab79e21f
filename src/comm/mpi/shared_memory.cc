// MPI backend node-shared memory: one MPI shared window per alloc_shared call over the
// node's communicator. Each local rank's part of the window is
//   [pad to 64][G signal counters, one per 64-byte line][data, bytes long]
// and every rank maps every part (MPI_Win_shared_query). Counters are std::atomic<uint64_t>
// living in the shared pages, so signals are plain release/acquire atomics between processes.
#include <atomic>
#include <cstdint>
#include <new>

#include "comm/mpi/mpi_world.h"

namespace moed::mpi {

// NOTE: an atomic shared between processes must not need a lock (a lock would live in one
// process's memory only).
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "signals need lock-free 64-bit atomics in shared memory");

namespace {

constexpr size_t kLine = 64;

char* align_up(void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  return reinterpret_cast<char*>((v + kLine - 1) / kLine * kLine);
}

}  // namespace

StatusOr<std::shared_ptr<SharedBuffer>> MpiWorld::alloc_shared(size_t bytes) {
  MOED_RETURN_IF_ERROR(failure());
  ++counters_.collectives;
  const int g = ranks_per_node_;
  const int lr = local_rank();
  auto what = [&] { return str_cat("rank ", rank_, " in alloc_shared on node ", node()); };
  // Same size on every local rank (checked and agreed over the node before allocating, so
  // the blocking window allocation below never waits for a rank that isn't coming).
  CallBuffers buf;
  uint64_t* sizes = buf.make<uint64_t>(size_t(g));
  uint64_t* mine = buf.make<uint64_t>(1);
  *mine = bytes;
  MPI_Request req;
  MOED_RETURN_IF_ERROR(
      check(MPI_Iallgather(mine, 1, MPI_UINT64_T, sizes, 1, MPI_UINT64_T, node_comm_, &req),
            "MPI_Iallgather"));
  MOED_RETURN_IF_ERROR(wait(&req, what, &buf));
  for (int r = 0; r < g; ++r) {
    if (sizes[size_t(r)] != sizes[0]) {
      return invalid_argument("alloc_shared: local rank ", r, " of node ", node(), " asked for ",
                              sizes[size_t(r)], " bytes, local rank 0 for ", sizes[0]);
    }
  }
  const size_t data_bytes = (bytes + kLine - 1) / kLine * kLine;
  const size_t part = kLine + size_t(g) * kLine + data_bytes;
  MPI_Info info;
  MPI_Info_create(&info);
  // Each part in its own pages: local first-touch placement, no false sharing at edges.
  MPI_Info_set(info, "alloc_shared_noncontig", "true");
  void* base = nullptr;
  MPI_Win win = MPI_WIN_NULL;
  Status s = check(MPI_Win_allocate_shared(MPI_Aint(part), 1, info, node_comm_, &base, &win),
                   "MPI_Win_allocate_shared");
  MPI_Info_free(&info);
  MOED_RETURN_IF_ERROR(s);
  // Passive-target epoch for the window's lifetime: direct loads/stores are then allowed.
  MPI_Win_lock_all(MPI_MODE_NOCHECK, win);

  std::vector<char*> parts(static_cast<size_t>(g));
  for (int r = 0; r < g; ++r) {
    MPI_Aint size = 0;
    int disp = 0;
    void* p = nullptr;
    MPI_Win_shared_query(win, r, &size, &disp, &p);
    // NOTE: each part is mapped page-aligned in every process, so aligning up lands on
    // the same byte of the part everywhere.
    parts[size_t(r)] = align_up(p);
  }
  auto counter = [&](int owner, int from) {
    return reinterpret_cast<std::atomic<uint64_t>*>(parts[size_t(owner)] + size_t(from) * kLine);
  };
  for (int from = 0; from < g; ++from) new (counter(lr, from)) std::atomic<uint64_t>(0);
  MPI_Win_sync(win);
  // Nobody signals into a counter before its owner has constructed it.
  MOED_RETURN_IF_ERROR(check(MPI_Ibarrier(node_comm_, &req), "MPI_Ibarrier"));
  s = wait(&req, what, nullptr);
  if (!s.ok()) {
    MPI_Win_unlock_all(win);
    // The window is leaked: freeing it is collective and a local rank is missing.
    return s;
  }
  std::vector<void*> segments(static_cast<size_t>(g));
  std::vector<std::atomic<uint64_t>*> in(static_cast<size_t>(g)), out(static_cast<size_t>(g));
  for (int r = 0; r < g; ++r) {
    segments[size_t(r)] = parts[size_t(r)] + size_t(g) * kLine;
    in[size_t(r)] = counter(lr, r);   // r -> me
    out[size_t(r)] = counter(r, lr);  // me -> r
  }
  return make_shared_buffer(bytes, std::move(segments), std::move(in), std::move(out), [win] {
    // After a failure a local rank may never come to the collective free: leak the window.
    if (mpi_peer_may_be_gone()) return;
    MPI_Win w = win;
    MPI_Win_unlock_all(w);
    // NOTE: collective over the node: every local rank drops its buffers in the same order.
    MPI_Win_free(&w);
  });
}

}  // namespace moed::mpi
