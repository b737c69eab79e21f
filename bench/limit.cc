#include "bench/limit.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <string>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#define MOED_HAVE_CALLGRIND 1
#endif

#include "bench/common.h"

namespace moed::bench {

uint64_t last_level_cache_bytes() {
  static const uint64_t bytes = [] {
    uint64_t best = 0;
    int best_level = 0;
    for (int i = 0; i < 8; ++i) {
      const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i);
      std::ifstream level_file(dir + "/level"), size_file(dir + "/size");
      int level = 0;
      std::string size;
      if (!(level_file >> level) || !(size_file >> size) || size.empty()) continue;
      uint64_t n = std::strtoull(size.c_str(), nullptr, 10);
      if (size.back() == 'K') n <<= 10;
      if (size.back() == 'M') n <<= 20;
      if (level > best_level || (level == best_level && n > best)) best = n, best_level = level;
    }
#ifdef _SC_LEVEL3_CACHE_SIZE
    if (best == 0) {
      const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
      if (l3 > 0) best = uint64_t(l3);
    }
#endif
    return best > 0 ? best : uint64_t(32) << 20;
  }();
  return bytes;
}

const char* stream_op_name(StreamOp op) {
  switch (op) {
    case StreamOp::kRead: return "read";
    case StreamOp::kWrite: return "write";
    case StreamOp::kCopy: return "copy";
  }
  return "?";
}

double StreamRates::gbps(StreamOp op) const {
  return op == StreamOp::kRead ? read_gbps : op == StreamOp::kWrite ? write_gbps : copy_gbps;
}
double& StreamRates::gbps(StreamOp op) {
  return op == StreamOp::kRead ? read_gbps : op == StreamOp::kWrite ? write_gbps : copy_gbps;
}

namespace {

constexpr size_t kLine = 64;
constexpr int64_t kMinLinesPerTask = (size_t(1) << 16) / kLine;

// Keeps the reads' sum alive, so that the compiler cannot drop them.
std::atomic<uint64_t> read_sink{0};

// Calls line(offset) for every line of [p, p + n), n a multiple of 64, as kStreams runs side
// by side: a core keeps more cache misses in flight over several streams than over one (2 cores
// of the AMD VMs read 31 GB/s over 4 streams each, 25 over one), and the kernels do read several
// at once (a combine gathers each token's K rows). The lines left over go last, one stream.
constexpr size_t kStreams = 4;
template <typename Line>
void for_lines(size_t n, Line&& line) {
  const size_t q = n / kLine / kStreams * kLine;  // bytes per stream
  for (size_t i = 0; i < q; i += kLine) {
    for (size_t s = 0; s < kStreams; ++s) line(s * q + i);
  }
  for (size_t i = q * kStreams; i < n; i += kLine) line(i);
}

// [p, p + n), n a multiple of 64, p 64-byte aligned.
uint64_t read_lines(const char* p, size_t n) {
#if defined(__SSE2__)
  __m128i a = _mm_setzero_si128(), b = a, c = a, d = a;
  for_lines(n, [&](size_t i) {
    a = _mm_add_epi64(a, _mm_load_si128(reinterpret_cast<const __m128i*>(p + i)));
    b = _mm_add_epi64(b, _mm_load_si128(reinterpret_cast<const __m128i*>(p + i + 16)));
    c = _mm_add_epi64(c, _mm_load_si128(reinterpret_cast<const __m128i*>(p + i + 32)));
    d = _mm_add_epi64(d, _mm_load_si128(reinterpret_cast<const __m128i*>(p + i + 48)));
  });
  alignas(16) uint64_t out[2];
  _mm_store_si128(reinterpret_cast<__m128i*>(out),
                  _mm_add_epi64(_mm_add_epi64(a, b), _mm_add_epi64(c, d)));
  return out[0] + out[1];
#else
  uint64_t s[4] = {0, 0, 0, 0};
  for_lines(n, [&](size_t i) {
    for (int j = 0; j < 8; ++j) {
      uint64_t v;
      std::memcpy(&v, p + i + j * 8, 8);
      s[j % 4] += v;
    }
  });
  return s[0] + s[1] + s[2] + s[3];
#endif
}

void write_lines(char* p, size_t n, bool nt) {
#if defined(__SSE2__)
  if (nt) {
    const __m128i v = _mm_set1_epi8(1);
    for (size_t i = 0; i < n; i += 16) _mm_stream_si128(reinterpret_cast<__m128i*>(p + i), v);
    _mm_sfence();
    return;
  }
#endif
  (void)nt;
  std::memset(p, 1, n);
}

void copy_lines(char* dst, const char* src, size_t n, bool nt) {
#if defined(__SSE2__)
  if (nt) {
    for_lines(n, [&](size_t i) {
      const __m128i a = _mm_load_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_load_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_load_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_load_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    });
    _mm_sfence();
    return;
  }
#endif
  (void)nt;
  std::memcpy(dst, src, n);
}

}  // namespace

