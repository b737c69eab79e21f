#include "dispatch/harness.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <sstream>

#include "moed/reference.h"

namespace moed::testing {

namespace {

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t x = a * 0x9e3779b97f4a7c15ull + b + 0x632be59bd9b4e9b3ull;
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  return x ^ (x >> 29);
}

// A random float with a full 24-bit mantissa in [-2, 2): sums of these round differently in
// different orders, so an order mistake shows.
float random_float(std::mt19937_64& rng) {
  return (float(rng() >> 40) * (1.0f / 16777216.0f) - 0.5f) * 4.0f;
}

// Random rows of `dtype` (f32 / bf16).
Tensor random_rows(DType dtype, int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Tensor t = Tensor::empty(dtype, rows, cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < cols; ++h) {
      const float v = random_float(rng);
      if (dtype == DType::kBF16) {
        t.row<bf16>(r)[h] = float_to_bf16(v);
      } else {
        t.row<float>(r)[h] = v;
      }
    }
  }
  return t;
}

float load(const TensorView& v, int64_t r, int64_t h) {
  switch (v.dtype) {
    case DType::kF32:
      return v.row<float>(r)[h];
    case DType::kBF16:
      return bf16_to_float(v.row<bf16>(r)[h]);
    case DType::kFP8:
      return fp8_e4m3_to_float(v.row<fp8_e4m3>(r)[h]);
  }
  return 0;
}

void store(const TensorView& v, int64_t r, int64_t h, float x) {
  if (v.dtype == DType::kBF16) {
    v.row<bf16>(r)[h] = float_to_bf16(x);
  } else {
    v.row<float>(r)[h] = x;
  }
}

uint32_t bits_at(const TensorView& v, int64_t r, int64_t h) {
  uint32_t b = 0;
  std::memcpy(&b, static_cast<const char*>(v.row_ptr(r)) + size_t(h) * v.element_size(),
              v.element_size());
  return b;
}

Status compare_rows(const std::string& what, const TensorView& got, const TensorView& want) {
  if (got.dtype != want.dtype || got.rows != want.rows || got.cols != want.cols) {
    return internal_error(what, ": got ", dtype_name(got.dtype), " [", got.rows, ", ", got.cols,
                          "], want ", dtype_name(want.dtype), " [", want.rows, ", ", want.cols,
                          "]");
  }
  for (int64_t r = 0; r < got.rows; ++r) {
    if (std::memcmp(got.row_ptr(r), want.row_ptr(r), got.row_bytes()) == 0) continue;
    for (int64_t h = 0; h < got.cols; ++h) {
      if (bits_at(got, r, h) == bits_at(want, r, h)) continue;
      return internal_error(what, "[", r, "][", h, "] = ", load(got, r, h), " (bits 0x", std::hex,
                            bits_at(got, r, h), ") but the reference has ", std::dec,
                            load(want, r, h), " (bits 0x", std::hex, bits_at(want, r, h), ")");
    }
  }
  return ok_status();
}

template <typename T>
Status compare_values(const std::string& what, std::span<const T> got, std::span<const T> want) {
  if (got.size() != want.size()) {
    return internal_error(what, ": got ", got.size(), " values, want ", want.size());
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      return internal_error(what, "[", i, "] = ", got[i], " but the reference has ", want[i]);
    }
  }
  return ok_status();
}
template <typename T>
Status compare_values(const std::string& what, const std::vector<T>& got,
                      const std::vector<T>& want) {
  return compare_values<T>(what, std::span<const T>(got), std::span<const T>(want));
}

TokenRows rows_of(const TokenTensor& t) { return t.rows(); }

