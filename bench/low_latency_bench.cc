// moed bench low-latency: low-latency dispatch and combine (design.md §6) at one shape, bf16 and
// FP8, one call and the send / receive halves (through the hook) timed separately, beside
// Flex's normal mode at the same shape, all in one run, each whole call against its physical
// limit (bench/limit.h; the halves have no model of their own: how a call splits its work
// between them is the implementation's).
//
//   moed bench low-latency --shape decode --ranks 8 --world threads --json
//   moed bench low-latency --ranks 4 --tokens 1,8,32     # small decode batches, T per rank
//
// Every record carries the latency floor measured at the start of the run (floor_seconds: the
// larger of a bare signal round trip between ranks 0 and 1 and one empty collective; both are
// in the record too) and floor_ratio = seconds / floor_seconds; a whole call also its time
// back to back, warm as the floor is (warm_seconds, warm_floor_ratio).
//
// A multi-rank time is the maximum over ranks of one iteration (every rank starts after a
// barrier); figures are medians over iterations. Bandwidth counts the rows every rank received
// (aggregate) times their payload bytes (design.md §7.1).
//
//   mpirun -np 4 moed bench low-latency --world mpi --shape decode
//
// Every check is made by each rank on its own outputs (any rank can rebuild any other's input
// from the seeds) and the verdicts are combined over ranks, so the MPI world (one rank per
// process) runs the same checks; only rank 0 prints.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>

#include "bench/common.h"
#include "cli/registry.h"
#include "moed/dispatcher.h"
#include "moed/low_latency.h"

