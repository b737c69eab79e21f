// `moed bench permute` and `moed bench unpermute`: the single-rank token path on bf16, against
// its physical limit (bench/limit.h: the bytes it must move over STREAM bandwidths measured
// with the same threads in the same run, one operation before each iteration).
//
// permute is timed as make_permute_layout + permute_rows_into a preallocated buffer; bytes =
// output rows * H * 2; its model reads each token row once and the [T, E] routing map, and
// writes each output row with its source index and prob. unpermute is timed into a
// preallocated [T, H] output; bytes = input rows * H * 2; its model reads each row and its
// index once and writes each token row once. Every run checks its
// output against moed::reference_dispatch / reference_combine (ep_size = 1) bit for bit.
#include <random>
#include <string>

#include "bench/common.h"
#include "cli/registry.h"
#include "moed/permute.h"
#include "moed/reference.h"

namespace moed::bench::permute_bench {
namespace {

struct Args : ReportArgs {
  std::string shape = "mixtral";
  int threads = 0;
};

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
  // Uniform top-k routing (K distinct experts per token), random probs; fixed seeds.
  std::mt19937 topk_rng(1234), token_rng(1);
  const RoutingMap map = to_map(random_topk(s, 0.01f, topk_rng), s.num_experts);
  const Tensor x = random_tokens(s.num_tokens, s.hidden, 2.0f, token_rng);
  const TokenRows tokens{x.view(), {}};

  StatusOr<PermuteOutput> permuted = permute(tokens, map, {}, pool);
  if (!permuted.ok()) fail(what, permuted.status());
  const PermuteLayout& layout = permuted->layout;
  const int64_t N = layout.num_rows;
  const ReferenceProblem problem = reference_problem(s, map, x);

  Report report(a);
  Stream stream(pool);
  const double row = double(s.hidden) * 2;
  nlohmann::json r = shape_record(what, s, threads, a.iters, {{"dtype", "bf16"}, {"rows", N}});
  if (!unpermute_suite) {
    TokenTensor out;
    out.x = Tensor::empty(DType::kBF16, N, s.hidden);
    const size_t bytes = size_t(N) * s.hidden * 2;
    const StatusOr<Paired> times = paired_seconds(
        [&] {
          StatusOr<PermuteLayout> l = make_permute_layout(map, {}, pool);
          if (!l.ok()) fail(what, l.status());
          const Status st = permute_rows_into(tokens, *l, out.rows(), pool);
          if (!st.ok()) fail(what, st);
        },
        stream, a.iters);
    if (!times.ok()) fail(what, times.status());
    StatusOr<std::vector<ReferenceRankDispatch>> ref = reference_dispatch(problem);
    if (!ref.ok()) fail(what, ref.status());
    const ReferenceRankDispatch& d = (*ref)[0];
    const bool verified = bitwise_equal(out.x.view(), d.expert_input.x.view()) &&
                          layout.permuted_probs == d.permuted_probs &&
                          layout.tokens_per_expert == d.tokens_per_expert &&
                          std::vector<int32_t>(layout.sorted_indices) == d.row_src_token;
    r["bytes"] = bytes;
    TrafficModel m;
    m.read_bytes = double(s.num_tokens) * (row + double(s.num_experts));
    m.write_bytes = double(N) * (row + 8);
    add_limit(r, *times, m);
    r["verified"] = verified;
  } else {
    // Expert outputs: the permuted rows themselves (any bf16 rows would do).
    const Tensor& y = permuted->rows.x;
    Tensor out = Tensor::empty(DType::kBF16, s.num_tokens, s.hidden);
    const size_t bytes = size_t(N) * s.hidden * 2;
    const StatusOr<Paired> times = paired_seconds(
        [&] {
          const Status st = unpermute_into(y.view(), layout.sorted_indices, {}, out.view(), pool);
          if (!st.ok()) fail(what, st);
        },
        stream, a.iters);
    if (!times.ok()) fail(what, times.status());
    StatusOr<std::vector<Tensor>> ref = reference_combine(problem, {y.view()});
    if (!ref.ok()) fail(what, ref.status());
    r["bytes"] = bytes;
    TrafficModel m;
    m.read_bytes = double(N) * (row + 4);
    m.write_bytes = double(s.num_tokens) * row;
    add_limit(r, *times, m);
    r["weighted"] = false;
    r["verified"] = bitwise_equal(out.view(), (*ref)[0].view());
  }
  report.add(std::move(r));
  if (Status st = report.finish(); !st.ok()) fail(what, st);
}

void add_command(CLI::App& bench, const char* name, const char* help, bool unpermute_suite) {
  auto args = std::make_shared<Args>();
  CLI::App* c = bench.add_subcommand(name, help);
  c->add_option("--shape", args->shape, "tiny | mixtral | dsv3 | decode")->capture_default_str();
  c->add_option("--threads", args->threads, "worker threads (0 = all cores)")
      ->capture_default_str();
  add_report_options(*c, *args);
  c->callback([args, unpermute_suite] { run(*args, unpermute_suite); });
}

void setup(CLI::App& bench) {
  add_command(bench, "permute", "bf16 permute (layout + row copy) on one rank vs its limit",
              false);
  add_command(bench, "unpermute", "bf16 unpermute (fp32 sum per token) on one rank vs its limit",
              true);
}

}  // namespace

MOED_CLI_COMMAND("bench", setup);

}  // namespace moed::bench::permute_bench