Stream::Stream(World& w) : w_(&w), pool_(w.pool()) { allocate(size_t(w.size())); }

Stream::Stream(ThreadPool& pool) : pool_(pool) { allocate(1); }

void Stream::allocate(size_t R) {
  total_ = std::max<uint64_t>(4 * last_level_cache_bytes(), uint64_t(64) << 20);
  share_ = (size_t(total_) / R + kLine - 1) / kLine * kLine;
  total_ = uint64_t(share_) * R;
  src_ = static_cast<char*>(std::aligned_alloc(kLine, share_));
  dst_ = static_cast<char*>(std::aligned_alloc(kLine, share_));
  if (src_ == nullptr || dst_ == nullptr) throw std::bad_alloc();
  // Every page touched now, so that no timed pass takes page faults.
  std::memset(src_, 1, share_);
  std::memset(dst_, 0, share_);
}

Stream::~Stream() {
  std::free(src_);
  std::free(dst_);
}

StatusOr<double> Stream::run(StreamOp op, bool nt) {
  const int64_t lines = int64_t(share_ / kLine);
  auto pass = [&] {
    pool_.parallel_for(
        lines,
        [&](int64_t b, int64_t e, int) {
          const size_t at = size_t(b) * kLine, n = size_t(e - b) * kLine;
          switch (op) {
            case StreamOp::kRead:
              read_sink.fetch_add(read_lines(src_ + at, n), std::memory_order_relaxed);
              break;
            case StreamOp::kWrite:
              write_lines(dst_ + at, n, nt);
              break;
            case StreamOp::kCopy:
              copy_lines(dst_ + at, src_ + at, n, nt);
          }
        },
        kMinLinesPerTask);
    return ok_status();
  };
  double seconds = 0;
  if (w_ != nullptr) {
    MOED_ASSIGN_OR_RETURN(seconds, time_span(*w_, pass));
  } else {
    const auto a = std::chrono::steady_clock::now();
    MOED_RETURN_IF_ERROR(pass());
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
  }
  const double bytes = double(total_) * (op == StreamOp::kCopy ? 2 : 1);
  return seconds > 0 ? bytes / seconds / 1e9 : 0.0;
}

Status Stream::calibrate() {
  StreamRates& c = calibration_;
  c.array_bytes = total_;
  // Twice each, the better kept: the first pass of each may still find the other's lines.
  auto best = [&](StreamOp op, bool nt) -> StatusOr<double> {
    MOED_ASSIGN_OR_RETURN(const double a, run(op, nt));
    MOED_ASSIGN_OR_RETURN(const double b, run(op, nt));
    return std::max(a, b);
  };
  MOED_ASSIGN_OR_RETURN(c.read_gbps, best(StreamOp::kRead, false));
  MOED_ASSIGN_OR_RETURN(const double write_plain, best(StreamOp::kWrite, false));
  MOED_ASSIGN_OR_RETURN(const double write_nt, best(StreamOp::kWrite, true));
  MOED_ASSIGN_OR_RETURN(const double copy_plain, best(StreamOp::kCopy, false));
  MOED_ASSIGN_OR_RETURN(const double copy_nt, best(StreamOp::kCopy, true));
  // NOTE: every rank must keep the same kind of store; rank 0's verdict is everyone's.
  int64_t nt[2] = {write_nt > write_plain, copy_nt > copy_plain};
  if (w_ != nullptr) MOED_RETURN_IF_ERROR(w_->broadcast_bytes(nt, sizeof(nt), 0));
  c.nt_write = nt[0] != 0;
  c.nt_copy = nt[1] != 0;
  c.write_gbps = c.nt_write ? write_nt : write_plain;
  c.copy_gbps = c.nt_copy ? copy_nt : copy_plain;
  calibrated_ = true;
  return ok_status();
}