namespace moed::bench::low_latency_bench {
namespace {

struct Args : WorldArgs, ReportArgs {
  Args() : WorldArgs(8), ReportArgs(20) {}
  std::string shape = "decode";
  std::vector<int64_t> tokens;  // T per rank to run (empty: the shape's)
};

// One figure as the ranks measured it: the per-iteration maximum over ranks, then the median.
struct Figure {
  int64_t num_tokens = 0;  // T per rank
  std::string dispatcher, phase, dtype;
  Paired times;                // the kernel's, each with the STREAM sample taken before it
  std::vector<double> warm;    // the whole call back to back (time_halves), max over ranks
  int64_t rows = 0;            // rows received, summed over ranks
  size_t row_bytes = 0;        // payload bytes per row
  uint64_t network_bytes = 0;  // per iteration, summed over ranks
  bool verified = false;
};

// What combine(dispatch(x)) with unit weights and the dispatched rows as expert outputs must
// give: fp32 acc = 0; acc += x once per routed expert; rounded to bf16 once.
bool round_trip_ok(const Tensor& x, const TopkRouting& r, const TensorView& out) {
  const int64_t H = x.cols();
  std::vector<float> acc(static_cast<size_t>(H));
  for (int64_t t = 0; t < x.rows(); ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int k = 0; k < r.num_topk; ++k) {
      if (r.idx(t, k) < 0) continue;
      for (int64_t h = 0; h < H; ++h) acc[size_t(h)] += bf16_to_float(x.row<bf16>(t)[h]);
    }
    for (int64_t h = 0; h < H; ++h) {
      if (float_to_bf16(acc[size_t(h)]).bits != out.row<bf16>(t)[h].bits) return false;
    }
  }
  return true;
}

Tensor make_tokens(int rank, int64_t T, int H) {
  std::mt19937 rng(1234u + uint32_t(rank));
  return random_tokens(T, H, 1.0f, rng);
}

// Every received FP8 row and its scales equal quantize_fp8_row of the source token's row.
bool fp8_rows_ok(const LowLatencyDispatchOutput& d, int ranks, int64_t T, int H) {
  std::vector<Tensor> xs;
  for (int s = 0; s < ranks; ++s) xs.push_back(make_tokens(s, T, H));
  const int S = H / kFp8BlockSize;
  std::vector<fp8_e4m3> q(static_cast<size_t>(H));
  std::vector<float> scales(static_cast<size_t>(S));
  for (int j = 0; j < d.num_local_experts; ++j) {
    for (int s = 0; s < ranks; ++s) {
      const LowLatencyRange range = d.layout_range[size_t(j) * ranks + s];
      for (int32_t i = 0; i < range.count; ++i) {
        const int64_t row = j * d.rows_per_expert + range.begin + i;
        const int32_t t = d.src_info[size_t(row)];
        if (t < 0 || t >= T) return false;
        quantize_fp8_row(std::span<const bf16>(xs[size_t(s)].row<bf16>(t), size_t(H)), false, q,
                         scales);
        if (std::memcmp(d.recv.x.row_ptr(row), q.data(), size_t(H)) != 0 ||
            std::memcmp(d.recv.scales.row_ptr(row), scales.data(), size_t(S) * 4) != 0) {
          return false;
        }
      }
    }
  }
  return true;
}

// Per iteration: a STREAM operation, one whole call, another STREAM operation, then the send
// half (return_recv_hook) and the receive half (the hook's wait), each timed over the ranks;
// both halves are paired with the operation before the send. With `beside` (Flex's call of the
// same phase): an operation and one call of it too, after the whole call in even iterations
// and before it in odd ones, so that the two are compared iteration by iteration under the
// same load, neither always finding the other's rows in the caches. Then `iters` whole calls
// back to back (each followed by one of `beside`), warm as the floor is timed: each call above
// starts after a STREAM operation has evicted the caches, which at T = 1 is most of its time.
struct HalfTimes {
  Paired one, send, recv, beside;
  std::vector<double> warm, beside_warm;
};
StatusOr<HalfTimes> time_halves(World& w, int iters, Stream& stream,
                                const std::function<Status(bool hook)>& call,
                                const std::function<Status()>& wait,
                                const std::function<Status()>& beside = nullptr) {
  HalfTimes t;
  MOED_RETURN_IF_ERROR(stream.calibrate());
  t.one.calibration = t.send.calibration = t.recv.calibration = t.beside.calibration =
      stream.calibration();
  auto time_beside = [&]() -> Status {
    if (!beside) return ok_status();
    MOED_ASSIGN_OR_RETURN(const StreamSample c, stream.next());
    MOED_ASSIGN_OR_RETURN(const double b, time_max(w, beside));
    t.beside.add(b, c);
    return ok_status();
  };
  for (int i = 0; i < iters; ++i) {
    if (i % 2 == 1) MOED_RETURN_IF_ERROR(time_beside());
    MOED_ASSIGN_OR_RETURN(const StreamSample c1, stream.next());
    MOED_ASSIGN_OR_RETURN(const double one, time_max(w, [&] { return call(false); }));
    if (i % 2 == 0) MOED_RETURN_IF_ERROR(time_beside());
    MOED_ASSIGN_OR_RETURN(const StreamSample c2, stream.next());
    MOED_ASSIGN_OR_RETURN(const double send, time_max(w, [&] { return call(true); }));
    MOED_ASSIGN_OR_RETURN(const double recv, time_max(w, wait));
    t.one.add(one, c1);
    t.send.add(send, c2);
    t.recv.add(recv, c2);
  }
  MOED_RETURN_IF_ERROR(close_figures(stream, {&t.one, &t.send, &t.recv, &t.beside}));
  for (int i = 0; i < iters; ++i) {
    MOED_ASSIGN_OR_RETURN(const double one, time_max(w, [&] { return call(false); }));
    t.warm.push_back(one);
    if (!beside) continue;
    MOED_ASSIGN_OR_RETURN(const double b, time_max(w, beside));
    t.beside_warm.push_back(b);
  }
  return t;
}

// The latency floor of this world, measured in the run: a bare signal round trip between ranks
// 0 and 1 (node-shared signals when they share a node, else an 8-byte network message each
// way), and one empty collective (a barrier, the slowest rank's time). A dispatch or combine
// without a count exchange still has to hear from every peer, which is what the collective
// does; floor_seconds is the larger of the two.
struct Floor {
  double round_trip = 0, collective = 0;
  double seconds() const { return std::max(round_trip, collective); }
};
StatusOr<Floor> measure_floor(World& w, int iters) {
  Floor f;
  const int n = std::max(20, iters * 10), warmup = 5;
  MOED_ASSIGN_OR_RETURN(f.collective,
                        median_time_max(w, n, [&] { return w.barrier(); }, warmup));
  if (w.size() < 2) return f;
  const bool shared = w.same_node(0, 1);
  std::shared_ptr<SharedBuffer> signals;
  if (shared) {
    MOED_ASSIGN_OR_RETURN(signals, w.alloc_shared(64));  // collective over each node
  }
  MOED_RETURN_IF_ERROR(w.barrier());
  std::vector<double> times;
  constexpr int kTag = 0x7f10;
  uint64_t token = 0;
  for (int i = -warmup; i < n && w.rank() <= 1; ++i) {
    const uint64_t v = uint64_t(i + warmup + 1);
    const int peer = 1 - w.rank();
    const auto a = std::chrono::steady_clock::now();
    if (w.rank() == 0) {
      if (shared) {
        signals->signal(1, v);
        MOED_RETURN_IF_ERROR(signals->wait_signal(1, v));
      } else {
        MOED_RETURN_IF_ERROR(w.send(peer, kTag, &v, sizeof(v)));
        MOED_RETURN_IF_ERROR(w.recv(peer, kTag, &token, sizeof(token)));
      }
    } else if (shared) {
      MOED_RETURN_IF_ERROR(signals->wait_signal(0, v));
      signals->signal(0, v);
    } else {
      MOED_RETURN_IF_ERROR(w.recv(peer, kTag, &token, sizeof(token)));
      MOED_RETURN_IF_ERROR(w.send(peer, kTag, &token, sizeof(token)));
    }
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
    if (i >= 0) times.push_back(t);
  }
  f.round_trip = median(std::move(times));
  MOED_RETURN_IF_ERROR(w.barrier());
  return f;
}

// Rank `rank`'s routing: each token picks K distinct experts of E uniformly; unit weights.
TopkRouting uniform_topk(int rank, int64_t T, int E, int K) {
  std::mt19937 rng(5678u + uint32_t(rank));
  TopkRouting topk;
  topk.num_tokens = T;
  topk.num_topk = K;
  std::vector<int32_t> experts(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) experts[size_t(e)] = e;
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int k = 0; k < K; ++k) {
      topk.topk_idx.push_back(experts[size_t(k)]);
      topk.topk_weights.push_back(1.0f);
    }
  }
  return topk;
}

