// Internal: the Flex dispatcher's entry points for the rest of the library (its class and
// phases stay in this folder): the factory TokenDispatcher::create and FlexDispatcher::make call
// (DeepEP's design, design.md §5) and DeepEP V2's ordered combine, which ElasticBuffer calls.
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "moed/combine_recipe.h"
#include "moed/dispatcher.h"
#include "moed/flex.h"

namespace moed {

// The config is valid and agreed (TokenDispatcher::create and FlexDispatcher::make check it):
// the Flex dispatcher, as its own type and as a TokenDispatcher (the factory create and the
// tests' harness take).
StatusOr<std::unique_ptr<FlexDispatcher>> make_flex(World& world, const DispatchConfig& config);
StatusOr<std::unique_ptr<TokenDispatcher>> make_flex_dispatcher(World& world,
                                                                const DispatchConfig& config);

// DeepEP V2's combine over Flex's layout (ElasticBuffer's expanded layout,
// moed/elastic_buffer.h): the combine in one collective call, each token's terms summed in V2's
// order (moed/combine_recipe.h) after bias_0 + bias_1, and each (token, slot)'s row weight
// handed back. Needs etp_size = 1 and a routing with top-k slots (from a top-k form).
struct OrderedCombineInput {
  TensorView rows;                     // [num_rows, H] f32 or bf16, the dispatch's layout
  std::span<const float> row_weights;  // [num_rows] or empty
  TensorView bias_0, bias_1;           // optional [T, H] of rows' dtype
  CombineRecipe recipe;
  int num_topk = 0;               // K of the weights' output
  std::optional<TensorView> out;  // optional caller-owned [T, H]
};
struct OrderedCombineOutput {
  Tensor combined;                  // [T, H]; empty when out was given
  std::vector<float> slot_weights;  // [T, K] when row_weights were given (any rank), else empty
};
StatusOr<OrderedCombineOutput> flex_ordered_combine(FlexDispatcher& dispatcher,
                                                    std::shared_ptr<const DispatchHandle> handle,
                                                    const OrderedCombineInput& input);

}  // namespace moed
