// Threads backend collectives: every rank publishes its buffers in a slot, then each rank
// pulls what it needs straight from the others' send buffers (one copy), between two
// barriers. Every check runs on every rank over all slots, so all ranks reach the same
// verdict and return the same error.
#include <cstring>

#include "comm/backend.h"
#include "comm/sum_rows.h"
#include "comm/threads/threads_world.h"
#include "moed/status.h"

namespace moed::threads {

template <typename Check, typename Work>
Status ThreadsWorld::collective(const Slot& mine, Check&& check, Work&& work) {
  MOED_RETURN_IF_ERROR(internal::start_collective(*this, op_name(mine.op)));
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
// Span lengths, then each rank d's recv sizes against what each rank s sends it (all_gather_v:
// its send_bytes; all_to_all_v: its send_sizes[d]), checked on every rank from the slots, so a
// wrong argument on one rank is an error on all of them (the spans themselves are only read
// when the lengths are right).
Status check_exchange(const std::vector<Slot>& slots, const char* name, bool gather) {
  const size_t n = slots.size();
  for (size_t r = 0; r < n; ++r) {
    const Slot& s = slots[r];
    MOED_RETURN_IF_ERROR(
        gather ? internal::check_length(name, int(r), "recv sizes", s.recv_sizes.size(), n)
               : internal::check_exchange_lengths(name, int(r), n, s.send_sizes, s.send_offsets,
                                                  s.recv_sizes, s.recv_offsets));
  }
  for (size_t d = 0; d < n; ++d) {
    MOED_RETURN_IF_ERROR(internal::check_recv_sizes(
        name, int(d), int(n), [&](int s) { return slots[d].recv_sizes[size_t(s)]; },
        [&](int s) {
          const Slot& from = slots[size_t(s)];
          return gather ? from.send_bytes : from.send_sizes[d];
        }));
  }
  return ok_status();
}
}  // namespace

Status ThreadsWorld::barrier() {
  return collective(
      Slot(Op::kBarrier), [](const std::vector<Slot>&) { return ok_status(); },
      [](const std::vector<Slot>&) {});
}

Status ThreadsWorld::broadcast_bytes(void* data, size_t bytes, int root) {
  Slot mine(Op::kBroadcast, nullptr, data);
  mine.send_bytes = bytes;
  mine.root = root;
  return collective(
      mine,
      [&](const std::vector<Slot>& slots) {
        return internal::check_broadcast(
            size_, root, [&](int r) { return slots[size_t(r)].root; },
            [&](int r) { return slots[size_t(r)].send_bytes; });
      },
      [&](const std::vector<Slot>& slots) {
        if (rank_ == root) {
          internal::count_send_to_all(*this, bytes);
        } else if (bytes > 0) {
          std::memcpy(data, slots[size_t(root)].recv, bytes);
        }
      });
}

Status ThreadsWorld::all_gather_v_bytes(const void* send, size_t send_bytes, void* recv,
                                        std::span<const size_t> recv_bytes) {
  Slot mine(Op::kAllGatherV, send, recv);
  mine.send_bytes = send_bytes;
  mine.recv_sizes = recv_bytes;
  return collective(
      mine,
      [](const std::vector<Slot>& slots) { return check_exchange(slots, "all_gather_v", true); },
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
  Slot mine(Op::kAllToAllV, send, recv);
  mine.send_sizes = send_bytes;
  mine.send_offsets = send_offsets;
  mine.recv_sizes = recv_bytes;
  mine.recv_offsets = recv_offsets;
  return collective(
      mine,
      [](const std::vector<Slot>& slots) { return check_exchange(slots, "all_to_all_v", false); },
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
  Slot mine(Op::kReduceScatterV, send);
  mine.send_sizes = counts;
  // Sums go to a temporary first, so recv may alias send (in place).
  std::vector<float> sum;
  Status status = collective(
      mine,
      [&](const std::vector<Slot>& slots) -> Status {
        const size_t n = size_t(size_);
        for (size_t r = 0; r < n; ++r) {
          std::span<const size_t> c = slots[r].send_sizes;
          MOED_RETURN_IF_ERROR(internal::check_counts_length(int(r), c.size(), n));
          MOED_RETURN_IF_ERROR(
              internal::check_counts_match(r, c.data(), slots[0].send_sizes.data(), n));
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
  Slot mine(Op::kAllReduce, send);
  mine.send_bytes = count;
  std::vector<float> sum;
  Status status = collective(
      mine,
      [&](const std::vector<Slot>& slots) {
        return internal::check_same_as_rank0("all_reduce_f32", "count", size_,
                                             [&](int r) { return slots[size_t(r)].send_bytes; });
      },
      [&](const std::vector<Slot>& slots) {
        sum.resize(count);
        internal::sum_rows(pool(), size_, count, sum.data(),
                           [&](int r) { return static_cast<const float*>(slots[size_t(r)].send); });
        internal::count_send_to_all(*this, count * sizeof(float));
      });
  if (status.ok() && count > 0) std::memcpy(recv, sum.data(), count * sizeof(float));
  return status;
}

}  // namespace moed::threads
