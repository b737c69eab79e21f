// Backend-independent parts of World: construction, blocking wrappers, agreement, and
// SharedBuffer's signals (shared-memory counters work the same for threads and processes).
#include "moed/world.h"

#include <algorithm>
#include <thread>

namespace moed {

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

Status World::send(int dst, int tag, const void* data, size_t bytes) {
  MOED_ASSIGN_OR_RETURN(Request r, isend(dst, tag, data, bytes));
  return r ? r->wait() : ok_status();
}

Status World::recv(int src, int tag, void* data, size_t bytes) {
  MOED_ASSIGN_OR_RETURN(Request r, irecv(src, tag, data, bytes));
  return r ? r->wait() : ok_status();
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
