// Memory behind moed's own Tensors. Large blocks are kept after release and handed out again
// for the same size (PyTorch's caching allocator does this for GPU memory), so an op that
// returns a fresh [T, H] output every step does not pay for new pages every step: on these
// VMs a first-touched page costs about as much as copying it several times.
#pragma once

#include <cstddef>

namespace moed::internal {

// 64-byte aligned; nullptr for 0 bytes; throws std::bad_alloc when out of memory.
void* allocate_block(size_t bytes);
// `bytes` as passed to allocate_block.
void release_block(void* p, size_t bytes);
// Not cached, for memory with a life of its own (node-shared segments): aligned as
// allocate_block's blocks are, large ones asking for huge pages as theirs do; std::free it.
// nullptr when out of memory.
void* allocate_uncached(size_t bytes);
// A block whose rows are written sparsely (a few rows at the start of each of many slots):
// small pages from here on, so a touched row costs its own pages, not the 2 MiB page around
// it that large blocks ask for (allocate_block, allocate_uncached).
void advise_sparse(void* p, size_t bytes);

}  // namespace moed::internal
