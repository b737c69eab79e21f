// gloo backend: the data phase of a collective among ranks of one host, through shared memory
// instead of gloo's TCP loopback (which costs several copies and syscalls per byte).
//
// Only when every rank of the world is on this host (coll_ exists, host_staging()): otherwise
// the collectives keep their gloo sends and receives, so a world that spans hosts never mixes
// the two (one path per world, the same on every rank).
//
// Each rank owns one staging segment, mapped by every rank of the host. A data phase (stage
// round k) is: the writer copies its outgoing bytes into its own segment and publishes
// stage_seq = k in its CollSlot; each reader waits for that (bounded, like every host wait:
// await_host polls the world's failure state, the deadline and the writer's liveness) and
// copies its part out. Two copies per byte, no syscalls. The writer needs no "everyone has
// read round k-1" word: every collective runs a gather() before its data phase, and no rank
// leaves that gather until every rank has entered it, i.e. has finished reading round k-1.
//
// Segments are cached and grown (doubling, from 1 MiB): every rank knows every rank's bytes
// (the size exchange that precedes the data phase), so every rank decides the same growth and
// maps the new segment with map_segment, which unlinks it once all have mapped it: nothing is
// left in /dev/shm after a crash (except in map_segment's own create-to-unlink window).
#include <sys/mman.h>

#include <algorithm>
#include <vector>

#include "comm/gloo/gloo_world.h"

namespace moed::gloo_comm {
namespace {

constexpr size_t kMinStage = size_t(1) << 20;

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

Status GlooWorld::host_stage(std::span<const uint64_t> bytes,
                             const std::function<void(char*)>& write,
                             const std::function<void(int, const char*)>& read, const char* op) {
  MOED_RETURN_IF_ERROR(grow_stages(bytes, op));
  const uint64_t k = ++stage_calls_;
  if (bytes[size_t(rank_)] > 0) write(stage_[size_t(rank_)]);
  coll_[rank_].stage_seq.store(k, std::memory_order_release);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_ || bytes[size_t(r)] == 0) continue;
    MOED_RETURN_IF_ERROR(await_host(coll_[r].stage_seq, k, r, op, "reading the data of"));
    read(r, stage_[size_t(r)]);
  }
  return ok_status();
}

}  // namespace moed::gloo_comm