// One T per rank: low-latency dispatch and combine (bf16 and FP8, whole calls and halves) and
// Flex's normal mode at the same shape.
Status run_tokens(World& w, const Shape& s, int iters, std::vector<Figure>* figures) {
  const int R = w.size(), E = s.num_experts, K = s.num_topk, H = s.hidden;
  const int64_t T = s.num_tokens;
  // Inputs: random bf16 rows (any rank can rebuild any other's, to check FP8 rows).
  Tensor x = make_tokens(w.rank(), T, H);
  const TopkRouting topk = uniform_topk(w.rank(), T, E, K);

  MOED_ASSIGN_OR_RETURN(auto buffer, LowLatencyBuffer::create(w, T, H, E));
  const bool root = w.rank() == 0;
  Stream stream(w);  // this rank's share of the STREAM arrays
  auto add = [&](Figure f, const Paired& times, int64_t rows, uint64_t net) {
    f.num_tokens = T;
    f.times = times;
    f.rows = rows;
    f.network_bytes = net;
    if (root) figures->push_back(std::move(f));
  };
  // The whole call as `op`, its halves as op_send and op_recv.
  auto add_halves = [&](const std::string& op, const char* dtype, size_t row_bytes,
                        const HalfTimes& t, int64_t rows, uint64_t net, bool verified) {
    for (auto [suffix, times] :
         {std::pair{"", &t.one}, std::pair{"_send", &t.send}, std::pair{"_recv", &t.recv}}) {
      Figure f{0, "low_latency", op + suffix, dtype, {}, {}, 0, row_bytes};
      f.verified = verified;
      if (times == &t.one) f.warm = t.warm;
      add(f, *times, rows, net);
    }
  };

  // Flex's normal mode at the same shape, one call each (dispatch includes its notify), timed
  // in the bf16 loops beside the low-latency calls. Its combine is weighted, as the
  // low-latency combine always is (DeepEP's low_latency_combine takes topk_weights), so both
  // compute the same sum of w * y: unweighted, Flex would skip K multiplies per element, a
  // visible share of the combine where the fold is arithmetic-bound.
  DispatchConfig config;
  config.kind = DispatcherKind::kFlex;
  config.num_experts = E;
  config.weighted_combine = true;
  MOED_ASSIGN_OR_RETURN(std::unique_ptr<TokenDispatcher> flex, TokenDispatcher::create(w, config));
  DispatchOutput fd;
  DispatchInput flex_input;
  flex_input.hidden = TokenRows{x.view(), {}};
  flex_input.topk = TopkView::of(topk);
  auto flex_dispatch = [&]() -> Status {
    MOED_ASSIGN_OR_RETURN(fd, flex->dispatch(flex_input));
    return ok_status();
  };
  MOED_ASSIGN_OR_RETURN(const Traffic fdt, traffic_of(w, flex_dispatch, "flex dispatch"));
  MOED_ASSIGN_OR_RETURN(const int64_t frows, sum_ranks(w, fd.num_rows()));
  CombineOutput fc;
  auto flex_combine = [&]() -> Status {
    MOED_ASSIGN_OR_RETURN(fc,
                          flex->combine({.expert_output = fd.expert_input, .handle = fd.handle}));
    return ok_status();
  };
  MOED_ASSIGN_OR_RETURN(const Traffic fct, traffic_of(w, flex_combine, "flex combine"));
  MOED_ASSIGN_OR_RETURN(const bool fok, all_ranks_ok(w, round_trip_ok(x, topk, fc.hidden.view())));
  auto add_flex = [&](const char* phase, const HalfTimes& t, uint64_t net) {
    Figure f{0, "flex", phase, "bf16", {}, t.beside_warm, 0, size_t(H) * 2};
    f.verified = fok;
    add(f, t.beside, frows, net);
  };

  for (const bool fp8 : {false, true}) {
    const size_t row_bytes = fp8 ? size_t(H) + size_t(H / kFp8BlockSize) * 4 : size_t(H) * 2;
    const char* dtype = fp8 ? "fp8" : "bf16";
    LowLatencyDispatchOutput d;
    auto dispatch = [&](bool hook) -> Status {
      MOED_ASSIGN_OR_RETURN(d, buffer->low_latency_dispatch({.x = x.view(),
                                                             .topk = TopkView::of(topk),
                                                             .use_fp8 = fp8,
                                                             .return_recv_hook = hook}));
      return ok_status();
    };
    MOED_ASSIGN_OR_RETURN(
        const Traffic dt,
        traffic_of(w, [&] { return dispatch(false); }, str_cat("low_latency dispatch ", dtype)));
    int64_t mine = 0;
    for (int32_t c : d.recv_count) mine += c;
    MOED_ASSIGN_OR_RETURN(const int64_t rows, sum_ranks(w, mine));
    const std::function<Status()> flex_beside = fp8 ? nullptr : std::function(flex_dispatch);
    MOED_ASSIGN_OR_RETURN(
        const HalfTimes dtimes,
        time_halves(w, iters, stream, dispatch, [&] { return d.hook->wait(); }, flex_beside));
    // bf16: verified is set below from the round trip.
    MOED_ASSIGN_OR_RETURN(const bool rows_ok, all_ranks_ok(w, !fp8 || fp8_rows_ok(d, R, T, H)));
    add_halves("dispatch", dtype, row_bytes, dtimes, rows, dt.network_bytes, rows_ok);
    if (fp8) continue;
    add_flex("dispatch", dtimes, fdt.network_bytes);

    // Combine of the bf16 dispatch: the received rows are the expert outputs.
    // NOTE: read in place (no copy of the [L * R * M, H] slots, 470 MB a rank at decode): the
    // dispatch's half stays untouched until the next dispatch.
    const TensorView y = d.recv.x;
    std::shared_ptr<const LowLatencyHandle> handle = d.handle;
    LowLatencyCombineOutput c;
    auto combine = [&](bool hook) -> Status {
      MOED_ASSIGN_OR_RETURN(
          c, buffer->low_latency_combine(
                 {.x = y, .topk = TopkView::of(topk), .handle = handle, .return_recv_hook = hook}));
      return ok_status();
    };
    MOED_ASSIGN_OR_RETURN(
        const Traffic ct,
        traffic_of(w, [&] { return combine(false); }, "low_latency combine bf16"));
    MOED_ASSIGN_OR_RETURN(const bool ok,
                          all_ranks_ok(w, round_trip_ok(x, topk, c.combined_x.view())));
    MOED_ASSIGN_OR_RETURN(
        const HalfTimes ctimes,
        time_halves(w, iters, stream, combine, [&] { return c.hook->wait(); }, flex_combine));
    add_halves("combine", "bf16", size_t(H) * 2, ctimes, rows, ct.network_bytes, ok);
    add_flex("combine", ctimes, fct.network_bytes);
    if (root) {
      for (Figure& f : *figures) {
        if (f.dispatcher == "low_latency" && f.dtype == "bf16") f.verified = ok;
      }
    }
  }

  return ok_status();
}

