// moed run: the main job. One MoE layer (router -> dispatch -> grouped SwiGLU experts ->
// combine, shared expert overlapping the dispatch) forward and backward for a few steps across
// R ranks, then a per-stage table, load balance, traffic, and a check that the output and every
// gradient are bitwise equal to the single-process reference layer's (max relative errors are
// printed beside, as a diagnostic).
//
//   moed run                                     # threads world, 4 ranks, preset small, flex
//   moed run --dispatcher alltoall --ranks 8 --ranks-per-node 4 --dtype bf16 --etp 2
//   moed run --preset tiny --capacity-factor 1.0 --drop-policy position --pad-to-capacity
//   mpirun -np 4 moed run --world mpi
//
// Exit status: 0 when every bit matches the reference layer, 2 when any differs, 1 on any other
// error.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cli/registry.h"
#include "cli/world_choice.h"
#include "lost_rank.h"
#include "moed/dtype.h"
#include "moed/low_latency.h"
#include "moed/moe_layer.h"
#include "moed/threads_world.h"

namespace moed::cli::run_command {
namespace {

struct Preset {
  const char* name;
  int64_t tokens;  // per rank
  int hidden, ffn, experts, topk, shared_ffn;
};
// Each finishes in a few seconds on 2 cores with 4 ranks, up to medium; large is for real
// machines.
constexpr Preset kPresets[] = {
    {"tiny", 64, 256, 512, 8, 2, 256},
    {"small", 256, 512, 1024, 8, 2, 512},
    {"medium", 1024, 1024, 2048, 16, 2, 1024},
    {"large", 4096, 4096, 8192, 64, 8, 4096},
};

struct RunArgs {
  std::string world;  // "" = mpi under mpirun, else threads
  int ranks = 4;
  int ranks_per_node = 0;
  std::string dispatcher = "flex";
  std::string preset = "small";
  std::optional<int64_t> tokens;
  std::optional<int> hidden, ffn, experts, topk, shared_ffn;
  int etp = 1;
  std::string dtype = "f32";
  std::optional<double> capacity_factor;
  std::string drop_policy = "probs";
  bool pad_to_capacity = false;
  bool no_overlap = false;
  std::optional<int> steps;  // 3 for the layer, 8 with --fail-rank
  uint64_t seed = 1;
  bool json = false;
  std::optional<int> fail_rank;  // lose this rank (lost_rank.cc)
  int at_step = 4;
  std::string fail_how = "silent";
  double shrink_timeout = 1.0;
};

[[noreturn]] void fail(const Status& s) { fail_command("moed run", s.to_string()); }

template <typename T>
T value_or(const StatusOr<T>& v) {
  if (!v.ok()) fail(v.status());
  return *v;
}

Tensor random_rows(DType dt, int64_t rows, int64_t cols, uint64_t seed) {
  Tensor t = Tensor::empty(dt, rows, cols);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> row(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (float& v : row) v = u(rng);
    store_row(row.data(), t.view().row_ptr(r), dt, row.size());
  }
  return t;
}

float at(const Tensor& t, int64_t r, int64_t c) {
  return t.dtype() == DType::kF32 ? t.row<float>(r)[c] : bf16_to_float(t.row<bf16>(r)[c]);
}

// Normwise relative error max|a - b| / max|b|, a diagnostic only (the verdict is bitwise);
// -1 on a shape mismatch.
double rel_err(const Tensor& a, const Tensor& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols() || a.dtype() != b.dtype()) return -1;
  double num = 0, den = 0;
  for (int64_t r = 0; r < a.rows(); ++r) {
    for (int64_t c = 0; c < a.cols(); ++c) {
      num = std::max(num, std::fabs(double(at(a, r, c)) - double(at(b, r, c))));
      den = std::max(den, std::fabs(double(at(b, r, c))));
    }
  }
  return den > 0 ? num / den : num;
}

std::string fmt_err(double e) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", e);
  return buf;
}

