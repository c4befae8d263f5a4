// The engine: sequences a training step over its parts the way DeepSpeed's engine does:
//
//   for each micro-batch:  loss = model(x); engine.backward(loss); engine.step();
//
// backward() divides the loss by gradient_accumulation_steps; step() is called after every
// backward and runs the optimizer (then zeroes the gradients) only at the accumulation boundary:
// after gradient_accumulation_steps micro-steps, or where setAccumulationBoundary says
// (accumulation_window.h, Note [accumulation boundary]).
//
// It holds one of each part (docs/design.md, "The engine's parts") and nothing else: the groups
// (comm/engine_groups.h), the model state the plan chose (state/model_state.h), the optimizer
// step (optim/optimizer_step.h), the accumulation window, the step log and the checkpoint clock.
// Features are functions of their layer that take the parts they need for one call
// (checkpoints, the 16-bit export, pretrained loading, meta init).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include "zeroshard/checkpoint/checkpoint_clock.h"
#include "zeroshard/checkpoint/engine_checkpoint.h"
#include "zeroshard/checkpoint/model_export.h"
#include "zeroshard/checkpoint/pretrained.h"
#include "zeroshard/comm/engine_groups.h"
#include "zeroshard/config/config.h"
#include "zeroshard/optim/accumulation_window.h"
#include "zeroshard/state/memory_stats.h"
#include "zeroshard/engine/step_log.h"
#include "zeroshard/optim/optimizer_step.h"
#include "zeroshard/plan/sharding_plan.h"
#include "zeroshard/stage3/unit_builder.h"
#include "zeroshard/state/meta_init.h"
#include "zeroshard/state/model_state.h"
#include "zeroshard/state/module_inputs.h"

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace c10d {
class ProcessGroup;
} // namespace c10d