// What one run holds in memory, for the report: the low-latency buffers (node-shared, every
// rank's), and peak RSS.
struct Memory {
  uint64_t low_latency_buffer_bytes = 0;  // summed over ranks, at the largest T
};

Status run_rank(World& w, const Shape& base, const std::vector<int64_t>& tokens, int iters,
                Floor* floor, Memory* memory, std::vector<Figure>* figures) {
  MOED_ASSIGN_OR_RETURN(const Floor f, measure_floor(w, iters));
  if (w.rank() == 0) *floor = f;
  for (int64_t T : tokens) {
    Shape s = base;
    s.num_tokens = T;
    MOED_RETURN_IF_ERROR(run_tokens(w, s, iters, figures));
  }
  const int64_t T = *std::max_element(tokens.begin(), tokens.end());
  MOED_ASSIGN_OR_RETURN(
      const int64_t ll,
      sum_ranks(w, int64_t(get_low_latency_size_hint(T, base.hidden, w.size(), base.num_experts))));
  if (w.rank() == 0) memory->low_latency_buffer_bytes = uint64_t(ll);
  return ok_status();
}

void run(const Args& a) {
  StatusOr<WorldShape> ws = world_shape(a.shape, a.world, a.ranks);
  if (!ws.ok()) fail("low-latency", ws.status());
  const int ranks = ws->ranks;
  const Shape& s = ws->shape;
  std::vector<int64_t> tokens = a.tokens;
  if (tokens.empty()) tokens.push_back(s.num_tokens);
  WorldOptions opts;
  opts.ranks_per_node = a.ranks_per_node;
  std::vector<Figure> figures;
  Floor floor;
  Memory memory;
  int my_rank = 0;
  int threads = 0;  // the ranks' pools together (STREAM runs on them too)
  Status st = run_in_world(
      a.world, ranks, opts, a.json,
      [&](World& w) {
        if (w.rank() == 0) threads = w.pool().num_threads() * w.size();
        return run_rank(w, s, tokens, a.iters, &floor, &memory, &figures);
      },
      &my_rank);
  if (!st.ok()) fail("low-latency", st);
  if (my_rank != 0) return;

  Report report(a);
  const uint64_t peak = peak_rss_bytes();
  const int G = a.ranks_per_node > 0 ? a.ranks_per_node : ranks;
  for (const Figure& f : figures) {
    const size_t bytes = size_t(f.rows) * f.row_bytes;
    Shape fs = s;
    fs.num_tokens = f.num_tokens;
    nlohmann::json rec =
        world_record("low_latency", fs, a.world, ranks, a.ranks_per_node, threads, a.iters,
                     {{"dispatcher", f.dispatcher},
                      {"phase", f.phase},
                      {"dtype", f.dtype},
                      {"rows", f.rows},
                      {"bytes", bytes},
                      {"network_bytes", f.network_bytes},
                      {"floor_seconds", floor.seconds()},
                      {"floor_round_trip_seconds", floor.round_trip},
                      {"floor_collective_seconds", floor.collective},
                      {"low_latency_buffer_bytes", memory.low_latency_buffer_bytes},
                      {"peak_rss_bytes", peak},
                      {"verified", f.verified}});
    const bool whole = f.phase == "dispatch" || f.phase == "combine";
    if (whole) {
      // Every rank's routing, rebuilt from its seed: the model counts all of them.
      std::vector<TopkRouting> topk;
      for (int r = 0; r < ranks; ++r) {
        topk.push_back(uniform_topk(r, f.num_tokens, s.num_experts, s.num_topk));
      }
      const double row = double(s.hidden) * 2;
      add_limit(rec, f.times,
                f.phase == "dispatch"
                    ? dispatch_model(topk, s.num_experts, ranks, G, row, double(f.row_bytes))
                    : combine_model(topk, s.num_experts, ranks, G, row, /*weighted=*/true));
    } else {
      rec["seconds"] = median(f.times.kernel);
    }
    if (f.dispatcher == "flex" && f.phase == "combine") rec["weighted_combine"] = true;
    // The fastest iteration: what the call's rounds cost when no other process got in the way.
    rec["seconds_min"] = f.times.kernel.empty()
                             ? 0.0
                             : *std::min_element(f.times.kernel.begin(), f.times.kernel.end());
    if (f.dispatcher == "low_latency" && f.dtype == "bf16" &&
        (f.phase == "dispatch" || f.phase == "combine")) {
      // Issue 14's target: the low-latency call no slower than Flex's, timed in the same
      // iterations (time_halves' `beside`).
      for (const Figure& g : figures) {
        if (g.dispatcher == "flex" && g.phase == f.phase && g.num_tokens == f.num_tokens) {
          add_comparison(rec, "low_latency / flex", f.times.kernel, g.times.kernel, 1.0);
        }
      }
    }
    const double seconds = rec["seconds"].get<double>();
    rec["microseconds"] = seconds * 1e6;
    rec["floor_ratio"] = floor.seconds() > 0 ? seconds / floor.seconds() : 0.0;
    if (!f.warm.empty()) {
      const double warm = median(f.warm);
      rec["warm_seconds"] = warm;
      rec["warm_floor_ratio"] = floor.seconds() > 0 ? warm / floor.seconds() : 0.0;
    }
    report.add(std::move(rec));
  }
  if (!a.json) {
    std::printf(
        "floor: signal round trip (ranks 0-1) %.1f us, empty collective %.1f us; "
        "floor_seconds = %.1f us\n"
        "memory: peak RSS %.1f MB; low-latency buffers %.1f MB (all ranks, at T = %lld)\n",
        floor.round_trip * 1e6, floor.collective * 1e6, floor.seconds() * 1e6, double(peak) / 1e6,
        double(memory.low_latency_buffer_bytes) / 1e6,
        static_cast<long long>(*std::max_element(tokens.begin(), tokens.end())));
  }
  if (Status st = report.finish(); !st.ok()) fail("low-latency", st);
}

void setup(CLI::App& bench) {
  auto args = std::make_shared<Args>();
  CLI::App* c = bench.add_subcommand(
      "low-latency", "low-latency dispatch / combine (bf16, fp8, send and receive halves) vs Flex");
  c->add_option("--shape", args->shape, "tiny | mixtral | dsv3 | decode")->capture_default_str();
  c->add_option("--tokens", args->tokens,
                "T per rank, overriding the shape's; a list runs each, e.g. --tokens 1,8,32")
      ->delimiter(',')
      ->check(CLI::Range(int64_t(1), int64_t(1) << 20));
  add_world_options(*c, *args);
  add_report_options(*c, *args);
  c->callback([args] { run(*args); });
}

}  // namespace

MOED_CLI_COMMAND("bench", setup);

}  // namespace moed::bench::low_latency_bench
