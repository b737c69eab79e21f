// Internal: World's transport methods (moed/world.h documents them), declared once for every
// class that implements them: the backends and the test decorators.
#pragma once

#include <cstddef>
#include <memory>
#include <span>

#include "moed/world.h"

// NOTE: the interface's methods listed once, so backends and decorators cannot drift: each
// declares the same signatures, and `override` makes any that leaves World's an error.
#define MOED_WORLD_TRANSPORT_OVERRIDES                                                        \
  Status barrier() override;                                                                  \
  Status broadcast_bytes(void* data, size_t bytes, int root) override;                        \
  Status all_gather_v_bytes(const void* send, size_t send_bytes, void* recv,                  \
                            std::span<const size_t> recv_bytes) override;                     \
  Status all_to_all_v_bytes(const void* send, std::span<const size_t> send_bytes,             \
                            std::span<const size_t> send_offsets, void* recv,                 \
                            std::span<const size_t> recv_bytes,                               \
                            std::span<const size_t> recv_offsets) override;                   \
  Status reduce_scatter_v_f32(const float* send, std::span<const size_t> counts, float* recv) \
      override;                                                                               \
  Status all_reduce_f32(const float* send, float* recv, size_t count) override;               \
  StatusOr<std::shared_ptr<SharedBuffer>> alloc_shared(size_t bytes) override;                \
  StatusOr<Request> isend(int dst, int tag, const void* data, size_t bytes) override;         \
  StatusOr<Request> irecv(int src, int tag, void* data, size_t bytes) override
