// Reading Megatron-Core's per-rank routing traces (moed/megatron_trace.h). The format is the one
// megatron/core/transformer/moe/router_trace.py writes (RouterTracer._flush_records_to_disk and
// _record) and tests/unit_tests/transformer/moe/test_router_trace.py pins down.
#include "moed/megatron_trace.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <tuple>

namespace moed {

namespace {

using nlohmann::json;

std::string trace_file(const std::string& dir, int rank) {
  return (std::filesystem::path(dir) / ("router_trace_rank" + std::to_string(rank) + ".jsonl"))
      .string();
}
std::string sidecar_file(const std::string& dir, int rank) {
  return (std::filesystem::path(dir) / ("hidden_states_rank" + std::to_string(rank) + ".bin"))
      .string();
}

// (block, mtp_idx, layer): RouterTracer's layer identity.
using LayerKey = std::tuple<std::string, int, int>;

std::string key_label(const LayerKey& k) {
  const auto& [block, mtp, layer] = k;
  if (block == "mtp") return "mtp " + std::to_string(mtp) + " layer " + std::to_string(layer);
  return block + " layer " + std::to_string(layer);
}

struct Record {
  int line = 0;
  int64_t num_tokens = 0;
  int topk = 0;
  std::vector<int32_t> idx;  // [num_tokens, topk]
  bool has_hs = false;
  int64_t hs_offset = 0, hs_bytes = 0, hs_hidden = 0;
};

struct RankFile {
  std::string path;
  std::set<int64_t> steps;
  std::map<LayerKey, std::vector<Record>> selected;  // the selected step's matching records
  std::map<LayerKey, int> layers_of_step;            // every layer of the step: first line
};

// One field of a record as an integer, with the file, line and value in the error.
Status get_int(const json& rec, const char* field, const std::string& at, int64_t& out) {
  const auto it = rec.find(field);
  if (it == rec.end()) return invalid_argument(at, ": the record has no \"", field, "\"");
  if (!it->is_number_integer()) {
    return invalid_argument(at, ": \"", field, "\" = ", it->dump(), " is not an integer");
  }
  out = it->get<int64_t>();
  return ok_status();
}

// Reads `path` line by line. Every line must be a complete record with the identity fields;
// records of the selected step (and block / mtp / layer when given) keep their indices.
// `step` unset: only the steps are collected (the first pass over rank 0).
Status scan_file(const std::string& path, int rank, const MegatronTraceSelection& sel,
                 std::optional<int64_t> step, RankFile& out) {
  std::ifstream f(path);
  if (!f) return invalid_argument(path, ": cannot open");
  out.path = path;
  std::string text;
  int line = 0;
  while (std::getline(f, text)) {
    ++line;
    // NOTE: Megatron's own reader (test_router_trace.py `_read_jsonl`) skips blank lines.
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string at = path + ":" + std::to_string(line);
    const json rec = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (rec.is_discarded() || !rec.is_object()) {
      return invalid_argument(at, ": not a complete JSON record (",
                              text.size() > 40 ? text.substr(0, 40) + "..." : text,
                              "); was the file cut short?");
    }
    int64_t st = 0, layer = 0, r = 0, mtp = -1;
    MOED_RETURN_IF_ERROR(get_int(rec, "step", at, st));
    MOED_RETURN_IF_ERROR(get_int(rec, "layer", at, layer));
    MOED_RETURN_IF_ERROR(get_int(rec, "rank", at, r));
    if (r != rank) {
      return invalid_argument(at, ": rank = ", r, ", but the file is rank ", rank, "'s");
    }
    const auto block = rec.find("block");
    if (block == rec.end() || !block->is_string()) {
      return invalid_argument(at, ": \"block\" is missing or not a string");
    }
    if (rec.contains("mtp_idx")) MOED_RETURN_IF_ERROR(get_int(rec, "mtp_idx", at, mtp));
    out.steps.insert(st);
    if (!step || st != *step || block->get<std::string>() != sel.block) continue;
    const LayerKey key{block->get<std::string>(), int(mtp), int(layer)};
    out.layers_of_step.emplace(key, line);
    if ((sel.mtp_idx && mtp != *sel.mtp_idx) || (sel.layer && layer != *sel.layer)) continue;

    Record rc;
    rc.line = line;
    int64_t topk = 0;
    MOED_RETURN_IF_ERROR(get_int(rec, "num_tokens", at, rc.num_tokens));
    MOED_RETURN_IF_ERROR(get_int(rec, "topk", at, topk));
    if (rc.num_tokens < 0) return invalid_argument(at, ": num_tokens = ", rc.num_tokens, " < 0");
    if (topk < 1 || topk > 4096) return invalid_argument(at, ": topk = ", topk, " is outside [1, 4096]");
    rc.topk = int(topk);
    const auto top = rec.find("top_indices");
    if (top == rec.end() || !top->is_array() || int64_t(top->size()) != rc.num_tokens) {
      return invalid_argument(at, ": top_indices has ",
                              top == rec.end() || !top->is_array() ? std::string("no rows")
                                                                   : std::to_string(top->size()) + " rows",
                              " but num_tokens = ", rc.num_tokens);
    }
    const int64_t E = sel.num_experts;
    rc.idx.reserve(size_t(rc.num_tokens) * size_t(topk));
    for (int64_t t = 0; t < rc.num_tokens; ++t) {
      const json& row = (*top)[size_t(t)];
      if (!row.is_array() || int64_t(row.size()) != topk) {
        return invalid_argument(at, ": top_indices[", t, "] = ", row.dump().substr(0, 60),
                                " does not hold topk = ", topk, " indices");
      }
      for (int64_t k = 0; k < topk; ++k) {
        const json& v = row[size_t(k)];
        if (!v.is_number_integer()) {
          return invalid_argument(at, ": top_indices[", t, "][", k, "] = ", v.dump(),
                                  " is not an integer");
        }
        const int64_t e = v.get<int64_t>();
        if (e < -1 || (E > 0 && e >= E) || e > INT32_MAX) {
          return E > 0 ? invalid_argument(at, ": top_indices[", t, "][", k, "] = ", e,
                                          " is outside [-1, ", E, ") (--experts)")
                       : invalid_argument(at, ": top_indices[", t, "][", k, "] = ", e,
                                          " is outside [-1, 2^31)");
        }
        rc.idx.push_back(int32_t(e));
      }
    }
    if (rec.contains("hs_offset")) {
      rc.has_hs = true;
      MOED_RETURN_IF_ERROR(get_int(rec, "hs_offset", at, rc.hs_offset));
      MOED_RETURN_IF_ERROR(get_int(rec, "hs_bytes", at, rc.hs_bytes));
      const auto shape = rec.find("hs_shape");
      if (shape == rec.end() || !shape->is_array() || shape->size() != 2 ||
          !(*shape)[0].is_number_integer() || !(*shape)[1].is_number_integer() ||
          (*shape)[0].get<int64_t>() != rc.num_tokens || (*shape)[1].get<int64_t>() < 1) {
        return invalid_argument(at, ": hs_shape = ",
                                shape == rec.end() ? std::string("(none)") : shape->dump(),
                                "; RouterTracer writes [num_tokens = ", rc.num_tokens, ", hidden]");
      }
      rc.hs_hidden = (*shape)[1].get<int64_t>();
      if (rc.hs_offset < 0 || rc.hs_bytes != rc.num_tokens * rc.hs_hidden * 2) {
        return invalid_argument(at, ": hs_bytes = ", rc.hs_bytes, " at hs_offset = ", rc.hs_offset,
                                ", but hs_shape ", shape->dump(), " of bf16 is ",
                                rc.num_tokens * rc.hs_hidden * 2, " bytes");
      }
    }
    out.selected[key].push_back(std::move(rc));
  }
  if (f.bad()) return invalid_argument(path, ": read error after line ", line);
  return ok_status();
}

std::string join(const auto& values) {
  std::string s;
  for (const auto& v : values) {
    if (!s.empty()) s += ", ";
    if constexpr (std::is_same_v<std::decay_t<decltype(v)>, LayerKey>) {
      s += key_label(v);
    } else {
      s += std::to_string(v);
    }
  }
  return s.empty() ? "none" : s;
}

// The ranks whose files are in `dir`: 0..R-1, every one present.
StatusOr<int> count_ranks(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return invalid_argument(dir, ": not a directory of router_trace_rank*.jsonl files");
  }
  static const std::regex name(R"(router_trace_rank(\d+)\.jsonl)");
  std::set<int> ranks;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    std::smatch m;
    const std::string f = entry.path().filename().string();
    if (std::regex_match(f, m, name) && m[1].length() < 7) ranks.insert(std::stoi(m[1].str()));
  }
  if (ec) return invalid_argument(dir, ": cannot list the directory: ", ec.message());
  if (ranks.empty()) {
    return invalid_argument(dir, ": no router_trace_rank*.jsonl files (Megatron-Core's "
                                 "RouterTracer writes one per rank)");
  }
  const int R = *ranks.rbegin() + 1;
  for (int r = 0; r < R; ++r) {
    if (!ranks.count(r)) {
      return invalid_argument(trace_file(dir, r), " is missing (found ranks ", join(ranks),
                              "); a step's routing needs every rank");
    }
  }
  return R;
}

