#include "core/block_cache.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <list>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

#include "moed/tensor.h"

namespace moed {

namespace {

// Blocks from 1 MiB up are cached; their sizes are rounded up to 64 KiB so that shapes
// differing in a few rows share a size class.
constexpr size_t kMinCached = size_t(1) << 20;
constexpr size_t kGranule = size_t(64) << 10;
// Blocks from 4 MiB up are 2 MiB aligned and asked to be backed by huge pages: one page
// fault per 2 MiB instead of 512 the first time they are touched.
constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kMinHuge = size_t(4) << 20;

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
// Under the sanitizers every block goes back to malloc, so use-after-free stays visible.
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

size_t rounded_size(size_t bytes) {
  if (bytes < kMinCached) return (bytes + 63) / 64 * 64;
  return (bytes + kGranule - 1) / kGranule * kGranule;
}

size_t default_limit() {
  if (kSanitized) return 0;
  if (const char* env = std::getenv("MOED_TENSOR_CACHE_BYTES")) {
    return size_t(std::strtoull(env, nullptr, 10));
  }
  return size_t(1) << 30;
}

void* system_allocate(size_t rounded) {
  void* p = internal::allocate_uncached(rounded);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

// Free blocks by size, oldest first within a size; evicted least recently released first.
class BlockCache {
 public:
  static BlockCache& get() {
    static BlockCache* cache = new BlockCache();  // never destroyed: Tensors may outlive main
    return *cache;
  }

  void* allocate(size_t bytes) {
    const size_t rounded = rounded_size(bytes);
    if (rounded >= kMinCached) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(rounded);
      if (it != free_.end() && !it->second.empty()) {
        auto entry = it->second.back();
        void* p = entry->first;  // before erase frees the list node
        it->second.pop_back();
        order_.erase(entry);
        cached_bytes_ -= rounded;
        ++hits_;
        return p;
      }
      ++misses_;
    }
    return system_allocate(rounded);
  }

  void release(void* p, size_t bytes) {
    const size_t rounded = rounded_size(bytes);
    if (rounded >= kMinCached) {
      std::vector<void*> evicted;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (rounded <= limit_) {
          order_.emplace_back(p, rounded);
          free_[rounded].push_back(std::prev(order_.end()));
          cached_bytes_ += rounded;
          p = nullptr;
          while (cached_bytes_ > limit_) evicted.push_back(evict_oldest());
        }
      }
      for (void* q : evicted) std::free(q);
    }
    std::free(p);
  }

  void set_limit(size_t bytes) {
    std::vector<void*> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      limit_ = kSanitized ? 0 : bytes;
      while (cached_bytes_ > limit_) evicted.push_back(evict_oldest());
    }
    for (void* q : evicted) std::free(q);
  }

  void clear() {
    std::vector<void*> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (cached_bytes_ > 0) evicted.push_back(evict_oldest());
    }
    for (void* q : evicted) std::free(q);
  }

  TensorCacheStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return TensorCacheStats{cached_bytes_, limit_, hits_, misses_};
  }

 private:
  using Order = std::list<std::pair<void*, size_t>>;

  void* evict_oldest() {
    auto entry = order_.begin();
    std::vector<Order::iterator>& same = free_[entry->second];
    // The oldest of a size is the first of its list (releases append).
    same.erase(same.begin());
    cached_bytes_ -= entry->second;
    void* p = entry->first;
    order_.erase(entry);
    return p;
  }

  std::mutex mu_;
  Order order_;                                                    // release order
  std::unordered_map<size_t, std::vector<Order::iterator>> free_;  // by rounded size
  size_t cached_bytes_ = 0;
  size_t limit_ = default_limit();
  uint64_t hits_ = 0, misses_ = 0;
};

}  // namespace

namespace internal {
void* allocate_uncached(size_t bytes) {
  const size_t rounded = rounded_size(bytes);
  const size_t align = rounded >= kMinHuge ? kHugePage : 64;
  void* p = std::aligned_alloc(align, (rounded + align - 1) / align * align);
  if (p != nullptr && rounded >= kMinHuge) madvise(p, rounded, MADV_HUGEPAGE);  // a hint
  return p;
}
void* allocate_block(size_t bytes) {
  if (bytes == 0) return nullptr;
  return BlockCache::get().allocate(bytes);
}
void release_block(void* p, size_t bytes) {
  if (p != nullptr) BlockCache::get().release(p, bytes);
}
void advise_sparse(void* p, size_t bytes) {
  // Only blocks from kMinHuge up asked for huge pages, and only they are 2 MiB aligned.
  if (p != nullptr && rounded_size(bytes) >= kMinHuge) madvise(p, bytes, MADV_NOHUGEPAGE);
}
}  // namespace internal

void set_tensor_cache_limit(size_t bytes) { BlockCache::get().set_limit(bytes); }
void release_tensor_cache() { BlockCache::get().clear(); }
TensorCacheStats tensor_cache_stats() { return BlockCache::get().stats(); }

}  // namespace moed
