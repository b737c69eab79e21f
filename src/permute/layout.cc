// make_permute_layout: where every routed (token, expert) pair of an effective routing goes.
//
// Two passes over the sparse routing (a map is converted once), each split into contiguous token pieces (DeepEP's channels): the
// first counts each piece's tokens per expert, a short serial step turns the counts into
// each piece's first row inside each (expert, source) chunk, and the second pass writes
// sorted_indices / permuted_probs. A piece never straddles a source boundary, so chunk order
// (source ascending, token ascending) falls out of piece order, for any thread count.
#include <algorithm>
#include <climits>

#include "moed/permute.h"

namespace moed {

namespace {

struct Piece {
  int source;
  int64_t begin;
  int64_t end;
};

Status check_map(const RoutingMap& routing) {
  const int64_t T = routing.num_tokens;
  const int E = routing.num_experts;
  if (T < 0) return invalid_argument("routing num_tokens = ", T, " is negative");
  if (E <= 0) return invalid_argument("routing num_experts = ", E, " must be positive");
  const size_t cells = size_t(T) * size_t(E);
  if (routing.routing_map.size() != cells) {
    return invalid_argument("routing_map has ", routing.routing_map.size(), " entries; [", T, ", ",
                            E, "] needs ", cells);
  }
  if (routing.probs.size() != cells) {
    return invalid_argument("routing probs has ", routing.probs.size(), " entries; [", T, ", ", E,
                            "] needs ", cells);
  }
  return ok_status();
}

Status check_options(int64_t T, int E, const PermuteOptions& o, int expert_end,
                     int num_sources) {
  if (T > INT32_MAX) {
    return invalid_argument("routing num_tokens = ", T, " does not fit the int32 sorted_indices");
  }
  if (o.expert_begin < 0 || o.expert_begin > expert_end || expert_end > E) {
    return invalid_argument("expert range [", o.expert_begin, ", ", o.expert_end,
                            ") is not inside [0, ", E, "]");
  }
  if (o.capacity && *o.capacity < 0) {
    return invalid_argument("capacity = ", *o.capacity, " must be >= 0");
  }
  if (o.expert_alignment < 1) {
    return invalid_argument("expert_alignment = ", o.expert_alignment, " must be >= 1");
  }
  if (!o.source_offsets.empty()) {
    const auto& so = o.source_offsets;
    if (so.size() < 2) {
      return invalid_argument("source_offsets has ", so.size(),
                              " entries; it needs num_sources + 1 >= 2");
    }
    if (so.front() != 0 || so.back() != T) {
      return invalid_argument("source_offsets must run from 0 to num_tokens = ", T, "; got ",
                              so.front(), " .. ", so.back());
    }
    for (size_t s = 1; s < so.size(); ++s) {
      if (so[s] < so[s - 1]) {
        return invalid_argument("source_offsets[", s, "] = ", so[s], " < source_offsets[", s - 1,
                                "] = ", so[s - 1]);
      }
    }
  }
  if (!o.source_capacities.empty()) {
    if (o.capacity) {
      return invalid_argument("capacity and source_capacities are both set; give one");
    }
    if (int64_t(o.source_capacities.size()) != num_sources) {
      return invalid_argument("source_capacities has ", o.source_capacities.size(), " entries for ",
                              num_sources, " sources");
    }
    for (size_t s = 0; s < o.source_capacities.size(); ++s) {
      if (o.source_capacities[s] < 0) {
        return invalid_argument("source_capacities[", s, "] = ", o.source_capacities[s],
                                " must be >= 0");
      }
    }
  }
  return ok_status();
}

}  // namespace

int PermuteLayout::expert_of_row(int64_t row) const {
  if (row < 0 || row >= num_rows) return -1;
  // First segment whose end is past `row` (empty segments are skipped by upper_bound).
  const auto it = std::upper_bound(expert_offsets.begin(), expert_offsets.end(), row);
  return expert_begin + int(it - expert_offsets.begin()) - 1;
}

namespace {

StatusOr<PermuteLayout> layout_of(const SparseRouting& routing, const PermuteOptions& options,
                                  ThreadPool& pool) {
  const int E = routing.num_experts;
  const int expert_end = options.expert_end < 0 ? E : options.expert_end;
  const int num_sources =
      options.source_offsets.empty() ? 1 : int(options.source_offsets.size()) - 1;
  const int64_t T = routing.num_tokens();
  MOED_RETURN_IF_ERROR(check_options(T, E, options, expert_end, num_sources));

  const int eb = options.expert_begin;
  const int n = expert_end - eb;
  auto source_begin = [&](int s) -> int64_t {
    return options.source_offsets.empty() ? (s == 0 ? 0 : T) : options.source_offsets[size_t(s)];
  };
  auto capacity_of = [&](int s) -> std::optional<int64_t> {
    if (!options.source_capacities.empty()) return options.source_capacities[size_t(s)];
    return options.capacity;
  };

  // Pieces: the pool's token ranges, cut again at source boundaries. Sources with no tokens
  // get no piece; their chunks are empty (or all padding).
  const int workers = int(std::clamp<int64_t>(T, 1, pool.num_threads()));
  std::vector<Piece> pieces;
  for (int w = 0; w < workers; ++w) {
    int64_t b, e;
    ThreadPool::split(T, workers, w, &b, &e);
    for (int s = 0; s < num_sources && b < e; ++s) {
      const int64_t sb = std::max(b, source_begin(s)), se = std::min(e, source_begin(s + 1));
      if (sb < se) pieces.push_back(Piece{s, sb, se});
    }
  }
  const int64_t num_pieces = int64_t(pieces.size());

  // Pass 1: counts[piece][j].
  std::vector<int64_t> cursor(size_t(num_pieces) * n, 0);
  pool.parallel_for(num_pieces, [&](int64_t pb, int64_t pe, int) {
    for (int64_t p = pb; p < pe; ++p) {
      int64_t* c = cursor.data() + size_t(p) * n;
      for (int64_t i = routing.begin[size_t(pieces[size_t(p)].begin)];
           i < routing.begin[size_t(pieces[size_t(p)].end)]; ++i) {
        const int j = routing.expert[size_t(i)] - eb;
        if (j >= 0 && j < n) ++c[j];
      }
    }
  });

  // Serial: chunk and segment offsets; counts become each piece's first row.
  PermuteLayout l;
  l.num_tokens = T;
  l.num_experts = E;
  l.expert_begin = eb;
  l.expert_end = expert_end;
  l.tokens_per_expert.assign(size_t(n), 0);
  l.tokens_per_expert_unpadded.assign(size_t(n), 0);
  l.expert_offsets.assign(size_t(n) + 1, 0);
  const int64_t align = options.expert_alignment;
  int64_t row = 0;
  for (int j = 0; j < n; ++j) {
    l.expert_offsets[size_t(j)] = row;
    int64_t p = 0;
    for (int s = 0; s < num_sources; ++s) {
      const int64_t chunk_begin = row;
      for (; p < num_pieces && pieces[size_t(p)].source == s; ++p) {
        int64_t& c = cursor[size_t(p) * n + j];
        const int64_t count = c;
        c = row;
        row += count;
      }
      const int64_t tokens = row - chunk_begin;
      l.tokens_per_expert_unpadded[size_t(j)] += tokens;
      if (const std::optional<int64_t> cap = capacity_of(s)) {
        if (tokens > *cap) {
          return invalid_argument("expert ", eb + j, " has ", tokens, " tokens",
                                  num_sources > 1 ? str_cat(" from source ", s) : std::string(),
                                  ", more than the capacity ", *cap,
                                  " (drop them first: apply_layout_options)");
        }
        row = chunk_begin + *cap;
      }
    }
    const int64_t len = row - l.expert_offsets[size_t(j)];
    row = l.expert_offsets[size_t(j)] + (len + align - 1) / align * align;
    l.tokens_per_expert[size_t(j)] = row - l.expert_offsets[size_t(j)];
  }
  l.expert_offsets[size_t(n)] = row;
  l.num_rows = row;

  // Pass 2: each piece writes its tokens' rows; the rest stay padding.
  l.sorted_indices.assign(size_t(row), -1);
  l.permuted_probs.assign(size_t(row), 0.0f);
  pool.parallel_for(num_pieces, [&](int64_t pb, int64_t pe, int) {
    for (int64_t p = pb; p < pe; ++p) {
      int64_t* c = cursor.data() + size_t(p) * n;
      for (int64_t t = pieces[size_t(p)].begin; t < pieces[size_t(p)].end; ++t) {
        for (int64_t i = routing.begin[size_t(t)]; i < routing.begin[size_t(t) + 1]; ++i) {
          const int j = routing.expert[size_t(i)] - eb;
          if (j < 0 || j >= n) continue;
          const int64_t r = c[j]++;
          l.sorted_indices[size_t(r)] = int32_t(t);
          l.permuted_probs[size_t(r)] = routing.prob[size_t(i)];
        }
      }
    }
  });
  return l;
}

}  // namespace

StatusOr<PermuteLayout> make_permute_layout(const RoutingMap& routing,
                                            const PermuteOptions& options, ThreadPool& pool) {
  MOED_RETURN_IF_ERROR(check_map(routing));
  return layout_of(to_sparse(routing), options, pool);
}

StatusOr<PermuteLayout> make_permute_layout(const SparseRouting& routing,
                                            const PermuteOptions& options, ThreadPool& pool) {
  MOED_RETURN_IF_ERROR(validate(routing, routing.num_experts));
  return layout_of(routing, options, pool);
}

StatusOr<std::vector<float>> row_values_to_map(const PermuteLayout& layout,
                                               std::span<const float> row_values) {
  if (int64_t(row_values.size()) != layout.num_rows) {
    return invalid_argument("row values have ", row_values.size(), " entries; the layout has ",
                            layout.num_rows, " rows");
  }
  const int E = layout.num_experts;
  std::vector<float> map(size_t(layout.num_tokens) * E, 0.0f);
  for (int j = 0; j < layout.num_segments(); ++j) {
    const int e = layout.expert_begin + j;
    for (int64_t r = layout.expert_offsets[size_t(j)]; r < layout.expert_offsets[size_t(j) + 1];
         ++r) {
      const int32_t t = layout.sorted_indices[size_t(r)];
      if (t >= 0) map[size_t(t) * E + e] = 0.0f + row_values[size_t(r)];
    }
  }
  return map;
}

}  // namespace moed
