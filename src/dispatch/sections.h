// The byte layout of a block made of consecutive sections: a network message, a receive
// block, a node-shared segment. Every such layout in the dispatchers is written with it (Flex's
// messages and push targets, DeepEP's rank-major blocks and messages, low-latency mode's
// segment), so each is a list of its sections in order.
//
//   Sections s(64);                             // each section on 64 bytes
//   const size_t rows_off = s.add(n * row_bytes);
//   const size_t scales_off = s.add(n * scale_bytes);
//   const size_t bytes = s.aligned_end();
#pragma once

#include <cstddef>

namespace moed {

class Sections {
 public:
  explicit constexpr Sections(size_t align = 1) : align_(align) {}
  // A section of `bytes` after the others, on the alignment: where it starts.
  constexpr size_t add(size_t bytes) {
    const size_t at = round(end_);
    end_ = at + bytes;
    return at;
  }
  constexpr size_t end() const { return end_; }                 // the last section's end
  constexpr size_t aligned_end() const { return round(end_); }  // ... padded to the alignment

 private:
  constexpr size_t round(size_t n) const { return (n + align_ - 1) / align_ * align_; }
  size_t align_;
  size_t end_ = 0;
};

}  // namespace moed
