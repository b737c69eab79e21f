#include "dispatch/prepare.h"

#include <array>

namespace moed {

namespace {

Status check_local(const DispatchConfig& config, const DispatchInput& input) {
  const TokenRows& h = input.hidden;
  if ((input.topk == nullptr) == (input.map == nullptr)) {
    return invalid_argument("DispatchInput needs exactly one routing form (topk or map); got ",
                            input.topk ? "both" : "neither");
  }
  if (h.x.rows < 0 || h.x.cols <= 0) {
    return invalid_argument("hidden is [", h.x.rows, ", ", h.x.cols,
                            "]; the hidden size must be positive (also on ranks with 0 tokens)");
  }
  if (h.x.rows > 0 && h.x.data == nullptr) return invalid_argument("hidden.x.data is null");
  if (h.x.row_stride < h.x.cols) {
    return invalid_argument("hidden row_stride = ", h.x.row_stride, " < hidden = ", h.x.cols);
  }
  if (h.x.dtype == DType::kFP8) {
    if (h.x.cols % kFp8BlockSize != 0) {
      return invalid_argument("fp8 hidden = ", h.x.cols, " is not a multiple of ", kFp8BlockSize);
    }
    if (h.scales.dtype != DType::kF32 || h.scales.rows != h.x.rows ||
        h.scales.cols != h.x.cols / kFp8BlockSize || (h.x.rows > 0 && h.scales.data == nullptr)) {
      return invalid_argument("fp8 scales must be f32 [", h.x.rows, ", ", h.x.cols / kFp8BlockSize,
                              "]; got ", dtype_name(h.scales.dtype), " [", h.scales.rows, ", ",
                              h.scales.cols, "]");
    }
  }
  const int64_t routing_tokens = input.topk ? input.topk->num_tokens : input.map->num_tokens;
  if (routing_tokens != h.x.rows) {
    return invalid_argument("routing has ", routing_tokens, " tokens but hidden has ", h.x.rows,
                            " rows");
  }
  if (input.topk) {
    MOED_RETURN_IF_ERROR(validate(*input.topk, config.num_experts));
  } else {
    MOED_RETURN_IF_ERROR(validate(*input.map, config.num_experts));
    if (config.layout.capacity_factor && input.map->num_topk <= 0) {
      return invalid_argument(
          "capacity_factor needs the routing's num_topk; the routing map has "
          "num_topk = ",
          input.map->num_topk);
    }
  }
  return ok_status();
}

PreparedInput prepared_shapes(const DispatchInput& input) {
  PreparedInput p;
  p.num_tokens = input.hidden.x.rows;
  p.hidden = int(input.hidden.x.cols);
  p.dtype = input.hidden.x.dtype;
  p.num_topk = input.topk ? input.topk->num_topk : input.map->num_topk;
  return p;
}

}  // namespace

Status check_shapes_agree(std::span<const int64_t> table, size_t width, size_t offset,
                          int world_size) {
  static const char* const kNames[3] = {"hidden", "dtype", "num_topk"};
  for (int r = 1; r < world_size; ++r) {
    for (size_t i = 0; i < 3; ++i) {
      const int64_t a = table[offset + i], b = table[size_t(r) * width + offset + i];
      if (a == b) continue;
      if (i == 1) {
        return invalid_argument("dtype is ", dtype_name(DType(a)), " on rank 0 but ",
                                dtype_name(DType(b)), " on rank ", r);
      }
      return invalid_argument(kNames[i], " = ", a, " on rank 0 but ", b, " on rank ", r);
    }
  }
  return ok_status();
}

StatusOr<PreparedInput> prepare_dispatch_input_local(const DispatchConfig& config,
                                                     const DispatchInput& input, ThreadPool& pool) {
  MOED_RETURN_IF_ERROR(check_local(config, input));
  PreparedInput p = prepared_shapes(input);
  const bool reshapes = config.layout.capacity_factor || config.layout.router_padding_multiple > 0;
  if (input.topk) {
    p.effective = to_map(*input.topk, config.num_experts);
  } else if (!reshapes) {
    p.effective = *input.map;
  }
  if (reshapes) {
    // NOTE: the rank's own pool, never the global one: rank threads of the threads world would
    // otherwise queue behind each other on one pool.
    const RoutingMap& source = input.topk ? p.effective : *input.map;
    MOED_ASSIGN_OR_RETURN(p.effective,
                          apply_layout_options(source, p.num_topk, config.layout, &pool));
  }
  if (config.layout.capacity_factor) {
    p.capacity = expert_capacity(p.num_tokens, p.num_topk, config.num_experts,
                                 *config.layout.capacity_factor);
  }
  const int E = config.num_experts;
  p.tokens_per_expert.assign(size_t(E), 0);
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const uint8_t* row = &p.effective.routing_map[size_t(t) * E];
    for (int e = 0; e < E; ++e) p.tokens_per_expert[size_t(e)] += row[e];
  }
  return p;
}

StatusOr<PreparedInput> prepare_dispatch_input(World& world, const DispatchConfig& config,
                                               const DispatchInput& input) {
  MOED_RETURN_IF_ERROR(world.agree(check_local(config, input)));
  // Shapes that must agree across ranks; every rank sees the same table and decides alike.
  const PreparedInput shapes = prepared_shapes(input);
  const std::array<int64_t, 3> mine = {shapes.hidden, int64_t(shapes.dtype), shapes.num_topk};
  MOED_ASSIGN_OR_RETURN(std::vector<int64_t> all,
                        all_gather<int64_t>(world, std::span<const int64_t>(mine)));
  MOED_RETURN_IF_ERROR(check_shapes_agree(all, 3, 0, world.size()));
  return prepare_dispatch_input_local(config, input, world.pool());
}

ExpertLayout compute_expert_layout(const DispatchConfig& config, int world_size, int rank,
                                   const std::vector<int64_t>& counts,
                                   const std::vector<int64_t>& capacity) {
  const int R = world_size, E = config.num_experts, L = config.num_local_experts(R);
  const int first = first_local_expert(config, R, rank);
  const int64_t align = config.layout.expert_alignment;
  ExpertLayout l;
  l.num_local_experts = L;
  l.world_size = R;
  l.chunk_offset.resize(size_t(L) * R);
  l.chunk_rows.resize(size_t(L) * R);
  l.chunk_tokens.resize(size_t(L) * R);
  l.segment_offset.resize(size_t(L) + 1);
  l.tokens_per_expert.resize(size_t(L));
  l.tokens_per_expert_unpadded.resize(size_t(L));
  int64_t off = 0;
  for (int j = 0; j < L; ++j) {
    l.segment_offset[size_t(j)] = off;
    int64_t real = 0;
    for (int s = 0; s < R; ++s) {
      const size_t c = size_t(j) * R + s;
      const int64_t tokens = counts[size_t(s) * E + first + j];
      const int64_t rows = config.layout.pad_to_capacity ? capacity[size_t(s)] : tokens;
      MOED_CHECK(tokens <= rows, "chunk (j=", j, ", s=", s, ") has ", tokens, " tokens > ", rows);
      l.chunk_offset[c] = off;
      l.chunk_rows[c] = rows;
      l.chunk_tokens[c] = tokens;
      off += rows;
      real += tokens;
    }
    const int64_t len = off - l.segment_offset[size_t(j)];
    const int64_t padded = (len + align - 1) / align * align;
    off += padded - len;
    l.tokens_per_expert[size_t(j)] = padded;
    l.tokens_per_expert_unpadded[size_t(j)] = real;
  }
  l.segment_offset[size_t(L)] = off;
  l.num_rows = off;
  return l;
}

}  // namespace moed
