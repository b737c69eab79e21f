// MoELayer against reference_moe_layer, bit for bit: every dispatcher, both worlds,
// R in {1, 2, 4}, f32 and bf16, with ETP, layout options, a shared expert, uneven ranks (one
// with no tokens) and two emulated nodes. The f32 and bf16 paths are both bitwise: the same
// expert GEMM calls see the same rows (canonical layout), OpenBLAS is run single-threaded in
// fixed row blocks, and every sum outside it has a fixed order.
#include "moed/moe_layer.h"

#include <gtest/gtest.h>

#include <map>

#include "moe/moe_test_util.h"
#include "support/world_test.h"

namespace moed {
namespace {

using moe_test::expect_bitwise;
using moe_test::expect_grads_bitwise;
using moe_test::random_rows;
using testing::Backend;

MoEConfig tiny_config(DispatcherKind kind, DType dt) {
  return moe_test::layer_config(
      {.hidden = 32, .ffn_hidden = 24, .num_experts = 8, .num_topk = 2, .shared_expert_ffn = 16},
      dt, kind, 7);
}
MoEConfig low_latency_config(DType dt) {
  MoEConfig c = tiny_config(DispatcherKind::kFlex, dt);
  c.low_latency = true;
  return c;
}

struct Inputs {
  std::vector<Tensor> x, g;
  std::vector<TensorView> xv, gv;
};

Inputs make_inputs(const MoEConfig& c, int ranks) {
  Inputs in;
  const std::vector<int64_t> t = moe_test::tokens_per_rank(ranks);
  for (int r = 0; r < ranks; ++r) {
    in.x.push_back(random_rows(c.dtype, t[size_t(r)], c.hidden, 100u + uint32_t(r)));
    in.g.push_back(random_rows(c.dtype, t[size_t(r)], c.hidden, 200u + uint32_t(r)));
  }
  for (int r = 0; r < ranks; ++r) {
    in.xv.push_back(in.x[size_t(r)].view());
    in.gv.push_back(in.g[size_t(r)].view());
  }
  return in;
}

// Runs the layer on `ranks` ranks and checks output and every gradient against the reference.
// outputs (optional): each rank's output, for comparisons across dispatchers.
Status check_layer(Backend b, const MoEConfig& c, int ranks, int ranks_per_node,
                   std::map<int, Tensor>* outputs = nullptr) {
  Inputs in = make_inputs(c, ranks);
  MOED_ASSIGN_OR_RETURN(ReferenceMoEResult ref, reference_moe_layer(c, ranks, in.xv, in.gv));
  std::mutex mu;
  return testing::run_world(b, ranks, ranks_per_node, [&](World& w) -> Status {
    MOED_ASSIGN_OR_RETURN(std::unique_ptr<MoELayer> layer, MoELayer::create(w, c));
    const int r = w.rank();
    // Two steps: the second reuses the dispatcher's (and low-latency buffer's) state.
    for (int step = 0; step < 2; ++step) {
      MOED_ASSIGN_OR_RETURN(Tensor y, layer->forward(in.xv[size_t(r)]));
      MOED_RETURN_IF_ERROR(
          expect_bitwise(y, ref.output[size_t(r)], "rank " + std::to_string(r) + ": output"));
      MOED_ASSIGN_OR_RETURN(MoEGrads g, layer->backward(in.gv[size_t(r)]));
      MOED_RETURN_IF_ERROR(expect_grads_bitwise(g, ref.grads[size_t(r)], r));
      if (outputs != nullptr && step == 0) {
        std::lock_guard<std::mutex> lock(mu);
        (*outputs)[r] = std::move(y);
      }
    }
    return ok_status();
  });
}

class MoELayerTest : public ::testing::TestWithParam<Backend> {};

const DispatcherKind kNormal[] = {DispatcherKind::kAllGather, DispatcherKind::kAlltoAll,
                                  DispatcherKind::kFlex};

TEST_P(MoELayerTest, EqualsReferenceEveryDispatcherAndRankCount) {
  for (DispatcherKind kind : kNormal) {
    for (DType dt : {DType::kF32, DType::kBF16}) {
      for (int ranks : {1, 2, 4}) {
        SCOPED_TRACE(std::string(dispatcher_kind_name(kind)) + " " + dtype_name(dt) +
                     " R=" + std::to_string(ranks));
        Status s = check_layer(GetParam(), tiny_config(kind, dt), ranks, 0);
        ASSERT_TRUE(s.ok()) << s.to_string();
      }
    }
  }
}

TEST_P(MoELayerTest, LowLatencyEqualsReference) {
  for (int ranks : {1, 2, 4}) {
    SCOPED_TRACE("R=" + std::to_string(ranks));
    Status s = check_layer(GetParam(), low_latency_config(DType::kBF16), ranks, 0);
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
  // Two nodes of two: rows for the other node go over the network path.
  Status s = check_layer(GetParam(), low_latency_config(DType::kBF16), 4, 2);
  ASSERT_TRUE(s.ok()) << s.to_string();
}

TEST_P(MoELayerTest, ExpertTensorParallelAndTwoNodes) {
  for (DispatcherKind kind : kNormal) {
    SCOPED_TRACE(dispatcher_kind_name(kind));
    MoEConfig c = tiny_config(kind, DType::kF32);
    c.etp_size = 2;  // R = 4: EP = 2, each expert split in two
    Status s = check_layer(GetParam(), c, 4, 0);
    ASSERT_TRUE(s.ok()) << s.to_string();
    c.etp_size = 1;
    s = check_layer(GetParam(), c, 4, /*ranks_per_node=*/2);
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
}

TEST_P(MoELayerTest, LayoutOptions) {
  for (DispatcherKind kind : kNormal) {
    SCOPED_TRACE(dispatcher_kind_name(kind));
    MoEConfig c = tiny_config(kind, DType::kBF16);
    c.layout.capacity_factor = 0.75;  // drops tokens
    c.layout.drop_policy = DropPolicy::kPosition;
    c.layout.pad_to_capacity = true;
    c.layout.expert_alignment = 4;
    Status s = check_layer(GetParam(), c, 4, 0);
    ASSERT_TRUE(s.ok()) << s.to_string();
    MoEConfig d = tiny_config(kind, DType::kF32);
    d.layout.capacity_factor = 1.0;
    d.layout.router_padding_multiple = 4;
    d.shared_expert_ffn = 0;
    d.num_topk = 8;  // K = E
    s = check_layer(GetParam(), d, 2, 0);
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
}

TEST_P(MoELayerTest, OutputIdenticalAcrossDispatchers) {
  std::vector<std::map<int, Tensor>> outs(3);
  for (int i = 0; i < 3; ++i) {
    Status s =
        check_layer(GetParam(), tiny_config(kNormal[i], DType::kF32), 4, 0, &outs[size_t(i)]);
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
  for (int i = 1; i < 3; ++i) {
    for (auto& [rank, y] : outs[0]) {
      ASSERT_TRUE(outs[size_t(i)].count(rank));
      EXPECT_TRUE(bitwise_equal(y, outs[size_t(i)][rank]))
          << dispatcher_kind_name(kNormal[i]) << " differs from allgather on rank " << rank;
    }
  }
}

TEST_P(MoELayerTest, BadConfigAndInputAreErrorsOnEveryRank) {
  MoEConfig c = tiny_config(DispatcherKind::kFlex, DType::kF32);
  c.num_experts = 6;  // not divisible by EP = 4
  Status s = testing::run_world(
      GetParam(), 4, 0, [&](World& w) -> Status { return MoELayer::create(w, c).status(); });
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("num_experts = 6"), std::string::npos) << s.message();

  MoEConfig ll = low_latency_config(DType::kF32);
  EXPECT_EQ(ll.validate(2).code(), StatusCode::kUnimplemented);

  MoEConfig ok = tiny_config(DispatcherKind::kFlex, DType::kF32);
  s = testing::run_world(GetParam(), 2, 0, [&](World& w) -> Status {
    MOED_ASSIGN_OR_RETURN(std::unique_ptr<MoELayer> layer, MoELayer::create(w, ok));
    Tensor x = random_rows(DType::kF32, 4, w.rank() == 1 ? 31 : 32, 1);
    return layer->forward(x).status();
  });
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("[4, 31]"), std::string::npos) << s.message();
}

INSTANTIATE_TEST_SUITE_P(Worlds, MoELayerTest, ::testing::ValuesIn(testing::backends()),
                         testing::backend_param_name<::testing::TestParamInfo<Backend>>);

}  // namespace
}  // namespace moed
