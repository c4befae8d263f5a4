#include "zeroshard/engine/engine.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "zeroshard/comm/process_group.h"
#include "zeroshard/checkpoint/streamed_export.h"
#include "zeroshard/config/auto_values.h"
#include "zeroshard/grad/grad_reducer.h"
#include "zeroshard/layout/host_memory.h"
#include "zeroshard/layout/param_storage.h"

#include <chrono>
#include <cstdio>

namespace zeroshard {
namespace {

std::chrono::milliseconds timeoutOf(const Config& config) {
  return std::chrono::milliseconds(static_cast<int64_t>(config.extras.collectiveTimeoutSeconds * 1000.0));
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

} // namespace

Engine::Engine(std::vector<ParamGroupSpec> groups, c10::intrusive_ptr<c10d::ProcessGroup> processGroup,
               Config config, std::vector<UnitSpec> units, MetaInit init,
               std::vector<std::pair<std::string, at::Tensor>> frozen)
    : Engine(ModelInputs{std::move(groups), std::move(units), std::move(init), std::move(frozen), {}, false},
             std::move(processGroup), std::move(config)) {}

Engine::Engine(torch::nn::Module& model, c10::intrusive_ptr<c10d::ProcessGroup> processGroup, Config config,
               const std::vector<std::string>& unitModules)
    : Engine(modelInputsOf(model, unitModules), std::move(processGroup), std::move(config)) {}

Engine::Engine(torch::nn::Module& model, c10::intrusive_ptr<c10d::ProcessGroup> processGroup, Config config,
               const std::vector<std::string>& unitModules, const ModuleInit& init, at::Device device)
    : Engine(modelInputsOf(model, unitModules, init, device), std::move(processGroup), std::move(config)) {}

// The parts in dependency order (the members' order): the plan from the config, the groups
// from the plan, the model state over the groups, the optimizer step over the model state.
Engine::Engine(ModelInputs model, c10::intrusive_ptr<c10d::ProcessGroup> processGroup, Config config)
    : config_(withAutoResolved(std::move(config), model.groups, *processGroup)),
      clock_(config_.extras.checkpointEveryMinutes),
      plan_(ShardingPlan::fromConfig(config_, processGroup->getSize(),
                                     paramsOnMeta(model.groups) ? model.init.device.str() : deviceOfParamGroups(model.groups),
                                     localWorldSizeFromEnv(processGroup->getSize()))),
      groups_(std::move(processGroup), timeoutOf(config_), plan_),
      batchSizes_(config_.batchSizes(groups_.world().worldSize())),
      state_(std::move(model), config_, plan_, groups_),
      step_(config_, state_.stepped(), groups_.world().rank()),
      window_(batchSizes_.accumulationSteps),
      stepLog_(groups_.world().rank() == 0, config_.stepsPerPrint, config_.wallClockBreakdown,
               [this] { return groups_.world().waitNanos(); },
               [this] {
                 if (!state_.buckets().empty()) synchronizeDevice(state_.device());
               }) {
  groups_.resetStepStats();
  if (config_.compile.enabled && groups_.world().rank() == 0) {
    TORCH_WARN("zeroshard: compile.enabled is ignored by an engine built from C++: torch.compile is Python's, so the "
               "units run eagerly (zeroshard.initialize in Python compiles them, docs/compile.md)");
  }
}

Engine::~Engine() = default;

void Engine::backward(const at::Tensor& loss, bool scaleByAccumulation) {
  TORCH_CHECK(loss.defined() && loss.numel() == 1, "zeroshard: engine.backward() needs a scalar loss, got ",
              loss.defined() ? loss.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(!window_.awaitingStep(), "zeroshard: engine.backward() called twice without engine.step() between; "
                                      "call engine.step() after every backward, as with DeepSpeed");
  // Note [profiler names]: the engine's phases appear in a torch.profiler trace under
  // "zeroshard::" names: forward (python/zeroshard/engine.py), backward and step here,
  // optimizer_step (OptimizerStep::take), reduce_bucket (a bucket's reduction launched,
  // GradReducer), gather_params (stages 1-2's all-gather after the step, ReplicatedParams; an
  // offloaded step starts each bucket's gather inside optimizer_step, with no span of its own),
  // gather_unit / wait_unit / release_unit (stage 3, UnitScheduler); the collectives
  // themselves are c10d's own events. benchmarks/profile_step.py writes such a trace.
  RECORD_USER_SCOPE("zeroshard::backward");
  const TimedPhase timed(stepLog_, StepPhase::kBackward);
  if (stepLog_.prints()) lastLoss_ = loss.detach();
  const int64_t accumulation = scaleByAccumulation ? batchSizes_.accumulationSteps : 1;
  const bool boundary = window_.isBoundary();
  GradReducer& reducer = state_.reducer();
  reducer.beginBackward(boundary);
  try {
    // fp16: the loss is scaled in fp32 (the gradient entering the fp16 graph is the scale).
    const double divisor = static_cast<double>(accumulation);
    const at::Tensor scaled = step_.scaler() ? loss.to(at::kFloat) * (step_.lossScale() / divisor)
                              : accumulation > 1 ? loss / divisor
                                                 : loss;
    torch::autograd::backward({scaled});
  } catch (...) {
    reducer.abortBackward();
    state_.params().abortBackward();
    throw;
  }
  reducer.finishBackward();
  state_.params().finishBackward();
  window_.recordBackward(boundary);
}

bool Engine::step() {
  // The decision this micro-step's backward took (Note [accumulation boundary]): its gradients
  // were reduced for it.
  if (!window_.finishMicroStep()) return false;
  bool taken = false;
  {
    RECORD_USER_SCOPE("zeroshard::step");
    const TimedPhase timed(stepLog_, StepPhase::kStep);
    taken = step_.take(state_.stepped(), groups_.shard(), window_.boundaries());
    groups_.recordStep();
    state_.recordPeaks();
  }
  logBoundary();
  if (clock_.savesOnStep() && checkpointDue()) saveCheckpoint(config_.extras.checkpointDir);
  return taken;
}

void Engine::logBoundary() {
  const int64_t boundaries = window_.boundaries();
  // The line reports skipped steps and the lr: the deferred nonfinite check's flag is read first,
  // on every rank (in "error" mode they all raise here, none waits in a collective for another).
  if (boundaries % config_.stepsPerPrint == 0) settleLastStep("at the log line of step " + std::to_string(boundaries));
  if (!stepLog_.boundary(boundaries)) return;
  StepLogLine line;
  line.step = boundaries;
  line.skipped = step_.skippedSteps();
  line.lrs = learningRates();
  line.lossScale = lossScale();
  // The one read of the loss, on print steps only (a device synchronisation on a GPU).
  if (lastLoss_.defined()) line.loss = lastLoss_.item<double>();
  stepLog_.print(std::move(line), batchSizes_.train);
}

void Engine::setLogSink(std::function<void(const std::string&)> sink) { stepLog_.setSink(std::move(sink)); }
void Engine::beginForward() { stepLog_.begin(StepPhase::kForward); }
void Engine::endForward() { stepLog_.end(StepPhase::kForward); }

void Engine::settleLastStep(const std::optional<std::string>& where) {
  step_.settle(state_.stepped(), window_.boundaries(), where);
}

void Engine::checkLastStep() { settleLastStep("by check_last_step()"); }

int64_t Engine::globalSteps() {
  settleLastStep("when global_steps was read");
  return state_.optimizer().stepCount();
}

int64_t Engine::skippedSteps() {
  settleLastStep("when skipped_steps was read");
  return step_.skippedSteps();
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
  const UncountedCollectives uncountedShards(groups_.shard());
  auto path = zeroshard::saveCheckpoint(checkpointedState(config_, batchSizes_, groups_, state_, step_, window_), dir,
                                        tag, clientState, rankError, excludeFrozen);
  clock_.saved();
  return path;
}

LoadedCheckpoint Engine::loadCheckpoint(const std::string& dir, const std::string& tag, const LoadOptions& options) {
  checkBetweenSteps("load_checkpoint()");
  settleLastStep("at load_checkpoint()");  // before the load replaces what a skipped step would take back
  auto loaded = zeroshard::loadCheckpoint(checkpointedState(config_, batchSizes_, groups_, state_, step_, window_),
                                          dir, tag, options);
  state_.followMasters();
  step_.afterLoad(state_.optimizer(), loaded.schedulerStateLoaded && options.optimizerStates);
  return loaded;
}

bool Engine::checkpointDue() { return clock_.due(groups_.world(), state_.device()); }

bool Engine::save16bitModel(const std::string& dir, const std::string& filename, const ModelExportOptions& options,
                            ModelExportStats* stats) {
  return exportModelFile(state_, groups_.world(), groups_.shard(), config_.zero.gather16bitWeightsOnModelSave, dir,
                         filename, options, stats);
}

std::optional<std::vector<std::pair<std::string, at::Tensor>>> Engine::consolidatedStateDict(
    const ModelExportOptions& options, ModelExportStats* stats) {
  return exportStateDict(state_, groups_.world(), groups_.shard(), options, stats);
}

PretrainedLoad Engine::loadPretrained(const std::string& path, bool strict, const TensorRenames& renames) {
  checkBetweenSteps("load_pretrained()");
  return zeroshard::loadPretrained(state_, groups_.world(), groups_.shard(), path, strict, renames);
}

void Engine::setModuleState(ModuleState state) { state_.setModuleState(std::move(state)); }

void Engine::setModuleStateFrom(const std::vector<std::pair<std::string, at::Tensor>>& stateDict) {
  state_.setModuleState(moduleStateOf(stateDict, state_.buckets(), state_.frozenBuckets(), state_.frozenWhole()));
}

void Engine::broadcastModuleState() { state_.broadcastModuleState(groups_.world()); }

std::vector<std::pair<std::string, at::Tensor>> Engine::namedParameters() const { return state_.namedParameters(); }

std::vector<std::pair<std::string, at::Tensor>> Engine::masterWeights() {
  return state_.masterWeights(groups_.shard());
}

void Engine::setParameters(const std::vector<std::pair<std::string, at::Tensor>>& values) {
  state_.setParameters(values);
}

void Engine::preForward(size_t unitSpec, const std::optional<std::vector<at::Tensor>>& inputs) {
  state_.preForward(unitSpec, inputs);
}

bool Engine::watchesInputs(size_t unitSpec) const { return state_.watchesInputs(unitSpec); }

void Engine::postForward(size_t unitSpec, const std::vector<at::Tensor>& outputs) {
  state_.postForward(unitSpec, outputs);
}

at::Tensor Engine::runUnit(size_t unitSpec, const std::function<at::Tensor()>& forward) {
  if (!state_.units()) return forward();
  preForward(unitSpec);
  at::Tensor out = forward();
  postForward(unitSpec, {out});
  return out;
}

at::Tensor Engine::runUnit(size_t unitSpec, const std::vector<at::Tensor>& inputs,
                           const std::function<at::Tensor()>& forward) {
  if (!state_.units()) return forward();
  preForward(unitSpec, inputs);
  at::Tensor out = forward();
  postForward(unitSpec, {out});
  return out;
}

std::vector<std::string> Engine::unitNames() const {
  std::vector<std::string> names;
  for (const auto& info : state_.unitInfos()) names.push_back(info.name);
  return names;
}

void Engine::gatherParameters() { state_.params().gatherAll(); }
void Engine::reshardParameters() { state_.params().reshardAll(); }

void Engine::setLearningRate(double lr, int group) { step_.setLearningRate(state_.optimizer(), lr, group); }
double Engine::learningRate(int group) const { return OptimizerStep::learningRate(state_.optimizer(), group); }
std::vector<double> Engine::learningRates() const { return OptimizerStep::learningRates(state_.optimizer()); }
std::vector<std::pair<double, double>> Engine::betas() const { return OptimizerStep::betas(state_.optimizer()); }

void Engine::loadLrScheduleState(int64_t lastBatchIteration) {
  step_.loadScheduleState(state_.stepped(), lastBatchIteration, window_.boundaries());
}

} // namespace zeroshard
