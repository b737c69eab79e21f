// What the send and receive phases of dispatch.cc and combine.cc do alike: keep the requests
// they post, count their node-shared traffic, and run their receive phase now or as a hook.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "dispatch/low_latency/state.h"

namespace moed {

namespace low_latency {

// Keeps a posted isend / irecv in `requests` (waited on by the receive phase), or returns the
// error of posting it.
inline Status keep_request(StatusOr<Request> posted, std::vector<Request>& requests) {
  if (!posted.ok()) return std::move(posted).status();
  requests.push_back(std::move(posted).value());
  return ok_status();
}

// Reports the rows the workers copied into node-shared segments, counted per worker so the
// parallel copies need no shared counter.
inline void add_shared_rows(World& w, std::span<const uint64_t> rows_per_worker, size_t row_bytes) {
  uint64_t rows = 0;
  for (uint64_t n : rows_per_worker) rows += n;
  w.add_shared_bytes(rows * row_bytes, rows);
}

// The receive phase: run now (hook = an already-completed request), or handed back as `hook`
// when the caller asked for one (return_recv_hook).
template <typename Receive>
Status receive_now_or_hook(bool return_hook, Receive receive, Request& hook) {
  if (return_hook) {
    hook = make_hook(std::move(receive));
    return ok_status();
  }
  Status s = receive();
  hook = completed_request(s);
  return s;
}

}  // namespace low_latency

}  // namespace moed
