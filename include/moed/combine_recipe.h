// DeepEP V2's combine orders (its reference, deep_ep/utils/refs.py, fixes them bit for bit),
// which ElasticBuffer's combines follow (moed/elastic_buffer.h). moed's own combine order
// (design.md §4.1: experts ascending) is not this one; these are DeepEP's recipes, kept exactly so
// that DeepEP's tests and users get DeepEP's bits.
//
// One token's sum: acc = bias_0 + bias_1 (fp32, or 0), then its terms, each a row in the
// combine's dtype with the top-k slot it stands for (its rank's last slot for a rank's row):
//   - neither reduction: every term is added to acc in slot order;
//   - reduce_in_local: the terms of one rank are first summed (fp32 from 0, slot order) and
//     rounded to the dtype; the partial stands at the rank's last slot;
//   - reduce_in_scaleup too: the rank partials of one node are then summed the same way
//     (in the order of their slots) and rounded; that partial stands at the node's last slot;
// and the items left are added to acc in the order of their slots. acc is rounded once.
// With allow_multiple_reduction = False (no partials) the result does not depend on how the
// experts are spread over ranks and nodes: the same bits at every EP size and node split.
#pragma once

namespace moed {

struct CombineRecipe {
  bool reduce_in_local = false;
  bool reduce_in_scaleup = false;  // needs reduce_in_local
};

}  // namespace moed
