// Cluster presets of the plan model (moed/plan.h). One parameter set per system, each number
// from the hardware's published specification (cited beside it), none fitted to a table row.
//
// Two rules turn a data sheet into the model's numbers, the same for every system:
//   - the GPU-to-GPU fabric (NVLink, Infinity Fabric / xGMI) is usable at 0.8 x its line rate
//     per direction: DeepEP's README quotes "~160 GB/s NVLink maximum bandwidth" for the H800,
//     whose NVLink carries 400 GB/s both ways (200 per direction);
//   - the network is the GPU's NIC line rate (DeepEP: "CX7 InfiniBand 400 Gb/s RDMA network card
//     (~50 GB/s maximum bandwidth)"); HBM is 0.9 x the data sheet (local passes only).
#include "moed/plan.h"

namespace moed {

namespace {

struct Spec {
  const char* name;
  const char* description;
  double fabric_gbps_both_ways;  // per GPU, the data sheet's (bidirectional) figure
  double nic_gbit_per_gpu;       // NIC line rate per GPU, Gb/s
  double hbm_spec_gbps;
  bool efa;                      // AWS EFA (SRD through libfabric) rather than IB / RoCE verbs
  int domain;                    // GPUs per NVLink / xGMI domain
  const char* sources;
};

// clang-format off
const Spec kSpecs[] = {
  {"h800", "H800, 8 per node on NVLink (400 GB/s), one ConnectX-7 400 Gb/s IB NIC per GPU",
   400, 400, 3350, false, 8,
   "NVIDIA H800 SXM5: NVLink 400 GB/s, HBM3 3.35 TB/s; NVIDIA ConnectX-7: 400 Gb/s (DeepEP README: "
   "H800 ~160 GB/s NVLink, CX7 ~50 GB/s)"},
  {"h100", "H100 SXM, 8 per node on NVLink 4 (900 GB/s), one ConnectX-7 400 Gb/s IB NIC per GPU",
   900, 400, 3350, false, 8,
   "NVIDIA H100 SXM5 datasheet: NVLink 900 GB/s, HBM3 3.35 TB/s; NVIDIA DGX H100: 8x ConnectX-7 "
   "400 Gb/s"},
  {"h200", "H200, 8 per node on NVLink 4 (900 GB/s), one ConnectX-7 400 Gb/s IB NIC per GPU",
   900, 400, 4800, false, 8,
   "NVIDIA H200 SXM datasheet: NVLink 900 GB/s, HBM3e 4.8 TB/s; ConnectX-7 400 Gb/s"},
  {"h200-efa", "AWS p5en: H200, 8 per node on NVLink 4 (900 GB/s), two 200 Gb/s EFA NICs per GPU",
   900, 400, 4800, true, 8,
   "AWS p5en.48xlarge: 8x H200 (NVLink 900 GB/s, HBM3e 4.8 TB/s), 3200 Gbps EFAv3 = 16x 200 Gb/s"},
  {"b200", "B200, 8 per node on NVLink 5 (1.8 TB/s), one ConnectX-7 400 Gb/s NIC per GPU",
   1800, 400, 8000, false, 8,
   "NVIDIA DGX B200 datasheet: NVLink 5 1.8 TB/s per GPU, HBM3e 8 TB/s per GPU, 8x ConnectX-7 "
   "400 Gb/s"},
  {"b200-efa", "AWS p6-b200: B200, 8 per node on NVLink 5 (1.8 TB/s), one 400 Gb/s EFA NIC per GPU",
   1800, 400, 8000, true, 8,
   "AWS p6-b200.48xlarge: 8x B200 (NVLink 5 1.8 TB/s, HBM3e 8 TB/s), 3200 Gbps EFAv4 = 8x 400 Gb/s"},
  {"gb200", "GB200 NVL72: 72 B200 GPUs in one NVLink 5 domain (1.8 TB/s), ConnectX-7 400 Gb/s",
   1800, 400, 8000, false, 72,
   "NVIDIA GB200 NVL72: 72 GPUs on one NVLink 5 switch domain, 1.8 TB/s per GPU, HBM3e 8 TB/s; "
   "ConnectX-7 400 Gb/s per GPU"},
  {"mi300x", "MI300X, 8 per node on Infinity Fabric (7 links, 896 GB/s), ConnectX-7 400 Gb/s",
   896, 400, 5300, false, 8,
   "AMD Instinct MI300X datasheet: 7 Infinity Fabric links of 128 GB/s, 896 GB/s aggregate, HBM3 "
   "5.3 TB/s; NVIDIA ConnectX-7 400 Gb/s"},
  {"mi300x-thor2", "MI300X on Infinity Fabric (896 GB/s), Broadcom Thor2 400 Gb/s RoCE",
   896, 400, 5300, false, 8,
   "AMD Instinct MI300X datasheet (as mi300x); Broadcom BCM57608 Thor2: 400 Gb/s"},
  {"mi355x", "MI355X, 8 per node on Infinity Fabric (7 links, 1075 GB/s), Pollara 400 AI NIC",
   1075.2, 400, 8000, false, 8,
   "AMD Instinct MI355X datasheet: 7 Infinity Fabric links of 153.6 GB/s, 1075 GB/s aggregate, "
   "HBM3E 8 TB/s; AMD Pensando Pollara 400 AI NIC: 400 Gb/s"},
};
// clang-format on

Cluster make(const Spec& s) {
  Cluster c;
  c.name = s.name;
  c.description = s.description;
  c.nvl_gbps = 0.8 * s.fabric_gbps_both_ways / 2;
  c.net_gbps = s.nic_gbit_per_gpu / 8;
  c.hbm_gbps = 0.9 * s.hbm_spec_gbps;
  // NOTE: hop latencies are round figures of the usual order, not from a data sheet: 1 us for a
  // GPU write seen by its peer over NVLink / xGMI, 3 us for an RDMA write over IB / RoCE, 15 us
  // over EFA (SRD through libfabric). They move no DeepEP row by more than 3%.
  c.nvl_latency_us = 1.0;
  c.net_latency_us = s.efa ? 15.0 : 3.0;
  // The floor of one call: perplexityai/pplx-kernels README (2bd6e30), "1 tok per GPU", EP8
  // NVLINK dispatch 41.6 us, combine 41.7 us: launch, count exchange, completion flags.
  c.fixed_us = 40.0;
  // A write posted by a CPU proxy over EFA: UCCL-EP's own all-to-all on EFA
  // (uccl-project/uccl ep/bench/alltoall/efa_alltoall_results.md, two p5, rail-aligned) moves
  // 8 KB messages at 13.8 GB/s and 16 KB at 21.1 GB/s against 43.7 GB/s for 4 MB: per message
  // 8192 / 13.8e9 - 8192 / 43.7e9 = 0.41 us and 16384 / 21.1e9 - 16384 / 43.7e9 = 0.40 us on
  // top of the bytes. No such figure is published for CX7, Thor2 or Pollara (0: not charged).
  c.proxy_message_us = s.efa ? 0.40 : 0.0;
  c.ranks_per_node = s.domain;
  c.sources = s.sources;
  return c;
}

}  // namespace

std::vector<Cluster> cluster_presets() {
  std::vector<Cluster> out;
  for (const Spec& s : kSpecs) out.push_back(make(s));
  return out;
}

StatusOr<Cluster> cluster_preset(const std::string& name) {
  for (const Spec& s : kSpecs) {
    if (s.name == name) return make(s);
  }
  std::string known;
  for (const std::string& n : cluster_preset_names()) known += (known.empty() ? "" : ", ") + n;
  return invalid_argument("--cluster '", name, "' is not one of ", known);
}

std::vector<std::string> cluster_preset_names() {
  std::vector<std::string> names;
  for (const Spec& s : kSpecs) names.push_back(s.name);
  return names;
}

}  // namespace moed
