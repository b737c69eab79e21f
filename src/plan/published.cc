// Every published table of MoE dispatch / combine performance found for `moed plan --validate`,
// quoted as published (the figure and the source's own settings); docs/planner.md has the same
// table with the model beside it. Hidden 7168 and top-8 throughout.
#include "plan/published.h"

namespace moed::published {

namespace {

// clang-format off
const PublishedSource kSources[] = {
  {"DeepEP V1", "deepseek-ai/DeepEP docs/legacy.md @ dd758ca (README.md before V2, e.g. @ 567632d): "
                "\"Normal kernels with NVLink and RDMA forwarding\" and \"Low-latency kernels with "
                "pure RDMA\", H800 + CX7 400 Gb/s; and the first README.md @ ebfe47e (2025-02-25)"},
  {"DeepEP V2", "deepseek-ai/DeepEP README.md @ dd758ca, \"Performance\": 8K tokens, FP8 dispatch, "
                "BF16 combine, logical bandwidth (tests/elastic/test_ep.py: bytes per token include "
                "top-k indices and weights; local traffic counted)"},
  {"HybridEP", "deepseek-ai/DeepEP branch hybrid-ep @ 94a9f8f, docs/README_Hybrid-EP.md, "
               "\"Performance Results\": H100 (IB), B200, GB200; 4096 tokens, 8 local experts, random "
               "uniform router; bandwidth of tests/test_hybrid_ep.py (NVL: received tokens, RDMA: "
               "(token, node) pairs with the own node)"},
  {"NCCL EP", "NVIDIA/nccl contrib/nccl_ep/README.md @ 5067397, \"Reference performance numbers\": "
              "H100, low-latency, BF16 dispatch and combine, 128 tokens, 256 experts (ep_bench.cu: "
              "selections x 2H)"},
  {"UCCL-EP", "uccl-project/uccl ep/README.md @ da914a2, \"Results\": p5en (H200 + 2x 200 Gb/s EFA "
              "per GPU), p6-b200 (B200 + 400 Gb/s EFA), MI300X + CX7, MI355X + Pollara, MI300X + "
              "Thor2; DeepEP's tests and bandwidth definitions; internode runs with 288 experts"},
  {"pplx-garden", "perplexityai/pplx-garden docs/fabric-lib.md @ 2446003, \"All-to-All Performance "
                  "Results\": decode (128 tokens) and prefill (4096 tokens), pplx-EFA / pplx-CX7 / "
                  "DeepEP-CX7, latency in us; benchmarks/bench_all_to_all.py: 256 experts, FP8 + "
                  "fp32 scales, NVLink inside a node"},
  {"pplx-kernels", "perplexityai/pplx-kernels README.md @ 2bd6e30, \"Benchmark Results\", 128 tok "
                   "per GPU: NVLINK (EP8) and IBGDA (EP16-128) dispatch / combine in us "
                   "(tests/bench_all_to_all.py: R1 config 256 experts, FP8 in, BF16 out)"},
  {"MORI", "ROCm/mori README.md @ 624002c, \"Benchmark on DeepSeek V3 model configurations\" "
           "(MI300X + CX7, MI355X + AINIC); bandwidth of docs/MORI-EP-BENCHMARK.md and "
           "examples/ops/dispatch_combine/test_dispatch_combine_internode.py (H x element size, no "
           "scales; low-latency: selections)"},
  {"Triton-distributed", "ByteDance-Seed/Triton-distributed README.md @ 1512a81: low-latency "
                         "AllToAll on 32 H800, 128 tokens per rank, fp8: 137 us, DeepEP 182 us "
                         "(\"DeepEP doesn't use NVLink for inference\"; that 182 us is DeepEP's own pure-RDMA EP32 "
                         "row)"},
};

// Designs: what each kernel family moves and how its source counts (moed/plan.h Convention).
const Design kDesigns[] = {
  // DeepEP V1 normal kernels: (token, node) over RDMA to the rank with the same local index,
  // forwarded over NVLink; low-latency: one IBGDA write per (token, expert), NVLink inside a node
  // (DeepEP #173).
  // Its SM-limited copy rate: the HybridEP document's sweep of DeepEP on B200 (Torch API) at 16
  // SMs, the fewest it lists (that row is not validated): 246 GB/s fp8 dispatch, 348 bf16, 302
  // combine, i.e. 15.4, 21.75 and 18.9 GB/s per SM.
  {"deepep-normal", "flex", false, Convention::kDeepEP, true, 15.4, 21.75, 18.9},
  {"deepep-ll", "low-latency", false, Convention::kDeepEP, true},
  // DeepEP's low-latency kernels without NVLink (allow_nvlink_for_low_latency_mode off, as
  // Triton-distributed ran them): every (token, expert) over RDMA.
  {"deepep-ll-rdma", "low-latency", false, Convention::kDeepEP, false},
  // DeepEP V2 (ElasticBuffer, hybrid mode): the same two hops; its test counts index and weights.
  {"deepep-v2", "flex", false, Convention::kDeepEPv2, true},
  // HybridEP: RDMA to the peer node, then NVLink inside it (TMA copies).
  {"hybrid-ep", "flex", false, Convention::kDeepEP, true},
  // NCCL EP low-latency: one GIN put per (token, expert).
  {"nccl-ep-ll", "low-latency", false, Convention::kDeepEP, true},
  // UCCL-EP: DeepEP's kernels with every RDMA write posted by CPU proxy threads (ep/README.md).
  {"uccl-normal", "flex", true, Convention::kDeepEP, true, 15.4, 21.75, 18.9},
  {"uccl-ll", "low-latency", true, Convention::kDeepEP, true},
  // pplx-garden: rows per (token, expert), one RDMA write per peer from a host proxy after a
  // count exchange (TransferEngine), NVLink inside a node.
  {"pplx-garden", "pplx", true, Convention::kDeepEP, true},
  // pplx-kernels: the same layout, IBGDA writes through NVSHMEM (GPU-initiated).
  {"pplx-kernels", "pplx", false, Convention::kDeepEP, true},
  // MORI: IntraNode (one row per (token, rank) over xGMI), InterNodeV1 (DeepEP's two hops),
  // InterNodeV1LL (no de-duplication: one write per (token, expert)).
  {"mori-intra", "flat", false, Convention::kPayload, true},
  {"mori-normal", "flex", false, Convention::kPayload, true},
  {"mori-ll", "low-latency", false, Convention::kPayload, true},
  // Triton-distributed's low-latency AllToAll: one put per (token, expert), NVLink inside a node.
  {"triton-dist-ll", "low-latency", false, Convention::kDeepEP, true},
};

// Why rows miss (docs/planner.md groups them): each names what the byte count leaves out.
constexpr const char* kPre130 =
    "before DeepEP #130 (Tencent, up to 30% faster): today's same kernels reach 58/57 GB/s at EP32, "
    "within the model; the gap is RDMA efficiency #130 recovered, not bytes";
constexpr const char* kTwoNodes =
    "the NIC runs at 26-34 GB/s of its 50 (physical) at 2 nodes, where DeepEP V2 on the same links "
    "reaches line rate: an implementation limit with one rail peer, not in the model";
constexpr const char* kMoriBelowLine =
    "InterNodeV1 moves 34 GB/s of the NIC's 50 (physical) at 4 nodes: below line rate, not a byte count";
constexpr const char* kGb200Fp8 =
    "FP8 dispatch falls below BF16 at EP 36 on GB200 (489 vs 632 GB/s at 32 SMs, 261 at 16): "
    "SM-bound FP8 work; HybridEP documents no per-SM rate";
constexpr const char* kDeepEPGb200 =
    "DeepEP on GB200 at 32 SMs runs below the per-SM rate of its B200 sweep at 16+ ranks (MNNVL "
    "across trays); the model's SM limit uses B200's rate";
constexpr const char* kDeepEPGb200Combine24 =
    "DeepEP's combine at 24 GB200 ranks (207 GB/s) is half its 16-rank figure (443) for the same "
    "bytes per rank: not a byte count";
constexpr const char* kNcclCombine8 =
    "NVLink-only combine takes 16 us more than one round plus the bytes: NCCL EP's low-latency "
    "combine reduces the K rows per token in a pass the model does not charge";
constexpr const char* kUcclEfaNormal =
    "UCCL-EP on EFA at 2-3 nodes moves 25-35 GB/s of the NIC's 50 (physical): writes posted by CPU "
    "proxies with ordering emulated by immediate data; at 4 nodes it matches the model";
constexpr const char* kP5enCombine =
    "p5en combine takes 2.4-5.3x its dispatch time for 1.9x the bytes, while the same code on "
    "p6-b200 (one 400 Gb/s NIC per GPU) combines at line rate: p5en's two-NIC path, not bytes";
constexpr const char* kEfaLL16 =
    "EP16 on EFA runs faster than 512 CPU-posted messages at UCCL's measured 0.40 us each predict "
    "(EP24 and EP32 match it): the per-message cost is not constant in the peer count";
constexpr const char* kUcclAmdFp8 =
    "FP8 dispatch below BF16 (260 vs 295 GB/s on MI300X, 299 vs 336 on MI355X): per-token FP8 "
    "work on the CUs; no per-CU copy rate published for these kernels";
constexpr const char* kUcclAmdLL =
    "UCCL-EP low-latency on MI300X: 65 us at EP8 where MORI takes 35 us on the same GPUs and "
    "bytes; a CPU-posted write's cost on CX7 is not published (0 in the preset)";
constexpr const char* kThor2 =
    "Thor2 runs with one RDMA write in flight per NIC (UCCL README: UCCL_IB_MAX_INFLIGHT_NORMAL=1 "
    "against CQE error 12): the NIC waits a round trip per chunk, not in the model";
constexpr const char* kPplxEfa16 =
    "EFA at EP16 adds 105 us over the same kernels on CX7, more than the model's EFA hop "
    "latency (2 x 12 us more than IB)";
constexpr const char* kPrefill =
    "the prefill table contradicts itself: EP8 runs on NVLink alone, yet pplx-CX7 dispatch takes "
    "5071 us and pplx-EFA 1052; CX7 combine at EP16 (1062 us) beats its dispatch (2735) with twice "
    "the bytes; its DeepEP column is 2-3x DeepEP's own times";
constexpr const char* kPplxKernels =
    "IBGDA time falls as EP grows (622 us at EP16 to 308 at EP128) while the bytes per rank stay: "
    "~24 us per local expert, a signalling cost the README does not describe (nor GPU or hidden)";
constexpr const char* kPplxNvl =
    "NVLink EP8 dispatch 84 us against 63 modelled: the README names no GPU or hidden size";
constexpr const char* kMoriLL =
    "InterNodeV1LL sends every token to every node and forwards over xGMI; its EP16 times are "
    "below (token, expert) writes at line rate, so it moves fewer bytes than its formula counts";

constexpr bool F8 = true, B16 = false, GRP = true, UNI = false;

const Setting kSettings[] = {
  // ---- DeepEP V1 (H800): normal kernels group-limited (top-4 groups) on 24 SMs (legacy.md:
  // Buffer.set_num_sms(24)), low-latency uniform.
  {"DeepEP V1", "normal", "h800", "deepep-normal", 8, 4096, 256, F8, GRP, 153, 0, 158, 0, "", "", 24},
  {"DeepEP V1", "normal", "h800", "deepep-normal", 16, 4096, 256, F8, GRP, 43, 0, 43, 0, "", "", 24},
  {"DeepEP V1", "normal", "h800", "deepep-normal", 32, 4096, 256, F8, GRP, 58, 0, 57, 0, "", "", 24},
  {"DeepEP V1", "normal", "h800", "deepep-normal", 64, 4096, 256, F8, GRP, 51, 0, 50, 0, "", "", 24},
  {"DeepEP V1", "low-latency", "h800", "deepep-ll", 8, 128, 256, F8, UNI, 98, 77, 127, 114, "", ""},
  {"DeepEP V1", "low-latency", "h800", "deepep-ll", 16, 128, 256, F8, UNI, 63, 118, 74, 195, "", ""},
  {"DeepEP V1", "low-latency", "h800", "deepep-ll", 32, 128, 256, F8, UNI, 48, 155, 53, 273, "", ""},
  {"DeepEP V1", "low-latency", "h800", "deepep-ll", 64, 128, 256, F8, UNI, 43, 173, 46, 314, "", ""},
  {"DeepEP V1", "low-latency", "h800", "deepep-ll", 128, 128, 256, F8, UNI, 39, 192, 39, 369, "", ""},
  {"DeepEP V1", "low-latency", "h800", "deepep-ll", 256, 128, 256, F8, UNI, 39, 194, 40, 360, "", ""},

  // ---- DeepEP V1 as first published (README.md @ ebfe47e, 2025-02-25): normal kernels before
  // Tencent's optimization (#130) and low-latency kernels on pure RDMA (before #173 let them
  // use NVLink). Its EP8-16 normal and EP128-256 low-latency rows equal today's and are not
  // repeated.
  {"DeepEP V1", "normal @ ebfe47e", "h800", "deepep-normal", 32, 4096, 256, F8, GRP, 44, 0, 47, 0, kPre130, kPre130, 24},
  {"DeepEP V1", "normal @ ebfe47e", "h800", "deepep-normal", 64, 4096, 256, F8, GRP, 46, 0, 45, 0, "", "", 24},
  {"DeepEP V1", "pure RDMA @ ebfe47e", "h800", "deepep-ll-rdma", 8, 128, 256, F8, UNI, 46, 163, 46, 318, "", ""},
  {"DeepEP V1", "pure RDMA @ ebfe47e", "h800", "deepep-ll-rdma", 16, 128, 256, F8, UNI, 43, 173, 44, 329, "", ""},
  {"DeepEP V1", "pure RDMA @ ebfe47e", "h800", "deepep-ll-rdma", 32, 128, 256, F8, UNI, 41, 182, 41, 350, "", ""},
  {"DeepEP V1", "pure RDMA @ ebfe47e", "h800", "deepep-ll-rdma", 64, 128, 256, F8, UNI, 40, 186, 41, 353, "", ""},

  // ---- DeepEP V2: 8K tokens, 256 experts and uniform routing (test_ep.py: top-k of random
  // scores, no groups). The README names no GPU: "SM90 + CX7" at EP 8x2 implies ~290 GB/s of
  // scale-up traffic per GPU at 90 GB/s logical scale-out (each token reaches ~6.5 of 16 ranks),
  // more than an H800's NVLink (160 usable), so an SM90 part with NVLink 4 (h100: H100 / H20 /
  // H200 carry 900 GB/s); "SM100 + CX7" is B200.
  {"DeepEP V2", "SM90 CX7 EP 8x2", "h100", "deepep-v2", 16, 8192, 256, F8, UNI, 90, 0, 81, 0, "", ""},
  {"DeepEP V2", "SM90 CX7 EP 8x4", "h100", "deepep-v2", 32, 8192, 256, F8, UNI, 61, 0, 61, 0, "", ""},
  {"DeepEP V2", "SM100 CX7 EP 8x2", "b200", "deepep-v2", 16, 8192, 256, F8, UNI, 90, 0, 91, 0, "", ""},
  {"DeepEP V2", "SM100 EP 8, 64 SMs", "b200", "deepep-v2", 8, 8192, 256, F8, UNI, 726, 0, 740, 0, "", ""},
  {"DeepEP V2", "SM100 EP 8, 24 SMs", "b200", "deepep-v2", 8, 8192, 256, F8, UNI, 643, 0, 675, 0, "", ""},

  // ---- HybridEP: "Kernel Only" at the most SMs each table lists (the link-bound point);
  // 8 local experts, so E = 8 x EP.
  {"HybridEP", "H100 IB, kernel, 16 SMs", "h100", "hybrid-ep", 16, 4096, 128, F8, UNI, 68.48, 0, 62.95, 0, kTwoNodes, kTwoNodes},
  {"HybridEP", "H100 IB, kernel, 16 SMs", "h100", "hybrid-ep", 16, 4096, 128, B16, UNI, 71.71, 0, 0, 0, kTwoNodes, ""},
  {"HybridEP", "H100 IB, kernel, 16 SMs", "h100", "hybrid-ep", 32, 4096, 256, F8, UNI, 55.35, 0, 57.46, 0, "", ""},
  {"HybridEP", "H100 IB, kernel, 16 SMs", "h100", "hybrid-ep", 32, 4096, 256, B16, UNI, 57.69, 0, 0, 0, "", ""},
  {"HybridEP", "H100 IB, kernel, 16 SMs", "h100", "hybrid-ep", 64, 4096, 512, F8, UNI, 46.52, 0, 49.77, 0, "", ""},
  {"HybridEP", "H100 IB, kernel, 16 SMs", "h100", "hybrid-ep", 64, 4096, 512, B16, UNI, 49.97, 0, 0, 0, "", ""},
  {"HybridEP", "B200, kernel, 16 SMs", "b200", "hybrid-ep", 8, 4096, 64, F8, UNI, 599.27, 0, 673.84, 0, "", ""},
  {"HybridEP", "B200, kernel, 16 SMs", "b200", "hybrid-ep", 8, 4096, 64, B16, UNI, 734.95, 0, 0, 0, "", ""},
  {"HybridEP", "GB200, kernel, 32 SMs", "gb200", "hybrid-ep", 8, 4096, 64, F8, UNI, 713.98, 0, 737.13, 0, "", ""},
  {"HybridEP", "GB200, kernel, 32 SMs", "gb200", "hybrid-ep", 8, 4096, 64, B16, UNI, 764.03, 0, 0, 0, "", ""},
  {"HybridEP", "GB200, kernel, 32 SMs", "gb200", "hybrid-ep", 16, 4096, 128, F8, UNI, 650.48, 0, 666.26, 0, "", ""},
  {"HybridEP", "GB200, kernel, 32 SMs", "gb200", "hybrid-ep", 16, 4096, 128, B16, UNI, 706.95, 0, 0, 0, "", ""},
  {"HybridEP", "GB200, kernel, 32 SMs", "gb200", "hybrid-ep", 24, 4096, 192, F8, UNI, 577.96, 0, 639.80, 0, "", ""},
  {"HybridEP", "GB200, kernel, 32 SMs", "gb200", "hybrid-ep", 24, 4096, 192, B16, UNI, 665.97, 0, 0, 0, "", ""},
  {"HybridEP", "GB200, kernel, 32 SMs", "gb200", "hybrid-ep", 32, 4096, 256, F8, UNI, 538.86, 0, 605.15, 0, "", ""},
  {"HybridEP", "GB200, kernel, 32 SMs", "gb200", "hybrid-ep", 32, 4096, 256, B16, UNI, 642.23, 0, 0, 0, "", ""},
  {"HybridEP", "GB200, kernel, 32 SMs", "gb200", "hybrid-ep", 36, 4096, 288, F8, UNI, 489.27, 0, 596.99, 0, kGb200Fp8, ""},
  {"HybridEP", "GB200, kernel, 32 SMs", "gb200", "hybrid-ep", 36, 4096, 288, B16, UNI, 632.31, 0, 0, 0, "", ""},
  // The same document's DeepEP (V1) figures: Torch API, at the most SMs listed.
  {"HybridEP", "DeepEP on B200, 48 SMs", "b200", "deepep-normal", 8, 4096, 64, F8, UNI, 554, 0, 586, 0, "", "", 48},
  {"HybridEP", "DeepEP on B200, 48 SMs", "b200", "deepep-normal", 8, 4096, 64, B16, UNI, 646, 0, 0, 0, "", "", 48},
  {"HybridEP", "DeepEP on GB200, 32 SMs", "gb200", "deepep-normal", 8, 4096, 64, F8, UNI, 447.76, 0, 519.57, 0, "", "", 32},
  {"HybridEP", "DeepEP on GB200, 32 SMs", "gb200", "deepep-normal", 8, 4096, 64, B16, UNI, 615.78, 0, 0, 0, "", "", 32},
  {"HybridEP", "DeepEP on GB200, 32 SMs", "gb200", "deepep-normal", 16, 4096, 128, F8, UNI, 393.72, 0, 442.51, 0, "", kDeepEPGb200, 32},
  {"HybridEP", "DeepEP on GB200, 32 SMs", "gb200", "deepep-normal", 16, 4096, 128, B16, UNI, 520.76, 0, 0, 0, "", "", 32},
  {"HybridEP", "DeepEP on GB200, 32 SMs", "gb200", "deepep-normal", 24, 4096, 192, F8, UNI, 405.04, 0, 207.10, 0, "", kDeepEPGb200Combine24, 32},
  {"HybridEP", "DeepEP on GB200, 32 SMs", "gb200", "deepep-normal", 24, 4096, 192, B16, UNI, 502.84, 0, 0, 0, kDeepEPGb200, "", 32},

  // ---- NCCL EP: H100, low-latency, BF16 both ways.
  {"NCCL EP", "H100 low-latency", "h100", "nccl-ep-ll", 8, 128, 256, B16, UNI, 224.3, 0, 185.2, 0, "", kNcclCombine8},
  {"NCCL EP", "H100 low-latency", "h100", "nccl-ep-ll", 16, 128, 256, B16, UNI, 76.7, 0, 73.0, 0, "", ""},
  {"NCCL EP", "H100 low-latency", "h100", "nccl-ep-ll", 32, 128, 256, B16, UNI, 53.6, 0, 50.0, 0, "", ""},
  {"NCCL EP", "H100 low-latency", "h100", "nccl-ep-ll", 64, 128, 256, B16, UNI, 48.8, 0, 43.8, 0, "", ""},

  // ---- UCCL-EP: DeepSeek-V3 pretraining setting (top-4 groups) for normal kernels, 288 experts
  // across nodes and 256 inside one (the README's commands), 128 tokens for low-latency; normal
  // kernels on 24 SMs (CUDA) or 64 CUs (ROCm), ep/bench/test_intranode.py's num_sms.
  {"UCCL-EP", "p5en normal", "h200-efa", "uccl-normal", 8, 4096, 256, F8, GRP, 320, 500, 319, 973, "", "", 24},
  {"UCCL-EP", "p5en normal", "h200-efa", "uccl-normal", 16, 4096, 288, F8, GRP, 50, 1196, 18, 6379, kUcclEfaNormal, kP5enCombine, 24},
  {"UCCL-EP", "p5en normal", "h200-efa", "uccl-normal", 24, 4096, 288, F8, GRP, 53, 1633, 26, 6365, kUcclEfaNormal, kP5enCombine, 24},
  {"UCCL-EP", "p5en normal", "h200-efa", "uccl-normal", 32, 4096, 288, F8, GRP, 54, 2022, 43, 4899, "", kP5enCombine, 24},
  {"UCCL-EP", "p5en low-latency", "h200-efa", "uccl-ll", 16, 128, 288, F8, UNI, 36, 226, 48, 293, kEfaLL16, kEfaLL16},
  {"UCCL-EP", "p5en low-latency", "h200-efa", "uccl-ll", 24, 128, 288, F8, UNI, 20, 386, 26, 580, "", ""},
  {"UCCL-EP", "p5en low-latency", "h200-efa", "uccl-ll", 32, 128, 288, F8, UNI, 16, 465, 25, 694, "", ""},
  {"UCCL-EP", "p6-b200 normal", "b200-efa", "uccl-normal", 8, 4096, 256, F8, GRP, 280, 571, 426, 727, "", "", 24},
  {"UCCL-EP", "p6-b200 normal", "b200-efa", "uccl-normal", 16, 4096, 288, F8, GRP, 53, 1141, 60, 1965, kUcclEfaNormal, kUcclEfaNormal, 24},
  {"UCCL-EP", "p6-b200 normal", "b200-efa", "uccl-normal", 24, 4096, 288, F8, GRP, 53, 1637, 59, 2887, kUcclEfaNormal, "", 24},
  {"UCCL-EP", "p6-b200 normal", "b200-efa", "uccl-normal", 32, 4096, 288, F8, GRP, 53, 2072, 57, 3724, "", "", 24},
  {"UCCL-EP", "p6-b200 low-latency", "b200-efa", "uccl-ll", 16, 128, 288, F8, UNI, 33, 228, 46, 318, kEfaLL16, kEfaLL16},
  {"UCCL-EP", "p6-b200 low-latency", "b200-efa", "uccl-ll", 24, 128, 288, F8, UNI, 17, 448, 26, 566, "", ""},
  {"UCCL-EP", "p6-b200 low-latency", "b200-efa", "uccl-ll", 32, 128, 288, F8, UNI, 19, 406, 24, 617, "", ""},
  // MI300X + CX7 (the EP64 row's BF16 cell is labelled EP32 in the README: left out).
  {"UCCL-EP", "MI300X + CX7 normal", "mi300x", "uccl-normal", 8, 4096, 256, F8, GRP, 260, 0, 304, 0, kUcclAmdFp8, "", 64},
  {"UCCL-EP", "MI300X + CX7 normal", "mi300x", "uccl-normal", 8, 4096, 256, B16, GRP, 295, 0, 0, 0, "", "", 64},
  {"UCCL-EP", "MI300X + CX7 normal", "mi300x", "uccl-normal", 16, 4096, 288, F8, GRP, 74, 0, 78, 0, "", "", 64},
  {"UCCL-EP", "MI300X + CX7 normal", "mi300x", "uccl-normal", 16, 4096, 288, B16, GRP, 82, 0, 0, 0, "", "", 64},
  {"UCCL-EP", "MI300X + CX7 normal", "mi300x", "uccl-normal", 32, 4096, 288, F8, GRP, 60, 0, 60, 0, "", "", 64},
  {"UCCL-EP", "MI300X + CX7 normal", "mi300x", "uccl-normal", 32, 4096, 288, B16, GRP, 61, 0, 0, 0, "", "", 64},
  {"UCCL-EP", "MI300X + CX7 normal", "mi300x", "uccl-normal", 64, 4096, 576, F8, GRP, 52, 0, 51, 0, "", "", 64},
  {"UCCL-EP", "MI300X + CX7 low-latency", "mi300x", "uccl-ll", 8, 128, 288, F8, UNI, 114, 65, 157, 92, kUcclAmdLL, kUcclAmdLL},
  {"UCCL-EP", "MI300X + CX7 low-latency", "mi300x", "uccl-ll", 16, 128, 288, F8, UNI, 55, 136, 70, 207, kUcclAmdLL, kUcclAmdLL},
  {"UCCL-EP", "MI300X + CX7 low-latency", "mi300x", "uccl-ll", 32, 128, 288, F8, UNI, 30, 224, 42, 341, kUcclAmdLL, kUcclAmdLL},
  {"UCCL-EP", "MI355X + Pollara normal", "mi355x", "uccl-normal", 8, 4096, 256, F8, GRP, 299, 0, 333, 0, kUcclAmdFp8, "", 64},
  {"UCCL-EP", "MI355X + Pollara normal", "mi355x", "uccl-normal", 8, 4096, 256, B16, GRP, 336, 0, 0, 0, "", "", 64},
  {"UCCL-EP", "MI355X + Pollara normal", "mi355x", "uccl-normal", 16, 4096, 288, F8, GRP, 82, 0, 82, 0, "", "", 64},
  {"UCCL-EP", "MI355X + Pollara normal", "mi355x", "uccl-normal", 16, 4096, 288, B16, GRP, 82, 0, 0, 0, "", "", 64},
  {"UCCL-EP", "MI355X + Pollara normal", "mi355x", "uccl-normal", 32, 4096, 288, F8, GRP, 59, 0, 59, 0, "", "", 64},
  {"UCCL-EP", "MI355X + Pollara normal", "mi355x", "uccl-normal", 32, 4096, 288, B16, GRP, 58, 0, 0, 0, "", "", 64},
  {"UCCL-EP", "MI355X + Pollara normal", "mi355x", "uccl-normal", 64, 4096, 576, F8, GRP, 50, 0, 49, 0, "", "", 64},
  {"UCCL-EP", "MI300X + Thor2 normal", "mi300x-thor2", "uccl-normal", 16, 4096, 288, F8, GRP, 71, 0, 45, 0, kThor2, kThor2, 64},
  {"UCCL-EP", "MI300X + Thor2 normal", "mi300x-thor2", "uccl-normal", 16, 4096, 288, B16, GRP, 81, 0, 0, 0, kThor2, "", 64},
  {"UCCL-EP", "MI300X + Thor2 normal", "mi300x-thor2", "uccl-normal", 32, 4096, 288, F8, GRP, 49, 0, 50, 0, kThor2, kThor2, 64},
  {"UCCL-EP", "MI300X + Thor2 normal", "mi300x-thor2", "uccl-normal", 32, 4096, 288, B16, GRP, 55, 0, 0, 0, kThor2, "", 64},

  // ---- pplx-garden: H200 nodes (the paper's and blog's 8x H200), EFA = p5en, CX7 = h200.
  {"pplx-garden", "decode, pplx-EFA", "h200-efa", "pplx-garden", 8, 128, 256, F8, UNI, 0, 49.7, 0, 64.2, "", ""},
  {"pplx-garden", "decode, pplx-EFA", "h200-efa", "pplx-garden", 16, 128, 256, F8, UNI, 0, 214.8, 0, 241.5, kPplxEfa16, ""},
  {"pplx-garden", "decode, pplx-EFA", "h200-efa", "pplx-garden", 32, 128, 256, F8, UNI, 0, 229.1, 0, 335.0, "", ""},
  {"pplx-garden", "decode, pplx-EFA", "h200-efa", "pplx-garden", 64, 128, 256, F8, UNI, 0, 266.7, 0, 391.2, "", ""},
  {"pplx-garden", "decode, pplx-CX7", "h200", "pplx-garden", 8, 128, 256, F8, UNI, 0, 50.5, 0, 65.3, "", ""},
  {"pplx-garden", "decode, pplx-CX7", "h200", "pplx-garden", 16, 128, 256, F8, UNI, 0, 110.2, 0, 185.5, "", ""},
  {"pplx-garden", "decode, pplx-CX7", "h200", "pplx-garden", 32, 128, 256, F8, UNI, 0, 153.9, 0, 266.3, "", ""},
  {"pplx-garden", "decode, pplx-CX7", "h200", "pplx-garden", 64, 128, 256, F8, UNI, 0, 187.5, 0, 309.1, "", ""},
  {"pplx-garden", "decode, DeepEP-CX7", "h200", "deepep-ll", 8, 128, 256, F8, UNI, 0, 42.6, 0, 72.0, "", ""},
  {"pplx-garden", "decode, DeepEP-CX7", "h200", "deepep-ll", 16, 128, 256, F8, UNI, 0, 123.9, 0, 203.0, "", ""},
  {"pplx-garden", "decode, DeepEP-CX7", "h200", "deepep-ll", 32, 128, 256, F8, UNI, 0, 159.1, 0, 285.0, "", ""},
  {"pplx-garden", "decode, DeepEP-CX7", "h200", "deepep-ll", 64, 128, 256, F8, UNI, 0, 177.9, 0, 325.0, "", ""},
  {"pplx-garden", "prefill, pplx-EFA", "h200-efa", "pplx-garden", 8, 4096, 256, F8, UNI, 0, 1052.4, 0, 1396.7, kPrefill, kPrefill},
  {"pplx-garden", "prefill, pplx-EFA", "h200-efa", "pplx-garden", 16, 4096, 256, F8, UNI, 0, 3196.7, 0, 5379.1, kPrefill, kPrefill},
  {"pplx-garden", "prefill, pplx-EFA", "h200-efa", "pplx-garden", 32, 4096, 256, F8, UNI, 0, 4619.0, 0, 8271.5, kPrefill, kPrefill},
  {"pplx-garden", "prefill, pplx-EFA", "h200-efa", "pplx-garden", 64, 4096, 256, F8, UNI, 0, 5334.3, 0, 9779.3, kPrefill, kPrefill},
  {"pplx-garden", "prefill, pplx-CX7", "h200", "pplx-garden", 8, 4096, 256, F8, UNI, 0, 5071.1, 0, 1405.1, kPrefill, kPrefill},
  {"pplx-garden", "prefill, pplx-CX7", "h200", "pplx-garden", 16, 4096, 256, F8, UNI, 0, 2734.8, 0, 1062.2, kPrefill, kPrefill},
  {"pplx-garden", "prefill, pplx-CX7", "h200", "pplx-garden", 32, 4096, 256, F8, UNI, 0, 4011.8, 0, 7526.8, kPrefill, kPrefill},
  {"pplx-garden", "prefill, pplx-CX7", "h200", "pplx-garden", 64, 4096, 256, F8, UNI, 0, 4665.2, 0, 8771.1, kPrefill, kPrefill},
  {"pplx-garden", "prefill, DeepEP-CX7", "h200", "deepep-ll", 8, 4096, 256, F8, UNI, 0, 1810.3, 0, 962.9, kPrefill, kPrefill},
  {"pplx-garden", "prefill, DeepEP-CX7", "h200", "deepep-ll", 16, 4096, 256, F8, UNI, 0, 2481.9, 0, 1863.9, kPrefill, kPrefill},
  {"pplx-garden", "prefill, DeepEP-CX7", "h200", "deepep-ll", 32, 4096, 256, F8, UNI, 0, 3680.2, 0, 3565.4, kPrefill, kPrefill},
  {"pplx-garden", "prefill, DeepEP-CX7", "h200", "deepep-ll", 64, 4096, 256, F8, UNI, 0, 5071.6, 0, 5922.7, kPrefill, kPrefill},

  // ---- pplx-kernels: the README names no GPU; NVLink 4 + CX7 400 Gb/s (any Hopper node with
  // IBGDA) is the h100 preset, whose numbers equal h200's for these links.
  {"pplx-kernels", "128 tok, NVLINK", "h100", "pplx-kernels", 8, 128, 256, F8, UNI, 0, 83.6, 0, 102.3, kPplxNvl, kPplxNvl},
  {"pplx-kernels", "128 tok, IBGDA", "h100", "pplx-kernels", 16, 128, 256, F8, UNI, 0, 622.4, 0, 668.1, kPplxKernels, kPplxKernels},
  {"pplx-kernels", "128 tok, IBGDA", "h100", "pplx-kernels", 32, 128, 256, F8, UNI, 0, 427.6, 0, 481.4, kPplxKernels, kPplxKernels},
  {"pplx-kernels", "128 tok, IBGDA", "h100", "pplx-kernels", 64, 128, 256, F8, UNI, 0, 317.4, 0, 529.9, kPplxKernels, kPplxKernels},
  {"pplx-kernels", "128 tok, IBGDA", "h100", "pplx-kernels", 128, 128, 256, F8, UNI, 0, 307.7, 0, 593.9, kPplxKernels, kPplxKernels},

  // ---- MORI: EP8 IntraNode (xGMI), EP16+ InterNodeV1 (RDMA figure) and InterNodeV1LL; the
  // README's starred (stale) MI300X EP32 rows are left out.
  {"MORI", "MI300X + CX7", "mi300x", "mori-intra", 8, 4096, 256, F8, UNI, 307, 0, 330, 0, "", ""},
  {"MORI", "MI300X + CX7", "mi300x", "mori-normal", 16, 4096, 256, F8, UNI, 52, 0, 67, 0, kTwoNodes, kTwoNodes},
  {"MORI", "MI355X + AINIC", "mi355x", "mori-intra", 8, 4096, 256, F8, UNI, 345, 0, 420, 0, "", ""},
  {"MORI", "MI355X + AINIC", "mi355x", "mori-normal", 16, 4096, 256, F8, UNI, 54, 0, 71, 0, kTwoNodes, kTwoNodes},
  {"MORI", "MI355X + AINIC", "mi355x", "mori-normal", 32, 4096, 256, F8, UNI, 46, 0, 61, 0, kMoriBelowLine, kMoriBelowLine},
  {"MORI", "MI300X + CX7 latency", "mi300x", "mori-intra", 8, 128, 256, F8, UNI, 134, 35, 204, 47, "", ""},
  {"MORI", "MI300X + CX7 latency", "mi300x", "mori-ll", 16, 128, 256, F8, UNI, 96, 76, 121, 122, kMoriLL, kMoriLL},
  {"MORI", "MI355X + AINIC latency", "mi355x", "mori-intra", 8, 128, 256, F8, UNI, 142, 31, 276, 36, "", ""},
  {"MORI", "MI355X + AINIC latency", "mi355x", "mori-ll", 16, 128, 256, F8, UNI, 87, 84, 139, 108, kMoriLL, kMoriLL},
  {"MORI", "MI355X + AINIC latency", "mi355x", "mori-ll", 32, 128, 256, F8, UNI, 45, 152, 76, 187, kMoriLL, kMoriLL},

  // ---- Triton-distributed (32 H800): its AllToAll, NVLink inside a node; one time (dispatch).
  // Its DeepEP figure (182 us) is DeepEP's own pure-RDMA EP32 row above, not repeated.
  {"Triton-distributed", "32 H800, low-latency", "h800", "triton-dist-ll", 32, 128, 256, F8, UNI, 0, 137, 0, 0, "", ""},
};
// clang-format on

}  // namespace

std::span<const Design> designs() { return kDesigns; }
std::span<const Setting> settings() { return kSettings; }
std::span<const PublishedSource> sources() { return kSources; }

}  // namespace moed::published