// Copies of inputs with row_stride = cols + pad (the pad 0xff bytes: NaN in f32 and bf16),
// kept alive for the case.
class StridedCopies {
 public:
  explicit StridedCopies(bool on) : on_(on) {}
  TensorView operator()(const TensorView& v) {
    if (!on_) return v;
    const int64_t pad = v.cols % 2 == 0 ? 3 : 2;  // odd strides too
    Tensor t = Tensor::empty(v.dtype, v.rows, v.cols + pad);
    if (t.rows() > 0) std::memset(t.data(), 0xff, size_t(t.rows()) * t.view().row_bytes());
    TensorView out(t.data(), v.dtype, v.rows, v.cols, v.cols + pad);
    for (int64_t r = 0; r < v.rows; ++r) std::memcpy(out.row_ptr(r), v.row_ptr(r), v.row_bytes());
    keep_.push_back(std::move(t));
    return out;
  }
  TokenRows operator()(const TokenRows& r) {
    return TokenRows{(*this)(r.x), r.scales.data ? (*this)(r.scales) : r.scales};
  }

 private:
  bool on_;
  std::vector<Tensor> keep_;
};

}  // namespace

std::string DispatchCase::name() const {
  std::ostringstream os;
  os << "R" << ranks << " G" << ranks_per_node << " ETP" << etp << " E" << num_experts << " K"
     << num_topk << " T[";
  for (size_t i = 0; i < tokens.size(); ++i) os << (i ? "," : "") << tokens[i];
  os << "] " << dtype_name(dtype) << "->" << dtype_name(out_dtype);
  if (skewed) os << " skewed";
  if (layout.capacity_factor) {
    os << " cf" << *layout.capacity_factor << "/" << drop_policy_name(layout.drop_policy);
  }
  if (layout.pad_to_capacity) os << " pad_to_capacity";
  if (layout.expert_alignment > 1) os << " align" << layout.expert_alignment;
  if (layout.router_padding_multiple > 0) os << " router_pad" << layout.router_padding_multiple;
  if (weighted) os << " weighted";
  if (map_form) os << " map";
  if (strided) os << " strided";
  os << " H" << hidden << " seed" << seed;
  return os.str();
}

CaseInput make_case_input(const DispatchCase& c) {
  CaseInput in;
  const int E = c.num_experts, K = c.num_topk;
  const int64_t H = c.hidden;
  for (int s = 0; s < c.ranks; ++s) {
    std::mt19937_64 rng(mix(c.seed, uint64_t(s)));
    const int64_t T = c.tokens[size_t(s)];
    TokenTensor x;
    x.x = Tensor::empty(c.dtype, T, H);
    if (c.dtype == DType::kFP8) {
      x.scales = Tensor::empty(DType::kF32, T, H / kFp8BlockSize);
      std::vector<float> row(static_cast<size_t>(H));
      for (int64_t t = 0; t < T; ++t) {
        for (auto& v : row) v = random_float(rng) * 8.0f;
        quantize_fp8_row(row, /*round_scale=*/(t % 2) == 1,
                         std::span<fp8_e4m3>(x.x.row<fp8_e4m3>(t), size_t(H)),
                         std::span<float>(x.scales.row<float>(t), size_t(H / kFp8BlockSize)));
      }
    } else {
      // Small integers: exact in bf16, and x * prob (prob a multiple of 1/8) stays exact, so
      // the round-trip identity can be checked bit for bit.
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < H; ++h) store(x.x.view(), t, h, float(int(rng() % 17) - 8));
      }
    }
    in.hidden.push_back(std::move(x));

    TopkRouting r;
    r.num_tokens = T;
    r.num_topk = K;
    r.topk_idx.assign(size_t(T) * K, -1);
    r.topk_weights.assign(size_t(T) * K, 0.0f);
    const int hot = int(mix(c.seed, 77) % uint64_t(E));
    std::vector<int> experts(static_cast<size_t>(E));
    for (int64_t t = 0; t < T; ++t) {
      for (int e = 0; e < E; ++e) experts[size_t(e)] = e;
      // Partial Fisher-Yates: K distinct experts; the hot one first when skewed.
      int start = 0;
      if (c.skewed) {
        std::swap(experts[0], experts[size_t(hot)]);
        start = 1;
      }
      for (int k = start; k < K; ++k) {
        const int j = k + int(rng() % uint64_t(E - k));
        std::swap(experts[size_t(k)], experts[size_t(j)]);
      }
      for (int k = 0; k < K; ++k) {
        // Some empty slots (K > 1, not the hot one) and probs that tie (multiples of 1/8).
        const bool empty = K > 1 && !(c.skewed && k == 0) && rng() % 10 == 0;
        r.topk_idx[size_t(t) * K + k] = empty ? -1 : experts[size_t(k)];
        r.topk_weights[size_t(t) * K + k] = empty ? 0.0f : float(1 + rng() % 8) / 8.0f;
      }
    }
    in.map.push_back(to_map(r, E));
    in.topk.push_back(std::move(r));
  }
  return in;
}

