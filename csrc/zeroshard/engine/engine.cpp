#include "zeroshard/engine/engine.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "zeroshard/comm/process_group.h"
#include "zeroshard/config/auto_values.h"
#include "zeroshard/grad/grad_reducer.h"
#include "zeroshard/grad/grad_storage.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <thread>

namespace zeroshard {
namespace {

std::chrono::milliseconds timeoutOf(const Config& config) {
  return std::chrono::milliseconds(static_cast<int64_t>(config.extras.collectiveTimeoutSeconds * 1000.0));
}

AdamWHyper hyperOf(const Config& config, const ParamGroupSpec& group) {
  const auto& o = config.optimizer;
  return AdamWHyper{group.lr.value_or(o.lr), group.beta1.value_or(o.beta1), group.beta2.value_or(o.beta2),
                    group.eps.value_or(o.eps), group.weightDecay.value_or(o.weightDecay)};
}

// "auto" left in the config (a C++ program reading a Hugging Face-style config) is resolved
// here, with the hidden size read from the weights; Python's initialize resolves it before,
// from model.config when the model has one. Rank 0 prints what each "auto" became.
Config withAutoResolved(Config config, const std::vector<ParamGroupSpec>& groups, const c10d::ProcessGroup& group) {
  if (config.autoKeys.empty()) return config;
  AutoInputs inputs;
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& g : groups) {
    for (const auto& p : g.params) shapes.push_back(p.sizes().vec());
  }
  inputs.hiddenSize = hiddenSizeFromShapes(shapes);
  inputs.hiddenSizeSource = "the weights (the most common second dimension of the 2-D parameters)";
  inputs.worldSize = group.getSize();
  AutoResolution resolved = resolveAuto(config, inputs);
  if (group.getRank() == 0) std::printf("zeroshard: %s\n", resolved.summary.c_str());
  return std::move(resolved.config);
}


// Whether the parameters are on the meta device: all of them, or none (the engine then
// allocates on MetaInit::device).
bool onMeta(const std::vector<ParamGroupSpec>& groups) {
  std::optional<std::string> meta, real;
  std::string realDevice;
  for (const auto& g : groups) {
    for (size_t i = 0; i < g.params.size(); ++i) {
      if (!g.params[i].defined()) continue;
      if (g.params[i].is_meta()) {
        if (!meta) meta = g.names[i];
      } else if (!real) {
        real = g.names[i];
        realDevice = g.params[i].device().str();
      }
    }
  }
  TORCH_CHECK(!(meta && real), "zeroshard: parameter '", *meta, "' is on the meta device but '", *real, "' is on ",
              realDevice, "; build the whole model on the meta device, or none of it");
  return meta.has_value();
}

} // namespace

