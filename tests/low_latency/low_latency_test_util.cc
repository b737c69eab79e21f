// The low-latency tests' problem, reference checks and fixture (low_latency_test_util.h).
#include "low_latency/low_latency_test_util.h"

#include <cmath>
#include <cstring>
#include <random>

namespace moed::low_latency_test {

using ::moed::testing::run_world;

namespace {

bf16 random_bf16(std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  return float_to_bf16(u(rng) * std::ldexp(1.0f, int(rng() % 9) - 4));
}

}  // namespace

StatusOr<Problem> make_problem(const Case& c) {
  Problem p;
  p.c = c;
  std::mt19937 rng(c.seed);
  ReferenceProblem rp;
  rp.num_experts = c.num_experts;
  rp.ep_size = c.ranks;
  rp.weighted_combine = true;
  rp.num_topk = c.num_topk;
  for (int s = 0; s < c.ranks; ++s) {
    // Token counts from 0 to max_tokens: rank 0 has none, the last rank is full.
    int64_t T = c.all_empty             ? 0
                : s == 0 && c.ranks > 1 ? 0
                : s == c.ranks - 1      ? c.max_tokens
                                        : int64_t(rng() % uint32_t(c.max_tokens + 1));
    Tensor x = Tensor::empty(DType::kBF16, T, c.hidden);
    for (int64_t t = 0; t < T; ++t) {
      for (int h = 0; h < c.hidden; ++h) x.row<bf16>(t)[h] = random_bf16(rng);
    }
    TopkRouting r;
    r.num_tokens = T;
    r.num_topk = c.num_topk;
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> experts(size_t(c.num_experts));
      for (int e = 0; e < c.num_experts; ++e) experts[size_t(e)] = e;
      std::shuffle(experts.begin(), experts.end(), rng);
      if (c.skewed) std::swap(experts[0], *std::find(experts.begin(), experts.end(), 0));
      for (int k = 0; k < c.num_topk; ++k) {
        // About one entry in six is -1 (no expert), as DeepEP allows.
        const bool drop = !c.skewed && rng() % 6 == 0;
        r.topk_idx.push_back(drop ? -1 : experts[size_t(k)]);
        r.topk_weights.push_back(float(rng() % 1000) / 256.0f);
      }
    }
    rp.routing.push_back(to_map(r, c.num_experts));
    p.x.push_back(std::move(x));
    p.topk.push_back(std::move(r));
  }
  for (int s = 0; s < c.ranks; ++s) rp.hidden.push_back(TokenRows{p.x[size_t(s)].view(), {}});
  MOED_ASSIGN_OR_RETURN(p.ref, reference_dispatch(rp));
  std::vector<TensorView> ys;
  for (int r = 0; r < c.ranks; ++r) {
    const int64_t rows = p.ref[size_t(r)].expert_input.x.rows();
    Tensor y = Tensor::empty(DType::kBF16, rows, c.hidden);
    for (int64_t i = 0; i < rows; ++i) {
      for (int h = 0; h < c.hidden; ++h) y.row<bf16>(i)[h] = random_bf16(rng);
    }
    ys.push_back(y.view());
    p.y.push_back(std::move(y));
  }
  MOED_ASSIGN_OR_RETURN(p.ref_out, reference_combine(rp, ys));
  return p;
}