namespace {

// One case on one rank: its input, the reference's answers and the dispatcher under test,
// shared by the checks below (each compares one step with the reference, bit for bit).
struct CaseRun {
  const DispatchCase& c;
  const CaseInput& in;
  int me = 0;
  ReferenceProblem p;
  std::vector<ReferenceRankDispatch> ref;
  std::vector<RoutingMap> eff;  // the reference's effective routing, per source rank
  std::unique_ptr<TokenDispatcher> d;
  StridedCopies strided;
  DispatchOutput out;     // this rank's dispatch
  std::vector<Tensor> y;  // every rank's random expert outputs
  std::vector<TensorView> y_views;
  TensorView my_y;

  CaseRun(const DispatchCase& c, const CaseInput& in, int me)
      : c(c), in(in), me(me), strided(c.strided) {}
};

Status check_dispatch(CaseRun& run) {
  const DispatchCase& c = run.c;
  const int me = run.me;
  DispatchInput din;
  din.hidden = run.strided(run.in.hidden[size_t(me)].rows());
  if (c.map_form) {
    din.map = MapView::of(run.in.map[size_t(me)]);
  } else {
    din.topk = TopkView::of(run.in.topk[size_t(me)]);
  }
  MOED_ASSIGN_OR_RETURN(run.out, run.d->dispatch(din));
  const DispatchOutput& out = run.out;
  const ReferenceRankDispatch& want = run.ref[size_t(me)];
  const DispatchHandle& h = *out.handle;
  MOED_RETURN_IF_ERROR(
      compare_rows("dispatch expert_input", out.expert_input.x, want.expert_input.x));
  if (c.dtype == DType::kFP8) {
    MOED_RETURN_IF_ERROR(
        compare_rows("dispatch fp8 scales", out.expert_input.scales, want.expert_input.scales));
  }
  MOED_RETURN_IF_ERROR(compare_values(
      "tokens_per_expert",
      std::vector<int64_t>(out.tokens_per_expert.begin(), out.tokens_per_expert.end()),
      want.tokens_per_expert));
  MOED_RETURN_IF_ERROR(
      compare_values("handle tokens_per_expert", h.tokens_per_expert, want.tokens_per_expert));
  MOED_RETURN_IF_ERROR(compare_values("tokens_per_expert_unpadded", h.tokens_per_expert_unpadded,
                                      want.tokens_per_expert_unpadded));
  MOED_RETURN_IF_ERROR(compare_values(
      "permuted_probs", std::vector<float>(out.permuted_probs.begin(), out.permuted_probs.end()),
      want.permuted_probs));
  MOED_RETURN_IF_ERROR(
      compare_values("handle permuted_probs", h.permuted_probs, want.permuted_probs));
  MOED_RETURN_IF_ERROR(compare_values("row_src_rank", h.row_src_rank, want.row_src_rank));
  MOED_RETURN_IF_ERROR(compare_values("row_src_token", h.row_src_token, want.row_src_token));
  if (h.num_rows != want.expert_input.x.rows()) {
    return internal_error("handle num_rows = ", h.num_rows, ", reference ",
                          want.expert_input.x.rows());
  }
  return ok_status();
}

// Combine of random expert outputs (padding rows too: they must be ignored).
Status check_combine(CaseRun& run) {
  const DispatchCase& c = run.c;
  const int me = run.me;
  for (int g = 0; g < c.ranks; ++g) {
    run.y.push_back(random_rows(c.out_dtype, run.ref[size_t(g)].expert_input.x.rows(), c.hidden,
                                mix(c.seed, 100 + g)));
    run.y_views.push_back(run.y.back().view());
  }
  run.my_y = run.strided(run.y[size_t(me)].view());
  MOED_ASSIGN_OR_RETURN(CombineOutput co,
                        run.d->combine(CombineInput{TokenRows{run.my_y, {}}, run.out.handle}));
  MOED_ASSIGN_OR_RETURN(std::vector<Tensor> ref_out, reference_combine(run.p, run.y_views));
  MOED_RETURN_IF_ERROR(compare_rows("combine out", co.hidden, ref_out[size_t(me)]));
  const RoutingMap& m = run.eff[size_t(me)];
  std::vector<float> probs(size_t(m.num_tokens), 0.0f);
  for (int64_t t = 0; t < m.num_tokens; ++t) {
    float acc = 0.0f;
    for (int e = 0; e < c.num_experts; ++e) {
      if (m.routed(t, e)) acc += m.prob(t, e);
    }
    probs[size_t(t)] = acc;
  }
  return compare_values("combined_probs", co.combined_probs, probs);
}

Status check_dispatch_backward(CaseRun& run) {
  const DispatchCase& c = run.c;
  const int me = run.me, R = c.ranks;
  std::vector<Tensor> gr;
  std::vector<TensorView> gr_views;
  std::vector<std::vector<float>> gpp(static_cast<size_t>(R));
  const bool with_pprobs = c.seed % 3 != 0;
  for (int g = 0; g < R; ++g) {
    const int64_t n = run.ref[size_t(g)].expert_input.x.rows();
    gr.push_back(random_rows(c.out_dtype, n, c.hidden, mix(c.seed, 200 + g)));
    gr_views.push_back(gr.back().view());
    if (with_pprobs) {
      std::mt19937_64 rng(mix(c.seed, 300 + g));
      for (int64_t i = 0; i < n; ++i) gpp[size_t(g)].push_back(random_float(rng));
    }
  }
  MOED_ASSIGN_OR_RETURN(DispatchGrad dg,
                        run.d->dispatch_backward(DispatchGradInput{
                            run.strided(gr[size_t(me)].view()), gpp[size_t(me)], run.out.handle}));
  MOED_ASSIGN_OR_RETURN(ReferenceDispatchGrad rdg,
                        reference_dispatch_backward(run.p, gr_views, gpp));
  MOED_RETURN_IF_ERROR(
      compare_rows("dispatch backward grad_hidden", dg.grad_hidden, rdg.grad_hidden[size_t(me)]));
  return compare_values("dispatch backward grad_probs", dg.grad_probs, rdg.grad_probs[size_t(me)]);
}

Status check_combine_backward(CaseRun& run) {
  const DispatchCase& c = run.c;
  const int me = run.me;
  std::vector<Tensor> go;
  std::vector<TensorView> go_views;
  for (int s = 0; s < c.ranks; ++s) {
    go.push_back(random_rows(c.out_dtype, c.tokens[size_t(s)], c.hidden, mix(c.seed, 400 + s)));
    go_views.push_back(go.back().view());
  }
  MOED_ASSIGN_OR_RETURN(CombineGrad cg, run.d->combine_backward(CombineGradInput{
                                            run.strided(go[size_t(me)].view()),
                                            TokenRows{run.my_y, {}}, run.out.handle}));
  MOED_ASSIGN_OR_RETURN(ReferenceCombineGrad rcg,
                        reference_combine_backward(run.p, go_views, run.y_views));
  MOED_RETURN_IF_ERROR(compare_rows("combine backward grad_expert_output", cg.grad_expert_output,
                                    rcg.grad_expert_output[size_t(me)]));
  return compare_values("combine backward grad_probs", cg.grad_probs, rcg.grad_probs[size_t(me)]);
}

// Megatron's round trip, computed independently of the reference. Experts: each of the P
// shards returns x * prob / P (unweighted) or x / P (weighted, the combine applies the prob):
// combine(dispatch(x)) = x * (sum of kept probs). Backward with grad_out = x: the experts'
// backward multiplies by prob / P (or 1 / P), and the dispatch backward sums: grad_x = x *
// (sum of kept probs). All values are exact (small integers times multiples of 1/8 and
// halves), so bitwise equality holds in any order.
Status check_round_trip(CaseRun& run) {
  const DispatchCase& c = run.c;
  const int64_t H = c.hidden;
  const int P = c.etp;
  const DispatchHandle& h = *run.out.handle;
  // The experts' forward (and backward): each row times its prob / P, or 1 / P when weighted.
  auto experts = [&](const TensorView& rows) {
    const int64_t n = run.out.expert_input.x.rows;
    Tensor scaled = Tensor::empty(c.out_dtype, n, H);
    for (int64_t r = 0; r < n; ++r) {
      const float scale = (c.weighted ? 1.0f : h.permuted_probs[size_t(r)]) / float(P);
      for (int64_t hh = 0; hh < H; ++hh) store(scaled.view(), r, hh, load(rows, r, hh) * scale);
    }
    return scaled;
  };
  const Tensor ye = experts(run.out.expert_input.x);
  const RoutingMap& m = run.eff[size_t(run.me)];
  const TensorView x = run.in.hidden[size_t(run.me)].x.view();
  Tensor expect = Tensor::empty(c.out_dtype, x.rows, H);
  for (int64_t t = 0; t < x.rows; ++t) {
    float sum = 0.0f;
    for (int e = 0; e < c.num_experts; ++e) {
      if (m.routed(t, e)) sum += m.prob(t, e);
    }
    for (int64_t hh = 0; hh < H; ++hh) {
      store(expect.view(), t, hh, sum == 0.0f ? 0.0f : load(x, t, hh) * sum);
    }
  }
  MOED_ASSIGN_OR_RETURN(CombineOutput rt,
                        run.d->combine(CombineInput{TokenRows{ye.view(), {}}, run.out.handle}));
  MOED_RETURN_IF_ERROR(
      compare_rows("round trip combine(dispatch(x)) vs x * sum(probs)", rt.hidden, expect));
  Tensor gx = Tensor::empty(c.out_dtype, x.rows, H);
  for (int64_t t = 0; t < x.rows; ++t) {
    for (int64_t hh = 0; hh < H; ++hh) store(gx.view(), t, hh, load(x, t, hh));
  }
  MOED_ASSIGN_OR_RETURN(CombineGrad cg, run.d->combine_backward(CombineGradInput{
                                            gx.view(), TokenRows{ye.view(), {}}, run.out.handle}));
  const Tensor gy = experts(cg.grad_expert_output.view());
  MOED_ASSIGN_OR_RETURN(DispatchGrad dg,
                        run.d->dispatch_backward(DispatchGradInput{gy.view(), {}, run.out.handle}));
  return compare_rows("round trip backward grad_x vs x * sum(probs)", dg.grad_hidden, expect);
}

}  // namespace

