// Replay reports (moed/replay.h): the text table `moed replay` prints and its --json form.
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>

#include "moed/replay.h"
#include "replay/svg.h"

namespace moed {

namespace {

using svg::format;

// 1234567 -> "1.23 MB" (decimal units, as bandwidths in GB/s are).
std::string bytes_string(int64_t b) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  double v = double(b);
  int u = 0;
  while (v >= 1000.0 && u < 4) {
    v /= 1000.0;
    ++u;
  }
  return u == 0 ? format("%lld B", (long long)b) : format("%.2f %s", v, units[u]);
}

std::string seconds_string(double s) {
  if (s >= 1.0) return format("%.3f s", s);
  if (s >= 1e-3) return format("%.3f ms", s * 1e3);
  return format("%.2f us", s * 1e6);
}

std::string stats_row(const char* name, const std::vector<int64_t>& v, double imbalance) {
  if (v.empty()) return format("%-26s (none)\n", name);
  const int64_t sum = std::accumulate(v.begin(), v.end(), int64_t(0));
  const auto [mn, mx] = std::minmax_element(v.begin(), v.end());
  return format("%-26s %12lld %12.1f %12lld %9.3f\n", name, (long long)*mn,
                double(sum) / double(v.size()), (long long)*mx, imbalance);
}

std::string percent_change(int64_t from, int64_t to) {
  if (from == 0) return "";
  return format("(%+.1f%%)", 100.0 * (double(to) - double(from)) / double(from));
}

}  // namespace

std::string replay_table(const ReplayResult& r) {
  std::string out;
  out += format("moed replay: %s\n", r.trace_name.c_str());
  out += format(
      "  %lld step(s) x %lld tokens, top-%d, %d experts; %d ranks = %d node(s) x %d, "
      "%d local experts per rank, %lld tokens per rank per step\n",
      (long long)r.num_steps, (long long)r.num_tokens, r.num_topk, r.num_experts, r.num_ranks,
      r.num_nodes, r.ranks_per_node, r.num_local_experts, (long long)(r.num_tokens / r.num_ranks));
  out += format("  payload: hidden %lld x %d bytes = %lld bytes per row\n", (long long)r.hidden,
                r.dtype_bytes, (long long)r.row_bytes());
  const int64_t routed =
      std::accumulate(r.routed_per_expert.begin(), r.routed_per_expert.end(), int64_t(0));
  if (r.capacity_factor) {
    out += format(
        "  capacity factor %g (policy position) -> C = %lld per (source rank, expert, "
        "step); dropped %lld of %lld token-expert pairs (%.2f%%)\n",
        *r.capacity_factor, (long long)r.capacity, (long long)r.dropped, (long long)routed,
        routed ? 100.0 * double(r.dropped) / double(routed) : 0.0);
  } else {
    out += format("  dropless: %lld token-expert pairs routed, none dropped\n", (long long)routed);
  }

  out += "\nload (summed over steps)          min         mean          max  max/mean\n";
  out += stats_row("tokens per expert", r.tokens_per_expert, r.expert_imbalance);
  out += stats_row("rows per rank (experts)", r.rows_per_rank, r.rank_imbalance);
  std::vector<int64_t> recv = r.tokens_per_rank;
  out += stats_row("tokens received per rank", recv, [&] {
    const int64_t s = std::accumulate(recv.begin(), recv.end(), int64_t(0));
    return s ? double(*std::max_element(recv.begin(), recv.end())) * double(recv.size()) / double(s)
             : 0.0;
  }());

  out += "\ntokens per expert (kept";
  out += r.dropped > 0 ? ", +dropped)\n" : ")\n";
  for (int e0 = 0; e0 < r.num_experts; e0 += 8) {
    out += format("  e%-4d", e0);
    for (int e = e0; e < std::min(r.num_experts, e0 + 8); ++e) {
      const int64_t d = r.dropped_per_expert[size_t(e)];
      out += d > 0
                 ? format(" %8lld+%-6lld", (long long)r.tokens_per_expert[size_t(e)], (long long)d)
                 : format(" %8lld%-7s", (long long)r.tokens_per_expert[size_t(e)], "");
    }
    out += "\n";
  }

  out +=
      "\nper rank        rows   tokens in  tokens out   flat net bytes   Flex net bytes  "
      "Flex shm bytes\n";
  for (int s = 0; s < r.num_ranks; ++s) {
    int64_t sent = 0;
    for (int d = 0; d < r.num_ranks; ++d) sent += r.traffic_at(s, d);
    out += format("  r%-4d %11lld %11lld %11lld %16lld %16lld %15lld\n", s,
                  (long long)r.rows_per_rank[size_t(s)], (long long)r.tokens_per_rank[size_t(s)],
                  (long long)sent, (long long)r.flat.network_bytes[size_t(s)],
                  (long long)r.flex.network_bytes[size_t(s)],
                  (long long)r.flex.shared_bytes[size_t(s)]);
  }

  if (r.num_ranks <= 16) {
    out += "\ntraffic: tokens sent (source rank down, destination rank across)\n       ";
    for (int d = 0; d < r.num_ranks; ++d) out += format(" %8s", format("r%d", d).c_str());
    out += "\n";
    for (int s = 0; s < r.num_ranks; ++s) {
      out += format("  r%-4d", s);
      for (int d = 0; d < r.num_ranks; ++d) out += format(" %8lld", (long long)r.traffic_at(s, d));
      out += "\n";
    }
  } else {
    out += "\ntraffic matrix: see traffic.svg or --json (more than 16 ranks)\n";
  }

  const int64_t fn = r.flat.total_network_bytes(), xn = r.flex.total_network_bytes();
  const int64_t fs = r.flat.total_shared_bytes(), xs = r.flex.total_shared_bytes();
  const double steps = double(std::max<int64_t>(r.num_steps, 1));
  out += "\ndispatch (all ranks, all steps)      flat all-to-all      Flex (two hops)\n";
  out += format("  network bytes              %20s %20s %s\n", bytes_string(fn).c_str(),
                bytes_string(xn).c_str(), percent_change(fn, xn).c_str());
  out += format("  shared-memory bytes        %20s %20s %s\n", bytes_string(fs).c_str(),
                bytes_string(xs).c_str(), percent_change(fs, xs).c_str());
  out += format("  predicted time per step    %20s %20s",
                seconds_string(r.flat.seconds / steps).c_str(),
                seconds_string(r.flex.seconds / steps).c_str());
  out += r.flex.seconds > 0 ? format(" (%.2fx)\n", r.flat.seconds / r.flex.seconds) : "\n";
  out += format(
      "  model: per step, max over ranks of shared bytes / %g GB/s + network bytes / %g "
      "GB/s, bytes charged to the writer;\n         Flex header %lld B per (token, "
      "remote node) + %lld B per (token, expert) entry; flat counts payload only\n",
      r.shared_gbps, r.network_gbps, (long long)kFlexTokenHeaderBytes, (long long)kFlexEntryBytes);
  return out;
}