// PASS means every bit of the output and of every gradient equals the reference layer's (the
// layer promises that, design.md §4.2); the relative errors only say how far a FAIL is.
struct Verdict {
  bool output_bitwise = true, grads_bitwise = true;
  double output_err = 0, grads_err = 0;
  std::string first_grad;  // the first gradient that differs ("" = none)
};

void compare(const Tensor& y, const MoEGrads& g, const Tensor& ry, const MoEGrads& rg, Verdict* v) {
  auto err = [](const Tensor& a, const Tensor& b) {
    const double e = rel_err(a, b);
    return e < 0 ? INFINITY : e;
  };
  auto grad = [&](const std::string& name, const Tensor& a, const Tensor& b) {
    if (bitwise_equal(a.view(), b.view())) return;  // also both empty
    if (v->grads_bitwise) v->first_grad = name;
    v->grads_bitwise = false;
    v->grads_err = std::max(v->grads_err, err(a, b));
  };
  v->output_bitwise = bitwise_equal(y.view(), ry.view());
  v->output_err = v->output_bitwise ? 0 : err(y, ry);
  grad("grad_input", g.grad_input, rg.grad_input);
  grad("grad_router", g.grad_router, rg.grad_router);
  if (g.grad_fc1.size() != rg.grad_fc1.size() || g.grad_fc2.size() != rg.grad_fc2.size()) {
    if (v->grads_bitwise) v->first_grad = "grad_fc1/grad_fc2 (expert count)";
    v->grads_bitwise = false;
    v->grads_err = INFINITY;
  }
  for (size_t j = 0; j < g.grad_fc1.size() && j < rg.grad_fc1.size(); ++j) {
    grad("grad_fc1[" + std::to_string(j) + "]", g.grad_fc1[j], rg.grad_fc1[j]);
  }
  for (size_t j = 0; j < g.grad_fc2.size() && j < rg.grad_fc2.size(); ++j) {
    grad("grad_fc2[" + std::to_string(j) + "]", g.grad_fc2[j], rg.grad_fc2[j]);
  }
  grad("grad_shared_fc1", g.grad_shared_fc1, rg.grad_shared_fc1);
  grad("grad_shared_fc2", g.grad_shared_fc2, rg.grad_shared_fc2);
}

// What rank 0 reports, gathered over the ranks.
struct Summary {
  std::vector<std::vector<double>> stage_s;  // [stage][step]: max over ranks
  int64_t rows = 0;                          // dispatched rows, all ranks, one step
  double expert_flops = 0;                   // forward, all ranks, one step
  std::vector<int64_t> tokens_per_expert;    // [E], global
  int64_t routed = 0, dropped = 0;
  uint64_t shared_bytes = 0, network_bytes = 0;  // per step, all ranks
  int ranks_per_node = 0;                        // the world's G (MPI: found from the hosts)
  Verdict verdict;
};

const char* kStages[] = {"route", "dispatch", "experts", "combine", "shared", "backward"};
constexpr int kNumStages = 6;

// The job every rank runs: the layer's configuration, the inputs of all ranks (a function of
// seed and rank) and the single-process reference, computed once.
struct Job {
  MoEConfig c;
  std::string world;
  int ranks = 0;
  int64_t tokens = 0;  // per rank
  int steps = 0;
  bool json = false;
  std::vector<Tensor> xs, gs;  // per rank: input and output gradient
  std::vector<TensorView> xv, gv;
  std::chrono::steady_clock::time_point start;
  // The reference layer's result, from the first rank that computes it.
  std::mutex mu;
  std::optional<ReferenceMoEResult> ref;
  double ref_s = 0;
};

