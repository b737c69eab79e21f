// `moed dispatch`: dispatch and combine tokens from .npy files with a chosen dispatcher and
// write what every rank received. R ranks run as threads of this process (the threads world)
// or, under mpirun, as one MPI process each (--world mpi, the default there); the files are the
// same either way.
//
//   moed dispatch --x x.npy --topk-idx routed/topk_idx.npy --topk-probs routed/topk_probs.npy
//                 --ranks 4 --experts 16 --dispatcher flex --ranks-per-node 2 --out dispatched/
//   mpirun -np 4 moed dispatch --world mpi --x x.npy ... --experts 16 --dispatcher flex --out d/
//
// x is float32 or bf16 (uint16 bit patterns) [R*T, H]: rank r holds rows [r*T, (r+1)*T).
// Or the routing (and rows) of one router call from Megatron-Core's traces (moed/megatron_trace.h):
//
//   moed dispatch --trace megatron_traces/ --step 0 --layer 3 --experts 64 --dispatcher flex --out d/
//
// takes the ranks from the trace, the rows from its hidden-state sidecar (or --x), and, since a
// trace records no probs, prob 1 for every routed slot (so combined = x times the number of
// experts each token routed to).
// DIR receives, per rank r, expert_input_rank{r}.npy [rows_r, H] (x's dtype, the canonical
// layout of design.md §3.1) and permuted_probs_rank{r}.npy [rows_r]; tokens_per_expert.npy int64
// [R, L]; and combined.npy [R*T, H]: the unweighted combine of identity experts whose output
// row is its input row times its permuted prob (fp32 product rounded to x's dtype), which is
// x times the sum of the token's kept probs (Megatron's round-trip check). Each rank writes its
// own files; rank 0 gathers and writes the last two. Under MPI every process reads the inputs
// and creates DIR, so on several hosts DIR is per host unless it is a shared file system.
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cli/registry.h"
#include "cli/world_choice.h"
#include "moed/dispatcher.h"
#include "moed/megatron_trace.h"
#include "moed/npy.h"
#include "moed/world.h"
#include "tools/moed/trace_input.h"