Status check_case(World& w, const DispatchCase& c, DispatcherKind kind,
                  const DispatcherFactory& make) {
  const int R = c.ranks, P = c.etp;
  MOED_CHECK(w.size() == R, "world size ", w.size(), " != case ranks ", R);
  const CaseInput in = make_case_input(c);
  CaseRun run(c, in, w.rank());

  ReferenceProblem& p = run.p;
  p.num_experts = c.num_experts;
  p.ep_size = R / P;
  p.etp_size = P;
  p.layout = c.layout;
  p.weighted_combine = c.weighted;
  p.num_topk = c.num_topk;
  p.routing = in.map;
  for (const TokenTensor& x : in.hidden) p.hidden.push_back(rows_of(x));
  MOED_ASSIGN_OR_RETURN(run.ref, reference_dispatch(p));
  MOED_ASSIGN_OR_RETURN(run.eff, reference_effective_routing(p));

  DispatchConfig cfg;
  cfg.kind = kind;
  cfg.num_experts = c.num_experts;
  cfg.etp_size = P;
  cfg.layout = c.layout;
  cfg.weighted_combine = c.weighted;
  MOED_ASSIGN_OR_RETURN(run.d, make(w, cfg));

  MOED_RETURN_IF_ERROR(check_dispatch(run));
  MOED_RETURN_IF_ERROR(check_combine(run));
  MOED_RETURN_IF_ERROR(check_dispatch_backward(run));
  MOED_RETURN_IF_ERROR(check_combine_backward(run));
  if (c.dtype != DType::kFP8) MOED_RETURN_IF_ERROR(check_round_trip(run));
  return ok_status();
}

