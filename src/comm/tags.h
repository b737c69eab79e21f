// The tag space of the worlds' point-to-point messages (design.md §5.8): every protocol that
// sends on a world takes its tags from here, so two of them never match each other's receives.
#pragma once

#include <cstdint>

namespace moed::tags {

// Flex (design.md §5): one tag per step kind; each step's chain messages ride on its tag +
// kFlexChainOffset (§5.6).
inline constexpr int kFlexDispatch = 0x4d10;
inline constexpr int kFlexCombine = 0x4d11;
inline constexpr int kFlexDispatchBackward = 0x4d12;
inline constexpr int kFlexCombineBackward = 0x4d13;
inline constexpr int kFlexProbGrad = 0x4d14;
inline constexpr int kFlexStepKinds = 5;
inline constexpr int kFlexChainOffset = 0x8;
inline constexpr int flex_chain(int step_tag) { return step_tag + kFlexChainOffset; }

// DeepEP's rank-major receive (design.md §8.1).
inline constexpr int kRankMajorDispatch = 0x4d20;
inline constexpr int kRankMajorCombine = 0x4d21;

// ElasticBuffer's pipeline sends (`pp_send` / `pp_recv`, design.md §8.2).
inline constexpr int kPipeline = 0x5070;

// Low-latency mode (design.md §6.5): one tag per (operation sequence mod 16, message kind), so
// the at most four operations in flight never match each other's receives.
enum class LowLatencyKind : int {
  kDispatchHeader = 0,
  kDispatchData = 1,
  kCombineData = 2,
  kClean = 3,  // shrink mode's clean()
};
inline constexpr int kLowLatencyBase = 0x5100;
inline constexpr int kLowLatencyKinds = 4;
inline constexpr int kLowLatencySequences = 16;
inline constexpr int low_latency(uint64_t seq, LowLatencyKind kind) {
  return kLowLatencyBase + int(seq % kLowLatencySequences) * kLowLatencyKinds + int(kind);
}

// The ranges above, kept apart.
static_assert(flex_chain(kFlexDispatch + kFlexStepKinds - 1) < kRankMajorDispatch);
static_assert(kRankMajorCombine < kPipeline);
static_assert(kPipeline < kLowLatencyBase);

}  // namespace moed::tags