MoEConfig configure(const RunArgs& a, int64_t* tokens) {
  const Preset* preset = nullptr;
  for (const Preset& p : kPresets) {
    if (a.preset == p.name) preset = &p;
  }
  if (preset == nullptr) {
    fail(invalid_argument("--preset ", a.preset, " is not one of tiny, small, medium, large"));
  }
  MoEConfig c;
  *tokens = a.tokens.value_or(preset->tokens);
  c.hidden = a.hidden.value_or(preset->hidden);
  c.ffn_hidden = a.ffn.value_or(preset->ffn);
  c.num_experts = a.experts.value_or(preset->experts);
  c.num_topk = a.topk.value_or(preset->topk);
  c.shared_expert_ffn = a.shared_ffn.value_or(preset->shared_ffn);
  c.etp_size = a.etp;
  c.dtype = value_or(parse_dtype(a.dtype));
  // low-latency is the buffer of moed/low_latency.h, not a TokenDispatcher (IsMember below).
  c.low_latency = a.dispatcher == "low-latency" || a.dispatcher == "low_latency";
  if (!c.low_latency) c.dispatcher = value_or(parse_dispatcher_kind(a.dispatcher));
  c.layout.capacity_factor = a.capacity_factor;
  c.layout.drop_policy = value_or(parse_drop_policy(a.drop_policy));
  c.layout.pad_to_capacity = a.pad_to_capacity;
  c.overlap_shared_expert = !a.no_overlap;
  c.seed = a.seed;
  if (*tokens < 0) fail(invalid_argument("--tokens = ", *tokens, " must be >= 0"));
  return c;
}

// Bytes of memory the kernel says it can still give (MemAvailable); 0 when unknown.
uint64_t available_bytes() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return 0;
  unsigned long long kb = 0;
  char line[256];
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "MemAvailable: %llu kB", &kb) == 1) break;
  }
  std::fclose(f);
  return uint64_t(kb) * 1024;
}

// A run this machine cannot hold fails here, saying so, instead of being killed for memory
// halfway. The bound is what it must hold at least: the experts' weights and their f32
// gradients of this process's ranks (all of them in the threads world) and, in low-latency
// mode, each rank's buffer.
void check_memory(const Job& job, const RunArgs& a) {
  const MoEConfig& c = job.c;
  const int ranks = job.world == "threads" ? job.ranks : 1;
  const double expert_params = 3.0 * double(c.hidden) * double(c.ffn_hidden) *
                               double(c.num_experts) / double(job.ranks) * ranks;
  double need = expert_params * double(dtype_size(c.dtype) + sizeof(float));
  if (c.low_latency) {
    need +=
        double(get_low_latency_size_hint(job.tokens, c.hidden, job.ranks, c.num_experts)) * ranks;
  }
  const uint64_t have = available_bytes();
  if (have == 0 || need <= double(have)) return;
  fail(failed_precondition("--preset ", a.preset, " with ", job.ranks, " ranks (hidden ", c.hidden,
                           ", ffn ", c.ffn_hidden, ", ", c.num_experts, " experts, tokens ",
                           job.tokens, ", ", dtype_name(c.dtype), ", ", c.dispatcher_name(),
                           ") needs at least ", fmt::format("{:.1f}", need / 1e9),
                           " GB in this process (expert weights and gradients",
                           c.low_latency ? ", low-latency buffers" : "", "), but only ",
                           fmt::format("{:.1f}", double(have) / 1e9),
                           " GB are available; take a smaller --preset or fewer --experts, "
                           "--ffn, --hidden or --tokens"));
}

// What one rank saw in its steps, before the gather.
struct RankResult {
  std::vector<std::vector<double>> stage_s;  // [stage][step]: max over ranks
  Tensor y0;                                 // step 0's output and gradients
  MoEGrads g0;
  MoEStepStats st0;
};

