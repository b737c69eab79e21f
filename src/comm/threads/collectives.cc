// Threads backend collectives: every rank publishes its buffers in a slot, then each rank
// pulls what it needs straight from the others' send buffers (one copy), between two
// barriers. Every check runs on every rank over all slots, so all ranks reach the same
// verdict and return the same error.
#include <cstring>

#include "comm/sum_rows.h"
#include "comm/threads/threads_world.h"
#include "moed/status.h"

namespace moed::threads {

template <typename Check, typename Work>
Status ThreadsWorld::collective(const Slot& mine, Check&& check, Work&& work) {
  MOED_RETURN_IF_ERROR(failure());
  ++counters_.collectives;
  ctx_->slots[size_t(rank_)] = mine;
  MOED_RETURN_IF_ERROR(internal_barrier(mine.op));
  const std::vector<Slot>& slots = ctx_->slots;
  Status verdict;
  for (int r = 1; r < size_ && verdict.ok(); ++r) {
    if (slots[size_t(r)].op != slots[0].op) {
      verdict = failed_precondition("collective mismatch: rank 0 called ", op_name(slots[0].op),
                                    ", rank ", r, " called ", op_name(slots[size_t(r)].op));
    }
  }
  if (verdict.ok()) verdict = check(slots);
  if (verdict.ok()) work(slots);
  // NOTE: the second barrier keeps every rank's buffers and slot alive until all have read.
  MOED_RETURN_IF_ERROR(internal_barrier(mine.op));
  return verdict;
}

namespace {
// Span lengths are checked on every rank from the slots, so a wrong length on one rank is
// an error on all of them (the spans themselves are only read when the lengths are right).
Status check_lengths(const std::vector<Slot>& slots, const char* name, bool recv_only) {
  const size_t n = slots.size();
  auto bad = [&](size_t r, const char* what, size_t len) {
    return invalid_argument(name, ": rank ", r, " passed ", what, " of length ", len,
                            "; must be the world size ", n);
  };
  for (size_t r = 0; r < n; ++r) {
    const Slot& s = slots[r];
    if (!recv_only && s.send_sizes.size() != n) return bad(r, "send sizes", s.send_sizes.size());
    if (!recv_only && s.send_offsets.size() != n) {
      return bad(r, "send offsets", s.send_offsets.size());
    }
    if (s.recv_sizes.size() != n) return bad(r, "recv sizes", s.recv_sizes.size());
    if (s.recv_offsets.size() != n) return bad(r, "recv offsets", s.recv_offsets.size());
  }
  return ok_status();
}
}  // namespace

Status ThreadsWorld::barrier() {
  Slot mine;
  mine.op = Op::kBarrier;
  return collective(
      mine, [](const std::vector<Slot>&) { return ok_status(); }, [](const std::vector<Slot>&) {});
}

Status ThreadsWorld::broadcast_bytes(void* data, size_t bytes, int root) {
  Slot mine;
  mine.op = Op::kBroadcast;
  mine.recv = data;
  mine.send_bytes = bytes;
  mine.root = root;
  return collective(
      mine,
      [&](const std::vector<Slot>& slots) -> Status {
        for (int r = 0; r < size_; ++r) {
          const Slot& s = slots[size_t(r)];
          if (s.root != slots[0].root) {
            return invalid_argument("broadcast: rank ", r, " has root ", s.root, ", rank 0 has ",
                                    slots[0].root);
          }
        }
        if (root < 0 || root >= size_) {
          return invalid_argument("broadcast: root = ", root, " is outside [0, ", size_, ")");
        }
        for (int r = 0; r < size_; ++r) {
          if (slots[size_t(r)].send_bytes != slots[size_t(root)].send_bytes) {
            return invalid_argument("broadcast: rank ", r, " expects ", slots[size_t(r)].send_bytes,
                                    " bytes, root ", root, " sends ",
                                    slots[size_t(root)].send_bytes);
          }
        }
        return ok_status();
      },
      [&](const std::vector<Slot>& slots) {
        if (rank_ == root) {
          for (int d = 0; d < size_; ++d) count_send(d, bytes);
        } else if (bytes > 0) {
          std::memcpy(data, slots[size_t(root)].recv, bytes);
        }
      });
}

Status ThreadsWorld::all_gather_v_bytes(const void* send, size_t send_bytes, void* recv,
                                        std::span<const size_t> recv_bytes) {
  Slot mine;
  mine.op = Op::kAllGatherV;
  mine.send = send;
  mine.send_bytes = send_bytes;
  mine.recv = recv;
  mine.recv_sizes = recv_bytes;
  mine.recv_offsets = recv_bytes;  // only its length is checked
  return collective(
      mine,
      [&](const std::vector<Slot>& slots) -> Status {
        MOED_RETURN_IF_ERROR(check_lengths(slots, "all_gather_v", true));
        for (int d = 0; d < size_; ++d) {
          for (int s = 0; s < size_; ++s) {
            if (slots[size_t(d)].recv_sizes[size_t(s)] != slots[size_t(s)].send_bytes) {
              return invalid_argument("all_gather_v: rank ", d, " expects ",
                                      slots[size_t(d)].recv_sizes[size_t(s)], " bytes from rank ",
                                      s, ", which sends ", slots[size_t(s)].send_bytes);
            }
          }
        }
        return ok_status();
      },
      [&](const std::vector<Slot>& slots) {
        size_t off = 0;
        for (int s = 0; s < size_; ++s) {
          const size_t n = slots[size_t(s)].send_bytes;
          if (n > 0) std::memcpy(static_cast<char*>(recv) + off, slots[size_t(s)].send, n);
          off += n;
          count_send(s, send_bytes);
        }
      });
}

Status ThreadsWorld::all_to_all_v_bytes(const void* send, std::span<const size_t> send_bytes,
                                        std::span<const size_t> send_offsets, void* recv,
                                        std::span<const size_t> recv_bytes,
                                        std::span<const size_t> recv_offsets) {
  Slot mine;
  mine.op = Op::kAllToAllV;
  mine.send = send;
  mine.send_sizes = send_bytes;
  mine.send_offsets = send_offsets;
  mine.recv = recv;
  mine.recv_sizes = recv_bytes;
  mine.recv_offsets = recv_offsets;
  return collective(
      mine,
      [&](const std::vector<Slot>& slots) -> Status {
        MOED_RETURN_IF_ERROR(check_lengths(slots, "all_to_all_v", false));
        for (int d = 0; d < size_; ++d) {
          for (int s = 0; s < size_; ++s) {
            const size_t want = slots[size_t(d)].recv_sizes[size_t(s)];
            const size_t sent = slots[size_t(s)].send_sizes[size_t(d)];
            if (want != sent) {
              return invalid_argument("all_to_all_v: rank ", d, " expects ", want,
                                      " bytes from rank ", s, ", which sends ", sent);
            }
          }
        }
        return ok_status();
      },
      [&](const std::vector<Slot>& slots) {
        for (int i = 0; i < size_; ++i) {
          // Start with the next rank so the ranks don't all read rank 0's buffer at once.
          const int s = (rank_ + i) % size_;
          const Slot& from = slots[size_t(s)];
          const size_t n = recv_bytes[size_t(s)];
          if (n > 0) {
            std::memcpy(static_cast<char*>(recv) + recv_offsets[size_t(s)],
                        static_cast<const char*>(from.send) + from.send_offsets[size_t(rank_)], n);
          }
          count_send(s, send_bytes[size_t(s)]);
        }
      });
}

Status ThreadsWorld::reduce_scatter_v_f32(const float* send, std::span<const size_t> counts,
                                          float* recv) {
  Slot mine;
  mine.op = Op::kReduceScatterV;
  mine.send = send;
  mine.send_sizes = counts;
  // Sums go to a temporary first, so recv may alias send (in place).
  std::vector<float> sum;
  Status status = collective(
      mine,
      [&](const std::vector<Slot>& slots) -> Status {
        for (int r = 0; r < size_; ++r) {
          std::span<const size_t> c = slots[size_t(r)].send_sizes;
          if (c.size() != size_t(size_)) {
            return invalid_argument("reduce_scatter_v_f32: rank ", r, " passed ", c.size(),
                                    " counts; must be world size ", size_);
          }
          for (int d = 0; d < size_; ++d) {
            if (c[size_t(d)] != slots[0].send_sizes[size_t(d)]) {
              return invalid_argument("reduce_scatter_v_f32: rank ", r, " has counts[", d,
                                      "] = ", c[size_t(d)], ", rank 0 has ",
                                      slots[0].send_sizes[size_t(d)]);
            }
          }
        }
        return ok_status();
      },
      [&](const std::vector<Slot>& slots) {
        size_t off = 0;
        for (int d = 0; d < rank_; ++d) off += counts[size_t(d)];
        const size_t n = counts[size_t(rank_)];
        sum.resize(n);
        internal::sum_rows(pool(), size_, n, sum.data(), [&](int r) {
          return static_cast<const float*>(slots[size_t(r)].send) + off;
        });
        for (int d = 0; d < size_; ++d) count_send(d, counts[size_t(d)] * sizeof(float));
      });
  // After the second barrier nobody reads send any more, so recv may be overwritten.
  if (status.ok() && !sum.empty()) std::memcpy(recv, sum.data(), sum.size() * sizeof(float));
  return status;
}

Status ThreadsWorld::all_reduce_f32(const float* send, float* recv, size_t count) {
  Slot mine;
  mine.op = Op::kAllReduce;
  mine.send = send;
  mine.send_bytes = count;
  std::vector<float> sum;
  Status status = collective(
      mine,
      [&](const std::vector<Slot>& slots) -> Status {
        for (int r = 0; r < size_; ++r) {
          if (slots[size_t(r)].send_bytes != slots[0].send_bytes) {
            return invalid_argument("all_reduce_f32: rank ", r, " has count ",
                                    slots[size_t(r)].send_bytes, ", rank 0 has ",
                                    slots[0].send_bytes);
          }
        }
        return ok_status();
      },
      [&](const std::vector<Slot>& slots) {
        sum.resize(count);
        internal::sum_rows(pool(), size_, count, sum.data(),
                           [&](int r) { return static_cast<const float*>(slots[size_t(r)].send); });
        for (int d = 0; d < size_; ++d) count_send(d, count * sizeof(float));
      });
  if (status.ok() && count > 0) std::memcpy(recv, sum.data(), count * sizeof(float));
  return status;
}

}  // namespace moed::threads