Engine::Engine(std::vector<ParamGroupSpec> groups, c10::intrusive_ptr<c10d::ProcessGroup> processGroup,
               Config config, std::vector<UnitSpec> units, MetaInit init,
               std::vector<std::pair<std::string, at::Tensor>> frozen)
    : config_(withAutoResolved(std::move(config), groups, *processGroup)),
      plan_(ShardingPlan::fromConfig(config_, processGroup->getSize(),
                                     onMeta(groups) ? init.device.str() : deviceOfParamGroups(groups),
                                     localWorldSizeFromEnv(processGroup->getSize()))),
      groups_(std::move(processGroup), timeoutOf(config_), plan_),
      stepLog_(world().rank() == 0, config_.stepsPerPrint, config_.wallClockBreakdown,
               [this] { return world().waitNanos(); }, [this] { syncComputeDevice(); }),
      window_(config_.batchSizes(world().worldSize()).accumulationSteps) {
  computeDtype_ = config_.bf16.enabled ? at::kBFloat16 : config_.fp16.enabled ? at::kHalf : at::kFloat;
  if (config_.fp16.enabled) scaler_.emplace(config_.fp16);
  batchSizes_ = config_.batchSizes(world().worldSize());
  checkParamGroups(groups);
  const int shardRank = shardComm().rank();
  const int shards = shardComm().worldSize();
  const std::optional<at::Device> metaDevice = onMeta(groups) ? std::optional(init.device) : std::nullopt;
  std::vector<UnitPolicy> policies;
  std::vector<UnitBuffers> unitBuffers;
  if (plan_.paramsSharded()) {
    auto built = buildStage3Units(groups, std::move(units),
                                  {config_.zero.stage3ParamPersistenceThreshold, config_.extras.reshardAfterForward},
                                  shardRank, shards, computeDtype_, metaDevice, frozen);
    buckets_ = std::move(built.buckets);
    frozenBuckets_ = std::move(built.frozenBuckets);
    frozenWhole_ = std::move(built.frozenWhole);
    unitBuffers = std::move(built.buffers);
    policies = std::move(built.policies);
    specToUnit_ = std::move(built.unitOf);
    unitInfos_ = std::move(built.infos);
  } else {
    buckets_ = bucketParamGroups(groups, config_.zero.reduceBucketSize, shardRank, shards, computeDtype_, metaDevice);
    frozenWhole_ = std::move(frozen);
  }

  if (metaDevice) {
    // Nothing to broadcast: every rank initialises the same values (engine_init.cpp), into
    // storage that holds only what it keeps.
    if (!plan_.paramsSharded()) {
      for (auto& b : buckets_) b.allocateZeroed();
    }
    masters_.emplace(MasterWeights::allocated(buckets_, plan_.optimizerSharded(), shardRank));
  } else {
    // Every rank starts from rank 0's parameters, as DDP and DeepSpeed do.
    // With 16-bit parameters the fp32 master is what is broadcast, then cast into them.
    std::vector<CommHandle> handles;
    masters_.emplace(buckets_);
    for (size_t i = 0; i < buckets_.size(); ++i) handles.push_back(world().broadcast(masters_->of(buckets_[i], i), 0));
    // Frozen buffers are whole until the scheduler keeps this rank's shard (frozenWhole_ are
    // module state: broadcastModuleState()).
    for (auto& b : frozenBuckets_) handles.push_back(world().broadcast(b.flatParams(), 0));
    for (auto& h : handles) h.wait();
    masters_->pushToParams(buckets_);
  }

  for (const auto& group : groups) optimizer_.addGroup(hyperOf(config_, group));
  initSchedule();
  if (!metaDevice && plan_.optimizerSharded()) masters_->shard(buckets_, shardRank);
  if (plan_.paramsSharded()) {
    auto units = std::make_unique<UnitScheduler>(buckets_, frozenBuckets_, std::move(unitBuffers), std::move(policies),
                                                 shardComm(),
                                                 config_.zero.stage3PrefetchBucketSize,
                                                 config_.zero.stage3MaxLiveParameters, plan_.paramsOnHost(),
                                                 plan_.pinParams(), groups_.secondary(),
                                                 config_.extras.stage3GatherStream);
    units_ = units.get();
    params_ = std::move(units);
  } else {
    params_ = std::make_unique<ReplicatedParams>(buckets_, shardComm(), plan_.optimizerSharded(),
                                                 config_.zero.allgatherBucketSize);
  }
  // Offload (docs/offload.md): the masters move once the parameter storage holds its shards.
  if (plan_.anyOptimizerOnHost(buckets_.size()) || plan_.paramsOnHost()) {
    // torchrun sets OMP_NUM_THREADS=1, which would run the host AdamW on one core.
    if (plan_.anyOptimizerOnHost(buckets_.size()) && world().rank() == 0 && at::get_num_threads() == 1 &&
        std::thread::hardware_concurrency() > 1) {
      TORCH_WARN("zeroshard: the offloaded optimizer steps on the host with torch's intra-op threads, and there is "
                 "1 (torchrun sets OMP_NUM_THREADS=1); call torch.set_num_threads(n) (C++: at::set_num_threads) "
                 "with this rank's share of the host's cores");
    }
    masters_->offload(buckets_, plan_.optimizerOnHostByBucket(buckets_.size()), plan_.paramsOnHost(),
                      plan_.pinOptimizer());
  }
  // Before the gradient hooks: pointing a parameter at a scratch tensor of another dtype resets
  // its gradient accumulator.
  if (metaDevice) {
    for (const auto& [name, p] : frozenWhole_) {
      if (p.is_meta()) setTensorData(p, at::zeros(p.sizes(), p.options().device(init.device)));
    }
    initFromMeta(init);
  }
  grads_ = GradStorage::forPlan(plan_, buckets_, shardRank,
                                {computeDtype_, batchSizes_.accumulationSteps, config_.extras.reduceDtype == "fp32"},
                                groups_.replicate());
  registerShards();
  ReductionOptions reduction;
  // fp16 gradients are divided by the world size before they are summed, so the sum of many
  // ranks' scaled gradients stays inside fp16's range.
  reduction.preDivide = computeDtype_ == at::kHalf;
  reduction.reduceInFloat = config_.extras.reduceDtype == "fp32";
  const bool gradsOnGpu = !buckets_.front().flatParams().device().is_cpu();
  reduction.overlap = config_.zero.overlapCommResolved(gradsOnGpu);
  reduction.maxInFlight = config_.extras.maxInflightReductions;
  if (units_) reduction.onLaunched = [this](size_t bucket) { units_->afterBucketReduce(bucket); };
  reducer_ = std::make_unique<GradReducer>(buckets_, *grads_, shardComm(), std::move(reduction));
  nonfiniteDeferred_ = defersNonfiniteCheck();
  groups_.resetStepStats();
}

