// gloo backend node-shared memory: one POSIX shared-memory segment per alloc_shared, made by
// the node's first rank, mapped by every local rank, and unlinked as soon as all have mapped
// it (the kernel frees it when the last mapping goes, so a crash leaves nothing in /dev/shm).
// Its name (world id, node, call number) is known to every local rank without asking. Each
// local rank's part of the segment is
//   [G signal counters, one per 64-byte line][data, bytes rounded up to 64]
// like the MPI window's. The host's control segment (failures, pids) is made the same way.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <new>

#include "comm/gloo/gloo_world.h"
#include "comm/wait.h"

namespace moed::gloo_comm {

// NOTE: an atomic shared between processes must not need a lock (a lock would live in one
// process's memory only).
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "signals need lock-free 64-bit atomics in shared memory");

namespace {

constexpr size_t kLine = 64;

std::string errno_text(const char* call, const std::string& name) {
  return str_cat(call, "(", name, "): ", std::strerror(errno));
}

}  // namespace

StatusOr<void*> GlooWorld::map_segment(std::span<const int> ranks, uint64_t slot,
                                       const std::string& name, size_t bytes) {
  const bool leader = ranks[0] == rank_;
  const size_t length = std::max<size_t>(bytes, 1);
  void* base = nullptr;
  auto map = [&](int flags) -> Status {
    const int fd = shm_open(name.c_str(), flags, 0600);
    if (fd < 0) return internal_error("rank ", rank_, ": ", errno_text("shm_open", name));
    // posix_fallocate reserves the pages now: a /dev/shm too small for them is this error,
    // not a SIGBUS at the first write past its end.
    const int err = leader ? posix_fallocate(fd, 0, off_t(length)) : 0;
    if (err != 0) {
      errno = err;
      Status s = internal_error("rank ", rank_, ": ", errno_text("posix_fallocate", name), " (",
                                length, " bytes; is /dev/shm large enough?)");
      close(fd);
      return s;
    }
    void* p = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return internal_error("rank ", rank_, ": ", errno_text("mmap", name));
    base = p;
    return ok_status();
  };
  // 1. The leader makes the segment; 2. everyone else maps it; 3. the leader unlinks it.
  Status made = leader ? map(O_CREAT | O_EXCL | O_RDWR) : ok_status();
  Status s = agree_among(ranks, slot, made, "alloc_shared (creating the segment)");
  if (s.ok()) {
    Status mapped = leader ? ok_status() : map(O_RDWR);
    s = agree_among(ranks, slot, mapped, "alloc_shared (mapping the segment)");
  }
  if (leader && made.ok()) shm_unlink(name.c_str());
  if (!s.ok()) {
    if (base != nullptr) munmap(base, length);
    return s;
  }
  return base;
}

Status GlooWorld::start() {
  const size_t members = host_.ranks.size();
  control_bytes_ = HostControl::bytes(int(members));
  const std::string name = str_cat("/moed-", std::hex, host_.world_id, std::dec, "-host",
                                   host_.ranks[0]);
  MOED_ASSIGN_OR_RETURN(void* p, map_segment(host_.ranks, make_slot(Space::kHost, 1), name,
                                              control_bytes_));
  // Fresh pages are zero: nobody failed yet (fault_rank 0), nobody's entry written. Each
  // member writes only its own entry.
  control_ = static_cast<HostControl*>(p);
  HostControl::Member& me = control_->members[host_index_];
  me.pid.store(int64_t(getpid()), std::memory_order_relaxed);
  me.state.store(kAlive, std::memory_order_release);
  if (int(members) == size_ && size_ > 1) {
    // One host: the world's small collectives go through shared memory, not TCP.
    const std::string coll = str_cat("/moed-", std::hex, host_.world_id, std::dec, "-coll");
    MOED_ASSIGN_OR_RETURN(void* c, map_segment(host_.ranks, make_slot(Space::kHost, 3), coll,
                                               sizeof(CollSlot) * members));
    coll_ = static_cast<CollSlot*>(c);
    MOED_RETURN_IF_ERROR(probe_single_copy());
  }
  if (size_ > 1) {
    fault_recv_ = ctx_->createUnboundBuffer(fault_in_.data(), fault_in_.size());
    listener_ = std::thread([this] { listen_for_faults(); });
  }
  monitor_ = std::thread([this] { monitor(); });
  return ok_status();
}

