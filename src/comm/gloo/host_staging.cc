// gloo backend: the data phase of a collective among ranks of one host, through shared memory
// instead of gloo's TCP loopback (which costs several copies and syscalls per byte).
//
// Only when every rank of the world is on this host (coll_ exists, host_staging()): otherwise
// the collectives keep their gloo sends and receives, so a world that spans hosts never mixes
// the two (one path per world, the same on every rank).
//
// Single copy (a writer of at least single_copy_min_ bytes, when every rank may read every
// other's memory): the writer publishes the addresses of its stream's pieces in its CollSlot
// and stage_seq = k; each reader waits for that and copies its parts straight out of the
// writer's buffers with
// process_vm_readv (the kernel copies once, like OpenMPI's vader with cma), then publishes
// stage_done = k; the writer returns only once every rank is done, as its buffers are the
// caller's. At large sizes this saves the staging copy's second pass through DRAM (each byte
// written to the segment and read back).
//
// Staging (smaller writers, or no single copy): each rank owns one staging segment, mapped by
// every rank of the host. The writer copies its stream into its own segment and publishes
// stage_seq = k; each reader waits for that (bounded, like every host wait: await_host polls the
// world's failure state, the deadline and the writer's liveness) and copies its parts out. Two
// copies per byte, no syscalls. The writer needs no "everyone has read round k-1" word: every collective runs
// a gather() before its data phase, and no rank leaves that gather until every rank has entered it,
// i.e. has finished reading round k-1.
//
// Ring (an all-gather whose every block is read in place): every rank first copies its own
// block into its receive buffer; then rank r reads, step by step, blocks r-1, r-2, ... out of
// rank r-1's receive buffer once rank r-1 holds them (its ring_step), as OpenMPI's ring
// all-gather does. The bytes copied are those of reading every block from its writer, but
// nothing is read out of the caller's send buffer: reading another process's memory pins it
// page by page, which is costly for a 4 KiB-paged torch tensor read by several ranks
// (docs/benchmarks.md), where moed's own receive buffers are on huge pages.
//
// Segments are cached and grown (doubling, from 1 MiB): every rank knows every rank's bytes
// (the size exchange that precedes the data phase), so every rank decides the same growth and
// maps the new segment with map_segment, which unlinks it once all have mapped it: nothing is
// left in /dev/shm after a crash (except in map_segment's own create-to-unlink window).
#include <sys/mman.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "comm/gloo/gloo_world.h"

