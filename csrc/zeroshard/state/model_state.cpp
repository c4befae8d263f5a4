#include "zeroshard/state/model_state.h"

#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "zeroshard/comm/engine_groups.h"
#include "zeroshard/config/config.h"
#include "zeroshard/grad/grad_reducer.h"
#include "zeroshard/grad/grad_storage.h"
#include "zeroshard/layout/param_storage.h"
#include "zeroshard/stage3/unit_scheduler.h"

#include <thread>

namespace zeroshard {
namespace {

AdamWHyper hyperOf(const Config& config, const ParamGroupSpec& group) {
  const auto& o = config.optimizer;
  return AdamWHyper{group.lr.value_or(o.lr), group.beta1.value_or(o.beta1), group.beta2.value_or(o.beta2),
                    group.eps.value_or(o.eps), group.weightDecay.value_or(o.weightDecay)};
}

at::ScalarType computeDtypeOf(const Config& config) {
  return config.bf16.enabled ? at::kBFloat16 : config.fp16.enabled ? at::kHalf : at::kFloat;
}

} // namespace

ModelState::ModelState(ModelInputs model, const Config& config, const ShardingPlan& plan, EngineGroups& groups)
    : plan_(plan), computeDtype_(computeDtypeOf(config)), shardRank_(groups.shard().rank()) {
  checkParamGroups(model.groups);
  Communicator& shardComm = groups.shard();
  const int shards = shardComm.worldSize();
  const std::optional<at::Device> metaDevice =
      paramsOnMeta(model.groups) ? std::optional(model.init.device) : std::nullopt;
  std::vector<UnitPolicy> policies;
  std::vector<UnitBuffers> unitBuffers;
  if (plan_.paramsSharded()) {
    auto built = buildStage3Units(model.groups, std::move(model.units),
                                  {config.zero.stage3ParamPersistenceThreshold, config.extras.reshardAfterForward},
                                  shardRank_, shards, computeDtype_, metaDevice, model.frozen);
    buckets_ = std::move(built.buckets);
    frozenBuckets_ = std::move(built.frozenBuckets);
    frozenWhole_ = std::move(built.frozenWhole);
    unitBuffers = std::move(built.buffers);
    policies = std::move(built.policies);
    specToUnit_ = std::move(built.unitOf);
    unitInfos_ = std::move(built.infos);
  } else {
    buckets_ = bucketParamGroups(model.groups, config.zero.reduceBucketSize, shardRank_, shards, computeDtype_,
                                 metaDevice);
    frozenWhole_ = std::move(model.frozen);
  }

  if (metaDevice) {
    // Nothing to broadcast: every rank initialises the same values (initFromMeta), into
    // storage that holds only what it keeps.
    if (!plan_.paramsSharded()) {
      for (auto& b : buckets_) b.allocateZeroed();
    }
    masters_.emplace(MasterWeights::allocated(buckets_, plan_.optimizerSharded(), shardRank_));
  } else {
    // Every rank starts from rank 0's parameters, as DDP and DeepSpeed do.
    // With 16-bit parameters the fp32 master is what is broadcast, then cast into them.
    std::vector<CommHandle> handles;
    masters_.emplace(buckets_);
    for (size_t i = 0; i < buckets_.size(); ++i) {
      handles.push_back(groups.world().broadcast(masters_->of(buckets_[i], i), 0));
    }
    // Frozen buffers are whole until the scheduler keeps this rank's shard (frozenWhole_ are
    // module state: broadcastModuleState()).
    for (auto& b : frozenBuckets_) handles.push_back(groups.world().broadcast(b.flatParams(), 0));
    for (auto& h : handles) h.wait();
    masters_->pushToParams(buckets_);
  }

  for (const auto& group : model.groups) optimizer_.addGroup(hyperOf(config, group));
  if (!metaDevice && plan_.optimizerSharded()) masters_->shard(buckets_, shardRank_);
  if (plan_.paramsSharded()) {
    auto units = std::make_unique<UnitScheduler>(buckets_, frozenBuckets_, std::move(unitBuffers), std::move(policies),
                                                 shardComm, config.zero.stage3PrefetchBucketSize,
                                                 config.zero.stage3MaxLiveParameters, plan_.paramsOnHost(),
                                                 plan_.pinParams(), groups.secondary(),
                                                 config.extras.stage3GatherStream);
    units_ = units.get();
    params_ = std::move(units);
  } else {
    params_ = std::make_unique<ReplicatedParams>(buckets_, shardComm, plan_.optimizerSharded(),
                                                 config.zero.allgatherBucketSize);
  }
  // Offload (docs/offload.md): the masters move once the parameter storage holds its shards.
  const bool optimizerOnHost = plan_.anyOptimizerOnHost(buckets_.size());
  if (optimizerOnHost || plan_.paramsOnHost()) {
    // torchrun sets OMP_NUM_THREADS=1, which would run the host AdamW on one core.
    if (optimizerOnHost && groups.world().rank() == 0 && at::get_num_threads() == 1 &&
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
      if (p.is_meta()) setTensorData(p, at::zeros(p.sizes(), p.options().device(model.init.device)));
    }
    initFromMeta(*this, groups.world(), model.init);
  }
  const int64_t accumulation = config.batchSizes(groups.world().worldSize()).accumulationSteps;
  grads_ = GradStorage::forPlan(plan_, buckets_, shardRank_,
                                {computeDtype_, accumulation, config.extras.reduceDtype == "fp32"},
                                groups.replicate());
  for (size_t i = 0; i < buckets_.size(); ++i) {
    slots_.push_back(registerBucket(optimizer_, buckets_[i], masters_->of(buckets_[i], i), grads_->optimizerGrad(i),
                                    /*splitByGroup=*/plan_.paramsSharded(), shardRank_));
  }
  ReductionOptions reduction;
  // fp16 gradients are divided by the world size before they are summed, so the sum of many
  // ranks' scaled gradients stays inside fp16's range.
  reduction.preDivide = computeDtype_ == at::kHalf;
  reduction.reduceInFloat = config.extras.reduceDtype == "fp32";
  reduction.overlap = config.zero.overlapCommResolved(!device().is_cpu());
  reduction.maxInFlight = config.extras.maxInflightReductions;
  if (units_) reduction.onLaunched = [this](size_t bucket) { units_->afterBucketReduce(bucket); };
  reducer_ = std::make_unique<GradReducer>(buckets_, *grads_, shardComm, std::move(reduction));
  if (!model.stateDict.empty()) {
    setModuleState(moduleStateOf(model.stateDict, buckets_, frozenBuckets_, frozenWhole_));
    if (model.broadcastStateDict) broadcastModuleState(groups.world());
  }
}

ModelState::~ModelState() = default;

SteppedState ModelState::stepped() {
  return {plan_, optimizer_, *masters_, buckets_, slots_, *grads_, *params_};
}

void ModelState::recordPeaks() {
  lastPeakStagingBytes_ = reducer_->peakStagingBytes();
  reducer_->resetPeak();
  lastPeakGatheredBytes_ = params_->peakGatheredBytes();
  lastPeakSecondaryBytes_ = params_->peakSecondaryBytes();
  params_->resetPeak();
}

void ModelState::followMasters() {
  params_->reshardAll();
  masters_->pushToParams(buckets_);
  params_->afterStep();
  grads_->zero();
}

MemoryStats ModelState::memoryStats() const {
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

void ModelState::checkUnitSpec(size_t unitSpec) const {
  TORCH_CHECK(units_, "zeroshard: unit hooks are for stage 3; this engine runs stage ",
              static_cast<int>(plan_.stage()));
  TORCH_CHECK(unitSpec < specToUnit_.size(), "zeroshard: unit ", unitSpec, " does not exist (",
              specToUnit_.size(), " units)");
}

void ModelState::preForward(size_t unitSpec, const std::optional<std::vector<at::Tensor>>& inputs) {
  checkUnitSpec(unitSpec);
  if (!specToUnit_[unitSpec]) return;
  if (inputs) units_->watchInputs(*specToUnit_[unitSpec], *inputs);
  units_->preForward(*specToUnit_[unitSpec]);
}

void ModelState::postForward(size_t unitSpec, const std::vector<at::Tensor>& outputs) {
  checkUnitSpec(unitSpec);
  if (specToUnit_[unitSpec]) units_->postForward(*specToUnit_[unitSpec], outputs);
}

bool ModelState::watchesInputs(size_t unitSpec) const {
  checkUnitSpec(unitSpec);
  return specToUnit_[unitSpec] && units_->watchesInputs(*specToUnit_[unitSpec]);
}

void ModelState::withFrozenWhole(size_t frozenBucket, const std::function<void()>& use) {
  const auto unit = units_->unitOfFrozen(frozenBucket);
  const bool gathered = units_->gatherUnit(unit);
  try {
    use();
  } catch (...) {
    if (gathered) units_->releaseUnit(unit);
    throw;
  }
  if (gathered) units_->releaseUnit(unit);
}

void ModelState::setModuleState(ModuleState state) {
  checkModuleState(state, buckets_);
  moduleState_ = std::move(state);
}

void ModelState::broadcastModuleState(Communicator& world) {
  const UncountedCollectives uncounted(world);
  at::NoGradGuard noGrad;
  std::vector<std::pair<at::Tensor, at::Tensor>> sent;  // (the module's tensor, what is broadcast)
  std::vector<CommHandle> handles;
  for (const auto& [name, t] : moduleState_.tensors) {
    if (t.is_meta() || t.numel() == 0) continue;
    at::Tensor data = t.detach();
    at::Tensor buffer = data.is_contiguous() ? data : data.contiguous();
    handles.push_back(world.broadcast(buffer, 0));
    sent.emplace_back(data, buffer);
  }
  for (auto& h : handles) h.wait();
  for (auto& [data, buffer] : sent) {
    if (!buffer.is_same(data)) data.copy_(buffer);
  }
}

} // namespace zeroshard
