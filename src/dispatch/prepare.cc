#include "dispatch/prepare.h"

#include "core/row_checks.h"

namespace moed {

namespace {

bool has_topk(const DispatchInput& in) { return in.topk.num_topk > 0; }
bool has_map(const DispatchInput& in) { return in.map.num_experts > 0; }

int routing_forms(const DispatchInput& in) {
  return int(has_topk(in)) + int(has_map(in)) + int(in.routing != nullptr);
}

int64_t routing_tokens(const DispatchInput& in) {
  if (has_topk(in)) return in.topk.num_tokens;
  if (has_map(in)) return in.map.num_tokens;
  return in.routing->num_tokens();
}

int routing_topk(const DispatchInput& in) {
  if (has_topk(in)) return in.topk.num_topk;
  if (has_map(in)) return in.map.num_topk;
  return in.routing->num_topk;
}

Status check_routing(const DispatchConfig& config, const DispatchInput& input) {
  const int E = config.num_experts;
  if (has_topk(input)) return validate(input.topk, E);
  MOED_RETURN_IF_ERROR(has_map(input) ? validate(input.map, E) : validate(*input.routing, E));
  if (config.layout.capacity_factor && routing_topk(input) <= 0) {
    return invalid_argument("capacity_factor needs the routing's num_topk; the ",
                            has_map(input) ? "routing map" : "sparse routing",
                            " has num_topk = ", routing_topk(input));
  }
  return ok_status();
}

Status check_local(const DispatchConfig& config, const DispatchInput& input) {
  const TokenRows& h = input.hidden;
  if (routing_forms(input) != 1) {
    return invalid_argument(
        "DispatchInput needs exactly one routing form (topk with num_topk > 0, map with "
        "num_experts > 0, or routing); got ",
        routing_forms(input) ? "several" : "none");
  }
  if (input.layout_applied && !has_map(input) && input.routing == nullptr) {
    return invalid_argument("layout_applied needs the routing as a map or sparse routing");
  }
  MOED_RETURN_IF_ERROR(internal::check_token_rows("hidden", h));
  if (routing_tokens(input) != h.x.rows) {
    return invalid_argument("routing has ", routing_tokens(input), " tokens but hidden has ",
                            h.x.rows, " rows");
  }
  MOED_RETURN_IF_ERROR(check_dispatch_out_columns(input));
  return check_routing(config, input);
}

// The input's routing in the sparse form (one conversion; checked already).
SparseRouting sparse_of(const DispatchConfig& config, const DispatchInput& input) {
  if (input.routing) return *input.routing;
  if (has_map(input)) return to_sparse(input.map);
  return to_sparse(input.topk, config.num_experts);
}

PreparedInput prepared_shapes(const DispatchInput& input) {
  PreparedInput p;
  p.num_tokens = input.hidden.x.rows;
  p.hidden = int(input.hidden.x.cols);
  p.dtype = input.hidden.x.dtype;
  p.num_topk = routing_topk(input);
  p.out_rows = input.out ? input.out->rows : -1;
  return p;
}

}  // namespace

Status check_dispatch_out_columns(const DispatchInput& input) {
  if (!input.out) return ok_status();
  const TensorView& x = input.hidden.x;
  return moed::internal::check_out_buffer("out", *input.out, input.out->rows, x.cols, x.dtype,
                                          "hidden");
}

StatusOr<PreparedInput> prepare_dispatch_input(const DispatchConfig& config,
                                               const DispatchInput& input, ThreadPool& pool) {
  MOED_RETURN_IF_ERROR(check_local(config, input));
  PreparedInput p = prepared_shapes(input);
  p.effective = sparse_of(config, input);
  p.effective.num_topk = p.num_topk;
  const LayoutOptions& o = config.layout;
  if ((o.capacity_factor || o.router_padding_multiple > 0) && !input.layout_applied) {
    // NOTE: the rank's own pool, never the global one: rank threads of the threads world would
    // otherwise queue behind each other on one pool.
    MOED_ASSIGN_OR_RETURN(p.effective, apply_layout_options(p.effective, o, &pool));
  }
  p.tokens_per_expert = p.effective.tokens_per_expert();
  if (o.capacity_factor) {
    p.capacity = expert_capacity(p.num_tokens, p.num_topk, config.num_experts, *o.capacity_factor);
    for (int e = 0; input.layout_applied && e < config.num_experts; ++e) {
      if (p.tokens_per_expert[size_t(e)] > p.capacity) {
        return invalid_argument("layout_applied, but expert ", e, " has ",
                                p.tokens_per_expert[size_t(e)], " tokens, more than the capacity ",
                                p.capacity);
      }
    }
  }
  return p;
}

ExpertLayout compute_expert_layout(const DispatchConfig& config, int world_size, int rank,
                                   const CountsView& counts) {
  const int R = world_size, L = config.num_local_experts(R);
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
      const int64_t tokens = counts.count(s, first + j);
      const int64_t rows = config.layout.pad_to_capacity ? counts.capacity_of(s) : tokens;
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
