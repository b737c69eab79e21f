#include "comm/agreement.h"

#include <algorithm>

#include "moed/dtype.h"

namespace moed {

StatusOr<AgreedTable> agree_in_one(World& world, const Status& local,
                                   std::span<const AgreedField> fields,
                                   std::span<const int64_t> payload) {
  AgreedTable t;
  t.num_fields = fields.size();
  t.width = 1 + fields.size() + payload.size();
  std::vector<int64_t> mine(t.width, 0);
  mine[0] = int64_t(local.code());
  for (size_t i = 0; i < fields.size(); ++i) mine[1 + i] = fields[i].value;
  std::copy(payload.begin(), payload.end(), mine.begin() + 1 + ptrdiff_t(fields.size()));
  MOED_ASSIGN_OR_RETURN(t.table, all_gather<int64_t>(world, std::span<const int64_t>(mine)));
  const int R = world.size();
  for (int r = 1; r < R; ++r) {
    for (size_t i = 0; i < fields.size(); ++i) {
      const int64_t a = t.field(0, i), b = t.field(r, i);
      if (fields[i].kind == AgreedField::kFirst && a != b) {
        return invalid_argument(fields[i].name, " = ", a, " on rank 0 but ", b, " on rank ", r);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    if (t.row(r)[0] != 0) {
      // NOTE: every rank saw the failure in the table, so every rank takes this path and
      // World::agree's collectives match; only the error path pays for the message.
      Status agreed = world.agree(local);
      if (agreed.ok()) return internal_error("rank ", r, " reported an error that agree() lost");
      return agreed;
    }
  }
  for (int r = 1; r < R; ++r) {
    for (size_t i = 0; i < fields.size(); ++i) {
      const AgreedField& f = fields[i];
      const int64_t a = t.field(0, i), b = t.field(r, i);
      if (f.kind == AgreedField::kFree || f.kind == AgreedField::kFirst || a == b) continue;
      if (f.kind == AgreedField::kAgreeDType) {
        return invalid_argument(f.name, " is ", dtype_name(DType(a)), " on rank 0 but ",
                                dtype_name(DType(b)), " on rank ", r);
      }
      return invalid_argument(f.name, " = ", a, " on rank 0 but ", b, " on rank ", r);
    }
  }
  return t;
}

}  // namespace moed
