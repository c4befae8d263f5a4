// The module state an engine carries beside its sharded parameters: buffers, frozen parameters
// (whole, or sharded in stage 3's frozen buckets) and second names of tied trained parameters,
// by state-dict name. Checkpoints, exports and pretrained loads read and write it.
#pragma once

#include <ATen/core/Tensor.h>

#include "zeroshard/layout/bucket.h"

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard {

// Module state a checkpoint must hold that the engine does not shard: buffers and frozen
// parameters (whole on every rank), and state-dict names under which a trained parameter
// appears a second time (tied weights). With it, a checkpoint converts to a complete state
// dict in the model's own order.
struct ModuleState {
  std::vector<std::string> keys;  // every state-dict name, in the model's order
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::vector<std::pair<std::string, std::string>> aliases;  // name -> trained parameter's name
  // Stage 3: frozen parameters held sharded in the engine's frozen buckets, under each of
  // their state-dict names (they are whole only while their unit is gathered).
  struct Sharded {
    std::string name;
    size_t bucket = 0;
    size_t param = 0;
  };
  std::vector<Sharded> sharded;
  // The names of `tensors` and `sharded` that are frozen parameters, not buffers: what
  // exclude_frozen_parameters leaves out.
  std::vector<std::string> frozen;
  bool isFrozen(const std::string& name) const;
};

// The module state of a model from its state dict (every name, in order): a trained parameter
// under another name than its own is an alias of it; a frozen parameter of `frozenBuckets` is
// sharded; what else is not trained (buffers, frozen parameters kept whole) is saved whole.
// `frozenWhole`: the frozen parameters kept whole (to tell them from buffers). The one rule for
// Python (state_dict order) and C++ models.
ModuleState moduleStateOf(const std::vector<std::pair<std::string, at::Tensor>>& stateDict,
                          const std::vector<Bucket>& buckets, const std::vector<Bucket>& frozenBuckets = {},
                          const std::vector<std::pair<std::string, at::Tensor>>& frozenWhole = {});

// Checks the module state against the trained parameters (names known, none twice).
void checkModuleState(const ModuleState& state, const std::vector<Bucket>& buckets);

}  // namespace zeroshard