Status check_dispatch(const Problem& p, int rank, const LowLatencyDispatchOutput& d, bool fp8,
                      bool round_scale) {
  const ReferenceRankDispatch& ref = p.ref[size_t(rank)];
  const int L = p.c.num_experts / p.c.ranks, H = p.c.hidden, S = H / kFp8BlockSize;
  if (d.num_local_experts != L || d.rows_per_expert != p.c.ranks * p.c.max_tokens) {
    return internal_error("rank ", rank, ": output shape L = ", d.num_local_experts);
  }
  if (d.recv.x.dtype != (fp8 ? DType::kFP8 : DType::kBF16)) return internal_error("recv dtype");
  int64_t off = 0;
  std::vector<fp8_e4m3> q(static_cast<size_t>(H));
  std::vector<float> scales(static_cast<size_t>(S));
  for (int j = 0; j < L; ++j) {
    const int64_t n = ref.tokens_per_expert[size_t(j)];
    if (d.recv_count[size_t(j)] != n) {
      return internal_error("rank ", rank, ": recv_count[", j, "] = ", d.recv_count[size_t(j)],
                            ", reference ", n);
    }
    int32_t begin = 0;
    for (int s = 0; s < p.c.ranks; ++s) {
      int32_t count = 0;
      for (int64_t i = 0; i < n; ++i) count += ref.row_src_rank[size_t(off + i)] == s;
      const LowLatencyRange got = d.layout_range[size_t(j) * p.c.ranks + s];
      if (got.begin != begin || got.count != count) {
        return internal_error("rank ", rank, ": layout_range[", j, "][", s, "] = (", got.begin,
                              ", ", got.count, "), expected (", begin, ", ", count, ")");
      }
      begin += count;
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = j * d.rows_per_expert + i;
      const int32_t s = ref.row_src_rank[size_t(off + i)], t = ref.row_src_token[size_t(off + i)];
      if (d.src_info[size_t(row)] != t) {
        return internal_error("rank ", rank, ": src_info of expert ", j, " row ", i, " = ",
                              d.src_info[size_t(row)], ", reference ", t);
      }
      if (std::memcmp(&d.recv_probs[size_t(row)], &ref.permuted_probs[size_t(off + i)], 4) != 0) {
        return internal_error("rank ", rank, ": recv_probs of expert ", j, " row ", i, " = ",
                              d.recv_probs[size_t(row)], ", reference ",
                              ref.permuted_probs[size_t(off + i)]);
      }
      if (!fp8) {
        if (std::memcmp(d.recv.x.row_ptr(row), ref.expert_input.x.row<bf16>(off + i),
                        size_t(H) * 2) != 0) {
          return internal_error("rank ", rank, ": bf16 row ", i, " of expert ", j, " differs");
        }
        continue;
      }
      quantize_fp8_row(std::span<const bf16>(p.x[size_t(s)].row<bf16>(t), size_t(H)), round_scale,
                       q, scales);
      if (std::memcmp(d.recv.x.row_ptr(row), q.data(), size_t(H)) != 0 ||
          std::memcmp(d.recv.scales.row_ptr(row), scales.data(), size_t(S) * 4) != 0) {
        return internal_error("rank ", rank, ": fp8 row ", i, " of expert ", j,
                              " differs from quantize_fp8_row of (", s, ", ", t, ")");
      }
    }
    off += n;
  }
  return ok_status();
}

Tensor expert_output(const Problem& p, int rank, const LowLatencyDispatchOutput& d) {
  const ReferenceRankDispatch& ref = p.ref[size_t(rank)];
  const int L = p.c.num_experts / p.c.ranks;
  Tensor y = Tensor::empty(DType::kBF16, L * d.rows_per_expert, p.c.hidden);
  for (int64_t i = 0; i < y.rows(); ++i) {
    for (int h = 0; h < p.c.hidden; ++h) y.row<bf16>(i)[h] = bf16{0x7fc0};
  }
  int64_t off = 0;
  for (int j = 0; j < L; ++j) {
    for (int64_t i = 0; i < ref.tokens_per_expert[size_t(j)]; ++i) {
      std::memcpy(y.row<bf16>(j * d.rows_per_expert + i), p.y[size_t(rank)].row<bf16>(off + i),
                  size_t(p.c.hidden) * 2);
    }
    off += ref.tokens_per_expert[size_t(j)];
  }
  return y;
}

Status check_combine(const Problem& p, int rank, const Tensor& out) {
  if (!bitwise_equal(out.view(), p.ref_out[size_t(rank)].view())) {
    return internal_error("rank ", rank, ": combine differs from the reference's weighted combine");
  }
  return ok_status();
}

Status run_with_buffer(Backend backend, const Case& c,
                       const std::function<Status(World&, LowLatencyBuffer&)>& body) {
  return run_world(backend, c.ranks, c.per_node, [&](World& w) -> Status {
    MOED_ASSIGN_OR_RETURN(auto buffer,
                          LowLatencyBuffer::create(w, c.max_tokens, c.hidden, c.num_experts));
    return body(w, *buffer);
  });
}

StatusOr<std::array<Problem, 2>> two_problems(const Case& c) {
  Case c2 = c;
  c2.seed += 1000;
  MOED_ASSIGN_OR_RETURN(Problem a, make_problem(c));
  MOED_ASSIGN_OR_RETURN(Problem b, make_problem(c2));
  return std::array<Problem, 2>{std::move(a), std::move(b)};
}

INSTANTIATE_TEST_SUITE_P(Worlds, LowLatencyTest, ::testing::ValuesIn(::moed::testing::backends()),
                         ::moed::testing::backend_param_name<::testing::TestParamInfo<Backend>>);

}  // namespace moed::low_latency_test
