#include "zeroshard/optim/optimizer_step.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include "zeroshard/comm/communicator.h"
#include "zeroshard/config/config.h"
#include "zeroshard/grad/grad_storage.h"
#include "zeroshard/layout/host_memory.h"
#include "zeroshard/layout/param_storage.h"
#include "zeroshard/optim/master_weights.h"
#include "zeroshard/optim/optimizer.h"
#include "zeroshard/plan/sharding_plan.h"

namespace zeroshard {

OptimizerStep::OptimizerStep(const Config& config, const SteppedState& state, int rank)
    : gradientClipping_(config.gradientClipping),
      nonfinite_(config.extras.nonfinite),
      nonfiniteCheck_(config.extras.nonfiniteCheck),
      schedulerType_(config.scheduler.type),
      warns_(rank == 0) {
  if (config.fp16.enabled) scaler_.emplace(config.fp16);
  ShardedAdamW& optimizer = state.optimizer;
  if (config.scheduler.enabled()) {
    // The groups' lrs before the schedule touches them: WarmupCosineLR's ratios multiply them,
    // WarmupLR without warmup_max_lr warms up to them.
    std::vector<double> baseLrs;
    for (int g = 0; g < optimizer.numGroups(); ++g) baseLrs.push_back(optimizer.hyper(g).lr);
    schedule_.emplace(config.scheduler, std::move(baseLrs));
    if (schedule_->current()) applySchedule(optimizer, *schedule_->current());
  }
  deferred_ = decideDeferred(state);
}

bool OptimizerStep::take(const SteppedState& state, Communicator& shardComm, int64_t boundary) {
  RECORD_USER_SCOPE("zeroshard::optimizer_step");  // Note [profiler names]
  ShardedAdamW& optimizer = state.optimizer;
  const ShardingPlan& plan = state.plan;
  state.grads.finishCopies();
  // Before this step reads the lr and step count, which a skipped last step must not have moved.
  settle(state, boundary);
  // Note [host writes after device reads]: the host step writes pinned host buffers (masters,
  // stage-3 host shards) that asynchronous copies queued on the device may still be reading
  // (the last step's copy back, a gather's host-to-device copy). Waiting for the device here
  // costs little: the host step needs the gradients, which come after that work anyway.
  const bool optimizerOnHost = plan.anyOptimizerOnHost(state.buckets.size());
  if (optimizerOnHost || plan.paramsOnHost()) synchronizeDevice(state.device());
  optimizer.prepareGrads();
  at::Tensor skipOnDevice;  // the deferred check's flag: the kernel skips the step when it is 1
  if (scaler_) {
    const bool overflow = overflowed(state, shardComm);
    scaler_->update(overflow);
    if (overflow) return skip(state);
  } else if (deferred_) {
    skipOnDevice = nonfiniteOnDevice(state, shardComm);
  } else if (nonfinite_ != "off" && !gradsFinite(state, shardComm, boundary)) {
    return skip(state);  // zeroshard.nonfinite "skip" ("error" raised in gradsFinite)
  }
  clipGradients(state, shardComm);
  if (optimizerOnHost) {
    stepBucketByBucket(state);
  } else {
    optimizer.step(skipOnDevice);
    state.masters.pushToParams(state.buckets);
    state.params.afterStep();
  }
  if (skipOnDevice.defined()) deferredSkip_.record(skipOnDevice, boundary, optimizer);
  if (schedule_) applySchedule(optimizer, schedule_->step());
  finish(state);
  return true;
}

// Offload: bucket by bucket, the AdamW step (on the host for offloaded buckets), the copy of the
// updated shard into the parameters (asynchronous from pinned memory on a GPU), and the start of
// the bucket's all-gather (stages 1-2; at stage 3 the shard is the parameter storage), so each
// bucket's copy and gather overlap the next one's step. The values are step()'s.
void OptimizerStep::stepBucketByBucket(const SteppedState& state) {
  ShardedAdamW& optimizer = state.optimizer;
  optimizer.beginStep();
  for (size_t b = 0; b < state.buckets.size(); ++b) {
    std::vector<ShardedAdamW::ShardRef> shards;
    for (const auto& slot : state.slots[b]) shards.push_back({slot.group, slot.index});
    optimizer.stepShards(shards);
    state.masters.pushToParams(state.buckets[b], b);
    state.params.afterStepOf(b);
  }
  optimizer.endStep();
  state.params.finishAfterStep();
}

bool OptimizerStep::overflowed(const SteppedState& state, Communicator& shardComm) {
  auto found = state.optimizer.unscaleAndFindNonFinite(1.0 / scaler_->scale(), state.device());
  // Shards differ between ranks: one rank's inf must stop every rank's step. The flag is read
  // on the host once (the one synchronisation of an fp16 step), after the ranks are combined.
  if (state.plan.optimizerSharded()) shardComm.allReduce(found).wait();
  return found.item<float>() > 0;
}

// Every rank skips: parameters and optimizer state stay as they were.
bool OptimizerStep::skip(const SteppedState& state) {
  state.optimizer.discardPrepared();
  ++skippedSteps_;
  finish(state);
  return false;
}

void OptimizerStep::finish(const SteppedState& state) {
  state.grads.zero();
  stepSquares_ = at::Tensor();
  stepSum_ = at::Tensor();
}

// Note [finite probe]: the nonfinite check needs one value per step that is finite exactly when
// every gradient element is. With clipping the squared global norm is computed anyway and
// serves. Without it a plain sum does, for less: one read of each gradient, no squares, 16-bit
// gradients summed in fp32 without a converted copy; and it leaves fp32's range only past
// 3.4e38 in all, where a square does past 1.8e19 in one element, so it fails on finite
// gradients later than the norm would. The check's verdict and message are the same; nothing it
// computes reaches the weights.
const at::Tensor& OptimizerStep::finiteProbe(const SteppedState& state, Communicator& shardComm) {
  if (gradientClipping_ > 0) return globalGradSquares(state, shardComm);
  if (stepSum_.defined()) return stepSum_;
  stepSum_ = state.optimizer.localGradSum(state.device());
  if (state.plan.optimizerSharded()) {
    const UncountedCollectives uncounted(shardComm);  // a check, not the step's traffic
    shardComm.allReduce(stepSum_).wait();
  }
  return stepSum_;
}

// The squared global norm of the step's gradients, computed once a step (the nonfinite check
// and clipping share it).
const at::Tensor& OptimizerStep::globalGradSquares(const SteppedState& state, Communicator& shardComm) {
  if (stepSquares_.defined()) return stepSquares_;
  stepSquares_ = state.optimizer.localGradSquareSum(state.device());
  // Each rank holds a disjoint shard of the reduced gradients. Without clipping only the
  // nonfinite check reads the norm: its one-value reduction is a check, not the step's traffic,
  // and comm_stats() (held to the stages' formulas) does not count it.
  if (state.plan.optimizerSharded()) {
    std::optional<UncountedCollectives> uncounted;
    if (gradientClipping_ <= 0) uncounted.emplace(shardComm);
    shardComm.allReduce(stepSquares_).wait();
  }
  return stepSquares_;
}

void OptimizerStep::clipGradients(const SteppedState& state, Communicator& shardComm) {
  const double maxNorm = gradientClipping_;
  if (maxNorm <= 0) return;
  lastGradNorm_ = globalGradSquares(state, shardComm).sqrt();
  const at::Tensor coef = lastGradNorm_.add(1e-6).reciprocal().mul_(maxNorm).clamp_max_(1.0);
  // On a CPU reading coef costs nothing and saves a pass over the gradients when no clipping
  // is needed; on a GPU it would be a host synchronisation, so a factor of 1 is applied there.
  if (!coef.device().is_cpu() || coef.item<double>() < 1.0) state.optimizer.scaleGrads(coef);
}

void OptimizerStep::applySchedule(ShardedAdamW& optimizer, const std::vector<ScheduledValues>& values) {
  TORCH_INTERNAL_ASSERT(static_cast<int>(values.size()) == optimizer.numGroups());
  for (int g = 0; g < optimizer.numGroups(); ++g) {
    AdamWHyper& hyper = optimizer.hyper(g);
    const ScheduledValues& v = values[g];
    hyper.lr = v.lr;
    if (v.beta1) hyper.beta1 = *v.beta1;
    if (v.beta2) hyper.beta2 = *v.beta2;
  }
}

void OptimizerStep::setLearningRate(ShardedAdamW& optimizer, double lr, int group) const {
  TORCH_CHECK(!schedule_, "zeroshard: set_lr: the config's scheduler (", schedulerType_,
              ") sets the learning rate after every optimizer step, so a value set here would not last; "
              "remove \"scheduler\" from the config to schedule the lr yourself");
  TORCH_CHECK(lr >= 0, "zeroshard: learning rate must be >= 0, got ", lr);
  TORCH_CHECK(group >= -1 && group < optimizer.numGroups(), "zeroshard: param group ", group,
              " does not exist (", optimizer.numGroups(), " groups)");
  for (int g = 0; g < optimizer.numGroups(); ++g) {
    if (group == -1 || group == g) optimizer.hyper(g).lr = lr;
  }
}

double OptimizerStep::learningRate(const ShardedAdamW& optimizer, int group) {
  TORCH_CHECK(group >= 0 && group < optimizer.numGroups(), "zeroshard: param group ", group,
              " does not exist (", optimizer.numGroups(), " groups)");
  return optimizer.hyper(group).lr;
}

std::vector<double> OptimizerStep::learningRates(const ShardedAdamW& optimizer) {
  std::vector<double> out;
  for (int g = 0; g < optimizer.numGroups(); ++g) out.push_back(optimizer.hyper(g).lr);
  return out;
}

std::vector<std::pair<double, double>> OptimizerStep::betas(const ShardedAdamW& optimizer) {
  std::vector<std::pair<double, double>> out;
  for (int g = 0; g < optimizer.numGroups(); ++g) out.emplace_back(optimizer.hyper(g).beta1, optimizer.hyper(g).beta2);
  return out;
}

void OptimizerStep::loadScheduleState(const SteppedState& state, int64_t lastBatchIteration, int64_t boundary) {
  TORCH_CHECK(schedule_, "zeroshard: lr_scheduler.load_state_dict: the config has no \"scheduler\"");
  TORCH_CHECK(lastBatchIteration >= -1, "zeroshard: lr_scheduler.load_state_dict: last_batch_iteration must be -1 "
              "or more, got ", lastBatchIteration);
  settle(state, boundary, "at lr_scheduler.load_state_dict()");  // a rewind after the restore would undo it
  schedule_->restore(lastBatchIteration);
}

void OptimizerStep::afterLoad(ShardedAdamW& optimizer, bool loadedWithSchedule) {
  // The schedule owns the lr (LoadOptions::loadSchedulerState): the saved groups' values stand
  // only when they came with the schedule state they belong to.
  if (schedule_ && schedule_->current() && !loadedWithSchedule) applySchedule(optimizer, *schedule_->current());
}

} // namespace zeroshard
