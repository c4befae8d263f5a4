#include "zeroshard/checkpoint/engine_checkpoint.h"

#include "zeroshard/comm/engine_groups.h"
#include "zeroshard/optim/optimizer_step.h"
#include "zeroshard/state/model_state.h"

namespace zeroshard {

CheckpointedState checkpointedState(const Config& config, const BatchSizes& batch, EngineGroups& groups,
                                    ModelState& model, OptimizerStep& step, AccumulationWindow& window) {
  return {config,
          model.plan(),
          groups.world(),
          model.computeDtype(),
          model.buckets(),
          model.slots(),
          model.optimizer(),
          step.scaler(),
          model.moduleState(),
          model.frozenBuckets(),
          [&model](size_t frozenBucket, const std::function<void()>& use) { model.withFrozenWhole(frozenBucket, use); },
          window,
          step.skippedSteps(),
          step.schedule(),
          groups.shard().rank(),
          groups.shard().worldSize(),
          batch};
}

} // namespace zeroshard
