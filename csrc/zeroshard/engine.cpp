#include "zeroshard/engine.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "zeroshard/grad/grad_reducer.h"
#include "zeroshard/grad/grad_storage.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <unordered_set>

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

void checkParams(const std::vector<ParamGroupSpec>& groups) {
  std::unordered_set<const void*> seen;
  size_t trainable = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& group = groups[g];
    TORCH_CHECK(group.names.size() == group.params.size(), "zeroshard: param group ", g, " has ",
                group.params.size(), " parameters but ", group.names.size(), " names");
    for (size_t i = 0; i < group.params.size(); ++i) {
      const auto& p = group.params[i];
      const auto& name = group.names[i];
      TORCH_CHECK(p.defined(), "zeroshard: parameter '", name, "' is undefined");
      TORCH_CHECK(p.is_leaf() && p.requires_grad(), "zeroshard: parameter '", name,
                  "' must be a leaf tensor that requires grad (frozen parameters stay outside the engine)");
      TORCH_CHECK(p.scalar_type() == at::kFloat, "zeroshard: parameter '", name, "' is ", p.scalar_type(),
                  "; keep the model in float32 (bf16/fp16 compute comes from the config's bf16/fp16 keys)");
      TORCH_CHECK(seen.insert(p.unsafeGetTensorImpl()).second, "zeroshard: parameter '", name,
                  "' appears twice (in two param groups, or under two names)");
      ++trainable;
    }
  }
  TORCH_CHECK(trainable > 0, "zeroshard: the model has no trainable parameters (none requires grad), "
                             "so there is nothing to shard or optimize");
}

// Where the model's states live: the device of its parameters (checkParams makes sure there is one).
std::string deviceOf(const std::vector<ParamGroupSpec>& groups) {
  for (const auto& group : groups) {
    for (const auto& p : group.params) {
      if (p.defined()) return p.device().str();
    }
  }
  return "cpu";
}

} // namespace

Engine::Engine(std::vector<ParamGroupSpec> groups, c10::intrusive_ptr<c10d::ProcessGroup> processGroup,
               Config config, std::vector<UnitSpec> units)
    : config_(std::move(config)),
      comm_(std::move(processGroup), timeoutOf(config_)),
      plan_(ShardingPlan::fromConfig(config_, comm_.worldSize(), deviceOf(groups))) {
  computeDtype_ = config_.bf16.enabled ? at::kBFloat16 : config_.fp16.enabled ? at::kHalf : at::kFloat;
  if (config_.fp16.enabled) scaler_.emplace(config_.fp16);
  batchSizes_ = config_.batchSizes(comm_.worldSize());
  checkParams(groups);
  std::vector<UnitPolicy> policies;
  if (plan_.paramsSharded()) {
    policies = buildUnits(groups, units);
  } else {
    buildBuckets(groups);
  }

  // Every rank starts from rank 0's parameters, as DDP and DeepSpeed do.
  // With 16-bit parameters the fp32 master is what is broadcast, then cast into them.
  std::vector<CommHandle> handles;
  for (auto& b : buckets_) handles.push_back(comm_.broadcast(b.master(), 0));
  for (auto& h : handles) h.wait();
  for (auto& b : buckets_) b.pushMasterToParams();

  for (const auto& group : groups) optimizer_.addGroup(hyperOf(config_, group));
  for (auto& b : buckets_) b.keepMaster(/*sharded=*/plan_.optimizerSharded());
  if (plan_.paramsSharded()) {
    units_ = std::make_unique<UnitScheduler>(buckets_, std::move(policies), comm_,
                                            config_.zero.stage3PrefetchBucketSize,
                                            config_.zero.stage3MaxLiveParameters);
  }
  grads_ = GradStorage::forPlan(plan_, buckets_, comm_.rank(),
                                {computeDtype_, batchSizes_.accumulationSteps, config_.extras.reduceDtype == "fp32"});
  registerShards();
  ReductionOptions reduction;
  // fp16 gradients are divided by the world size before they are summed, so the sum of many
  // ranks' scaled gradients stays inside fp16's range.
  reduction.preDivide = computeDtype_ == at::kHalf;
  reduction.reduceInFloat = config_.extras.reduceDtype == "fp32";
  reduction.overlap = config_.zero.overlapCommResolved();
  reduction.maxInFlight = config_.extras.maxInflightReductions;
  if (units_) reduction.onLaunched = [this](size_t unit) { units_->afterGradReduce(unit); };
  reducer_ = std::make_unique<GradReducer>(buckets_, *grads_, comm_, std::move(reduction));
  comm_.resetStats();
}

