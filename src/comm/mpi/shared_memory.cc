// MPI backend node-shared memory: each local rank creates one POSIX shared-memory segment per
// alloc_shared call, and every local rank maps every other's. A segment is
//   [G signal counters, one per 64-byte line][data, bytes long, rounded up to 64]
// Counters are std::atomic<uint64_t> living in the shared pages, so signals are plain
// release/acquire atomics between processes.
//
// NOTE: not MPI shared windows. Allocating and freeing a window are blocking collectives over
// the node: a rank that saw a peer's failure and left could leave another local rank inside
// MPI_Win_allocate_shared or MPI_Win_free for good. Here every wait is a polled non-blocking
// collective, and freeing is a local munmap. Each segment is unlinked as soon as every local
// rank has mapped it (or the call failed), so none outlives its processes in /dev/shm.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <new>

#include "comm/mpi/mpi_world.h"
#include "comm/wait.h"

namespace moed::mpi {

// NOTE: an atomic shared between processes must not need a lock (a lock would live in one
// process's memory only).
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "signals need lock-free 64-bit atomics in shared memory");

namespace {

constexpr size_t kLine = 64;

// What a local rank tells the others about its segment.
struct SegmentInfo {
  uint64_t bytes;  // as asked for (must match on every local rank)
  uint64_t pid;
  uint64_t seq;
};

std::string segment_name(const SegmentInfo& s) {
  return str_cat("/moed-mpi-", s.pid, "-", s.seq);
}

// The mappings of one buffer on this rank; unmapped when the buffer is dropped.
struct Mappings {
  std::vector<void*> base;
  size_t part = 0;
  ~Mappings() {
    for (void* p : base) {
      if (p != nullptr) munmap(p, part);
    }
  }
};

Status errno_error(const char* call, const std::string& name) {
  return internal_error(call, "(", name, "): ", std::strerror(errno));
}

// Maps `name` (part bytes) into this process; creates it when `create`.
StatusOr<void*> map_segment(const std::string& name, size_t part, bool create) {
  const int fd = create ? shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)
                        : shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return errno_error("shm_open", name);
  Status s;
  if (create && ftruncate(fd, off_t(part)) != 0) s = errno_error("ftruncate", name);
  struct stat st {};
  if (s.ok() && fstat(fd, &st) != 0) s = errno_error("fstat", name);
  if (s.ok() && size_t(st.st_size) != part) {
    s = internal_error("shared segment ", name, " has ", st.st_size, " bytes, expected ", part);
  }
  void* p = MAP_FAILED;
  if (s.ok()) {
    p = mmap(nullptr, part, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) s = errno_error("mmap", name);
  }
  close(fd);
  if (!s.ok()) {
    if (create) shm_unlink(name.c_str());
    return s;
  }
  return p;
}

}  // namespace

StatusOr<std::shared_ptr<SharedBuffer>> MpiWorld::alloc_shared(size_t bytes) {
  MOED_RETURN_IF_ERROR(internal::start_collective(*this, "alloc_shared"));
  static std::atomic<uint64_t> next_seq{0};
  const int g = ranks_per_node_;
  const int lr = local_rank();
  auto what = [&] { return str_cat("rank ", rank_, " in alloc_shared on node ", node()); };
  const size_t data_bytes = (bytes + kLine - 1) / kLine * kLine;
  const size_t part = size_t(g) * kLine + std::max<size_t>(data_bytes, kLine);

  auto maps = std::make_shared<Mappings>();
  maps->base.assign(size_t(g), nullptr);
  maps->part = part;
  const SegmentInfo me{bytes, uint64_t(getpid()), next_seq.fetch_add(1)};
  const std::string my_name = segment_name(me);
  MOED_ASSIGN_OR_RETURN(maps->base[size_t(lr)], map_segment(my_name, part, /*create=*/true));
  // Unlinked on every path out of this call: by then every local rank has mapped it, or the
  // call failed.
  struct Unlink {
    const std::string& name;
    ~Unlink() { shm_unlink(name.c_str()); }
  } unlink_mine{my_name};
  auto counter = [&](int owner, int from) {
    return reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(maps->base[size_t(owner)]) +
                                                    size_t(from) * kLine);
  };
  for (int from = 0; from < g; ++from) new (counter(lr, from)) std::atomic<uint64_t>(0);

  // Every local rank's segment (and the same size everywhere, checked).
  CallBuffers buf;
  auto* infos = buf.make<SegmentInfo>(size_t(g));
  auto* mine = buf.make_from(&me, 1);
  MPI_Request req;
  MOED_RETURN_IF_ERROR(check(MPI_Iallgather(mine, int(sizeof(SegmentInfo)), MPI_BYTE, infos,
                                            int(sizeof(SegmentInfo)), MPI_BYTE, node_comm_, &req),
                             "MPI_Iallgather"));
  MOED_RETURN_IF_ERROR(wait(&req, what, &buf));
  // Every local rank sees the same sizes, so a mismatch is the same error on each at once.
  for (int r = 0; r < g; ++r) {
    if (infos[r].bytes != infos[0].bytes) {
      return invalid_argument("alloc_shared: local rank ", r, " of node ", node(), " asked for ",
                              infos[r].bytes, " bytes, local rank 0 for ", infos[0].bytes);
    }
  }
  Status local;
  for (int r = 0; r < g && local.ok(); ++r) {
    if (r == lr) continue;
    StatusOr<void*> p = map_segment(segment_name(infos[r]), part, /*create=*/false);
    if (!p.ok()) {
      local = Status(p.status().code(), str_cat("alloc_shared: local rank ", lr, " of node ",
                                                node(), ": ", p.status().message()));
    } else {
      maps->base[size_t(r)] = *p;
    }
  }
  if (!local.ok()) {
    // A peer's segment is gone only if its owner left this call already, which it does when
    // it saw the world fail: then report that failure (it names the failed rank) once it
    // reaches this rank too. Any other mapping error (no memory) costs the timeout here and
    // in the other local ranks' barrier below.
    Status failed = internal::poll_until(*this, [] { return false; }, what);
    return failed.code() == StatusCode::kDeadlineExceeded ? local : failed;
  }
  // Every local rank has mapped every segment (so each may unlink its own); nobody signals
  // into a counter before its owner has constructed it.
  MOED_RETURN_IF_ERROR(check(MPI_Ibarrier(node_comm_, &req), "MPI_Ibarrier"));
  MOED_RETURN_IF_ERROR(wait(&req, what, &buf));
  std::vector<void*> segments(static_cast<size_t>(g));
  std::vector<std::atomic<uint64_t>*> in(static_cast<size_t>(g)), out(static_cast<size_t>(g));
  for (int r = 0; r < g; ++r) {
    segments[size_t(r)] = static_cast<char*>(maps->base[size_t(r)]) + size_t(g) * kLine;
    in[size_t(r)] = counter(lr, r);   // r -> me
    out[size_t(r)] = counter(r, lr);  // me -> r
  }
  // Freeing is local: the mappings go with the last owner on this rank.
  return make_shared_buffer(bytes, std::move(segments), std::move(in), std::move(out),
                            [maps]() mutable { maps.reset(); });
}

}  // namespace moed::mpi