Status run_cases(Backend b, const std::vector<DispatchCase>& cases, DispatcherKind kind,
                 const DispatcherFactory& make) {
  std::map<std::pair<int, int>, std::vector<const DispatchCase*>> groups;
  for (const DispatchCase& c : cases) groups[{c.ranks, c.ranks_per_node}].push_back(&c);
  for (const auto& [key, group] : groups) {
    Status s = run_world(b, key.first, key.second, [&](World& w) -> Status {
      for (const DispatchCase* c : group) {
        Status r = check_case(w, *c, kind, make);
        if (!r.ok()) {
          return Status(r.code(), str_cat(dispatcher_kind_name(kind), " case ", c->name(),
                                          ": rank ", w.rank(), ": ", r.message()));
        }
      }
      return ok_status();
    });
    if (!s.ok()) return s;
  }
  return ok_status();
}

std::vector<DispatchCase> sweep_cases() {
  struct Layout {
    LayoutOptions options;
    bool weighted;
  };
  std::vector<Layout> layouts;
  layouts.push_back({LayoutOptions{}, false});  // dropless
  {
    LayoutOptions o;
    o.capacity_factor = 0.5;
    o.drop_policy = DropPolicy::kProbs;
    layouts.push_back({o, false});
    o.drop_policy = DropPolicy::kPosition;
    layouts.push_back({o, false});
    o.drop_policy = DropPolicy::kProbs;
    o.pad_to_capacity = true;
    layouts.push_back({o, false});
  }
  {
    LayoutOptions o;
    o.expert_alignment = 16;
    layouts.push_back({o, false});
  }
  {
    LayoutOptions o;
    o.router_padding_multiple = 16;
    layouts.push_back({o, false});
  }
  layouts.push_back({LayoutOptions{}, true});  // weighted combine
  const DType dtypes[3] = {DType::kF32, DType::kBF16, DType::kFP8};

  std::vector<DispatchCase> cases;
  uint64_t seed = 1;
  for (int R : {1, 2, 3, 4, 8}) {
    for (int P : {1, 2}) {
      if (R % P != 0) continue;
      const int EP = R / P;
      std::vector<int> expert_counts = {R, 4 * R, 8 * R};
      if (EP != R) expert_counts.insert(expert_counts.begin(), EP);
      int combo = 0;
      for (int E : expert_counts) {
        const int L = E / EP;
        std::vector<int> ks;
        for (int k : {1, 2, L, E}) {
          if (k <= E && std::find(ks.begin(), ks.end(), k) == ks.end()) ks.push_back(k);
        }
        for (int K : ks) {
          for (int di = 0; di < 3; ++di, ++seed) {
            const int i = combo * 3 + di;
            const Layout& lay = layouts[size_t((combo + di * 3) % layouts.size())];
            DispatchCase c;
            c.ranks = R;
            c.ranks_per_node = (R == 4 && i % 2 == 1) ? 2 : 0;  // two nodes sometimes
            c.etp = P;
            c.num_experts = E;
            c.num_topk = K;
            for (int s = 0; s < R; ++s) c.tokens.push_back((i * 5 + s * 7 + 3) % 14);
            if (R > 1 && i % 3 == 0) c.tokens[size_t(R - 1)] = 0;
            c.skewed = i % 4 == 1;
            c.layout = lay.options;
            c.weighted = lay.weighted || i % 5 == 2;
            c.dtype = dtypes[di];
            c.out_dtype = i % 2 == 0 ? DType::kF32 : DType::kBF16;
            c.hidden = 128;
            c.map_form = i % 3 == 2;
            c.seed = seed;
            cases.push_back(std::move(c));
          }
          ++combo;
        }
      }
    }
  }
  return cases;
}