void Engine::registerShards() {
  for (size_t index = 0; index < buckets_.size(); ++index) {
    const auto& b = buckets_[index];
    const at::Tensor grad = grads_->optimizerGrad(index);
    auto& slots = slots_.emplace_back();
    if (plan_.paramsSharded()) {
      // Note [one optimizer slot per run]: a unit may mix param groups, so each run of
      // consecutive parameter pieces of one group in this rank's shard is one optimizer slot,
      // the last run reaching the shard's end. A unit of one group is then one slot over the
      // whole shard, as a stage-2 bucket is: the fused AdamW kernel takes every element
      // through its vector loop at both stages (a shard is a multiple of 16 elements), where a
      // slot per parameter would send each one's last elements through the scalar tail, which
      // rounds differently.
      const auto pieces = b.layout().piecesInShard(rank());
      for (size_t i = 0; i < pieces.size();) {
        const int group = b.paramGroupOf(pieces[i].param);
        size_t next = i + 1;
        while (next < pieces.size() && b.paramGroupOf(pieces[next].param) == group) ++next;
        const int64_t begin = pieces[i].shardOffset;
        const int64_t end = next == pieces.size() ? b.layout().shardNumel() : pieces[next].shardOffset;
        const size_t slot = optimizer_.addShard(group, b.master().narrow(0, begin, end - begin),
                                                grad.narrow(0, begin, end - begin));
        slots.push_back({group, slot, begin, end - begin});
        i = next;
      }
    } else {
      const int group = b.paramGroup();
      slots.push_back({group, optimizer_.addShard(group, b.master(), grad), 0, b.master().numel()});
    }
  }
}

Engine::~Engine() = default;

void Engine::buildBuckets(std::vector<ParamGroupSpec>& groups) {
  // Buckets fill in reverse parameter order, the order backward usually produces gradients.
  const int64_t capacity = config_.zero.reduceBucketSize;
  for (size_t g = 0; g < groups.size(); ++g) {
    auto& group = groups[g];
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
    int64_t filled = 0;
    auto flush = [&]() {
      if (params.empty()) return;
      std::reverse(params.begin(), params.end());
      std::reverse(names.begin(), names.end());
      std::vector<int> groupIds(params.size(), static_cast<int>(g));
      buckets_.emplace_back(std::move(params), std::move(names), std::move(groupIds), comm_.rank(),
                            comm_.worldSize(), computeDtype_);
      params.clear();
      names.clear();
      filled = 0;
    };
    for (size_t i = group.params.size(); i-- > 0;) {
      params.push_back(group.params[i]);
      names.push_back(group.names[i]);
      filled += group.params[i].numel();
      if (filled >= capacity) flush();
    }
    flush();
  }
}

bool Engine::isAccumulationBoundary() const {
  return (microSteps_ + 1) % batchSizes_.accumulationSteps == 0;
}