Status load_sidecar(const std::string& dir, int rank, const RankFile& file, const Record& rc,
                    MegatronLayerCall& call) {
  const std::string at = file.path + ":" + std::to_string(rc.line);
  if (!rc.has_hs) {
    return invalid_argument(at, ": the record has no hidden states (hs_offset); RouterTracer writes "
                                "them with capture_hidden_states=True");
  }
  const std::string path = sidecar_file(dir, rank);
  std::ifstream f(path, std::ios::binary);
  if (!f) return invalid_argument(path, ": cannot open (the sidecar of ", at, ")");
  f.seekg(0, std::ios::end);
  const int64_t size = int64_t(f.tellg());
  if (rc.hs_offset + rc.hs_bytes > size) {
    return invalid_argument(path, ": the record at ", at, " needs bytes [", rc.hs_offset, ", ",
                            rc.hs_offset + rc.hs_bytes, ") but the file has ", size, " bytes");
  }
  const size_t first = call.hidden_states.size();
  call.hidden_states.resize(first + size_t(rc.hs_bytes / 2));
  f.seekg(rc.hs_offset);
  // NOTE: torch writes the int16 bit patterns in the host's order, little-endian on every
  // platform Megatron runs on; moed's bf16 is the same 16 bits.
  f.read(reinterpret_cast<char*>(call.hidden_states.data() + first), rc.hs_bytes);
  if (!f) return invalid_argument(path, ": read error at byte ", rc.hs_offset);
  return ok_status();
}

}  // namespace