namespace moed::cli::dispatch_command {
namespace {

struct DispatchArgs {
  std::string x, topk_idx, topk_probs, out;
  std::string trace;  // a routing trace instead of --topk-idx / --topk-probs
  TraceArgs trace_args;
  std::optional<int> ranks;  // required for threads; under MPI the job's size
  int experts = 0;
  std::string dispatcher;
  int etp = 1;
  std::optional<double> capacity_factor;
  std::string drop_policy = "probs";
  bool pad_to_capacity = false;
  int expert_alignment = 1;
  int router_padding = 0;
  int ranks_per_node = 0;
  std::string world;  // "" = mpi under mpirun, else threads
};

[[noreturn]] void fail(const Status& s) { fail_command("moed dispatch", s.message()); }
template <typename T>
T value_or_fail(StatusOr<T> v) {
  if (!v.ok()) fail(v.status());
  return std::move(v).value();
}

// What one rank produced.
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

Status run_steps(World& w, TokenDispatcher* d, const Tensor& x, const TopkRouting& all,
                 int64_t tokens_per_rank, RankResult& out) {
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
  input.topk = TopkView::of(mine);
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

Status run_rank(World& w, const DispatchConfig& config, const Tensor& x, const TopkRouting& all,
                int64_t tokens_per_rank, RankResult& out) {
  MOED_ASSIGN_OR_RETURN(std::unique_ptr<TokenDispatcher> d, TokenDispatcher::create(w, config));
  Status s = run_steps(w, d.get(), x, all, tokens_per_rank, out);
  // NOTE: announced before d is torn down, so the other ranks hear kAborted at once.
  if (!s.ok()) w.abort(s);
  return s;
}

// The inputs, checked against each other and the configuration.
struct Problem {
  DispatchConfig config;
  int ranks_per_node = 0;  // 0 = the MPI world's default (the ranks of a host)
  Tensor x;
  TopkRouting all;
  int64_t tokens_per_rank = 0;
};

// x, topk_idx and topk_probs from .npy files, with their shapes checked against each other.
Status load_npy(const DispatchArgs& a, int R, Problem& p) {
  for (const auto& [flag, value] : {std::pair{"--x", &a.x}, std::pair{"--topk-idx", &a.topk_idx},
                                    std::pair{"--topk-probs", &a.topk_probs}}) {
    if (value->empty()) return invalid_argument(flag, " is required (or --trace)");
  }
  MOED_ASSIGN_OR_RETURN(const NpyArray xf, read_npy(a.x));
  if (xf.shape.size() != 2) {
    return invalid_argument(a.x, ": shape ", xf.shape_string(), "; x is [ranks * tokens, hidden]");
  }
  if (xf.dtype != NpyDType::kF32 && xf.dtype != NpyDType::kU16) {
    return invalid_argument(a.x, ": dtype '", npy_descr(xf.dtype),
                            "'; x is float32 (<f4) or bf16 bit patterns (<u2)");
  }
  const int64_t rows = xf.shape[0], H = xf.shape[1];
  if (rows % R != 0) {
    return invalid_argument(a.x, ": ", rows, " rows do not split evenly over --ranks = ", R);
  }
  MOED_ASSIGN_OR_RETURN(const NpyArray idx_f, read_npy(a.topk_idx));
  MOED_ASSIGN_OR_RETURN(const NpyArray prob_f, read_npy(a.topk_probs));
  if (idx_f.shape.size() != 2 || idx_f.shape[0] != rows || idx_f.shape[1] < 1) {
    return invalid_argument(a.topk_idx, ": shape ", idx_f.shape_string(), " but ", a.x, " has ",
                            rows, " rows; topk_idx is [", rows, ", K]");
  }
  if (prob_f.shape != idx_f.shape) {
    return invalid_argument(a.topk_probs, ": shape ", prob_f.shape_string(), " differs from ",
                            a.topk_idx, "'s ", idx_f.shape_string());
  }
  TopkRouting& all = p.all;
  all.num_tokens = rows;
  all.num_topk = int(idx_f.shape[1]);
  MOED_ASSIGN_OR_RETURN(all.topk_idx, npy_to_i32(idx_f));
  MOED_ASSIGN_OR_RETURN(all.topk_weights, npy_to_f32(prob_f));
  p.x = Tensor::empty(xf.dtype == NpyDType::kF32 ? DType::kF32 : DType::kBF16, rows, H);
  if (!xf.data.empty()) std::memcpy(p.x.data(), xf.data.data(), xf.data.size());
  return ok_status();
}

// One router call of a trace: its routing, prob 1 per routed slot, and its rows from the
// hidden-state sidecar (a Megatron trace) or --x.
Status load_trace(const DispatchArgs& a, int R, Problem& p) {
  if (!a.topk_idx.empty() || !a.topk_probs.empty()) {
    return invalid_argument("--trace gives the routing; --topk-idx and --topk-probs are for .npy "
                            "routing without it");
  }
  MOED_ASSIGN_OR_RETURN(const LoadedTrace t, a.trace_args.load(a.trace, a.experts, a.x.empty()));
  const RoutingTrace& r = t.routing;
  if (r.num_steps != 1) {
    std::string which;
    for (size_t i = 0; t.megatron && i < t.megatron->calls.size() && i < 6; ++i) {
      which += (i ? ", " : "") + t.megatron->calls[i].label();
    }
    return invalid_argument(a.trace, ": ", r.num_steps, " router calls selected (", which,
                            r.num_steps > 6 ? ", ..." : "",
                            "); moed dispatch moves one: choose it with --layer (and --microbatch)");
  }
  if (r.num_tokens % R != 0) {
    return invalid_argument(a.trace, ": ", r.num_tokens, " tokens do not split evenly over --ranks = ",
                            R);
  }
  TopkRouting& all = p.all;
  all.num_tokens = r.num_tokens;
  all.num_topk = r.num_topk;
  all.topk_idx = r.topk_idx;
  all.topk_weights.resize(r.topk_idx.size());
  for (size_t i = 0; i < r.topk_idx.size(); ++i) all.topk_weights[i] = r.topk_idx[i] >= 0 ? 1.0f : 0.0f;
  if (!a.x.empty()) {
    MOED_ASSIGN_OR_RETURN(const NpyArray xf, read_npy(a.x));
    if (xf.shape.size() != 2 || xf.shape[0] != r.num_tokens ||
        (xf.dtype != NpyDType::kF32 && xf.dtype != NpyDType::kU16)) {
      return invalid_argument(a.x, ": shape ", xf.shape_string(), " dtype '", npy_descr(xf.dtype),
                              "'; the trace's call has ", r.num_tokens,
                              " tokens, so x is [", r.num_tokens, ", hidden] float32 or bf16 (<u2)");
    }
    p.x = Tensor::empty(xf.dtype == NpyDType::kF32 ? DType::kF32 : DType::kBF16, xf.shape[0],
                        xf.shape[1]);
    if (!xf.data.empty()) std::memcpy(p.x.data(), xf.data.data(), xf.data.size());
    return ok_status();
  }
  if (!t.megatron) {
    return invalid_argument(a.trace, " holds only expert indices; give the rows with --x");
  }
  const MegatronLayerCall& call = t.megatron->calls.front();
  p.x = Tensor::empty(DType::kBF16, r.num_tokens, call.hidden);
  std::memcpy(p.x.data(), call.hidden_states.data(), call.hidden_states.size() * 2);
  return ok_status();
}

// Reads and checks the inputs and creates the output directory. Errors are returned, not
// printed: under MPI the ranks agree on them first.
Status prepare(const DispatchArgs& a, int R, bool mpi, Problem& p) {
  MOED_ASSIGN_OR_RETURN(const DispatcherKind kind, parse_dispatcher_kind(a.dispatcher));
  DispatchConfig& config = p.config;
  config.kind = kind;
  config.num_experts = a.experts;
  config.etp_size = a.etp;
  config.layout.capacity_factor = a.capacity_factor;
  MOED_ASSIGN_OR_RETURN(config.layout.drop_policy, parse_drop_policy(a.drop_policy));
  config.layout.pad_to_capacity = a.pad_to_capacity;
  config.layout.expert_alignment = a.expert_alignment;
  config.layout.router_padding_multiple = a.router_padding;
  MOED_RETURN_IF_ERROR(config.validate(R));
  // The threads world is one node unless told; the MPI world's default is the host.
  p.ranks_per_node = a.ranks_per_node == 0 && !mpi ? R : a.ranks_per_node;
  const int G = p.ranks_per_node;
  if (G != 0 && (G < 1 || R % G != 0)) {
    return invalid_argument("--ranks-per-node = ", G, " does not divide --ranks = ", R);
  }

  if (!a.trace.empty()) {
    MOED_RETURN_IF_ERROR(load_trace(a, R, p));
  } else {
    MOED_RETURN_IF_ERROR(load_npy(a, R, p));
  }
  if (Status s = validate(p.all, a.experts); !s.ok()) {
    const bool probs = s.message().rfind("topk_weights", 0) == 0;
    return s.with_context(!a.trace.empty() ? a.trace : probs ? a.topk_probs : a.topk_idx);
  }
  p.tokens_per_rank = p.x.rows() / R;

  // Every process makes the directory: under MPI each writes its own files into it.
  std::error_code ec;
  std::filesystem::create_directories(a.out, ec);
  if (ec) return invalid_argument(a.out, ": cannot create the directory: ", ec.message());
  return ok_status();
}

// What rank 0 prints, gathered over the ranks.
struct Summary {
  int ranks_per_node = 0;
  std::vector<uint64_t> per_rank;          // [R, 3]: rows, shared and network bytes of dispatch
  std::vector<int64_t> tokens_per_expert;  // [R, L]
};

Status write_file(const std::filesystem::path& dir, const std::string& name, NpyDType t,
                  std::initializer_list<int64_t> shape, const void* data) {
  return write_npy((dir / name).string(), t, shape, data);
}

// One rank, in either world: dispatch and combine, write this rank's files, gather the global
// ones on rank 0 and write them there.
Status rank_body(World& w, const Status& loaded, const Problem& p, const std::filesystem::path& dir,
                 Summary& sum) {
  // Each MPI process loaded the inputs itself; if any failed, all stop here together.
  MOED_RETURN_IF_ERROR(w.agree(loaded));
  RankResult res;
  MOED_RETURN_IF_ERROR(run_rank(w, p.config, p.x, p.all, p.tokens_per_rank, res));
  const int r = w.rank(), R = w.size();
  const int64_t rows = p.x.rows(), H = p.x.cols();
  const int64_t n = res.expert_input.rows();

  const uint64_t mine[3] = {uint64_t(n), res.dispatch_traffic.shared_bytes,
                            res.dispatch_traffic.network_bytes};
  MOED_ASSIGN_OR_RETURN(std::vector<uint64_t> per_rank,
                        all_gather<uint64_t>(w, std::span<const uint64_t>(mine, 3)));
  MOED_ASSIGN_OR_RETURN(std::vector<int64_t> tokens_per_expert,
                        all_gather<int64_t>(w, std::span<const int64_t>(res.tokens_per_expert)));
  // Only rank 0 needs the combined rows: a gather as an all-to-all that sends other ranks
  // nothing (an all-gather would hold a copy of the whole output on every rank).
  const size_t part = size_t(p.tokens_per_rank) * size_t(H) * dtype_size(p.x.dtype());
  if (res.combined.bytes() != part) {
    return internal_error("combine returned a ", res.combined.rows(), " x ", res.combined.cols(),
                          " output; expected ", p.tokens_per_rank, " x ", H);
  }
  Tensor combined;
  if (r == 0) combined = Tensor::empty(p.x.dtype(), rows, H);
  std::vector<size_t> send_counts(size_t(R), 0), recv_counts(size_t(R), r == 0 ? part : 0);
  send_counts[0] = part;
  MOED_RETURN_IF_ERROR(all_to_all_v<char>(
      w, std::span<const char>(static_cast<const char*>(res.combined.data()), part), send_counts,
      std::span<char>(static_cast<char*>(combined.data()), r == 0 ? combined.bytes() : 0),
      recv_counts));

  const NpyDType payload = p.x.dtype() == DType::kF32 ? NpyDType::kF32 : NpyDType::kU16;
  Status wrote = write_file(dir, "expert_input_rank" + std::to_string(r) + ".npy", payload, {n, H},
                            res.expert_input.data());
  if (wrote.ok()) {
    wrote = write_file(dir, "permuted_probs_rank" + std::to_string(r) + ".npy", NpyDType::kF32, {n},
                       res.permuted_probs.data());
  }
  if (wrote.ok() && r == 0) {
    const int64_t L = p.config.num_local_experts(R);
    wrote =
        write_file(dir, "tokens_per_expert.npy", NpyDType::kI64, {R, L}, tokens_per_expert.data());
    if (wrote.ok()) wrote = write_file(dir, "combined.npy", payload, {rows, H}, combined.data());
  }
  // A write that failed on any rank fails them all, so no rank reports success.
  MOED_RETURN_IF_ERROR(w.agree(wrote));
  if (r == 0) {
    sum.ranks_per_node = w.ranks_per_node();
    sum.per_rank = std::move(per_rank);
    sum.tokens_per_expert = std::move(tokens_per_expert);
  }
  return ok_status();
}

void run(const DispatchArgs& a) {
  const std::string world = a.world.empty() ? (launched_by_mpirun() ? "mpi" : "threads") : a.world;
  const bool mpi = world == "mpi";
  int R = 0;
  Status loaded;
  if (mpi) {
    // Each process is one rank, so the job's size is R.
    R = value_or_fail(mpi_world_size());
    if (a.ranks && *a.ranks != R) {
      loaded = invalid_argument("--ranks = ", *a.ranks, " but mpirun started ", R,
                                " processes; --world mpi runs one rank per process (pass --ranks ",
                                R, " or omit it)");
    }
  } else {
    std::error_code ec;
    if (!a.ranks && !a.trace.empty() && std::filesystem::is_directory(a.trace, ec)) {
      StatusOr<int> ranks = megatron_trace_ranks(a.trace);
      if (!ranks.ok()) fail(ranks.status());
      R = *ranks;
    } else {
      if (!a.ranks) fail(invalid_argument("--ranks is required with --world threads"));
      R = *a.ranks;
    }
    if (R < 1) fail(invalid_argument("--ranks = ", R, " must be >= 1"));
  }
  Problem p;
  if (loaded.ok()) loaded = prepare(a, R, mpi, p);
  // The threads world stops here. MPI ranks stop together once they have agreed (rank_body):
  // then every process reports the error (mpirun ends the job at the first non-zero exit, so
  // a process that quit alone could cut the others short), and a file that only some
  // processes cannot read still fails them all, none left waiting.
  if (!loaded.ok() && !mpi) fail(loaded);
  WorldOptions opts;
  // A bad --ranks-per-node must not stop the world from coming up to agree on the error.
  opts.ranks_per_node = loaded.ok() ? p.ranks_per_node : 0;
  Summary sum;
  int my_rank = 0;
  const Status s = run_in_world(
      world, R, opts, [&](World& w) { return rank_body(w, loaded, p, a.out, sum); }, &my_rank);
  // A rank whose own load failed says why; the others report the agreed error naming it.
  if (!s.ok()) fail(loaded.ok() ? s : loaded);
  if (my_rank != 0) return;

  const int G = sum.ranks_per_node;
  const int64_t rows = p.x.rows(), H = p.x.cols();
  const int64_t L = p.config.num_local_experts(R);
  std::printf(
      "moed dispatch: %s, %d ranks (%s world, %d node(s) x %d, etp %d), %lld tokens per rank, "
      "hidden %lld, %s, top-%d, %d experts -> %s\n",
      dispatcher_kind_name(p.config.kind), R, world.c_str(), R / G, G, a.etp,
      (long long)p.tokens_per_rank, (long long)H, dtype_name(p.x.dtype()), p.all.num_topk,
      a.experts, a.out.c_str());
  std::printf("  rank      rows   shared bytes  network bytes  tokens per expert\n");
  for (int r = 0; r < R; ++r) {
    const uint64_t* q = &sum.per_rank[size_t(r) * 3];
    std::string counts;
    for (int64_t j = 0; j < L; ++j) {
      counts += ' ';
      counts += std::to_string(sum.tokens_per_expert[size_t(r * L + j)]);
    }
    std::printf("  %4d %9llu %14llu %14llu %s\n", r, (unsigned long long)q[0],
                (unsigned long long)q[1], (unsigned long long)q[2], counts.c_str());
  }
  std::printf(
      "  wrote expert_input_rank{0..%d}.npy, permuted_probs_rank{0..%d}.npy, "
      "tokens_per_expert.npy [%d, %lld], combined.npy [%lld, %lld]\n",
      R - 1, R - 1, R, (long long)L, (long long)rows, (long long)H);
}

void setup(CLI::App& app) {
  auto a = std::make_shared<DispatchArgs>();
  CLI::App* c = app.add_subcommand(
      "dispatch",
      "dispatch + combine tokens from .npy files on R ranks (threads, or MPI processes under "
      "mpirun); write each rank's expert input and the combined output");
  c->add_option("--x", a->x,
                "tokens, float32 or bf16 (uint16) [R*T, H] .npy (with --trace: default the "
                "trace's hidden-state sidecar)");
  c->add_option("--topk-idx", a->topk_idx, "int32/int64 [R*T, K] .npy, -1 = none");
  c->add_option("--topk-probs", a->topk_probs, "float32 [R*T, K] .npy");
  c->add_option("--trace", a->trace,
                "routing from one router call of a Megatron-Core trace directory (or a one-step "
                "top-k .npy with --x), prob 1 per routed slot, instead of --topk-idx/--topk-probs");
  a->trace_args.add_options(c);
  c->add_option("--ranks", a->ranks,
                "ranks R (tokens split evenly); under --world mpi the job's size, if given");
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
  c->add_option("--ranks-per-node", a->ranks_per_node,
                "G ranks per node (0 = all in one node; under MPI, the host)");
  c->add_option("--world", a->world, "threads | mpi (default: mpi under mpirun, else threads)")
      ->check(CLI::IsMember({"threads", "mpi"}));
  c->callback([a] { run(*a); });
}

}  // namespace

MOED_CLI_COMMAND("", setup);

}  // namespace moed::cli::dispatch_command