StatusOr<StreamSample> Stream::next() {
  if (!calibrated_) MOED_RETURN_IF_ERROR(calibrate());
  const StreamOp op = StreamOp(next_op_);
  next_op_ = (next_op_ + 1) % 3;
  const bool nt = op == StreamOp::kWrite   ? calibration_.nt_write
                  : op == StreamOp::kCopy ? calibration_.nt_copy
                                           : false;
  MOED_ASSIGN_OR_RETURN(const double gbps, run(op, nt));
  return StreamSample{op, gbps};
}

double limit_seconds(const TrafficModel& m, const StreamRates& r) {
  if (r.read_gbps <= 0 || r.write_gbps <= 0 || r.copy_gbps <= 0) return 0;
  const double read = m.read_bytes + m.network_bytes, write = m.write_bytes + m.network_bytes;
  const double paired = std::min(read, write);
  return (2 * paired / r.copy_gbps + (read - paired) / r.read_gbps +
          (write - paired) / r.write_gbps) /
         1e9;
}

namespace {

struct Layout {
  int L = 1, G = 1;  // experts per rank, ranks per node
  int node_of_expert(int e) const { return (e / L) / G; }
};

// Token t's picks (its experts, -1 left out), and in `nodes` each pick's node, ascending.
int token_nodes(const Layout& l, const TopkRouting& r, int64_t t, std::vector<int>& nodes) {
  nodes.clear();
  for (int k = 0; k < r.num_topk; ++k) {
    const int e = r.idx(t, k);
    if (e >= 0) nodes.push_back(l.node_of_expert(e));
  }
  std::sort(nodes.begin(), nodes.end());
  return int(nodes.size());
}

Layout layout_of(int num_experts, int ranks, int ranks_per_node) {
  Layout l;
  l.L = std::max(1, num_experts / std::max(1, ranks));
  l.G = ranks_per_node > 0 ? ranks_per_node : ranks;
  return l;
}

}  // namespace

TrafficModel dispatch_model(const std::vector<TopkRouting>& topk, int num_experts, int ranks,
                            int ranks_per_node, double in_row_bytes, double out_row_bytes) {
  const Layout l = layout_of(num_experts, ranks, ranks_per_node);
  TrafficModel m;
  std::vector<int> nodes;
  for (int src = 0; src < int(topk.size()); ++src) {
    const TopkRouting& r = topk[size_t(src)];
    const int home = src / l.G;
    m.read_bytes += double(r.topk_idx.size()) * 8;  // indices and weights
    for (int64_t t = 0; t < r.num_tokens; ++t) {
      const int picks = token_nodes(l, r, t, nodes);
      if (picks == 0) continue;
      m.read_bytes += in_row_bytes;
      m.write_bytes += picks * (out_row_bytes + 8);
      nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
      const auto remote =
          std::count_if(nodes.begin(), nodes.end(), [&](int n) { return n != home; });
      m.network_bytes += double(remote) * (out_row_bytes + 8.0 * r.num_topk);
    }
  }
  return m;
}

