// Engine's checkpoints (the format and protocol: checkpoint/engine_checkpoint.h), and
// checkpoints on a clock (zeroshard.checkpoint.every_minutes): rank 0's clock decides, at an
// optimizer step's boundary, and every rank learns its decision from one broadcast, so the ranks
// never disagree on whether to save (their clocks may).
#include "zeroshard/engine/engine.h"

#include "zeroshard/checkpoint/engine_checkpoint.h"
#include "zeroshard/layout/param_storage.h"

#include <ATen/ops/full.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard {
namespace {

// Whether the group can run a collective on CPU tensors (Gloo beside NCCL). torch 2.13 asks the
// group directly; 2.11 has no hasBackendForDeviceType, but its getDeviceTypes() lists the same
// set: setBackend records each device type in both, so the two answers agree.
bool hasCpuBackend(c10d::ProcessGroup& group) {
#if ZEROSHARD_TORCH_VERSION_MAJOR > 2 || ZEROSHARD_TORCH_VERSION_MINOR >= 13
  return group.hasBackendForDeviceType(c10::DeviceType::CPU);
#else
  const std::vector<c10::Device> types = group.getDeviceTypes();
  return std::any_of(types.begin(), types.end(), [](const c10::Device& d) { return d.is_cpu(); });
#endif
}

} // namespace

CheckpointedState Engine::checkpointedState() {
  // Stage 3: a frozen bucket is whole while its unit is (gathered for the call unless it was).
  auto withFrozenWhole = [this](size_t frozenBucket, const std::function<void()>& use) {
    const auto unit = units_->unitOfFrozen(frozenBucket);
    const bool gathered = units_->gatherUnit(unit);
    try {
      use();
    } catch (...) {
      if (gathered) units_->releaseUnit(unit);
      throw;
    }
    if (gathered) units_->releaseUnit(unit);
  };
  return {config_,  plan_,    world(),        computeDtype_, buckets_,     slots_,
          optimizer_, scaler_ ? &*scaler_ : nullptr, moduleState_, frozenBuckets_, withFrozenWhole,
          window_, skippedSteps_, schedule_ ? &*schedule_ : nullptr,
          shardComm().rank(), shardComm().worldSize(), batchSizes_};
}

void Engine::checkBetweenSteps(const char* call) const {
  TORCH_CHECK(window_.betweenWindows(), "zeroshard: ", call,
              " must be called between optimizer steps (after an engine.step() that ended an "
              "accumulation window), not inside a window: a checkpoint holds no partial gradients");
}

std::string Engine::saveCheckpoint(const std::string& dir, const std::string& tag, const std::string& clientState,
                                   const std::string& rankError, bool excludeFrozen) {
  checkBetweenSteps("save_checkpoint()");
  settleLastStep("at save_checkpoint()");  // the step count, skipped steps and schedule it saves
  const UncountedCollectives uncountedShards(shardComm());
  auto path = zeroshard::saveCheckpoint(checkpointedState(), dir, tag, clientState, rankError, excludeFrozen);
  lastSaveMinutes_ = clock_();  // the clock (checkpointDue) counts from the last save
  return path;
}

LoadedCheckpoint Engine::loadCheckpoint(const std::string& dir, const std::string& tag, const LoadOptions& options) {
  checkBetweenSteps("load_checkpoint()");
  settleLastStep("at load_checkpoint()");  // before the load replaces what a skipped step would take back
  auto loaded = zeroshard::loadCheckpoint(checkpointedState(), dir, tag, options);
  params_->reshardAll();
  masters_->pushToParams(buckets_);
  params_->afterStep();
  zeroGrads();
  // The schedule owns the lr (LoadOptions::loadSchedulerState): the saved groups' values
  // stand only when they came with the schedule state they belong to.
  if (schedule_ && schedule_->current() && !(loaded.schedulerStateLoaded && options.optimizerStates)) {
    applySchedule(*schedule_->current());
  }
  return loaded;
}

double Engine::steadyMinutes() {
  using Minutes = std::chrono::duration<double, std::ratio<60>>;
  return std::chrono::duration_cast<Minutes>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void Engine::setClock(std::function<double()> minutesNow) {
  clock_ = std::move(minutesNow);
  lastSaveMinutes_ = clock_();
}

// The flag goes over the group's CPU backend when it has one (Gloo beside NCCL, as
// zeroshard's own process groups are): a host-side collective, no device synchronisation.
bool Engine::checkpointDue() {
  const double every = config_.extras.checkpointEveryMinutes;
  if (every <= 0) return false;
  const bool due = world().rank() == 0 && clock_() - lastSaveMinutes_ >= every;
  const bool onCpu = hasCpuBackend(*world().group());
  const at::Device device = onCpu ? at::Device(at::kCPU) : buckets_.front().flatParams().device();
  at::Tensor flag = at::full({1}, due ? 1.0f : 0.0f, at::TensorOptions().dtype(at::kFloat).device(device));
  {
    const UncountedCollectives uncounted(world());
    world().broadcast(flag, 0).wait();
  }
  return flag.item<float>() > 0;
}

void Engine::saveOnClock() {
  if (clockSaves_ && checkpointDue()) saveCheckpoint(config_.extras.checkpointDir);
}

} // namespace zeroshard