std::string MegatronLayerCall::label() const {
  std::string s = key_label(LayerKey{block, mtp_idx, layer});
  if (microbatch > 0) s += " microbatch " + std::to_string(microbatch);
  return s;
}

StatusOr<int> megatron_trace_ranks(const std::string& dir) { return count_ranks(dir); }

bool is_megatron_trace_dir(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_directory(path, ec) &&
         std::filesystem::exists(trace_file(path, 0), ec);
}

StatusOr<MegatronTrace> read_megatron_trace(const std::string& dir,
                                            const MegatronTraceSelection& sel) {
  MOED_ASSIGN_OR_RETURN(const int R, count_ranks(dir));
  MegatronTrace out;
  out.dir = dir;
  out.num_ranks = R;
  // Pass 1: the steps in rank 0's file, to settle the default step.
  RankFile first;
  MOED_RETURN_IF_ERROR(scan_file(trace_file(dir, 0), 0, sel, std::nullopt, first));
  out.steps.assign(first.steps.begin(), first.steps.end());
  if (out.steps.empty()) return invalid_argument(trace_file(dir, 0), ": no records");
  out.step = sel.step.value_or(out.steps.front());
  if (!first.steps.count(out.step)) {
    return invalid_argument(trace_file(dir, 0), ": no record for step ", out.step,
                            " (steps present: ", join(out.steps), ")");
  }
  // Pass 2: every rank's records of that step.
  std::vector<RankFile> files(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) {
    MOED_RETURN_IF_ERROR(scan_file(trace_file(dir, r), r, sel, out.step, files[size_t(r)]));
  }
  const RankFile& f0 = files[0];
  if (f0.selected.empty()) {
    std::vector<LayerKey> layers;
    for (const auto& [k, line] : f0.layers_of_step) layers.push_back(k);
    std::string want = "block '" + sel.block + "'";
    if (sel.mtp_idx) want += " mtp " + std::to_string(*sel.mtp_idx);
    if (sel.layer) want += " layer " + std::to_string(*sel.layer);
    return invalid_argument(f0.path, ": no record for step ", out.step, ", ", want,
                            " (layers of that step: ", join(layers), ")");
  }
  for (int r = 1; r < R; ++r) {
    const RankFile& f = files[size_t(r)];
    for (const auto& [key, recs] : f.selected) {
      if (!f0.selected.count(key)) {
        return invalid_argument(f.path, ":", recs.front().line, ": step ", out.step, ", ",
                                key_label(key), " is absent from rank 0's file ", f0.path);
      }
    }
  }
  for (const auto& [key, recs0] : f0.selected) {
    for (int r = 1; r < R; ++r) {
      const RankFile& f = files[size_t(r)];
      const auto it = f.selected.find(key);
      if (it == f.selected.end()) {
        return invalid_argument(f.path, ": no record for step ", out.step, ", ", key_label(key),
                                " (rank 0 has one at line ", recs0.front().line, ")");
      }
      if (it->second.size() != recs0.size()) {
        return invalid_argument(f.path, ": ", it->second.size(), " records for step ", out.step,
                                ", ", key_label(key), " but rank 0's file has ", recs0.size(),
                                " (every rank calls the router once per micro-batch)");
      }
    }
    for (size_t mb = 0; mb < recs0.size(); ++mb) {
      if (sel.microbatch && int(mb) != *sel.microbatch) continue;
      MegatronLayerCall call;
      std::tie(call.block, call.mtp_idx, call.layer) = key;
      call.microbatch = int(mb);
      call.tokens_per_rank = recs0[mb].num_tokens;
      call.num_topk = recs0[mb].topk;
      call.hidden = recs0[mb].has_hs ? recs0[mb].hs_hidden : 0;
      for (int r = 0; r < R; ++r) {
        const RankFile& f = files[size_t(r)];
        const Record& rc = f.selected.at(key)[mb];
        const std::string at = f.path + ":" + std::to_string(rc.line);
        if (rc.num_tokens != call.tokens_per_rank) {
          return invalid_argument(at, ": num_tokens = ", rc.num_tokens, ", but rank 0's record (",
                                  f0.path, ":", recs0[mb].line, ") has ", call.tokens_per_rank,
                                  "; moed splits a step's tokens evenly over the ranks");
        }
        if (rc.topk != call.num_topk) {
          return invalid_argument(at, ": topk = ", rc.topk, ", but rank 0's record has ",
                                  call.num_topk);
        }
        call.topk_idx.insert(call.topk_idx.end(), rc.idx.begin(), rc.idx.end());
        if (sel.load_hidden_states) {
          if (rc.has_hs && call.hidden != 0 && rc.hs_hidden != call.hidden) {
            return invalid_argument(at, ": hs_shape has hidden = ", rc.hs_hidden,
                                    ", but rank 0's record has ", call.hidden);
          }
          if (call.hidden == 0 && rc.has_hs) call.hidden = rc.hs_hidden;
          MOED_RETURN_IF_ERROR(load_sidecar(dir, r, f, rc, call));
        }
      }
      out.calls.push_back(std::move(call));
    }
  }
  if (out.calls.empty()) {
    return invalid_argument(f0.path, ": step ", out.step, " has no micro-batch ",
                            sel.microbatch.value_or(0), " (its layers have ",
                            f0.selected.begin()->second.size(), ")");
  }
  return out;
}

StatusOr<RoutingTrace> megatron_routing_trace(const MegatronTrace& t) {
  if (t.calls.empty()) return invalid_argument(t.dir, ": no router calls selected");
  const MegatronLayerCall& c0 = t.calls.front();
  RoutingTrace r;
  r.name = t.dir;
  r.num_steps = int64_t(t.calls.size());
  r.num_tokens = c0.tokens_per_rank * t.num_ranks;
  r.num_topk = c0.num_topk;
  for (const MegatronLayerCall& c : t.calls) {
    if (c.tokens_per_rank != c0.tokens_per_rank || c.num_topk != c0.num_topk) {
      return invalid_argument(t.dir, ": step ", t.step, ", ", c.label(), " has ", c.tokens_per_rank,
                              " tokens x top-", c.num_topk, " per rank but ", c0.label(), " has ",
                              c0.tokens_per_rank, " x top-", c0.num_topk,
                              "; choose one layer with --layer");
    }
    r.topk_idx.insert(r.topk_idx.end(), c.topk_idx.begin(), c.topk_idx.end());
  }
  return r;
}

}  // namespace moed