Status GlooWorld::await_host(const std::atomic<uint64_t>& word, uint64_t value, int r,
                             const char* op, const char* what) {
  // A rank that closed its world (its process ended normally) will never write again.
  const auto& state = control_->members[r].state;  // one host: host index = rank
  auto here = [&] { return word.load(std::memory_order_acquire) >= value; };
  Status s = internal::poll_until(
      *this, [&] { return here() || state.load(std::memory_order_acquire) == kClosed; },
      [&] { return str_cat("rank ", rank_, " in ", op, " (", what, " rank ", r, ")"); });
  if (s.ok() && !here()) {
    // Its failure message, if it sent one (the host's fault word is written before closing).
    MOED_RETURN_IF_ERROR(failure());
    s = aborted("rank ", r, " failed: it closed its moed world (its process ended) while rank ",
                rank_, " was in ", op);
    record_failure(r, s);
    send_fault(r, s);
    return failure();
  }
  if (!s.ok() && s.code() != StatusCode::kAborted) abort(s);  // every other rank hears why
  return s;
}

Status GlooWorld::host_gather(const void* mine, size_t n, void* out, const char* op) {
  const uint64_t k = ++coll_calls_;
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) MOED_RETURN_IF_ERROR(await_host(coll_[r].done, k - 1, r, op, "waiting for"));
  }
  CollSlot& me = coll_[rank_];
  if (n > 0) std::memcpy(me.data, mine, n);
  me.seq.store(k, std::memory_order_release);
  char* o = static_cast<char*>(out);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) {
      if (n > 0) std::memcpy(o + size_t(r) * n, mine, n);
      continue;
    }
    MOED_RETURN_IF_ERROR(await_host(coll_[r].seq, k, r, op, "receiving from"));
    if (n > 0) std::memcpy(o + size_t(r) * n, coll_[r].data, n);
  }
  me.done.store(k, std::memory_order_release);
  return ok_status();
}

StatusOr<std::shared_ptr<SharedBuffer>> GlooWorld::alloc_shared(size_t bytes) {
  MOED_RETURN_IF_ERROR(internal::start_collective(*this, "alloc_shared"));
  const int g = ranks_per_node_;
  const int lr = local_rank();
  const std::vector<int> ranks = node_ranks();
  const uint64_t slot = next_node_slot();
  // Same size on every local rank (checked before anything is made).
  const uint64_t mine = bytes;
  std::vector<uint64_t> sizes(static_cast<size_t>(g));
  MOED_RETURN_IF_ERROR(gather(ranks, slot, &mine, sizeof(mine), sizes.data(), "alloc_shared"));
  for (int r = 0; r < g; ++r) {
    if (sizes[size_t(r)] != sizes[0]) {
      return invalid_argument("alloc_shared: local rank ", r, " of node ", node(), " asked for ",
                              sizes[size_t(r)], " bytes, local rank 0 for ", sizes[0]);
    }
  }
  const size_t data_bytes = (bytes + kLine - 1) / kLine * kLine;
  const size_t part = size_t(g) * kLine + data_bytes;
  const size_t total = part * size_t(g);
  const std::string name = str_cat("/moed-", std::hex, host_.world_id, std::dec, "-n", node(),
                                   "-", segments_++);
  MOED_ASSIGN_OR_RETURN(void* p, map_segment(ranks, slot, name, total));
  char* base = static_cast<char*>(p);
  // Counters start at zero: the segment's pages are fresh (zero-filled) and a lock-free
  // atomic<uint64_t> is its 8 bytes.
  auto counter = [&](int owner, int from) {
    return reinterpret_cast<std::atomic<uint64_t>*>(base + size_t(owner) * part +
                                                    size_t(from) * kLine);
  };
  std::vector<void*> segments(static_cast<size_t>(g));
  std::vector<std::atomic<uint64_t>*> in(static_cast<size_t>(g)), out(static_cast<size_t>(g));
  for (int r = 0; r < g; ++r) {
    segments[size_t(r)] = base + size_t(r) * part + size_t(g) * kLine;
    in[size_t(r)] = counter(lr, r);   // r -> me
    out[size_t(r)] = counter(r, lr);  // me -> r
  }
  return make_shared_buffer(bytes, std::move(segments), std::move(in), std::move(out),
                            [base, total] { munmap(base, std::max<size_t>(total, 1)); });
}

}  // namespace moed::gloo_comm