std::string replay_json(const ReplayResult& r) {
  using nlohmann::json;
  json traffic = json::array();
  for (int s = 0; s < r.num_ranks; ++s) {
    traffic.push_back(std::vector<int64_t>(r.traffic.begin() + size_t(s) * r.num_ranks,
                                           r.traffic.begin() + size_t(s + 1) * r.num_ranks));
  }
  auto scheme = [](const SchemeCost& c) {
    return json{{"shared_bytes", c.shared_bytes},
                {"network_bytes", c.network_bytes},
                {"total_shared_bytes", c.total_shared_bytes()},
                {"total_network_bytes", c.total_network_bytes()},
                {"step_seconds", c.step_seconds},
                {"seconds", c.seconds}};
  };
  json j = {{"trace", r.trace_name},
            {"num_steps", r.num_steps},
            {"num_tokens", r.num_tokens},
            {"num_topk", r.num_topk},
            {"num_experts", r.num_experts},
            {"num_ranks", r.num_ranks},
            {"ranks_per_node", r.ranks_per_node},
            {"num_nodes", r.num_nodes},
            {"num_local_experts", r.num_local_experts},
            {"hidden", r.hidden},
            {"dtype_bytes", r.dtype_bytes},
            {"row_bytes", r.row_bytes()},
            {"capacity_factor", r.capacity_factor ? json(*r.capacity_factor) : json(nullptr)},
            {"drop_policy", "position"},
            {"capacity", r.capacity},
            {"routed_per_expert", r.routed_per_expert},
            {"tokens_per_expert", r.tokens_per_expert},
            {"dropped_per_expert", r.dropped_per_expert},
            {"dropped", r.dropped},
            {"rows_per_rank", r.rows_per_rank},
            {"tokens_per_rank", r.tokens_per_rank},
            {"traffic", traffic},
            {"expert_imbalance", r.expert_imbalance},
            {"rank_imbalance", r.rank_imbalance},
            {"shared_gbps", r.shared_gbps},
            {"network_gbps", r.network_gbps},
            {"flex_token_header_bytes", kFlexTokenHeaderBytes},
            {"flex_entry_bytes", kFlexEntryBytes},
            {"flat", scheme(r.flat)},
            {"flex", scheme(r.flex)}};
  return j.dump(2);
}

}  // namespace moed