void Engine::backward(const at::Tensor& loss) {
  TORCH_CHECK(loss.defined() && loss.numel() == 1, "zeroshard: engine.backward() needs a scalar loss, got ",
              loss.defined() ? loss.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(!backwardSinceStep_, "zeroshard: engine.backward() called twice without engine.step() between; "
                                   "call engine.step() after every backward, as with DeepSpeed");
  const int64_t accumulation = batchSizes_.accumulationSteps;
  reducer_->beginBackward(isAccumulationBoundary());
  try {
    // fp16: the loss is scaled in fp32 (the gradient entering the fp16 graph is the scale).
    const at::Tensor scaled = scaler_ ? loss.to(at::kFloat) * (scaler_->scale() / static_cast<double>(accumulation))
                              : accumulation > 1 ? loss / static_cast<double>(accumulation)
                                                 : loss;
    torch::autograd::backward({scaled});
  } catch (...) {
    reducer_->abortBackward();
    throw;
  }
  reducer_->finishBackward();
  if (units_) units_->finishBackward();
  backwardSinceStep_ = true;
}

bool Engine::step() {
  TORCH_CHECK(backwardSinceStep_, "zeroshard: engine.step() called without engine.backward() since the last "
                                  "step; call engine.backward(loss) after each forward, then engine.step()");
  backwardSinceStep_ = false;
  ++microSteps_;
  if (microSteps_ % batchSizes_.accumulationSteps != 0) {
    return false;
  }
  optimizer_.prepareGrads();
  if (scaler_) {
    const bool overflow = overflowed();
    scaler_->update(overflow);
    if (overflow) {
      // Every rank skips: parameters and optimizer state stay as they were.
      optimizer_.discardPrepared();
      ++skippedSteps_;
      finishStep();
      return false;
    }
  }
  clipGradients();
  optimizer_.step();
  for (auto& b : buckets_) b.pushMasterToParams();
  gatherParams();
  finishStep();
  return true;
}

bool Engine::overflowed() {
  auto found = optimizer_.unscaleAndFindNonFinite(1.0 / scaler_->scale(), buckets_.front().flatParams().device());
  // Shards differ between ranks: one rank's inf must stop every rank's step. The flag is read
  // on the host once (the one synchronisation of an fp16 step), after the ranks are combined.
  if (plan_.optimizerSharded()) comm_.allReduce(found).wait();
  return found.item<float>() > 0;
}

void Engine::finishStep() {
  zeroGrads();
  lastStepStats_ = comm_.stats();
  comm_.resetStats();
  lastPeakStagingBytes_ = reducer_->peakStagingBytes();
  reducer_->resetPeak();
  if (units_) {
    lastPeakGatheredBytes_ = units_->peakGatheredBytes();
    units_->resetPeak();
  }
}

void Engine::clipGradients() {
  const double maxNorm = config_.gradientClipping;
  if (maxNorm <= 0) return;
  at::Tensor squares = optimizer_.localGradSquareSum(buckets_.front().flatParams().device());
  // Each rank holds a disjoint shard of the reduced gradients.
  if (plan_.optimizerSharded()) comm_.allReduce(squares).wait();
  lastGradNorm_ = squares.sqrt();
  const at::Tensor coef = lastGradNorm_.add(1e-6).reciprocal().mul_(maxNorm).clamp_max_(1.0);
  // On a CPU reading coef costs nothing and saves a pass over the gradients when no clipping
  // is needed; on a GPU it would be a host synchronisation, so a factor of 1 is applied there.
  if (!coef.device().is_cpu() || coef.item<double>() < 1.0) optimizer_.scaleGrads(coef);
}

void Engine::gatherParams() {
  if (!plan_.optimizerSharded()) return;
  if (units_) {
    units_->refreshKeptUnits();  // the other units gather from their shards when next used
    return;
  }
  // Note [all-gather buckets]: zero_optimization.allgather_bucket_size bounds the elements one
  // all-gather delivers, as in DeepSpeed's stages 1 and 2. A bucket that fits is gathered in one
  // call straight into its flat buffer, all such buckets at once; a larger one goes chunk by
  // chunk, the same chunk of every rank's slice per call, each waited for before the next, so
  // the backend's staging buffer stays within the bound.
  const int64_t limit = config_.zero.allgatherBucketSize;
  const int64_t world = comm_.worldSize();
  std::vector<CommHandle> handles;
  for (auto& b : buckets_) {
    if (b.layout().paddedNumel() <= limit) {
      handles.push_back(comm_.allGather(b.paramShard(), b.flatParams()));
      continue;
    }
    const int64_t shardNumel = b.layout().shardNumel();
    const int64_t chunk = std::max<int64_t>(1, limit / world);
    const at::Tensor shard = b.paramShard();
    for (int64_t begin = 0; begin < shardNumel; begin += chunk) {
      const int64_t length = std::min(chunk, shardNumel - begin);
      std::vector<at::Tensor> pieces;
      for (int64_t r = 0; r < world; ++r) pieces.push_back(b.flatParams().narrow(0, r * shardNumel + begin, length));
      comm_.allGatherPieces(shard.narrow(0, begin, length), pieces).wait();
    }
  }
  for (auto& h : handles) h.wait();
}

void Engine::zeroGrads() {
  grads_->zero();
}

MemoryStats Engine::memoryStats() const {
  MemoryStats stats;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const auto& b = buckets_[i];
    if (units_) {
      // Between steps a unit holds its shard; only kept-gathered units also hold the full buffer.
      stats.paramBytes += static_cast<int64_t>(b.paramShard().nbytes());
      if (!units_->isReleasable(i)) stats.paramBytes += static_cast<int64_t>(b.flatParams().nbytes());
    } else {
      stats.paramBytes += static_cast<int64_t>(b.flatParams().nbytes());
    }
  }
  stats.gradBytes = grads_->bytes();
  stats.gatheredPeakBytes = lastPeakGatheredBytes_;
  stats.stagingPeakBytes = lastPeakStagingBytes_;
  stats.fp32GradsPeakBytes = optimizer_.peakConvertedBytes();
  // fp32 training: the master weights are the parameters' own storage, not a copy.
  stats.optimizerBytes = optimizer_.stateBytes();
  for (const auto& b : buckets_) stats.optimizerBytes += b.separateMasterBytes();
  return stats;
}