// The timed steps on one rank (after the reference, which one rank thread computes, every
// process under MPI).
Status run_steps(World& w, Job& job, std::unique_ptr<MoELayer>& layer, RankResult* out) {
  const int R = job.ranks;
  if (w.rank() == 0 || job.world == "mpi") {
    auto t0 = std::chrono::steady_clock::now();
    MOED_ASSIGN_OR_RETURN(ReferenceMoEResult rr, reference_moe_layer(job.c, R, job.xv, job.gv));
    std::lock_guard<std::mutex> lock(job.mu);
    job.ref = std::move(rr);
    job.ref_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  MOED_RETURN_IF_ERROR(w.barrier());
  MOED_ASSIGN_OR_RETURN(layer, MoELayer::create(w, job.c));
  const int r = w.rank();
  out->stage_s.assign(kNumStages, {});
  w.reset_counters();
  for (int step = 0; step < job.steps; ++step) {
    MOED_RETURN_IF_ERROR(w.barrier());
    MOED_ASSIGN_OR_RETURN(Tensor y, layer->forward(job.xv[size_t(r)]));
    MOED_ASSIGN_OR_RETURN(MoEGrads g, layer->backward(job.gv[size_t(r)]));
    const MoEStepStats& st = layer->last_stats();
    const double mine[kNumStages] = {st.route_s,   st.dispatch_s, st.experts_s,
                                     st.combine_s, st.shared_s,   st.backward_s};
    MOED_ASSIGN_OR_RETURN(std::vector<double> all,
                          all_gather<double>(w, std::span<const double>(mine, kNumStages)));
    for (int i = 0; i < kNumStages; ++i) {
      double mx = 0;
      for (int q = 0; q < R; ++q) mx = std::max(mx, all[size_t(q * kNumStages + i)]);
      out->stage_s[size_t(i)].push_back(mx);
    }
    if (step == 0) {
      out->y0 = std::move(y);
      out->g0 = std::move(g);
      out->st0 = st;
    }
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - job.start).count();
    if (r == 0 && elapsed > 3.0 && !job.json) {
      std::fprintf(stderr, "moed run: step %d/%d done (%.1f s)\n", step + 1, job.steps, elapsed);
    }
  }
  return ok_status();
}

