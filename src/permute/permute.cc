// permute: copy token rows into the layout's expert-major order. One memcpy per row (the
// rows are the unit DeepEP moves too); the pool splits the *output* rows, so every worker
// writes a contiguous range and the work is even however skewed the routing is.
#include "moed/permute.h"

#include <cstring>

#include "core/row_checks.h"
#include "core/row_kernels.h"

namespace moed {

using internal::check_token_rows;

Status permute_rows_into(const TokenRows& tokens, const PermuteLayout& layout, const TokenRows& out,
                         ThreadPool& pool) {
  MOED_RETURN_IF_ERROR(check_token_rows("tokens", tokens, layout.num_tokens));
  MOED_RETURN_IF_ERROR(check_token_rows("out", out, layout.num_rows));
  if (out.x.dtype != tokens.x.dtype || out.x.cols != tokens.x.cols) {
    return invalid_argument("out is ", dtype_name(out.x.dtype), " [", out.x.rows, ", ", out.x.cols,
                            "]; tokens need ", dtype_name(tokens.x.dtype), " [", layout.num_rows,
                            ", ", tokens.x.cols, "]");
  }
  if (int64_t(layout.sorted_indices.size()) != layout.num_rows) {
    return invalid_argument("layout has ", layout.sorted_indices.size(), " sorted_indices for ",
                            layout.num_rows, " rows");
  }
  const bool fp8 = tokens.has_scales();
  const size_t row_bytes = tokens.x.row_bytes();
  const size_t scale_bytes = fp8 ? tokens.scales.row_bytes() : 0;
  const int32_t* idx = layout.sorted_indices.data();
  // NOTE: a large output goes around the caches (as a large memcpy does); a small one stays
  // in them for the experts that read it next.
  const bool stream = size_t(layout.num_rows) * row_bytes >= internal::kStreamThresholdBytes;
  const auto copy = stream ? internal::stream_copy
                           : +[](void* d, const void* s, size_t n) { std::memcpy(d, s, n); };
  // NOTE: rows of several KB each; 16 rows per chunk keeps tiny problems on one thread.
  pool.parallel_for(
      layout.num_rows,
      [&](int64_t b, int64_t e, int) {
        for (int64_t r = b; r < e; ++r) {
          const int32_t t = idx[r];
          if (r + 1 < e && idx[r + 1] >= 0) {
            internal::prefetch_row(tokens.x.row_ptr(idx[r + 1]), row_bytes);
          }
          if (t >= 0) {
            copy(out.x.row_ptr(r), tokens.x.row_ptr(t), row_bytes);
            if (fp8) std::memcpy(out.scales.row_ptr(r), tokens.scales.row_ptr(t), scale_bytes);
          } else {
            std::memset(out.x.row_ptr(r), 0, row_bytes);
            if (fp8) std::memset(out.scales.row_ptr(r), 0, scale_bytes);  // 0.0f
          }
        }
        if (stream) internal::stream_fence();
      },
      16);
  return ok_status();
}

StatusOr<TokenTensor> permute_rows(const TokenRows& tokens, const PermuteLayout& layout,
                                   ThreadPool& pool) {
  MOED_RETURN_IF_ERROR(check_token_rows("tokens", tokens, layout.num_tokens));
  TokenTensor out;
  out.x = Tensor::empty(tokens.x.dtype, layout.num_rows, tokens.x.cols);
  if (tokens.has_scales()) {
    out.scales = Tensor::empty(DType::kF32, layout.num_rows, tokens.x.cols / kFp8BlockSize);
  }
  MOED_RETURN_IF_ERROR(permute_rows_into(tokens, layout, out.rows(), pool));
  return out;
}

StatusOr<PermuteOutput> permute(const TokenRows& tokens, const RoutingMap& routing,
                                const PermuteOptions& options, ThreadPool& pool) {
  MOED_RETURN_IF_ERROR(check_token_rows("tokens", tokens, -1));
  if (tokens.x.rows != routing.num_tokens) {
    return invalid_argument("tokens have ", tokens.x.rows, " rows but the routing map has ",
                            routing.num_tokens, " tokens");
  }
  PermuteOutput out;
  MOED_ASSIGN_OR_RETURN(out.layout, make_permute_layout(routing, options, pool));
  MOED_ASSIGN_OR_RETURN(out.rows, permute_rows(tokens, out.layout, pool));
  return out;
}

}  // namespace moed