namespace zeroshard {

class Engine {
 public:
  // `units` is used at stage 3 only; empty means one root unit holding every parameter.
  // `init`: the parameters are on the meta device (all of them, or none); ignored otherwise.
  // `frozen`: the model's frozen parameters (requires_grad=False), each once under its first
  // name: sharded with their units at stage 3 (Note [frozen parameters] in
  // stage3/unit_builder.cpp), whole below it; every rank takes rank 0's values.
  Engine(std::vector<ParamGroupSpec> groups, c10::intrusive_ptr<c10d::ProcessGroup> processGroup,
         Config config, std::vector<UnitSpec> units = {}, MetaInit init = {},
         std::vector<std::pair<std::string, at::Tensor>> frozen = {});
  // Every trainable parameter of `model` in one group (state/module_inputs.h). At stage 3,
  // `unitModules` names the submodules that are units (e.g. {"blocks.0", "blocks.1"}); unit i is
  // then run through runUnit(i, ...), and the whole forward through runUnit(unitModules.size(),
  // ...) as the root unit (everything else, including parameters shared between units).
  Engine(torch::nn::Module& model, c10::intrusive_ptr<c10d::ProcessGroup> processGroup, Config config,
         const std::vector<std::string>& unitModules = {});
  // A model built with meta tensors: `init(name, module)` is called for every submodule (and the
  // model itself, name "") that holds parameters or buffers of its own, in named_modules()
  // order, and fills them in place (its trained parameters are whole fp32 tensors on `device`
  // during the call). Buffers and frozen parameters on the meta device are first given zeroed
  // storage on `device`.
  using ModuleInit = zeroshard::ModuleInit;
  Engine(torch::nn::Module& model, c10::intrusive_ptr<c10d::ProcessGroup> processGroup, Config config,
         const std::vector<std::string>& unitModules, const ModuleInit& init, at::Device device);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Backpropagates loss / gradient_accumulation_steps (the loss itself with scaleByAccumulation
  // false: DeepSpeed's scale_wrt_gas=False, for a caller that scales it; fp16's loss scale is
  // applied either way); gradients are reduced as buckets become ready. Decides whether this
  // micro-step ends the accumulation window (isAccumulationBoundary()), which its step() then
  // follows. Blocks until this backward's reductions are done.
  void backward(const at::Tensor& loss, bool scaleByAccumulation = true);
  // Returns true when this call ended an accumulation window and the optimizer stepped. With
  // the deferred nonfinite check a step found later to hold an inf or NaN returned true: the
  // kernel skipped it on the device, and the host takes it back when it reads the flag
  // (checkLastStep()).
  bool step();
  // DeepSpeed's set_gradient_accumulation_boundary: while set, whether each following micro-step
  // ends the window (its backward reduces for the boundary, its step steps the optimizer); it
  // stays until set again; nullopt returns to counting gradient_accumulation_steps micro-steps
  // from the last boundary (Note [accumulation boundary]). A micro-step whose backward already
  // ran keeps the decision that backward took. Every rank sets the same.
  void setAccumulationBoundary(std::optional<bool> boundary) { window_.setOverride(boundary); }

  const Config& config() const { return config_; }
  const BatchSizes& batchSizes() const { return batchSizes_; }
  int stage() const { return static_cast<int>(plan_.stage()); }
  // What is sharded or replicated, over which ranks, and where (one line per state: plan().describe()).
  const ShardingPlan& plan() const { return plan_; }
  // plan().describe(), and where the frozen parameters are when the model has some.
  std::string describePlan() const {
    return state_.frozenBuckets().empty() && state_.frozenWhole().empty()
               ? plan_.describe()
               : plan_.describe() + "\n" + plan_.describeFrozen();
  }
  // The dtype parameters, gradients and gathers use: bf16 with bf16.enabled, else float32.
  at::ScalarType computeDtype() const { return state_.computeDtype(); }
  int rank() const { return groups_.world().rank(); }
  int worldSize() const { return groups_.world().worldSize(); }
  // step() calls (DeepSpeed's micro_steps), and the accumulation windows ended: optimizer
  // steps taken plus steps skipped (the log line's and the default checkpoint tag's step).
  int64_t microSteps() const { return window_.microSteps(); }
  int64_t accumulationBoundaries() const { return window_.boundaries(); }
  // Optimizer steps taken. With the deferred nonfinite check (zeroshard.nonfinite_check) this,
  // skippedSteps() and checkLastStep() first settle the last step's flag: on a GPU they wait
  // for the last step's kernels (optim/nonfinite_check.cpp).
  int64_t globalSteps();
  // Whether the micro-step whose backward comes next ends the window (between a backward and
  // its step: whether that micro-step does, as its backward decided).
  bool isAccumulationBoundary() const { return window_.isBoundary(); }
  // fp16: the current loss scale (1 otherwise), and the boundaries skipped for an overflow.
  double lossScale() const { return step_.lossScale(); }
  int64_t skippedSteps();
  // zeroshard.nonfinite_check "deferred": reads whether the last optimizer step was skipped on
  // the device for non-finite gradients (blocking), and acts on it as zeroshard.nonfinite says:
  // "error" raises, naming the step; "skip" counts it (rank 0 warns). A no-op otherwise, and
  // when it was read already. Every rank calls it (the ranks agree on the flag, no collective).
  // step(), the log line and checkpoint saves and loads call it themselves; call it after the
  // last step of a run that ends without one.
  void checkLastStep();
  // The global gradient norm before clipping, from the last optimizer step (0 before any).
  // Reading it synchronises with the device (it is kept there).
  double lastGradNorm() const { return step_.lastGradNorm(); }

  MemoryStats memoryStats() const { return state_.memoryStats(); }
  // Collectives of the last completed optimizer step (all its micro-batches), by kind. With
  // hybrid sharding also by level: inside the shard group ("intra", a node) and across the
  // groups ("inter"); with hpZ inside the secondary groups ("intra": the backward gathers) and
  // over the world ("inter": the rest). The two add up to commStats() (plan().twoLevels()).
  const CommStats& commStats() const { return groups_.last(); }
  const CommStats& intraStats() const { return groups_.intra(); }
  const CommStats& interStats() const { return groups_.inter(); }
  // Every trained parameter, by its original name (full tensors; stages 0-2 keep them whole).
  std::vector<std::pair<std::string, at::Tensor>> namedParameters() const;
  // Every trained parameter's fp32 master weights, whole, by its original name, as new CPU
  // tensors (with bf16/fp16 these are the values the optimizer keeps, not the 16-bit copy).
  // Collective and blocking: every rank calls it; the all-gathers are not counted in
  // commStats(). One bucket's full fp32 buffer exists at a time.
  std::vector<std::pair<std::string, at::Tensor>> masterWeights();

  // Stage 3 module hooks, by index into the UnitSpec list (units with no parameter of their own
  // are no-ops). postForward registers pre-backward hooks on the outputs. `inputs`: the unit's
  // forward inputs, which tell when its backward is done (a unit with frozen parameters is
  // released then; without them, at the end of the backward: UnitScheduler::watchInputs).
  void preForward(size_t unitSpec, const std::optional<std::vector<at::Tensor>>& inputs = std::nullopt);
  // Whether preForward uses the unit's inputs (it holds frozen parameters; not the root).
  bool watchesInputs(size_t unitSpec) const;
  void postForward(size_t unitSpec, const std::vector<at::Tensor>& outputs);
  // Stage 3 for C++ programs: runs `forward` as unit `unitSpec` (gathered before, released after,
  // gathered again for its backward). Below stage 3 it just runs `forward`.
  at::Tensor runUnit(size_t unitSpec, const std::function<at::Tensor()>& forward);
  // The same, given the unit's inputs: a unit holding frozen parameters is then released in
  // backward as soon as its input gradients are computed, rather than at the end of the backward.
  at::Tensor runUnit(size_t unitSpec, const std::vector<at::Tensor>& inputs, const std::function<at::Tensor()>& forward);
  // Stage 3: the units built, in UnitSpec order (empty below stage 3), and their names.
  const std::vector<UnitInfo>& stage3Units() const { return state_.unitInfos(); }
  std::vector<std::string> unitNames() const;
  // Stage 3: make every parameter whole (blocking), and release them again.
  void gatherParameters();
  void reshardParameters();
  // Writes whole values into trained parameters, by original name (state/model_params.cpp): into
  // this rank's fp32 master weights (its shard where they are sharded), the compute-dtype
  // parameters (their shard at stage 3, and the whole buffer where it exists), cast from the
  // fp32 value as after an optimizer step. A value in the 16-bit compute dtype leaves the fp32
  // master of each element where it equals the master's rounding (Note [write-back keeps the
  // master] in layout/param_targets.cpp). Optimizer state is kept. Collective-free and
  // blocking: every rank must pass the same values (e.g. after a broadcast) or the ranks'
  // copies diverge. Everything is checked (names known, shapes equal, floating values) before
  // anything is written. The zeroshard.deepspeed GatheredParameters(modifier_rank=r) write-back.
  // A frozen parameter's value goes into this rank's slice of it at stage 3 (its own dtype), or
  // into the whole tensor below stage 3.
  void setParameters(const std::vector<std::pair<std::string, at::Tensor>>& values);

  // Checkpoints (checkpoint/engine_checkpoint.h; the format is in checkpoint/manifest.h). Both are
  // collective and blocking: every rank calls them between optimizer steps, with the same
  // arguments. saveCheckpoint writes this rank's shards in parallel with the others and
  // returns the published checkpoint's path; `tag` empty means "global_step<N>". clientState
  // is saved from rank 0. loadCheckpoint (tag empty: the `latest` one) works at any world size
  // and stage; each rank reads only the slices it holds, and on any error no state is changed
  // on any rank. `rankError`, when not empty, is an error this rank met before the call (e.g.
  // serializing its client state): the call then fails on every rank, naming it, and changes
  // nothing (for loads it is LoadOptions::rankError).
  void setModuleState(ModuleState state);
  // The same from the model's state dict, every name in order (moduleStateOf).
  void setModuleStateFrom(const std::vector<std::pair<std::string, at::Tensor>>& stateDict);
  // Every rank takes rank 0's module state (buffers, frozen parameters kept whole), as it took
  // rank 0's parameters at construction: a model loaded on rank 0 only trains from the same
  // values everywhere. Collective and blocking, uncounted; once, after setModuleState.
  void broadcastModuleState();
  // excludeFrozen (DeepSpeed's exclude_frozen_parameters): the frozen parameters are not saved,
  // e.g. a LoRA run's base; loading such a checkpoint keeps the ones the engine has.
  std::string saveCheckpoint(const std::string& dir, const std::string& tag = "", const std::string& clientState = "",
                             const std::string& rankError = "", bool excludeFrozen = false);
  LoadedCheckpoint loadCheckpoint(const std::string& dir, const std::string& tag = "",
                                  const LoadOptions& options = {});
  // Checkpoints on a clock (zeroshard.checkpoint.every_minutes and .dir, checkpoint/checkpoint_clock.h):
  // whether this boundary is the first at least that many minutes after the last save (or the
  // engine's start) by rank 0's clock; collective (every rank calls it at the same boundary,
  // and all get rank 0's answer); false when the key is off. step() saves into the directory
  // by itself when it is due, unless setClockSaves(false) (the Python layer saves itself,
  // after its scheduler step). setClock replaces the clock (minutes, any origin) for tests.
  bool checkpointDue();
  void setClockSaves(bool on) { clock_.setSavesOnStep(on); }
  void setClock(std::function<double()> minutesNow) { clock_.setClock(std::move(minutesNow)); }

  // The model for inference as one file, dir/filename (checkpoint/streamed_export.h;
  // docs/checkpoints.md): its state dict, trained parameters in the compute dtype, safetensors for
  // a ".safetensors" name, torch.save's format for any other. Collective and blocking: every rank
  // calls it outside forward and backward; rank 0 writes (creating dir), streaming each tensor as
  // it is whole (stage 3: one unit gathered at a time). Returns true when written; at stage 3
  // without zero_optimization.stage3_gather_16bit_weights_on_model_save it writes nothing,
  // TORCH_WARNs on rank 0 (C++ programs: on stderr, through c10's warning handler) and returns false, as
  // DeepSpeed does. On any rank's error it fails on every rank, leaving no partial file.
  bool save16bitModel(const std::string& dir, const std::string& filename = "model.safetensors",
                      const ModelExportOptions& options = {}, ModelExportStats* stats = nullptr);
  // The same tensors as a state dict (DeepSpeed's _zero3_consolidated_16bit_state_dict): on rank 0
  // every state-dict name in the model's order, a tied weight under each of its names (one
  // tensor: Note [one tensor, several names]), each a whole new CPU tensor; nullopt on the other
  // ranks. Collective and blocking: every rank calls it outside forward and backward; stage 3
  // gathers one unit at a time (stats->gatheredPeakBytes), with or without
  // stage3_gather_16bit_weights_on_model_save (DeepSpeed checks that flag only for the file). On
  // any rank's error it fails on every rank.
  std::optional<std::vector<std::pair<std::string, at::Tensor>>> consolidatedStateDict(
      const ModelExportOptions& options = {}, ModelExportStats* stats = nullptr);

  // Pretrained weights from a Hugging Face-style safetensors checkpoint (checkpoint/pretrained.h,
  // pretrained_load.cpp; docs/checkpoints.md): `path` is a .safetensors file, a directory
  // with model.safetensors or model.safetensors.index.json, or that index. By state-dict name
  // (a tied weight from any one of its names), each rank reads only the element ranges it
  // holds, converted from the file's dtype, into its fp32 master weights and compute-dtype
  // parameters (as setParameters writes them; optimizer state is kept), and buffers and frozen
  // parameters whole. strict: any missing, unexpected or wrong-shaped tensor is one error
  // naming the path and listing them, and nothing changes on any rank; otherwise what fits is
  // loaded and the lists are returned. Collective and blocking: every rank calls it between
  // optimizer steps with the same path. `renames` (file tensor name -> state-dict name, exact)
  // applies before matching; every rank passes the same.
  PretrainedLoad loadPretrained(const std::string& path, bool strict = true, const TensorRenames& renames = {});

  // Learning rates (optim/optimizer_step.h). With a config "scheduler" the schedule owns every
  // group's lr (and, for OneCycle, betas): it puts its start values in at construction and is
  // stepped right after each optimizer step taken at an accumulation boundary (not after an
  // fp16 step skipped for an overflow), as DeepSpeed's engine steps its lr_scheduler
  // (optim/lr_schedule.h, Note [schedule semantics]). Without one, the lr is the config's or
  // the group's until setLearningRate changes it (a client-side scheduler).
  //
  // Sets lr of one param group, or of all with group = -1. Refused while a config schedule
  // owns the lr, so that two schedules never fight over it.
  void setLearningRate(double lr, int group = -1);
  double learningRate(int group = 0) const;
  // Every group's lr, and (beta1, beta2), as the next optimizer step uses them.
  std::vector<double> learningRates() const;
  std::vector<std::pair<double, double>> betas() const;
  // The config's schedule, or nullptr without one.
  const LrSchedule* lrSchedule() const { return step_.schedule(); }
  // DeepSpeed's lr_scheduler.load_state_dict: the schedule continues from `lastBatchIteration`;
  // the groups keep their values until its next step. Throws without a config schedule.
  void loadLrScheduleState(int64_t lastBatchIteration);

  // Logging (step_log.h): rank 0 prints a line every steps_per_print
  // boundaries; with wall_clock_breakdown it adds forward / backward / step / communication
  // milliseconds. setLogSink gets each line without prefix (an empty function: stdout, prefixed
  // "zeroshard: "). beginForward()/endForward() bracket the model's forward for its timing
  // (the Python Engine's __call__ does; C++ programs call them); without breakdown they only
  // read a clock, and only on rank 0.
  void setLogSink(std::function<void(const std::string&)> sink);
  void beginForward();
  void endForward();

 private:
  Engine(ModelInputs model, c10::intrusive_ptr<c10d::ProcessGroup> processGroup, Config config);
  void checkBetweenSteps(const char* call) const;
  // The deferred nonfinite check's flag of the last step, read and acted upon (OptimizerStep::settle).
  void settleLastStep(const std::optional<std::string>& where = std::nullopt);
  void logBoundary();

  Config config_;
  CheckpointClock clock_;  // counts from the engine's start
  ShardingPlan plan_;
  EngineGroups groups_;       // the world, the hybrid / hpZ subgroups, the step's counts by level
  BatchSizes batchSizes_;
  ModelState state_;          // buckets, storage, masters, optimizer state, units, module state
  OptimizerStep step_;        // loss scale, the nonfinite check, clipping, the schedule
  AccumulationWindow window_;  // micro-steps, boundaries, the override; from backward to step
  StepLog stepLog_;
  at::Tensor lastLoss_;  // the last micro-batch's loss, kept on rank 0 for the log line
};

} // namespace zeroshard
