// `moed bench permute` and `moed bench unpermute`: the single-rank token path on bf16, beside
// a plain copy of the same bytes with the same threads in the same run (spec §7).
//
// permute is timed as make_permute_layout + permute_rows_into a preallocated buffer (the copy
// bound copies into a preallocated buffer too); bytes = output rows * H * 2. unpermute is
// timed into a preallocated [T, H] output; bytes = input rows * H * 2. Every run checks its
// output against moed::reference_dispatch / reference_combine (ep_size = 1) bit for bit.
#include <cstdio>
#include <random>
#include <string>

#include "bench/common.h"
#include "moed/permute.h"
#include "moed/reference.h"
#include "tools/moed/registry.h"

namespace moed::bench {
namespace {

struct Args {
  std::string shape = "mixtral";
  int threads = 0;
  int iters = 10;
  bool json = false;
};

[[noreturn]] void fail(const std::string& what, const Status& s) {
  std::fprintf(stderr, "moed bench %s: %s\n", what.c_str(), s.to_string().c_str());
  throw CLI::RuntimeError(1);
}

// Uniform top-k routing (K distinct experts per token), random probs; fixed seed.
RoutingMap make_routing(const Shape& s) {
  RoutingMap m = RoutingMap::empty(s.num_tokens, s.num_experts);
  m.num_topk = s.num_topk;
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> prob(0.01f, 1.0f);
  std::vector<int> experts(static_cast<size_t>(s.num_experts));
  for (int64_t t = 0; t < s.num_tokens; ++t) {
    for (int e = 0; e < s.num_experts; ++e) experts[size_t(e)] = e;
    for (int k = 0; k < s.num_topk; ++k) {
      std::swap(experts[size_t(k)], experts[size_t(k) + rng() % size_t(s.num_experts - k)]);
      const size_t cell = size_t(t) * s.num_experts + experts[size_t(k)];
      m.routing_map[cell] = 1;
      m.probs[cell] = prob(rng);
    }
  }
  return m;
}

Tensor make_tokens(int64_t rows, int hidden, uint32_t seed) {
  Tensor x = Tensor::empty(DType::kBF16, rows, hidden);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int h = 0; h < hidden; ++h) x.row<bf16>(r)[h] = float_to_bf16(u(rng));
  }
  return x;
}

ReferenceProblem reference_problem(const Shape& s, const RoutingMap& m, const Tensor& x) {
  ReferenceProblem p;
  p.num_experts = s.num_experts;
  p.ep_size = 1;
  p.num_topk = s.num_topk;
  p.routing = {m};
  p.hidden = {TokenRows{x.view(), {}}};
  return p;
}

void run(const Args& a, bool unpermute_suite) {
  const std::string what = unpermute_suite ? "unpermute" : "permute";
  StatusOr<Shape> shape = find_shape(a.shape);
  if (!shape.ok()) fail(what, shape.status());
  const Shape& s = *shape;
  ThreadPool pool(a.threads);
  const int threads = pool.num_threads();
  const RoutingMap map = make_routing(s);
  const Tensor x = make_tokens(s.num_tokens, s.hidden, 1);
  const TokenRows tokens{x.view(), {}};

  StatusOr<PermuteOutput> permuted = permute(tokens, map, {}, pool);
  if (!permuted.ok()) fail(what, permuted.status());
  const PermuteLayout& layout = permuted->layout;
  const int64_t N = layout.num_rows;
  const ReferenceProblem problem = reference_problem(s, map, x);

  Report report(a.json);
  nlohmann::json r = {{"suite", what}, {"shape", s.name}, {"dtype", "bf16"},
                      {"threads", threads}, {"num_tokens", s.num_tokens}, {"hidden", s.hidden},
                      {"num_experts", s.num_experts}, {"num_topk", s.num_topk},
                      {"rows", N}, {"iters", a.iters}};
  if (!unpermute_suite) {
    TokenTensor out;
    out.x = Tensor::empty(DType::kBF16, N, s.hidden);
    const double seconds = median_seconds(
        [&] {
          StatusOr<PermuteLayout> l = make_permute_layout(map, {}, pool);
          if (!l.ok()) fail(what, l.status());
          const Status st = permute_rows_into(tokens, *l, out.rows(), pool);
          if (!st.ok()) fail(what, st);
        },
        a.iters);
    StatusOr<std::vector<ReferenceRankDispatch>> ref = reference_dispatch(problem);
    if (!ref.ok()) fail(what, ref.status());
    const ReferenceRankDispatch& d = (*ref)[0];
    const bool verified = bitwise_equal(out.x.view(), d.expert_input.x.view()) &&
                          layout.permuted_probs == d.permuted_probs &&
                          layout.tokens_per_expert == d.tokens_per_expert &&
                          std::vector<int32_t>(layout.sorted_indices) == d.row_src_token;
    const size_t bytes = size_t(N) * s.hidden * 2;
    r["bytes"] = bytes;
    r["seconds"] = seconds;
    r["copy_gbps"] = measure_copy_gbps(bytes, threads, a.iters);
    r["verified"] = verified;
  } else {
    // Expert outputs: the permuted rows themselves (any bf16 rows would do).
    const Tensor& y = permuted->rows.x;
    Tensor out = Tensor::empty(DType::kBF16, s.num_tokens, s.hidden);
    const double seconds = median_seconds(
        [&] {
          const Status st = unpermute_into(y.view(), layout.sorted_indices, {}, out.view(), pool);
          if (!st.ok()) fail(what, st);
        },
        a.iters);
    StatusOr<std::vector<Tensor>> ref = reference_combine(problem, {y.view()});
    if (!ref.ok()) fail(what, ref.status());
    const size_t bytes = size_t(N) * s.hidden * 2;
    r["bytes"] = bytes;
    r["seconds"] = seconds;
    r["copy_gbps"] = measure_copy_gbps(bytes, threads, a.iters);
    r["weighted"] = false;
    r["verified"] = bitwise_equal(out.view(), (*ref)[0].view());
  }
  report.add(std::move(r));
  report.finish();
}

void add_command(CLI::App& bench, const char* name, const char* help, bool unpermute_suite) {
  auto args = std::make_shared<Args>();
  CLI::App* c = bench.add_subcommand(name, help);
  c->add_option("--shape", args->shape, "tiny | mixtral | dsv3 | decode")->capture_default_str();
  c->add_option("--threads", args->threads, "worker threads (0 = all cores)")
      ->capture_default_str();
  c->add_option("--iters", args->iters, "timed iterations (median reported)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  c->add_flag("--json", args->json, "print the records as a JSON array");
  c->callback([args, unpermute_suite] { run(*args, unpermute_suite); });
}

void setup(CLI::App& bench) {
  add_command(bench, "permute", "bf16 permute (layout + row copy) on one rank vs memcpy", false);
  add_command(bench, "unpermute", "bf16 unpermute (fp32 sum per token) on one rank vs memcpy",
              true);
}

}  // namespace

MOED_CLI_COMMAND("bench", setup);

}  // namespace moed::bench
