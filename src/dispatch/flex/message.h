// The one wire layout of a dispatch message (design.md §5.5): Flex's source -> forwarder
// messages, the rank-major push's (deep_ep/rank_major.h) and low-latency mode's messages to
// another node's rank (low_latency/dispatch_rows.h). Headers, then the expert entries, then
// the payload rows, then the fp8 scales, then a tail of tail_bytes (the rank-major push's
// channel prefix rows), packed; Message reads and writes one, message_pieces lists one whose rows
// lie elsewhere for World::isend_gather.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "dispatch/flex/topology.h"
#include "dispatch/sections.h"
#include "moed/dispatch_layout.h"
#include "moed/world.h"

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
  size_t row_bytes = 0, scale_bytes = 0;
  size_t entries_off = 0, payload_off = 0, scales_off = 0, tail_off = 0, bytes = 0;
  static MessageLayout of(int64_t tokens, int64_t entries, size_t row_bytes, size_t scale_bytes,
                          size_t tail_bytes = 0) {
    const size_t t = size_t(tokens);
    Sections s;  // packed
    MessageLayout l{.row_bytes = row_bytes, .scale_bytes = scale_bytes};
    s.add(t * sizeof(MessageHeader));
    l.entries_off = s.add(size_t(entries) * sizeof(MessageEntry));
    l.payload_off = s.add(t * row_bytes);
    l.scales_off = s.add(t * scale_bytes);
    l.tail_off = s.add(tail_bytes);
    l.bytes = s.end();
    return l;
  }
};

// One message of a MessageLayout at `base`, its sections by index: token i's header, payload
// and scales, entry q (the entries of every token in turn). Byte is char or std::byte, const
// for a message received (the put_ members then do not compile).
template <typename Byte>
class Message {
 public:
  Message(Byte* base, const MessageLayout& layout) : base_(base), l_(layout) {}

  MessageHeader header(size_t i) const { return read<MessageHeader>(base_ + i * kHeader); }
  MessageEntry entry(size_t q) const {
    return read<MessageEntry>(base_ + l_.entries_off + q * kEntry);
  }
  Byte* payload(size_t i) const { return base_ + l_.payload_off + i * l_.row_bytes; }
  Byte* scales(size_t i) const {  // null without scales
    return l_.scale_bytes != 0 ? base_ + l_.scales_off + i * l_.scale_bytes : nullptr;
  }
  Byte* tail() const { return base_ + l_.tail_off; }

  void put_header(size_t i, const MessageHeader& h) const {
    std::memcpy(base_ + i * kHeader, &h, kHeader);
  }
  void put_entry(size_t q, const MessageEntry& e) const {
    std::memcpy(base_ + l_.entries_off + q * kEntry, &e, kEntry);
  }
  // Token i's row: its payload, and its scales when the layout has them.
  void put_row(size_t i, const void* payload, const void* scales) const {
    std::memcpy(this->payload(i), payload, l_.row_bytes);
    if (l_.scale_bytes != 0) std::memcpy(this->scales(i), scales, l_.scale_bytes);
  }

 private:
  static constexpr size_t kHeader = sizeof(MessageHeader), kEntry = sizeof(MessageEntry);
  // NOTE: the sections are packed, so headers and entries are read unaligned.
  template <typename T>
  static T read(const Byte* p) {
    T v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  Byte* base_;
  MessageLayout l_;
};

// Appends a piece to a gather list (World::isend_gather), or grows the last one when it ends
// where this one starts (consecutive rows of a dense tensor), so the transport copies runs of
// rows at a time.
inline void add_piece(std::vector<World::Piece>& pieces, const void* data, size_t bytes) {
  if (!pieces.empty() && static_cast<const char*>(pieces.back().data) + pieces.back().bytes ==
                             static_cast<const char*>(data)) {
    pieces.back().bytes += bytes;
  } else {
    pieces.push_back({data, bytes});
  }
}

// The gather list of a message of layout `l` whose headers and entries (and tail) were written
// at `written` and whose n rows lie elsewhere: rows[i] is token i's payload, rows[n + i] its
// scales when the layout has them.
inline void message_pieces(const MessageLayout& l, const char* written,
                           std::span<const char* const> rows, size_t n,
                           std::vector<World::Piece>& pieces) {
  pieces.clear();
  add_piece(pieces, written, l.payload_off);
  for (size_t i = 0; i < rows.size(); ++i)
    add_piece(pieces, rows[i], i < n ? l.row_bytes : l.scale_bytes);
  if (l.bytes > l.tail_off) add_piece(pieces, written + l.tail_off, l.bytes - l.tail_off);
}

}  // namespace moed::flex
