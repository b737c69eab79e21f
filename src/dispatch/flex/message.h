// The one wire layout of a dispatch message (design.md §5.5): Flex's source -> forwarder
// messages, the rank-major push's (deep_ep/rank_major.h) and low-latency mode's messages to
// another node's rank (low_latency/dispatch_rows.h). Headers, then the expert entries, then
// the payload rows, then the fp8 scales, then a tail of tail_bytes (the rank-major push's
// channel prefix rows). Packed: headers and entries are read and written with memcpy.
#pragma once

#include <cstddef>
#include <cstdint>

#include "dispatch/flex/topology.h"
#include "dispatch/sections.h"
#include "moed/dispatch_layout.h"

namespace moed::flex {

struct MessageHeader {
  int32_t src_token;
  int32_t num_entries;
  uint64_t rank_mask;  // local ranks of the destination node that need the token
  ChainLink chain;     // the destination node's place in the token's combine chain
};
struct MessageEntry {
  int32_t expert;
  float prob;
  int32_t slot;  // the entry's top-k column at its source (-1: none)
};
static_assert(sizeof(MessageHeader) == kFlexTokenHeaderBytes &&
              sizeof(MessageEntry) == kFlexEntryBytes);

struct MessageLayout {
  size_t entries_off = 0, payload_off = 0, scales_off = 0, tail_off = 0, bytes = 0;
  static MessageLayout of(int64_t tokens, int64_t entries, size_t row_bytes, size_t scale_bytes,
                          size_t tail_bytes = 0) {
    const size_t t = size_t(tokens);
    Sections s;  // packed
    MessageLayout l;
    s.add(t * sizeof(MessageHeader));
    l.entries_off = s.add(size_t(entries) * sizeof(MessageEntry));
    l.payload_off = s.add(t * row_bytes);
    l.scales_off = s.add(t * scale_bytes);
    l.tail_off = s.add(tail_bytes);
    l.bytes = s.end();
    return l;
  }
};

}  // namespace moed::flex
