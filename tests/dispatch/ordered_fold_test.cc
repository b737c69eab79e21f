// DeepEP V2's combine order (dispatch/ordered_fold.h) against its definition written out the
// plainest way, for every recipe: groups found by scanning, each group's sum in slot order from
// 0 rounded to bf16, items in the order of their last slots. Compared bitwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <vector>

#include "dispatch/ordered_fold.h"

namespace moed {
namespace {

struct Term {
  int slot, rank, node;
  std::vector<bf16> row;
};

// One level of partials: the items that share a key, summed in slot order and rounded.
std::vector<Term> group(const std::vector<Term>& items, bool by_node) {
  std::map<int, std::vector<Term>> groups;
  for (const Term& t : items) groups[by_node ? t.node : t.rank].push_back(t);
  std::vector<Term> out;
  for (auto& [key, members] : groups) {
    std::sort(members.begin(), members.end(),
              [](const Term& a, const Term& b) { return a.slot < b.slot; });
    Term p = members.back();
    for (size_t h = 0; h < p.row.size(); ++h) {
      float s = 0.0f;
      for (const Term& m : members) s += bf16_to_float(m.row[h]);
      p.row[h] = float_to_bf16(s);
    }
    out.push_back(p);
  }
  return out;
}

std::vector<bf16> reference(std::vector<Term> items, CombineRecipe recipe, const std::vector<float>& start) {
  if (recipe.reduce_in_local) items = group(items, false);
  if (recipe.reduce_in_local && recipe.reduce_in_scaleup) items = group(items, true);
  std::sort(items.begin(), items.end(), [](const Term& a, const Term& b) { return a.slot < b.slot; });
  std::vector<bf16> out(start.size());
  for (size_t h = 0; h < start.size(); ++h) {
    float acc = start[h];
    for (const Term& t : items) acc += bf16_to_float(t.row[h]);
    out[h] = float_to_bf16(acc);
  }
  return out;
}

TEST(OrderedFold, EveryRecipeMatchesItsDefinition) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-100.0f, 100.0f);
  const int H = 19;  // not a multiple of the vector widths
  for (int trial = 0; trial < 400; ++trial) {
    const int K = 1 + int(rng() % 8), R = 1 + int(rng() % 6), G = 1 + int(rng() % 3);
    std::vector<Term> terms;
    std::vector<int> slots(static_cast<size_t>(K));
    for (int k = 0; k < K; ++k) slots[size_t(k)] = k;
    std::shuffle(slots.begin(), slots.end(), rng);
    const int n = 1 + int(rng() % K);
    for (int i = 0; i < n; ++i) {
      const int rank = int(rng() % R);
      Term t{slots[size_t(i)], rank, rank / G, std::vector<bf16>(size_t(H))};
      for (bf16& v : t.row) v = float_to_bf16(u(rng) * (rng() % 3 == 0 ? 1e-3f : 1.0f));
      terms.push_back(t);
    }
    std::vector<float> start(size_t(H), 0.0f);
    if (trial % 2) for (float& v : start) v = bf16_to_float(float_to_bf16(u(rng)));
    for (CombineRecipe recipe : {CombineRecipe{false, false}, CombineRecipe{true, false},
                                 CombineRecipe{true, true}}) {
      std::vector<OrderedTerm> in;
      for (const Term& t : terms) in.push_back({t.row.data(), t.slot, t.rank, t.node});
      std::vector<float> acc = start;
      OrderedFold fold(DType::kBF16, H);
      fold.fold(acc.data(), in, recipe);
      std::vector<bf16> got(static_cast<size_t>(H));
      store_row(acc.data(), got.data(), DType::kBF16, size_t(H));
      const std::vector<bf16> want = reference(terms, recipe, start);
      for (int h = 0; h < H; ++h) {
        ASSERT_EQ(got[size_t(h)].bits, want[size_t(h)].bits)
            << "trial " << trial << " recipe " << recipe.reduce_in_local << recipe.reduce_in_scaleup
            << " h " << h;
      }
    }
  }
}

}  // namespace
}  // namespace moed
