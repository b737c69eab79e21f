// One token's sum in DeepEP V2's order (ordered_fold.h).
#include "dispatch/ordered_fold.h"

#include <algorithm>
#include <cstring>

namespace moed {

namespace {

// Groups `items` (sorted by slot) by `key`, each group's members in slot order; a group's place
// is its last member's slot. Calls make(members) for each group; returns the groups' results
// (sorted by slot again).
template <typename Key, typename Make>
std::vector<OrderedTerm> grouped(std::span<const OrderedTerm> items, Key key, Make make) {
  std::vector<OrderedTerm> out;
  std::vector<OrderedTerm> members;
  std::vector<bool> done(items.size(), false);
  for (size_t i = 0; i < items.size(); ++i) {
    if (done[i]) continue;
    members.clear();
    for (size_t j = i; j < items.size(); ++j) {
      if (!done[j] && key(items[j]) == key(items[i])) {
        members.push_back(items[j]);
        done[j] = true;
      }
    }
    out.push_back(make(std::span<const OrderedTerm>(members)));
  }
  std::sort(out.begin(), out.end(),
            [](const OrderedTerm& a, const OrderedTerm& b) { return a.slot < b.slot; });
  return out;
}

}  // namespace

OrderedFold::OrderedFold(DType dtype, int64_t hidden)
    : dtype_(dtype), hidden_(hidden), sum_(size_t(hidden)) {}

void OrderedFold::partial(std::span<const OrderedTerm> terms, void* out) {
  std::fill(sum_.begin(), sum_.end(), 0.0f);
  for (const OrderedTerm& t : terms) accumulate_row_f32(sum_.data(), t.row, dtype_, size_t(hidden_));
  store_row(sum_.data(), out, dtype_, size_t(hidden_));
}

void OrderedFold::fold(float* acc, std::span<OrderedTerm> terms, CombineRecipe recipe) {
  std::sort(terms.begin(), terms.end(),
            [](const OrderedTerm& a, const OrderedTerm& b) { return a.slot < b.slot; });
  std::vector<OrderedTerm> items(terms.begin(), terms.end());
  const size_t row_bytes = size_t(hidden_) * dtype_size(dtype_);
  // A group of one is its own partial: fp32 0 + x rounded back to the dtype is x.
  auto make_in = [&](std::vector<char>& rows, size_t& used) {
    return [&, row_bytes](std::span<const OrderedTerm> members) {
      OrderedTerm p = members.back();
      if (members.size() > 1) {
        char* row = rows.data() + used++ * row_bytes;
        partial(members, row);
        p.row = row;
      }
      return p;
    };
  };
  if (recipe.reduce_in_local) {
    rank_rows_.resize(items.size() * row_bytes);
    size_t used = 0;
    items = grouped(items, [](const OrderedTerm& t) { return t.rank; }, make_in(rank_rows_, used));
  }
  if (recipe.reduce_in_local && recipe.reduce_in_scaleup) {
    node_rows_.resize(items.size() * row_bytes);
    size_t used = 0;
    items = grouped(items, [](const OrderedTerm& t) { return t.node; }, make_in(node_rows_, used));
  }
  for (const OrderedTerm& t : items) accumulate_row_f32(acc, t.row, dtype_, size_t(hidden_));
}

}  // namespace moed
