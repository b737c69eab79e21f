// `moed dispatch`: dispatch and combine tokens from .npy files with a chosen dispatcher, R
// ranks as threads in this process (the threads world), and write what every rank received.
//
//   moed dispatch --x x.npy --topk-idx routed/topk_idx.npy --topk-probs routed/topk_probs.npy
//                 --ranks 4 --experts 16 --dispatcher flex --ranks-per-node 2 --out dispatched/
//
// x is float32 or bf16 (uint16 bit patterns) [R*T, H]: rank r holds rows [r*T, (r+1)*T).
// DIR receives, per rank r, expert_input_rank{r}.npy [rows_r, H] (x's dtype, the canonical
// layout of spec §3) and permuted_probs_rank{r}.npy [rows_r]; tokens_per_expert.npy int64
// [R, L]; and combined.npy [R*T, H]: the unweighted combine of identity experts whose output
// row is its input row times its permuted prob (fp32 product rounded to x's dtype), which is
// x times the sum of the token's kept probs (Megatron's round-trip check).
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moed/dispatcher.h"
#include "moed/npy.h"
#include "moed/threads_world.h"
#include "tools/moed/registry.h"

namespace moed::cli {
namespace {

struct DispatchArgs {
  std::string x, topk_idx, topk_probs, out;
  int ranks = 0;
  int experts = 0;
  std::string dispatcher;
  int etp = 1;
  std::optional<double> capacity_factor;
  std::string drop_policy = "probs";
  bool pad_to_capacity = false;
  int expert_alignment = 1;
  int router_padding = 0;
  int ranks_per_node = 0;
  std::string world = "threads";
};

[[noreturn]] void fail(const Status& s) {
  std::fprintf(stderr, "moed dispatch: %s\n", s.message().c_str());
  throw CLI::RuntimeError(1);
}
template <typename T>
T value_or_fail(StatusOr<T> v) {
  if (!v.ok()) fail(v.status());
  return std::move(v).value();
}

// What one rank produced, kept until every rank is done and the files are written.
struct RankResult {
  Tensor expert_input;
  std::vector<float> permuted_probs;
  std::vector<int64_t> tokens_per_expert;
  Tensor combined;
  TrafficCounters dispatch_traffic;
};

// Identity experts: y[i] = x_row[i] * prob_i in fp32, rounded once to the rows' dtype.
Tensor identity_experts(const TensorView& rows, std::span<const float> probs) {
  Tensor y = Tensor::empty(rows.dtype, rows.rows, rows.cols);
  for (int64_t i = 0; i < rows.rows; ++i) {
    const float p = probs[size_t(i)];
    if (rows.dtype == DType::kF32) {
      const float* in = rows.row<float>(i);
      float* o = y.row<float>(i);
      for (int64_t h = 0; h < rows.cols; ++h) o[h] = in[h] * p;
    } else {
      const bf16* in = rows.row<bf16>(i);
      bf16* o = y.row<bf16>(i);
      for (int64_t h = 0; h < rows.cols; ++h) o[h] = float_to_bf16(bf16_to_float(in[h]) * p);
    }
  }
  return y;
}

Status run_rank(World& w, const DispatchConfig& config, const Tensor& x, const TopkRouting& all,
                int64_t tokens_per_rank, RankResult& out) {
  MOED_ASSIGN_OR_RETURN(std::unique_ptr<TokenDispatcher> d, TokenDispatcher::create(w, config));
  const int64_t first = int64_t(w.rank()) * tokens_per_rank;
  const size_t K = size_t(all.num_topk);
  TopkRouting mine;
  mine.num_tokens = tokens_per_rank;
  mine.num_topk = all.num_topk;
  mine.topk_idx.assign(all.topk_idx.begin() + first * K,
                       all.topk_idx.begin() + (first + tokens_per_rank) * K);
  mine.topk_weights.assign(all.topk_weights.begin() + first * K,
                           all.topk_weights.begin() + (first + tokens_per_rank) * K);
  const TokenRows hidden{x.view().slice_rows(first, tokens_per_rank), {}};

  w.reset_counters();
  DispatchInput input;
  input.hidden = hidden;
  input.topk = &mine;
  MOED_ASSIGN_OR_RETURN(DispatchOutput dispatched, d->dispatch(input));
  out.dispatch_traffic = w.counters();
  out.expert_input = Tensor::copy_of(dispatched.expert_input.x);
  out.permuted_probs.assign(dispatched.permuted_probs.begin(), dispatched.permuted_probs.end());
  out.tokens_per_expert.assign(dispatched.tokens_per_expert.begin(),
                               dispatched.tokens_per_expert.end());
  const Tensor y = identity_experts(out.expert_input.view(), out.permuted_probs);
  CombineInput combine_input;
  combine_input.expert_output = TokenRows{y.view(), {}};
  combine_input.handle = dispatched.handle;
  MOED_ASSIGN_OR_RETURN(CombineOutput combined, d->combine(combine_input));
  out.combined = std::move(combined.hidden);
  return ok_status();
}

void write(const std::filesystem::path& dir, const std::string& name, NpyDType t,
           std::initializer_list<int64_t> shape, const void* data) {
  if (Status s = write_npy((dir / name).string(), t, shape, data); !s.ok()) fail(s);
}

void run(const DispatchArgs& a) {
  if (a.world != "threads") {
    fail(unimplemented("--world ", a.world,
                       ": the CLI runs the ranks as threads of one process "
                       "(--world threads); MPI runs go through the library's MPI world"));
  }
  const DispatcherKind kind = value_or_fail(parse_dispatcher_kind(a.dispatcher));
  if (kind == DispatcherKind::kLowLatency) {
    fail(invalid_argument("--dispatcher ", a.dispatcher,
                          ": moed dispatch takes allgather, alltoall or flex (low-latency has its "
                          "own layout)"));
  }
  if (a.ranks < 1) fail(invalid_argument("--ranks = ", a.ranks, " must be >= 1"));
  const int R = a.ranks;

  DispatchConfig config;
  config.kind = kind;
  config.num_experts = a.experts;
  config.etp_size = a.etp;
  config.layout.capacity_factor = a.capacity_factor;
  config.layout.drop_policy = value_or_fail(parse_drop_policy(a.drop_policy));
  config.layout.pad_to_capacity = a.pad_to_capacity;
  config.layout.expert_alignment = a.expert_alignment;
  config.layout.router_padding_multiple = a.router_padding;
  if (Status s = config.validate(R); !s.ok()) fail(s);
  const int G = a.ranks_per_node == 0 ? R : a.ranks_per_node;
  if (G < 1 || R % G != 0) {
    fail(invalid_argument("--ranks-per-node = ", G, " does not divide --ranks = ", R));
  }

  // Inputs, with their shapes checked against each other.
  const NpyArray xf = value_or_fail(read_npy(a.x));
  if (xf.shape.size() != 2) {
    fail(invalid_argument(a.x, ": shape ", xf.shape_string(), "; x is [ranks * tokens, hidden]"));
  }
  if (xf.dtype != NpyDType::kF32 && xf.dtype != NpyDType::kU16) {
    fail(invalid_argument(a.x, ": dtype '", npy_descr(xf.dtype),
                          "'; x is float32 (<f4) or bf16 bit patterns (<u2)"));
  }
  const int64_t rows = xf.shape[0], H = xf.shape[1];
  if (rows % R != 0) {
    fail(invalid_argument(a.x, ": ", rows, " rows do not split evenly over --ranks = ", R));
  }
  const NpyArray idx_f = value_or_fail(read_npy(a.topk_idx));
  const NpyArray prob_f = value_or_fail(read_npy(a.topk_probs));
  if (idx_f.shape.size() != 2 || idx_f.shape[0] != rows || idx_f.shape[1] < 1) {
    fail(invalid_argument(a.topk_idx, ": shape ", idx_f.shape_string(), " but ", a.x, " has ", rows,
                          " rows; topk_idx is [", rows, ", K]"));
  }
  if (prob_f.shape != idx_f.shape) {
    fail(invalid_argument(a.topk_probs, ": shape ", prob_f.shape_string(), " differs from ",
                          a.topk_idx, "'s ", idx_f.shape_string()));
  }
  TopkRouting all;
  all.num_tokens = rows;
  all.num_topk = int(idx_f.shape[1]);
  all.topk_idx = value_or_fail(npy_to_i32(idx_f));
  all.topk_weights = value_or_fail(npy_to_f32(prob_f));
  if (Status s = validate(all, a.experts); !s.ok()) {
    const bool probs = s.message().rfind("topk_weights", 0) == 0;
    fail(s.with_context(probs ? a.topk_probs : a.topk_idx));
  }
  Tensor x = Tensor::empty(xf.dtype == NpyDType::kF32 ? DType::kF32 : DType::kBF16, rows, H);
  if (!xf.data.empty()) std::memcpy(x.data(), xf.data.data(), xf.data.size());

  WorldOptions opts;
  opts.ranks_per_node = G;
  std::vector<RankResult> results(static_cast<size_t>(R));
  const int64_t T = rows / R;
  const Status s = run_threads(
      R, opts, [&](World& w) { return run_rank(w, config, x, all, T, results[size_t(w.rank())]); });
  if (!s.ok()) fail(s);

  std::error_code ec;
  std::filesystem::create_directories(a.out, ec);
  if (ec) fail(invalid_argument(a.out, ": cannot create the directory: ", ec.message()));
  const std::filesystem::path dir(a.out);
  const NpyDType payload = x.dtype() == DType::kF32 ? NpyDType::kF32 : NpyDType::kU16;
  const int64_t L = config.num_local_experts(R);
  std::vector<int64_t> tokens_per_expert;
  Tensor combined = Tensor::empty(x.dtype(), rows, H);
  std::printf(
      "moed dispatch: %s, %d ranks (%d node(s) x %d, etp %d), %lld tokens per rank, "
      "hidden %lld, %s, top-%d, %d experts -> %s\n",
      dispatcher_kind_name(kind), R, R / G, G, a.etp, (long long)T, (long long)H,
      dtype_name(x.dtype()), all.num_topk, a.experts, a.out.c_str());
  std::printf("  rank      rows   shared bytes  network bytes  tokens per expert\n");
  for (int r = 0; r < R; ++r) {
    const RankResult& res = results[size_t(r)];
    const int64_t n = res.expert_input.rows();
    write(dir, "expert_input_rank" + std::to_string(r) + ".npy", payload, {n, H},
          res.expert_input.data());
    write(dir, "permuted_probs_rank" + std::to_string(r) + ".npy", NpyDType::kF32, {n},
          res.permuted_probs.data());
    tokens_per_expert.insert(tokens_per_expert.end(), res.tokens_per_expert.begin(),
                             res.tokens_per_expert.end());
    if (T > 0)
      std::memcpy(combined.row<char>(int64_t(r) * T), res.combined.data(), res.combined.bytes());
    std::string counts;
    for (int64_t c : res.tokens_per_expert) counts += " " + std::to_string(c);
    std::printf("  %4d %9lld %14llu %14llu %s\n", r, (long long)n,
                (unsigned long long)res.dispatch_traffic.shared_bytes,
                (unsigned long long)res.dispatch_traffic.network_bytes, counts.c_str());
  }
  write(dir, "tokens_per_expert.npy", NpyDType::kI64, {R, L}, tokens_per_expert.data());
  write(dir, "combined.npy", payload, {rows, H}, combined.data());
  std::printf(
      "  wrote expert_input_rank{0..%d}.npy, permuted_probs_rank{0..%d}.npy, "
      "tokens_per_expert.npy [%d, %lld], combined.npy [%lld, %lld]\n",
      R - 1, R - 1, R, (long long)L, (long long)rows, (long long)H);
}

void setup(CLI::App& app) {
  auto a = std::make_shared<DispatchArgs>();
  CLI::App* c = app.add_subcommand(
      "dispatch",
      "dispatch + combine tokens from .npy files on R thread ranks; write each rank's "
      "expert input and the combined output");
  c->add_option("--x", a->x, "tokens, float32 or bf16 (uint16) [R*T, H] .npy")->required();
  c->add_option("--topk-idx", a->topk_idx, "int32/int64 [R*T, K] .npy, -1 = none")->required();
  c->add_option("--topk-probs", a->topk_probs, "float32 [R*T, K] .npy")->required();
  c->add_option("--ranks", a->ranks, "ranks R (tokens split evenly)")->required();
  c->add_option("--experts", a->experts, "experts E")->required();
  c->add_option("--dispatcher", a->dispatcher, "allgather | alltoall | flex")->required();
  c->add_option("--out", a->out, "output directory")->required();
  c->add_option("--etp", a->etp, "expert tensor parallel size P")->capture_default_str();
  c->add_option("--capacity-factor", a->capacity_factor, "drop tokens above the capacity");
  c->add_option("--drop-policy", a->drop_policy, "probs | position")->capture_default_str();
  c->add_flag("--pad-to-capacity", a->pad_to_capacity, "pad every chunk to the capacity");
  c->add_option("--expert-alignment", a->expert_alignment, "pad each segment to a multiple")
      ->capture_default_str();
  c->add_option("--router-padding", a->router_padding,
                "pad each expert's count to a multiple (0 = off)");
  c->add_option("--ranks-per-node", a->ranks_per_node, "G ranks per node (0 = all in one node)");
  c->add_option("--world", a->world, "threads (the only world the CLI runs)")
      ->capture_default_str();
  c->callback([a] { run(*a); });
}

}  // namespace

MOED_CLI_COMMAND("", setup);

}  // namespace moed::cli