namespace moed::gloo_comm {
namespace {

constexpr size_t kMinStage = size_t(1) << 20;
// Writers of at least this many bytes are read in place (single copy); smaller streams are
// staged: two copies that stay in cache cost less than the readers' syscalls and the extra
// wait for the slowest reader (docs/benchmarks.md).
constexpr uint64_t kSingleCopyMin = uint64_t(4) << 20;

size_t grown_capacity(size_t had, size_t need) {
  size_t c = std::max(kMinStage, 2 * had);
  while (c < need) c *= 2;
  return c;
}

}  // namespace

Status GlooWorld::grow_stages(std::span<const uint64_t> bytes, const char* op) {
  const size_t n = size_t(size_);
  if (stage_.empty()) {
    stage_.assign(n, nullptr);
    stage_cap_.assign(n, 0);
  }
  for (size_t r = 0; r < n; ++r) {
    if (bytes[r] <= stage_cap_[r]) continue;
    const size_t cap = grown_capacity(stage_cap_[r], bytes[r]);
    // Rank r makes its segment (map_segment's leader is ranks[0]); all ranks map it.
    std::vector<int> ranks{int(r)};
    for (int q = 0; q < size_; ++q)
      if (q != int(r)) ranks.push_back(q);
    const std::string name =
        str_cat("/moed-", std::hex, host_.world_id, std::dec, "-stage", r, "-", ++stage_gen_);
    StatusOr<void*> p = map_segment(ranks, next_slot(), name, cap);
    if (!p.ok()) {
      return Status(p.status().code(), str_cat(op, ": staging ", cap, " bytes of rank ", r,
                                               " in shared memory: ", p.status().message()));
    }
    if (stage_[r] != nullptr) munmap(stage_[r], stage_cap_[r]);
    stage_[r] = static_cast<char*>(*p);
    stage_cap_[r] = cap;
  }
  return ok_status();
}

void GlooWorld::unmap_stages() {
  for (size_t r = 0; r < stage_.size(); ++r) {
    if (stage_[r] != nullptr) munmap(stage_[r], stage_cap_[r]);
  }
  stage_.clear();
  stage_cap_.clear();
}

Status GlooWorld::probe_single_copy() {
  // Every rank publishes a word's address and its threshold; each reads every other's word (a
  // kernel without process_vm_readv, or ptrace rules that forbid it, says so here); all take
  // the same verdict. MOED_GLOO_SINGLE_COPY: 0 = never, N = from N bytes a writer (the same on
  // every rank, or never).
  probe_word_ = host_.world_id;
  const char* env = std::getenv("MOED_GLOO_SINGLE_COPY");
  const uint64_t threshold = env == nullptr ? kSingleCopyMin : std::strtoull(env, nullptr, 10);
  const uint64_t mine[2] = {uint64_t(reinterpret_cast<uintptr_t>(&probe_word_)), threshold};
  std::vector<uint64_t> where(2 * static_cast<size_t>(size_));
  MOED_RETURN_IF_ERROR(host_gather(mine, sizeof(mine), where.data(), "start (probe)"));
  uint64_t ok = threshold != 0;
  for (int r = 0; r < size_ && ok; ++r) {
    ok = where[2 * size_t(r) + 1] == threshold;
    if (r == rank_ || !ok) continue;
    uint64_t got = 0;
    iovec local{&got, sizeof(got)};
    iovec remote{reinterpret_cast<void*>(uintptr_t(where[2 * size_t(r)])), sizeof(got)};
    ok = process_vm_readv(pid_t(host_.pids[size_t(r)]), &local, 1, &remote, 1, 0) ==
             ssize_t(sizeof(got)) &&
         got == host_.world_id;
  }
  std::vector<uint64_t> all(static_cast<size_t>(size_));
  MOED_RETURN_IF_ERROR(host_gather(&ok, sizeof(ok), all.data(), "start (probe verdict)"));
  bool yes = size_t(size_) <= CollSlot::kMaxSources;
  for (uint64_t v : all) yes = yes && v != 0;
  single_copy_min_ = yes ? threshold : UINT64_MAX;
  return ok_status();
}

Status GlooWorld::read_single_copy(int r, const StageWant& want, const char* op) {
  // The writer's pieces that overlap [offset, offset + bytes) of its stream.
  const CollSlot& w = coll_[r];
  std::vector<iovec> remote;
  size_t at = 0;
  for (uint64_t i = 0; i < w.source_count && at < want.offset + want.bytes; ++i) {
    const size_t n = size_t(w.sources[i][1]);
    const size_t lo = std::max(at, want.offset), hi = std::min(at + n, want.offset + want.bytes);
    if (lo < hi) {
      remote.push_back({reinterpret_cast<char*>(uintptr_t(w.sources[i][0])) + (lo - at), hi - lo});
    }
    at += n;
  }
  iovec local{want.dst, want.bytes};
  size_t done = 0;
  for (size_t first = 0; first < remote.size();) {
    // IOV_MAX bounds one call; the kernel copies all of it unless a page is unreadable.
    const size_t count = std::min<size_t>(remote.size() - first, 1024);
    size_t asked = 0;
    for (size_t i = first; i < first + count; ++i) asked += remote[i].iov_len;
    iovec part{static_cast<char*>(local.iov_base) + done, asked};
    const ssize_t got =
        process_vm_readv(pid_t(host_.pids[size_t(r)]), &part, 1, &remote[first], count, 0);
    if (got != ssize_t(asked)) {
      Status s = aborted("rank ", rank_, " in ", op, ": reading ", asked, " bytes of rank ", r,
                         " (pid ", host_.pids[size_t(r)], ") with process_vm_readv: ",
                         got < 0 ? std::strerror(errno) : str_cat("only ", got, " bytes"));
      abort(s);
      return s;
    }
    done += asked;
    first += count;
  }
  return ok_status();
}

bool GlooWorld::host_ring(std::span<const uint64_t> bytes) const {
  if (size_ < 3) return false;  // two ranks: the ring is the direct read
  for (uint64_t b : bytes)
    if (b < single_copy_min_) return false;
  return true;
}

Status GlooWorld::host_ring_gather(std::span<const uint64_t> bytes, char* out,
                                   std::span<const size_t> offsets, const char* op) {
  const uint64_t k = ++stage_calls_;
  const uint64_t n = uint64_t(size_);
  const uint64_t base = k * n;
  const int left = (rank_ + size_ - 1) % size_, right = (rank_ + 1) % size_;
  CollSlot& me = coll_[rank_];
  // The stream a reader sees: this rank's whole receive buffer.
  me.source_count = 1;
  me.sources[0][0] = uint64_t(reinterpret_cast<uintptr_t>(out));
  me.sources[0][1] = offsets[size_t(size_)];
  me.stage_seq.store(k, std::memory_order_release);
  MOED_RETURN_IF_ERROR(await_host(coll_[left].stage_seq, k, left, op, "reading the data of"));
  for (uint64_t j = 0; j + 1 < n; ++j) {
    // Block `left` (its own) at once; later ones once left holds them.
    const size_t b = size_t((uint64_t(rank_) + 2 * n - 1 - j) % n);
    if (j > 0) {
      MOED_RETURN_IF_ERROR(await_host(coll_[left].ring_step, base + j, left, op, "waiting for"));
    }
    const StageWant want{offsets[b], out + offsets[b], bytes[b]};
    MOED_RETURN_IF_ERROR(read_single_copy(left, want, op));
    // As in host_stage: a part read after a writer's failure may come from freed memory.
    MOED_RETURN_IF_ERROR(failure());
    me.ring_step.store(base + j + 1, std::memory_order_release);
  }
  me.stage_done.store(k, std::memory_order_release);
  // The right neighbour reads this rank's receive buffer (the caller's) until it holds every
  // block.
  return await_host(coll_[right].ring_step, base + n - 1, right, op, "waiting for the reads of");
}

Status GlooWorld::host_stage(std::span<const uint64_t> bytes, std::span<const StageSource> mine,
                             const std::function<std::vector<StageWant>(int)>& wants,
                             const char* op) {
  const uint64_t k = ++stage_calls_;
  CollSlot& me = coll_[rank_];
  // Per writer, from its byte count (known to every rank): the same choice on every rank.
  auto single = [&](int r) { return bytes[size_t(r)] >= single_copy_min_; };
  std::vector<uint64_t> staged(bytes.begin(), bytes.end());
  for (int r = 0; r < size_; ++r) staged[size_t(r)] = single(r) ? 0 : bytes[size_t(r)];
  MOED_RETURN_IF_ERROR(grow_stages(staged, op));  // collective: on every rank, same sizes
  if (single(rank_)) {
    me.source_count = mine.size();
    for (size_t i = 0; i < mine.size(); ++i) {
      me.sources[i][0] = uint64_t(reinterpret_cast<uintptr_t>(mine[i].data));
      me.sources[i][1] = mine[i].bytes;
    }
  } else {
    char* st = stage_[size_t(rank_)];
    for (const StageSource& p : mine) {
      if (p.bytes > 0) std::memcpy(st, p.data, p.bytes);
      st += p.bytes;
    }
  }
  me.stage_seq.store(k, std::memory_order_release);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_ || bytes[size_t(r)] == 0) continue;
    MOED_RETURN_IF_ERROR(await_host(coll_[r].stage_seq, k, r, op, "reading the data of"));
    for (const StageWant& want : wants(r)) {
      if (want.bytes == 0) continue;
      if (single(r)) {
        MOED_RETURN_IF_ERROR(read_single_copy(r, want, op));
      } else {
        std::memcpy(want.dst, stage_[size_t(r)] + want.offset, want.bytes);
      }
    }
  }
  // A writer leaves before its readers only on a failure, which it records first on the
  // host: a part read after that may come from freed memory, so this call fails too.
  MOED_RETURN_IF_ERROR(failure());
  me.stage_done.store(k, std::memory_order_release);
  if (single(rank_) && bytes[size_t(rank_)] > 0) {
    // The readers copy from this rank's own buffers: they stay put until everyone is done.
    for (int r = 0; r < size_; ++r) {
      if (r != rank_)
        MOED_RETURN_IF_ERROR(await_host(coll_[r].stage_done, k, r, op, "waiting for the reads of"));
    }
  }
  return ok_status();
}

}  // namespace moed::gloo_comm
