// The Flex dispatcher's own type (DeepEP's design, docs/design.md §5), for its extra: the shared
// combine buffer that lets experts write their outputs where peers can read them without a
// copy. (DeepEP's get_dispatch_layout is moed/dispatch_layout.h's.)
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "moed/dispatcher.h"
#include "moed/routing.h"
#include "moed/status.h"
#include "moed/tensor.h"

namespace moed {

// The Flex dispatcher: a TokenDispatcher (TokenDispatcher::create with kind = kFlex makes the
// same) with Flex's extras, so they need no cast.
class FlexDispatcher : public TokenDispatcher {
 public:
  // config.kind must be kFlex. Collective, as TokenDispatcher::create.
  static StatusOr<std::unique_ptr<FlexDispatcher>> make(World& world, const DispatchConfig& config);

  // A view of `rows` x hidden rows of `dtype` (f32 or bf16) in node-shared memory, for the
  // experts of the dispatch that made `handle` to write their outputs into. Passing it (or a
  // view of its first handle->num_rows rows) as CombineInput.expert_output lets combine read
  // the rows in place; any other memory is first copied there (in the MPI world; in the threads
  // world every rank's memory is already node-shared and is read in place). Collective over the
  // node: every rank of the node calls it after the same dispatch with the same dtype. Valid
  // until the next call or the next combine with other memory.
  virtual StatusOr<TensorView> expert_output_buffer(const DispatchHandle& handle, DType dtype) = 0;

 protected:
  using TokenDispatcher::TokenDispatcher;
};

}  // namespace moed
