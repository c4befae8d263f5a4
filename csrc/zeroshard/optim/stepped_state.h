// What the optimizer step (optimizer_step.h) reads and writes of the model state, lent for one
// call: ModelState::stepped() in state/model_state.h, which owns all of it.
#pragma once

#include <c10/core/Device.h>

#include "zeroshard/layout/bucket.h"
#include "zeroshard/optim/bucket_slots.h"

#include <vector>

namespace zeroshard {

class GradStorage;
class MasterWeights;
class ParamStorage;
class ShardedAdamW;
class ShardingPlan;

struct SteppedState {
  const ShardingPlan& plan;
  ShardedAdamW& optimizer;
  MasterWeights& masters;
  const std::vector<Bucket>& buckets;
  const std::vector<std::vector<OptimizerSlot>>& slots;
  GradStorage& grads;
  ParamStorage& params;

  at::Device device() const { return buckets.front().flatParams().device(); }
};

} // namespace zeroshard