// Gathers what rank 0 reports into *sum (on rank 0): the verdicts, counts and traffic.
Status summarize(World& w, const Job& job, const RankResult& mine, Summary* sum) {
  const MoEConfig& c = job.c;
  const int r = w.rank();
  Verdict v;
  compare(mine.y0, mine.g0, job.ref->output[size_t(r)], job.ref->grads[size_t(r)], &v);
  const double mine_v[4] = {v.output_bitwise ? 1.0 : 0.0, v.grads_bitwise ? 1.0 : 0.0, v.output_err,
                            v.grads_err};
  MOED_ASSIGN_OR_RETURN(std::vector<double> all_v,
                        all_gather<double>(w, std::span<const double>(mine_v, 4)));
  MOED_ASSIGN_OR_RETURN(std::vector<std::vector<char>> all_first,
                        all_gather_v<char>(w, std::span<const char>(v.first_grad)));
  const MoEStepStats& st0 = mine.st0;
  const int L = int(st0.tokens_per_local_expert.size());
  const int p = r % c.etp_size;
  // Token counts from p = 0 only: the P ranks of an expert see the same tokens.
  std::vector<int64_t> counts(size_t(c.num_experts), 0);
  const int ep = r / c.etp_size;
  if (p == 0) {
    for (int j = 0; j < L; ++j) counts[size_t(ep * L + j)] = st0.tokens_per_local_expert[size_t(j)];
  }
  const double fp = double(c.ffn_hidden / c.etp_size);
  std::vector<int64_t> mine_i = {st0.dispatch_rows,
                                 st0.routed,
                                 st0.dropped,
                                 int64_t(w.counters().shared_bytes / uint64_t(job.steps)),
                                 int64_t(w.counters().network_bytes / uint64_t(job.steps)),
                                 int64_t(double(st0.dispatch_rows) * 6.0 * c.hidden * fp)};
  mine_i.insert(mine_i.end(), counts.begin(), counts.end());
  MOED_ASSIGN_OR_RETURN(std::vector<int64_t> all_i,
                        all_gather<int64_t>(w, std::span<const int64_t>(mine_i)));
  if (r != 0) return ok_status();
  const size_t n = mine_i.size();
  sum->ranks_per_node = w.ranks_per_node();
  sum->stage_s = mine.stage_s;
  sum->tokens_per_expert.assign(size_t(c.num_experts), 0);
  for (int q = 0; q < job.ranks; ++q) {
    const int64_t* row = &all_i[size_t(q) * n];
    sum->rows += row[0];
    sum->routed += row[1];
    sum->dropped += row[2];
    sum->shared_bytes += uint64_t(row[3]);
    sum->network_bytes += uint64_t(row[4]);
    sum->expert_flops += double(row[5]);
    for (int e = 0; e < c.num_experts; ++e) sum->tokens_per_expert[size_t(e)] += row[6 + e];
    Verdict& sv = sum->verdict;
    sv.output_bitwise = sv.output_bitwise && all_v[size_t(q) * 4] == 1.0;
    sv.grads_bitwise = sv.grads_bitwise && all_v[size_t(q) * 4 + 1] == 1.0;
    sv.output_err = std::max(sv.output_err, all_v[size_t(q) * 4 + 2]);
    sv.grads_err = std::max(sv.grads_err, all_v[size_t(q) * 4 + 3]);
    if (sv.first_grad.empty() && !all_first[size_t(q)].empty()) {
      sv.first_grad = "rank " + std::to_string(q) + " " +
                      std::string(all_first[size_t(q)].begin(), all_first[size_t(q)].end());
    }
  }
  return ok_status();
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// The figures both reports print, from the summary.
struct Figures {
  double row_bytes = 0, moved = 0;  // bytes per row; dispatched bytes, all ranks
  int64_t tmin = INT64_MAX, tmax = 0;
  double tmean = 0;  // tokens per expert
  bool pass = false;
  std::string verify;  // the verdict line
};

Figures figures_of(const Job& job, const Summary& sum) {
  const MoEConfig& c = job.c;
  Figures f;
  f.row_bytes = double(c.hidden) * double(dtype_size(c.dtype));
  f.moved = double(sum.rows) * f.row_bytes;
  const Verdict& v = sum.verdict;
  f.pass = v.output_bitwise && v.grads_bitwise;
  int64_t ttot = 0;
  for (int64_t t : sum.tokens_per_expert) {
    f.tmin = std::min(f.tmin, t);
    f.tmax = std::max(f.tmax, t);
    ttot += t;
  }
  f.tmean = double(ttot) / double(c.num_experts);
  // The verdict is bitwise; the max relative errors are a diagnostic (0 when equal).
  auto part = [](bool bitwise, const char* what) {
    return std::string(what) + (bitwise ? " bitwise equal" : " differ");
  };
  f.verify = std::string("verify: ") + (f.pass ? "PASS" : "FAIL") +
             " (vs the reference layer: " + part(v.output_bitwise, "output") + ", " +
             part(v.grads_bitwise, "grads") +
             (v.first_grad.empty() ? "" : " (first: " + v.first_grad + ")") +
             "; max rel err output " + fmt_err(v.output_err) + ", grads " + fmt_err(v.grads_err) +
             ")";
  return f;
}

void print_json(const RunArgs& a, const Job& job, const Summary& sum, const Figures& f) {
  const MoEConfig& c = job.c;
  const Verdict& v = sum.verdict;
  nlohmann::json j;
  j["world"] = job.world;
  j["ranks"] = job.ranks;
  j["ranks_per_node"] = sum.ranks_per_node;
  j["dispatcher"] = c.dispatcher_name();
  j["preset"] = a.preset;
  j["tokens_per_rank"] = job.tokens;
  j["hidden"] = c.hidden;
  j["ffn_hidden"] = c.ffn_hidden;
  j["num_experts"] = c.num_experts;
  j["num_topk"] = c.num_topk;
  j["shared_expert_ffn"] = c.shared_expert_ffn;
  j["etp_size"] = c.etp_size;
  j["dtype"] = dtype_name(c.dtype);
  j["steps"] = job.steps;
  j["overlap_shared_expert"] = c.overlap_shared_expert;
  for (int i = 0; i < kNumStages; ++i) {
    j["stages"][kStages[i]]["seconds"] = median_of(sum.stage_s[size_t(i)]);
  }
  j["stages"]["dispatch"]["gbps"] = f.moved / median_of(sum.stage_s[1]) / 1e9;
  j["stages"]["combine"]["gbps"] = f.moved / median_of(sum.stage_s[3]) / 1e9;
  j["stages"]["experts"]["gflops"] = sum.expert_flops / median_of(sum.stage_s[2]) / 1e9;
  j["dispatched_rows"] = sum.rows;
  j["load"] = {{"tokens_per_expert", sum.tokens_per_expert},
               {"min", f.tmin},
               {"mean", f.tmean},
               {"max", f.tmax},
               {"imbalance", f.tmean > 0 ? double(f.tmax) / f.tmean : 0.0},
               {"routed", sum.routed},
               {"dropped", sum.dropped}};
  j["traffic"] = {{"shared_bytes_per_step", sum.shared_bytes},
                  {"network_bytes_per_step", sum.network_bytes}};
  j["verify"] = {{"pass", f.pass},
                 {"output_bitwise", v.output_bitwise},
                 {"grads_bitwise", v.grads_bitwise},
                 {"output_max_rel_err", v.output_err},
                 {"grads_max_rel_err", v.grads_err},
                 {"first_differing_grad", v.first_grad},
                 {"reference_seconds", job.ref_s}};
  std::printf("%s\n", j.dump(2).c_str());
}

void print_tables(const RunArgs& a, const Job& job, const Summary& sum, const Figures& f) {
  const MoEConfig& c = job.c;
  std::printf("moed run: %s world, %d ranks (%d per node), dispatcher %s, %s, preset %s\n",
              job.world.c_str(), job.ranks, sum.ranks_per_node, c.dispatcher_name(),
              dtype_name(c.dtype), a.preset.c_str());
  std::printf("  T=%lld per rank  H=%d  F=%d  E=%d  K=%d  shared F=%d  ETP=%d  steps=%d\n",
              (long long)job.tokens, c.hidden, c.ffn_hidden, c.num_experts, c.num_topk,
              c.shared_expert_ffn, c.etp_size, job.steps);
  std::printf("\n  %-10s %10s %12s   (median over steps of the slowest rank)\n", "stage", "ms",
              "rate");
  for (int i = 0; i < kNumStages; ++i) {
    const double t = median_of(sum.stage_s[size_t(i)]);
    std::string rate;
    char buf[64];
    if (i == 1 || i == 3) {
      std::snprintf(buf, sizeof buf, "%8.2f GB/s", t > 0 ? f.moved / t / 1e9 : 0.0);
      rate = buf;
    } else if (i == 2) {
      std::snprintf(buf, sizeof buf, "%6.1f GFLOP/s", t > 0 ? sum.expert_flops / t / 1e9 : 0.0);
      rate = buf;
    } else if (i == 4 && c.shared_expert_ffn > 0) {
      rate = c.overlap_shared_expert ? "(overlaps dispatch)" : "(after dispatch)";
    }
    std::printf("  %-10s %10.3f %12s\n", kStages[i], t * 1e3, rate.c_str());
  }
  std::printf("  (GB/s: %lld rows received over all ranks x %d bytes per row, aggregate)\n",
              (long long)sum.rows, int(f.row_bytes));
  if (c.shared_expert_ffn > 0) {
    std::printf("  dispatch + shared expert: %.3f ms (%s)\n",
                (median_of(sum.stage_s[1]) + median_of(sum.stage_s[4])) * 1e3,
                c.overlap_shared_expert ? "overlapped" : "one after the other, --no-overlap");
  }
  std::printf(
      "\nload: tokens per expert min %lld  mean %.1f  max %lld  imbalance %.2f  "
      "routed %lld  dropped %lld\n",
      (long long)f.tmin, f.tmean, (long long)f.tmax, f.tmean > 0 ? double(f.tmax) / f.tmean : 0.0,
      (long long)sum.routed, (long long)sum.dropped);
  std::printf("traffic per step: shared-memory %.2f MB  network %.2f MB\n",
              double(sum.shared_bytes) / 1e6, double(sum.network_bytes) / 1e6);
  std::printf("%s  [reference layer %.2f s]\n", f.verify.c_str(), job.ref_s);
}

// --fail-rank: the low-latency decode loop in shrink mode instead of the MoE layer.
void run_with_a_lost_rank(const RunArgs& a) {
  if (a.dispatcher != "low-latency" && a.dispatcher != "low_latency")
    fail_command("moed run",
                 "--fail-rank runs the low-latency dispatcher in shrink mode; "
                 "--dispatcher " +
                     a.dispatcher +
                     " cannot go on without a rank "
                     "(its world shrinks instead: World::shrink, moed.Group.shrink)");
  LostRankArgs l;
  l.world = a.world.empty() ? (launched_by_mpirun() ? "mpi" : "threads") : a.world;
  l.ranks = l.world == "mpi" ? value_or(mpi_world_size()) : a.ranks;
  l.ranks_per_node = a.ranks_per_node;
  if (a.experts) l.experts = *a.experts;
  if (a.topk) l.topk = *a.topk;
  if (a.hidden) l.hidden = *a.hidden;
  if (a.tokens) l.tokens = *a.tokens;
  l.steps = a.steps.value_or(l.steps);
  l.fail_rank = *a.fail_rank;
  l.at_step = a.at_step;
  l.fail_how = a.fail_how;
  l.shrink_timeout_s = a.shrink_timeout;
  l.seed = a.seed;
  run_lost_rank(l);
}

void run(const RunArgs& a) {
  if (a.fail_rank) return run_with_a_lost_rank(a);
  Job job;
  job.c = configure(a, &job.tokens);
  job.world = a.world.empty() ? (launched_by_mpirun() ? "mpi" : "threads") : a.world;
  if (job.world != "threads" && job.world != "mpi") {
    fail(invalid_argument("--world ", job.world, " is not one of threads, mpi"));
  }
  job.ranks = job.world == "mpi" ? value_or(mpi_world_size()) : a.ranks;
  job.steps = a.steps.value_or(3);
  job.json = a.json;
  if (Status s = job.c.validate(job.ranks); !s.ok()) fail(s);
  check_memory(job, a);
  for (int r = 0; r < job.ranks; ++r) {
    const uint64_t seed = a.seed * 1000003u + uint64_t(r);
    job.xs.push_back(random_rows(job.c.dtype, job.tokens, job.c.hidden, seed));
    job.gs.push_back(random_rows(job.c.dtype, job.tokens, job.c.hidden, seed + 500u));
    job.xv.push_back(job.xs.back().view());
    job.gv.push_back(job.gs.back().view());
  }
  job.start = std::chrono::steady_clock::now();

  Summary sum;
  auto body = [&](World& w) -> Status {
    std::unique_ptr<MoELayer> layer;
    RankResult mine;
    Status st = run_steps(w, job, layer, &mine);
    if (st.ok()) st = summarize(w, job, mine, &sum);
    // NOTE: announced before the layer is torn down, so the other ranks hear kAborted at once.
    if (!st.ok()) w.abort(st);
    return st;
  };
  WorldOptions opts;
  opts.ranks_per_node = a.ranks_per_node;
  int my_rank = 0;
  Status s = run_in_world(job.world, job.ranks, opts, body, &my_rank);
  if (!s.ok()) fail(s);
  if (my_rank != 0) return;

  const Figures f = figures_of(job, sum);
  if (a.json) {
    print_json(a, job, sum, f);
  } else {
    print_tables(a, job, sum, f);
  }
  std::fflush(stdout);
  if (!f.pass) {
    if (a.json) std::fprintf(stderr, "moed run: %s\n", f.verify.c_str());
    throw CLI::RuntimeError(2);
  }
}

void setup(CLI::App& app) {
  auto a = std::make_shared<RunArgs>();
  CLI::App* c = app.add_subcommand(
      "run", "run an MoE layer forward and backward across ranks, verified against the reference");
  c->add_option("--world", a->world, "threads | mpi (default: mpi under mpirun, else threads)")
      ->check(CLI::IsMember({"threads", "mpi"}));
  c->add_option("--ranks", a->ranks, "ranks (threads world)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  c->add_option("--ranks-per-node", a->ranks_per_node, "ranks per node G (0 = all on one node)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  c->add_option("--dispatcher", a->dispatcher, "allgather | alltoall | flex | low-latency")
      ->capture_default_str()
      ->check(CLI::IsMember({"allgather", "alltoall", "flex", "low-latency", "low_latency"}));
  c->add_option("--preset", a->preset, "tiny | small | medium | large")
      ->capture_default_str()
      ->check(CLI::IsMember({"tiny", "small", "medium", "large"}));
  c->add_option("--tokens", a->tokens, "tokens per rank (overrides the preset)");
  c->add_option("--hidden", a->hidden, "hidden size H")->check(CLI::PositiveNumber);
  c->add_option("--ffn", a->ffn, "expert FFN size F")->check(CLI::PositiveNumber);
  c->add_option("--experts", a->experts, "experts E")->check(CLI::PositiveNumber);
  c->add_option("--topk", a->topk, "experts per token K")->check(CLI::PositiveNumber);
  c->add_option("--shared-expert-ffn", a->shared_ffn, "shared expert FFN size (0 = none)")
      ->check(CLI::NonNegativeNumber);
  c->add_option("--etp", a->etp, "expert tensor parallel size P")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  c->add_option("--dtype", a->dtype, "f32 | bf16")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "bf16"}));
  c->add_option("--capacity-factor", a->capacity_factor, "token dropping capacity factor")
      ->check(CLI::PositiveNumber);
  c->add_option("--drop-policy", a->drop_policy, "probs | position")
      ->capture_default_str()
      ->check(CLI::IsMember({"probs", "position"}));
  c->add_flag("--pad-to-capacity", a->pad_to_capacity,
              "pad every (rank, expert) chunk to capacity");
  c->add_flag("--no-overlap", a->no_overlap,
              "run the shared expert after the dispatch instead of during it");
  c->add_option("--steps", a->steps, "forward + backward steps (default 3; 8 with --fail-rank)")
      ->check(CLI::PositiveNumber);
  c->add_option("--seed", a->seed, "seed of weights and inputs")->capture_default_str();
  c->add_flag("--json", a->json, "print one JSON object instead of the tables");
  c->add_option("--fail-rank", a->fail_rank,
                "lose this rank mid-run: a low-latency decode loop in shrink mode goes on "
                "without it, each step verified against the masked reference");
  c->add_option("--at-step", a->at_step, "the step at which --fail-rank is lost")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  c->add_option("--fail-how", a->fail_how, "silent (as a killed process) | raise")
      ->capture_default_str()
      ->check(CLI::IsMember({"silent", "raise"}));
  c->add_option("--shrink-timeout", a->shrink_timeout,
                "seconds a rank waits for a silent peer before it masks it")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  c->callback([a] { run(*a); });
}

}  // namespace
}  // namespace moed::cli::run_command

MOED_CLI_COMMAND("", moed::cli::run_command::setup);
