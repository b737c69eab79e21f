// One token's sum in DeepEP V2's order (moed/combine_recipe.h), for the combines that serve
// ElasticBuffer: Flex's (the expanded layout, one term per token and expert) and the
// rank-major one (one term per token and rank).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "moed/combine_recipe.h"
#include "moed/dtype.h"

namespace moed {

// One term of a token: its row (the combine's dtype), the top-k slot it stands at, and the
// rank and node that hold it.
struct OrderedTerm {
  const void* row = nullptr;
  int slot = 0;
  int rank = 0;
  int node = 0;
};

// Scratch for fold_ordered, reused across tokens by one worker.
class OrderedFold {
 public:
  OrderedFold(DType dtype, int64_t hidden);
  // acc [hidden] holds the start (the biases' sum, or 0); adds the terms (any order on entry;
  // reordered in place) by `recipe`.
  void fold(float* acc, std::span<OrderedTerm> terms, CombineRecipe recipe);

 private:
  // The partial of terms[b, e) (sorted by slot): fp32 from 0, rounded to the dtype into `out`.
  void partial(std::span<const OrderedTerm> terms, void* out);
  DType dtype_;
  int64_t hidden_;
  std::vector<float> sum_;
  std::vector<char> rank_rows_, node_rows_;  // rounded partials, one row each
};

}  // namespace moed