void Engine::registerShards() {
  for (size_t i = 0; i < buckets_.size(); ++i) {
    slots_.push_back(registerBucket(optimizer_, buckets_[i], masters_->of(buckets_[i], i), grads_->optimizerGrad(i),
                                    /*splitByGroup=*/plan_.paramsSharded(), shardComm().rank()));
  }
}

Engine::~Engine() = default;

void Engine::backward(const at::Tensor& loss, bool scaleByAccumulation) {
  TORCH_CHECK(loss.defined() && loss.numel() == 1, "zeroshard: engine.backward() needs a scalar loss, got ",
              loss.defined() ? loss.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(!window_.awaitingStep(), "zeroshard: engine.backward() called twice without engine.step() between; "
                                      "call engine.step() after every backward, as with DeepSpeed");
  const TimedPhase timed(stepLog_, StepPhase::kBackward);
  if (stepLog_.prints()) lastLoss_ = loss.detach();
  const int64_t accumulation = scaleByAccumulation ? batchSizes_.accumulationSteps : 1;
  const bool boundary = window_.isBoundary();
  reducer_->beginBackward(boundary);
  try {
    // fp16: the loss is scaled in fp32 (the gradient entering the fp16 graph is the scale).
    const at::Tensor scaled = scaler_ ? loss.to(at::kFloat) * (scaler_->scale() / static_cast<double>(accumulation))
                              : accumulation > 1 ? loss / static_cast<double>(accumulation)
                                                 : loss;
    torch::autograd::backward({scaled});
  } catch (...) {
    reducer_->abortBackward();
    params_->abortBackward();
    throw;
  }
  reducer_->finishBackward();
  params_->finishBackward();
  window_.recordBackward(boundary);
}

bool Engine::step() {
  // The decision this micro-step's backward took (Note [accumulation boundary]): its gradients
  // were reduced for it.
  if (!window_.finishMicroStep()) return false;
  bool taken = false;
  {
    const TimedPhase timed(stepLog_, StepPhase::kStep);
    taken = takeStep();
  }
  logBoundary();
  saveOnClock();
  return taken;
}

bool Engine::takeStep() {
  grads_->finishCopies();
  // Before this step reads the lr and step count, which a skipped last step must not have moved.
  settleLastStep();
  // Note [host writes after device reads]: the host step writes pinned host buffers (masters,
  // stage-3 host shards) that asynchronous copies queued on the device may still be reading
  // (the last step's copy back, a gather's host-to-device copy). Waiting for the device here
  // costs little: the host step needs the gradients, which come after that work anyway.
  if (plan_.anyOptimizerOnHost(buckets_.size()) || plan_.paramsOnHost()) syncComputeDevice();
  optimizer_.prepareGrads();
  at::Tensor skipOnDevice;  // the deferred check's flag: the kernel skips the step when it is 1
  if (scaler_) {
    const bool overflow = overflowed();
    scaler_->update(overflow);
    if (overflow) return skipStep();
  } else if (nonfiniteDeferred_) {
    skipOnDevice = nonfiniteOnDevice();
  } else if (config_.extras.nonfinite != "off" && !gradsFinite()) {
    return skipStep();  // zeroshard.nonfinite "skip" ("error" raised in gradsFinite)
  }
  clipGradients();
  if (plan_.anyOptimizerOnHost(buckets_.size())) {
    stepBucketByBucket();
  } else {
    optimizer_.step(skipOnDevice);
    masters_->pushToParams(buckets_);
    params_->afterStep();
  }
  if (skipOnDevice.defined()) {
    deferredSkip_.record(skipOnDevice, window_.boundaries(), optimizer_);
  }
  if (schedule_) applySchedule(schedule_->step());
  finishStep();
  return true;
}

// Offload: bucket by bucket, the AdamW step (on the host for offloaded buckets), the copy of the
// updated shard into the parameters (asynchronous from pinned memory on a GPU), and the start of
// the bucket's all-gather (stages 1-2; at stage 3 the shard is the parameter storage), so each
// bucket's copy and gather overlap the next one's step. The values are step()'s.
void Engine::stepBucketByBucket() {
  optimizer_.beginStep();
  for (size_t b = 0; b < buckets_.size(); ++b) {
    std::vector<ShardedAdamW::ShardRef> shards;
    for (const auto& slot : slots_[b]) shards.push_back({slot.group, slot.index});
    optimizer_.stepShards(shards);
    masters_->pushToParams(buckets_[b], b);
    params_->afterStepOf(b);
  }
  optimizer_.endStep();
  params_->finishAfterStep();
}

bool Engine::overflowed() {
  auto found = optimizer_.unscaleAndFindNonFinite(1.0 / scaler_->scale(), buckets_.front().flatParams().device());
  // Shards differ between ranks: one rank's inf must stop every rank's step. The flag is read
  // on the host once (the one synchronisation of an fp16 step), after the ranks are combined.
  if (plan_.optimizerSharded()) shardComm().allReduce(found).wait();
  return found.item<float>() > 0;
}

// Every rank skips: parameters and optimizer state stay as they were.
bool Engine::skipStep() {
  optimizer_.discardPrepared();
  ++skippedSteps_;
  finishStep();
  return false;
}

void Engine::finishStep() {
  zeroGrads();
  stepSquares_ = at::Tensor();
  groups_.recordStep();
  lastPeakStagingBytes_ = reducer_->peakStagingBytes();
  reducer_->resetPeak();
  lastPeakGatheredBytes_ = params_->peakGatheredBytes();
  lastPeakSecondaryBytes_ = params_->peakSecondaryBytes();
  params_->resetPeak();
}

// The squared global norm of the step's gradients, computed once a step (the nonfinite check
// and clipping share it).
const at::Tensor& Engine::globalGradSquares() {
  if (stepSquares_.defined()) return stepSquares_;
  stepSquares_ = optimizer_.localGradSquareSum(buckets_.front().flatParams().device());
  // Each rank holds a disjoint shard of the reduced gradients. Without clipping only the
  // nonfinite check reads the norm: its one-value reduction is a check, not the step's traffic,
  // and comm_stats() (held to the stages' formulas) does not count it.
  if (plan_.optimizerSharded()) {
    std::optional<UncountedCollectives> uncounted;
    if (config_.gradientClipping <= 0) uncounted.emplace(shardComm());
    shardComm().allReduce(stepSquares_).wait();
  }
  return stepSquares_;
}

void Engine::clipGradients() {
  const double maxNorm = config_.gradientClipping;
  if (maxNorm <= 0) return;
  lastGradNorm_ = globalGradSquares().sqrt();
  const at::Tensor coef = lastGradNorm_.add(1e-6).reciprocal().mul_(maxNorm).clamp_max_(1.0);
  // On a CPU reading coef costs nothing and saves a pass over the gradients when no clipping
  // is needed; on a GPU it would be a host synchronisation, so a factor of 1 is applied there.
  if (!coef.device().is_cpu() || coef.item<double>() < 1.0) optimizer_.scaleGrads(coef);
}

void Engine::zeroGrads() {
  grads_->zero();
}

MemoryStats Engine::memoryStats() const {
  MemoryStats stats;
  stats.paramBytes = params_->bytes();
  stats.gradBytes = grads_->bytes();
  stats.gatheredPeakBytes = lastPeakGatheredBytes_;
  stats.secondaryPeakBytes = lastPeakSecondaryBytes_;
  stats.stagingPeakBytes = lastPeakStagingBytes_;
  stats.fp32GradsPeakBytes = optimizer_.peakConvertedBytes();
  // fp32 training: the master weights are the parameters' own storage, not a copy.
  stats.optimizerBytes = optimizer_.stateBytes();
  stats.optimizerBytes += masters_->separateBytes();
  stats.hostParamBytes = params_->hostBytes();
  stats.hostGradBytes = grads_->hostBytes();
  stats.hostOptimizerBytes = masters_->hostBytes();
  for (const auto& [name, p] : frozenWhole_) stats.frozenBytes += static_cast<int64_t>(p.nbytes());
  if (units_) {
    stats.frozenBytes += units_->frozenBytes();
    stats.hostFrozenBytes = units_->frozenHostBytes();
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (!plan_.optimizerOnHost(b, buckets_.size())) continue;
    for (const auto& slot : slots_[b]) {
      const auto state = optimizer_.shardState(slot.group, slot.index);
      stats.hostOptimizerBytes += static_cast<int64_t>(state.expAvg.nbytes() + state.expAvgSq.nbytes());
    }
  }
  return stats;
}

} // namespace zeroshard
