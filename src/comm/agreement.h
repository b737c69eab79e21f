// A step's agreement in one collective: every rank's verdict on its input, the values that must
// be equal everywhere and the counts everyone needs, gathered in one all_gather. World::agree
// is the verdict alone; the dispatchers (Flex's steps, AllGather's and AlltoAll's dispatch)
// agree through this, so a step makes one collective before its data moves.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "moed/status.h"
#include "moed/world.h"

namespace moed {

// One value of the agreement row. kAgree values must be equal on every rank (kAgreeDType
// prints dtype names); kFree values may differ (counts, held masks); kFirst values must be
// equal and are checked before the verdicts (a mode every rank must share).
struct AgreedField {
  enum Kind { kAgree, kAgreeDType, kFree, kFirst };
  const char* name;
  int64_t value;
  Kind kind = kFree;
};

// Rank r's row of the gathered table: [code, fields..., payload...].
struct AgreedTable {
  std::vector<int64_t> table;
  size_t width = 0;
  size_t num_fields = 0;
  const int64_t* row(int r) const { return &table[size_t(r) * width]; }
  // Rank r's value of fields[i], and its payload.
  int64_t field(int r, size_t i) const { return row(r)[1 + i]; }
  const int64_t* payload(int r) const { return row(r) + 1 + num_fields; }
};

// All-gathers [code, fields..., payload...] of every rank. Any rank's local error: every rank
// returns World::agree's error for it (its message travels in further collectives, on the
// error path only). A kAgree field that differs: "name = a on rank 0 but b on rank r" on every
// rank. Else the table. Collective.
StatusOr<AgreedTable> agree_in_one(World& world, const Status& local,
                                   std::span<const AgreedField> fields,
                                   std::span<const int64_t> payload = {});

}  // namespace moed
