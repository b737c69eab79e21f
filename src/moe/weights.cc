// MoEConfig checks and the deterministic parameters of the layer.
#include <cmath>

#include "moed/moe_layer.h"

namespace moed {
namespace {

// NOTE: each weight is a pure function of (seed, tensor tag, global expert, row, column of
// the unsharded matrix), so a shard of any ETP size, on any rank, holds the same values as
// the matching slice of the whole model.
enum Tag : uint64_t { kRouter = 1, kFc1 = 2, kFc2 = 3, kSharedFc1 = 4, kSharedFc2 = 5 };

uint64_t mix(uint64_t z) {  // splitmix64's finaliser
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform in [-scale, scale), exactly representable steps of 2^-24.
float weight(uint64_t seed, uint64_t tag, uint64_t expert, uint64_t row, uint64_t col,
             float scale) {
  uint64_t h = mix(seed ^ mix(tag ^ mix(expert ^ mix(row ^ mix(col)))));
  const float u = float(h >> 40) * (1.0f / 16777216.0f);
  return (2.0f * u - 1.0f) * scale;
}

void put(const Tensor& t, int64_t r, int64_t c, float v) {
  if (t.dtype() == DType::kF32) {
    t.row<float>(r)[c] = v;
  } else {
    t.row<bf16>(r)[c] = float_to_bf16(v);
  }
}

}  // namespace

RouterConfig MoEConfig::router_config() const {
  RouterConfig r = router;
  r.num_experts = num_experts;
  r.num_topk = num_topk;
  // Dropping and router padding happen once, here in routing; the dispatcher gets every
  // option (it needs the capacity for pad_to_capacity) but takes the router's routing with
  // layout_applied, so it does not drop or pad again.
  r.layout = LayoutOptions{};
  r.layout.capacity_factor = layout.capacity_factor;
  r.layout.drop_policy = layout.drop_policy;
  r.layout.router_padding_multiple = layout.router_padding_multiple;
  return r;
}

const char* MoEConfig::dispatcher_name() const {
  return low_latency ? "low_latency" : dispatcher_kind_name(dispatcher);
}

Status MoEConfig::validate(int world_size) const {
  if (hidden <= 0) return invalid_argument("hidden = ", hidden, " must be positive");
  if (ffn_hidden <= 0) return invalid_argument("ffn_hidden = ", ffn_hidden, " must be positive");
  if (num_experts <= 0) return invalid_argument("num_experts = ", num_experts, " must be positive");
  if (num_topk <= 0 || num_topk > num_experts) {
    return invalid_argument("num_topk = ", num_topk, " is outside [1, ", num_experts, "]");
  }
  if (shared_expert_ffn < 0) {
    return invalid_argument("shared_expert_ffn = ", shared_expert_ffn, " must be >= 0");
  }
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    return invalid_argument("dtype = ", dtype_name(dtype), ": the MoE layer runs in f32 or bf16");
  }
  if (etp_size <= 0 || world_size % etp_size != 0) {
    return invalid_argument("etp_size = ", etp_size, " does not divide the world size ",
                            world_size);
  }
  const int ep = world_size / etp_size;
  if (num_experts % ep != 0) {
    return invalid_argument("num_experts = ", num_experts, " is not divisible by EP = ", ep);
  }
  if (ffn_hidden % etp_size != 0) {
    return invalid_argument("ffn_hidden = ", ffn_hidden,
                            " is not divisible by etp_size = ", etp_size);
  }
  MOED_RETURN_IF_ERROR(layout.validate());
  MOED_RETURN_IF_ERROR(router_config().validate());
  if (low_latency) {
    if (dtype != DType::kBF16) {
      return unimplemented("the low-latency dispatcher moves bf16 only; dtype = ",
                           dtype_name(dtype));
    }
    if (etp_size != 1) {
      return unimplemented(
          "the low-latency dispatcher has no expert tensor parallelism; etp_size = ", etp_size);
    }
    if (layout.pad_to_capacity || layout.expert_alignment != 1) {
      return unimplemented(
          "the low-latency dispatcher has fixed slots: pad_to_capacity and expert_alignment do "
          "not apply to it");
    }
  }
  return ok_status();
}

MoEWeights make_moe_weights(const MoEConfig& c, int ep_size, int ep_rank, int etp_rank) {
  MoEWeights w;
  const int64_t H = c.hidden, F = c.ffn_hidden, P = c.etp_size, Fp = F / P;
  const int L = c.num_experts / ep_size;
  const uint64_t seed = c.seed;
  const float s_router = 1.0f / std::sqrt(float(H));
  w.router = Tensor::empty(DType::kF32, c.num_experts, H);
  for (int e = 0; e < c.num_experts; ++e) {
    for (int64_t h = 0; h < H; ++h)
      w.router.row<float>(e)[h] = weight(seed, kRouter, e, e, h, s_router);
  }
  const float s1 = 1.0f / std::sqrt(float(H)), s2 = 1.0f / std::sqrt(float(F));
  for (int j = 0; j < L; ++j) {
    const uint64_t e = uint64_t(ep_rank) * L + j;
    Tensor fc1 = Tensor::empty(c.dtype, H, 2 * Fp);
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t f = 0; f < Fp; ++f) {
        const int64_t col = etp_rank * Fp + f;
        put(fc1, h, f, weight(seed, kFc1, e, h, col, s1));           // gate
        put(fc1, h, Fp + f, weight(seed, kFc1, e, h, F + col, s1));  // up
      }
    }
    Tensor fc2 = Tensor::empty(c.dtype, Fp, H);
    for (int64_t f = 0; f < Fp; ++f) {
      for (int64_t h = 0; h < H; ++h)
        put(fc2, f, h, weight(seed, kFc2, e, etp_rank * Fp + f, h, s2));
    }
    w.fc1.push_back(std::move(fc1));
    w.fc2.push_back(std::move(fc2));
  }
  if (c.shared_expert_ffn > 0) {
    const int64_t S = c.shared_expert_ffn;
    const float ss2 = 1.0f / std::sqrt(float(S));
    w.shared_fc1 = Tensor::empty(c.dtype, H, 2 * S);
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t f = 0; f < 2 * S; ++f)
        put(w.shared_fc1, h, f, weight(seed, kSharedFc1, 0, h, f, s1));
    }
    w.shared_fc2 = Tensor::empty(c.dtype, S, H);
    for (int64_t f = 0; f < S; ++f) {
      for (int64_t h = 0; h < H; ++h)
        put(w.shared_fc2, f, h, weight(seed, kSharedFc2, 0, f, h, ss2));
    }
  }
  return w;
}

}  // namespace moed
