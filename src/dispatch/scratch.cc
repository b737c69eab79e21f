#include "dispatch/scratch.h"

namespace moed {

TensorView ScratchBuffer::view(DType dtype, int64_t rows, int64_t cols) {
  const size_t need = size_t(rows) * size_t(cols) * dtype_size(dtype);
  if (bytes_.bytes() < need) {
    bytes_ = Tensor();  // free first: old and new together could double the peak
    bytes_ = Tensor::empty(DType::kFP8, 1, int64_t(need));
  }
  return TensorView(bytes_.data(), dtype, rows, cols);
}

std::shared_ptr<void> OutputPool::acquire(DType dtype, int64_t rows, int64_t cols,
                                          TokenRows& rows_out, bool with_x) {
  // NOTE: two entries cover the usual caller, which holds the previous output while the next
  // dispatch runs; a caller holding more gets unpooled buffers instead of unbounded growth.
  constexpr size_t kMaxEntries = 2;
  std::shared_ptr<Entry> e;
  for (const std::shared_ptr<Entry>& c : entries_) {
    if (c.use_count() == 1) {
      e = c;
      break;
    }
  }
  if (!e) {
    e = std::make_shared<Entry>();
    if (entries_.size() < kMaxEntries) entries_.push_back(e);
  }
  rows_out.x = with_x ? e->x.view(dtype, rows, cols) : TensorView();
  rows_out.scales =
      dtype == DType::kFP8 ? e->scales.view(DType::kF32, rows, cols / kFp8BlockSize) : TensorView();
  return e;
}

}  // namespace moed