std::vector<DispatchCase> sweep_cases(int ranks) {
  std::vector<DispatchCase> out;
  for (const DispatchCase& c : sweep_cases()) {
    if (c.ranks == ranks) out.push_back(c);
  }
  return out;
}

std::vector<DispatchCase> edge_cases() {
  std::vector<DispatchCase> cases;
  uint64_t seed = 5000;
  auto add = [&](int R, int G, int E, int K, std::vector<int64_t> tokens, DType dt, int H) {
    DispatchCase c;
    c.ranks = R;
    c.ranks_per_node = G;
    c.num_experts = E;
    c.num_topk = K;
    c.tokens = std::move(tokens);
    c.dtype = dt;
    c.out_dtype = seed % 2 ? DType::kBF16 : DType::kF32;
    c.hidden = H;
    c.map_form = seed % 3 == 0;
    c.weighted = seed % 4 == 1;
    c.seed = seed++;
    cases.push_back(c);
    return &cases.back();
  };
  std::vector<LayoutOptions> layouts(5);
  layouts[1].capacity_factor = 0.5;
  layouts[2].capacity_factor = 0.5;
  layouts[2].drop_policy = DropPolicy::kPosition;
  layouts[2].pad_to_capacity = true;
  layouts[3].expert_alignment = 16;
  layouts[4].router_padding_multiple = 16;
  const DType dtypes[3] = {DType::kF32, DType::kBF16, DType::kFP8};

  // Strided inputs: every dtype, every layout, one and two nodes, ETP 2.
  for (int i = 0; i < 6; ++i) {
    const int R = i < 2 ? 1 + i : 4;
    DispatchCase* c = add(R, i == 5 ? 2 : 0, 2 * R, 2, std::vector<int64_t>(size_t(R), 9),
                          dtypes[i % 3], i % 3 == 2 ? 128 : 100);
    c->strided = true;
    c->layout = layouts[size_t(i) % layouts.size()];
    c->skewed = i == 3;
    if (i == 4) c->etp = 2;
  }
  // R = 5 and 7 (one node, and nodes of 1 for 5 ranks), some ranks with no tokens, K = 1, 2, E.
  for (int R : {5, 7}) {
    for (int i = 0; i < 4; ++i) {
      std::vector<int64_t> t;
      for (int s = 0; s < R; ++s) t.push_back((s * 3 + i) % 7);
      const int E = i < 2 ? R : 2 * R;
      const int K = i == 0 ? 1 : i == 3 ? E : 2;
      DispatchCase* c =
          add(R, R == 5 && i == 2 ? 1 : 0, E, K, t, dtypes[i % 3], i % 3 == 2 ? 128 : 17 + 16 * i);
      c->layout = layouts[size_t(i + R) % layouts.size()];
      c->strided = i == 1;
      c->skewed = i == 2;
    }
  }
  // Every rank with T = 0, every layout.
  for (int R : {2, 3, 5}) {
    for (size_t l = 0; l < layouts.size(); ++l) {
      DispatchCase* c = add(R, 0, 2 * R, 2, std::vector<int64_t>(size_t(R), 0), dtypes[l % 3],
                            l % 3 == 2 ? 128 : 17);
      c->layout = layouts[l];
      c->strided = l % 2 == 1;
    }
  }
  // Hidden sizes that are not a multiple of 16 (vector tails), a large one with few tokens.
  for (int H : {17, 100, 4099}) {
    for (int i = 0; i < 2; ++i) {
      const int R = 2 + i;
      const int64_t T = H > 1000 ? 3 : 6;
      DispatchCase* c = add(R, 0, 2 * R, 2, std::vector<int64_t>(size_t(R), T), dtypes[i], H);
      c->strided = i == 1;
    }
  }
  return cases;
}

}  // namespace moed::testing