std::vector<std::pair<std::string, at::Tensor>> Engine::namedParameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& b : buckets_) {
    for (size_t i = 0; i < b.size(); ++i) out.emplace_back(b.layout().params()[i].name, b.params()[i]);
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> Engine::masterWeights() {
  UncountedCollectives uncounted(comm_);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& b : buckets_) {
    at::Tensor full = b.master();
    if (plan_.optimizerSharded()) {
      full = at::empty({b.layout().paddedNumel()}, b.master().options());
      comm_.allGather(b.master(), full).wait();
    }
    for (const auto& place : b.layout().params()) {
      const at::Tensor view = full.narrow(0, place.offset, place.numel).view(place.shape);
      out.emplace_back(place.name, view.to(at::TensorOptions().device(at::kCPU), /*non_blocking=*/false, /*copy=*/true));
    }
  }
  return out;
}

void Engine::setLearningRate(double lr, int group) {
  TORCH_CHECK(lr >= 0, "zeroshard: learning rate must be >= 0, got ", lr);
  TORCH_CHECK(group >= -1 && group < optimizer_.numGroups(), "zeroshard: param group ", group,
              " does not exist (", optimizer_.numGroups(), " groups)");
  for (int g = 0; g < optimizer_.numGroups(); ++g) {
    if (group == -1 || group == g) optimizer_.hyper(g).lr = lr;
  }
}

double Engine::learningRate(int group) {
  TORCH_CHECK(group >= 0 && group < optimizer_.numGroups(), "zeroshard: param group ", group,
              " does not exist (", optimizer_.numGroups(), " groups)");
  return optimizer_.hyper(group).lr;
}

} // namespace zeroshard
