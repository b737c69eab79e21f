#include "faults/fault_world.h"

namespace moed::testing {

FaultWorld::FaultWorld(World& inner)
    : World(inner.rank(), inner.size(), inner.ranks_per_node(), inner.timeout(),
            inner.pool().num_threads()),
      inner_(inner) {}

void FaultWorld::arm(int nth, const Status& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  reason_ = reason;
  armed_at_.store(calls_.load());
  countdown_.store(nth > 0 ? nth : 0);
}

Status FaultWorld::hit(const char* call) {
  calls_.fetch_add(1);
  int c = countdown_.load();
  while (c > 0 && !countdown_.compare_exchange_weak(c, c - 1)) {
  }
  if (c != 1) return ok_status();
  Status reason;
  {
    std::lock_guard<std::mutex> lock(mu_);
    reason = Status(reason_.code(), reason_.message() + " at " + call);
  }
  fired_.store(true);
  abort(reason);
  return reason;
}

Status FaultWorld::barrier() {
  MOED_RETURN_IF_ERROR(hit("barrier"));
  return inner_.barrier();
}

Status FaultWorld::broadcast_bytes(void* data, size_t bytes, int root) {
  MOED_RETURN_IF_ERROR(hit("broadcast"));
  return inner_.broadcast_bytes(data, bytes, root);
}

Status FaultWorld::all_gather_v_bytes(const void* send, size_t send_bytes, void* recv,
                                      std::span<const size_t> recv_bytes) {
  MOED_RETURN_IF_ERROR(hit("all_gather"));
  return inner_.all_gather_v_bytes(send, send_bytes, recv, recv_bytes);
}

Status FaultWorld::all_to_all_v_bytes(const void* send, std::span<const size_t> send_bytes,
                                      std::span<const size_t> send_offsets, void* recv,
                                      std::span<const size_t> recv_bytes,
                                      std::span<const size_t> recv_offsets) {
  MOED_RETURN_IF_ERROR(hit("all_to_all"));
  return inner_.all_to_all_v_bytes(send, send_bytes, send_offsets, recv, recv_bytes, recv_offsets);
}

Status FaultWorld::reduce_scatter_v_f32(const float* send, std::span<const size_t> counts,
                                        float* recv) {
  MOED_RETURN_IF_ERROR(hit("reduce_scatter"));
  return inner_.reduce_scatter_v_f32(send, counts, recv);
}

Status FaultWorld::all_reduce_f32(const float* send, float* recv, size_t count) {
  MOED_RETURN_IF_ERROR(hit("all_reduce"));
  return inner_.all_reduce_f32(send, recv, count);
}

StatusOr<std::shared_ptr<SharedBuffer>> FaultWorld::alloc_shared(size_t bytes) {
  MOED_RETURN_IF_ERROR(hit("alloc_shared"));
  return inner_.alloc_shared(bytes);
}

StatusOr<Request> FaultWorld::isend(int dst, int tag, const void* data, size_t bytes) {
  MOED_RETURN_IF_ERROR(hit("isend"));
  return inner_.isend(dst, tag, data, bytes);
}

StatusOr<Request> FaultWorld::irecv(int src, int tag, void* data, size_t bytes) {
  MOED_RETURN_IF_ERROR(hit("irecv"));
  return inner_.irecv(src, tag, data, bytes);
}

}  // namespace moed::testing