TrafficModel combine_model(const std::vector<TopkRouting>& topk, int num_experts, int ranks,
                           int ranks_per_node, double row_bytes, bool weighted) {
  const Layout l = layout_of(num_experts, ranks, ranks_per_node);
  TrafficModel m;
  std::vector<int> nodes;     // the token's experts' nodes, ascending (the summation order)
  std::vector<int> per_node;  // its experts on each of them
  for (int src = 0; src < int(topk.size()); ++src) {
    const TopkRouting& r = topk[size_t(src)];
    const int home = src / l.G;
    for (int64_t t = 0; t < r.num_tokens; ++t) {
      const int picks = token_nodes(l, r, t, nodes);
      if (picks == 0) continue;
      m.read_bytes += picks * (row_bytes + 4 + (weighted ? 4 : 0));
      m.write_bytes += row_bytes;
      // Experts ascending are nodes ascending; count each node's.
      per_node.clear();
      std::vector<int> distinct;
      for (size_t i = 0; i < nodes.size(); ++i) {
        if (i == 0 || nodes[i] != nodes[i - 1]) {
          distinct.push_back(nodes[i]);
          per_node.push_back(0);
        }
        ++per_node.back();
      }
      const int n = int(distinct.size());
      // i = 0: every remote expert's bf16 row home. i >= 1: the fp32 partial (2 row_bytes)
      // chained through the first i nodes, then home (rounded when it is complete), the
      // remaining nodes' experts' rows home one by one.
      double best = 0;
      for (int i = 0; i < n; ++i) best += distinct[size_t(i)] != home ? per_node[size_t(i)] : 0;
      best *= row_bytes;
      for (int i = 1; i <= n; ++i) {
        double cost = 2 * row_bytes * (i - 1);
        if (distinct[size_t(i) - 1] != home) cost += (i == n ? 1 : 2) * row_bytes;
        for (int j = i; j < n; ++j) {
          if (distinct[size_t(j)] != home) cost += per_node[size_t(j)] * row_bytes;
        }
        best = std::min(best, cost);
      }
      m.network_bytes += best;
    }
  }
  return m;
}

Status close_figures(Stream& stream, std::initializer_list<Paired*> figures) {
  for (int i = 0; i < 3; ++i) {  // next() rotates read, write, copy: one of each
    MOED_ASSIGN_OR_RETURN(const StreamSample s, stream.next());
    for (Paired* p : figures) p->closing.push_back(s);
  }
  return ok_status();
}

StreamRates rates_of(const Paired& p) {
  StreamRates r = p.calibration;
  for (const auto* samples : {&p.stream, &p.closing}) {
    for (const StreamSample& s : *samples) r.gbps(s.op) = std::max(r.gbps(s.op), s.gbps);
  }
  return r;
}

void add_limit(nlohmann::json& record, const Paired& p, const TrafficModel& m) {
  const StreamRates r = rates_of(p);
  const double seconds = median(p.kernel);
  const double limit = limit_seconds(m, r);
  std::vector<double> fractions;
  for (size_t i = 0; i < p.kernel.size() && i < p.stream.size(); ++i) {
    StreamRates ri = r;
    ri.gbps(p.stream[i].op) = p.stream[i].gbps;  // the iteration's own load
    if (p.kernel[i] > 0) fractions.push_back(limit_seconds(m, ri) / p.kernel[i]);
  }
  const double fraction = seconds > 0 ? limit / seconds : 0.0;
  const double lo = fractions.empty() ? 0 : *std::min_element(fractions.begin(), fractions.end());
  const double hi = fractions.empty() ? 0 : *std::max_element(fractions.begin(), fractions.end());
  record["seconds"] = seconds;
  record["model_read_bytes"] = m.read_bytes;
  record["model_write_bytes"] = m.write_bytes;
  record["model_network_bytes"] = m.network_bytes;
  record["stream_read_gbps"] = r.read_gbps;
  record["stream_write_gbps"] = r.write_gbps;
  record["stream_copy_gbps"] = r.copy_gbps;
  record["stream_nt_write"] = r.nt_write;
  record["stream_nt_copy"] = r.nt_copy;
  record["stream_array_bytes"] = r.array_bytes;
  record["limit_seconds"] = limit;
  record["fraction_of_limit"] = fraction;
  record["fraction_min"] = lo;
  record["fraction_max"] = hi;
  record["noisy"] = fraction > 0 && (hi - lo) / fraction > kNoisySpread;
  record["cache_resident"] = m.total() <= double(last_level_cache_bytes());
}

Status callgrind_call(World& w, const std::string& name, const std::function<Status()>& fn) {
#ifdef MOED_HAVE_CALLGRIND
  if (RUNNING_ON_VALGRIND) {
    MOED_RETURN_IF_ERROR(w.barrier());
    if (w.rank() == 0) CALLGRIND_ZERO_STATS;
    MOED_RETURN_IF_ERROR(w.barrier());
    MOED_RETURN_IF_ERROR(fn());
    MOED_RETURN_IF_ERROR(w.barrier());
    if (w.rank() == 0) CALLGRIND_DUMP_STATS_AT(name.c_str());
    return w.barrier();
  }
#endif
  (void)w;
  (void)name;
  return fn();
}

}  // namespace moed::bench
