#pragma once

// The training configuration: DeepSpeed's ds_config.json keys, read into typed, validated
// fields. Reading never touches torch, so this header and config*.cpp compile in seconds.
//
// Contract: a Config that fromJsonString/fromFile returned holds only values in range; every
// problem is a ConfigError whose message starts with "zeroshard config (<source>): " and names
// the key path, the value given and what is allowed. Known DeepSpeed keys that zeroshard does
// not implement are not errors: each becomes one entry of Config::warnings.
// docs/config.md is the reference for every key.

#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace zeroshard {

// Derives from std::invalid_argument so that pybind11 turns it into a Python ValueError.
class ConfigError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// The three batch sizes, all resolved for one world size: train == microPerRank *
// accumulationSteps * world size.
struct BatchSizes {
  int64_t train;
  int64_t microPerRank;
  int64_t accumulationSteps;
};

// "fp16": dynamic loss scaling unless lossScale > 0.
struct Fp16Config {
  bool enabled = false;
  double lossScale = 0;  // 0 = dynamic
  int64_t initialScalePower = 16;
  int64_t lossScaleWindow = 1000;
  int64_t hysteresis = 2;
  double minLossScale = 1;
};

// "bf16" (DeepSpeed also accepts the alias "bfloat16").
struct Bf16Config {
  bool enabled = false;
};

// "optimizer": always decoupled-weight-decay AdamW; "Adam" is read as AdamW, as DeepSpeed does
// with its default adam_w_mode=true, and stored as "AdamW".
struct OptimizerConfig {
  std::string type = "AdamW";
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weightDecay = 0.01;
};

// "zero_optimization.offload_optimizer" / "offload_param" (ZeRO-Offload): "none" (DeepSpeed's
// default) keeps the state on the compute device, "cpu" in host memory (docs/offload.md).
struct OffloadConfig {
  bool toHost = false;    // device "cpu"
  bool pinMemory = true;  // page-locked host memory (DeepSpeed's default); only with a GPU
  // offload_optimizer only: the share of the optimizer state in host memory, by bucket: of n
  // buckets, those from int((1 - ratio) * n) on, as DeepSpeed splits its sub-groups; 1 = all.
  double ratio = 1.0;
};

// "zero_optimization". Sizes count elements, not bytes, as in DeepSpeed.
struct ZeroConfig {
  int64_t stage = 0;
  int64_t reduceBucketSize = 500000000;
  int64_t allgatherBucketSize = 500000000;
  std::optional<bool> overlapComm;  // unset: the stage and device decide, see overlapCommResolved()
  // contiguous_gradients is read but has no field: gradients are always contiguous here (stages
  // 0 and 1 accumulate into one flat buffer, stages 2 and 3 copy each final gradient into a flat
  // staging buffer), so `false` is a warning (docs/config.md).
  int64_t stage3PrefetchBucketSize = 50000000;  // 0 = no prefetch
  int64_t stage3ParamPersistenceThreshold = 100000;
  // 0 = DeepSpeed's meaning: nothing is prefetched past the unit in use.
  int64_t stage3MaxLiveParameters = 1000000000;
  // stage3_gather_16bit_weights_on_model_save (aliases gather_16bit_weights_on_model_save,
  // stage3_gather_fp16_weights_on_model_save): whether save_16bit_model gathers a stage-3 model
  // and writes it; without it stage 3 writes nothing and warns, as DeepSpeed does. Stages 0-2
  // always write.
  bool gather16bitWeightsOnModelSave = false;
  // Stages 1-3: fp32 master weights, exp_avg and exp_avg_sq (and a fp32 gradient shard) in host
  // memory, stepped there. Stage 3: the parameter shards in host memory too.
  OffloadConfig offloadOptimizer;
  OffloadConfig offloadParam;
  // zero_hpz_partition_size (ZeRO++ hpZ), stage 3: after its forward all-gather over the shard
  // group, each rank keeps a secondary shard of the unit in the compute dtype over groups of
  // this many consecutive ranks, and the backward all-gather runs inside that group. 1 = off
  // (DeepSpeed's default); at stages 0-2 it is ignored with a warning.
  int64_t hpzPartitionSize = 1;

  // Unset: on at stage 3 (DeepSpeed's default) and wherever the gradients are on a GPU. Below
  // stage 3 DeepSpeed leaves it off; on a GPU that makes the compute stream wait for every
  // bucket's reduction in turn, which cost little before max_inflight_reductions bounded the
  // staging buffers overlap keeps alive, and now costs the overlap for nothing (docs/config.md's
  // overlap_comm row).
  bool overlapCommResolved(bool gradsOnGpu) const;
};

// "scheduler": one of DeepSpeed's learning-rate schedules (deepspeed/runtime/lr_schedules.py),
// stepped by the engine once per optimizer step taken (optim/lr_schedule.h has the formulas).
struct SchedulerConfig {
  // "" = no schedule; else "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle" or
  // "LRRangeTest" (written exactly so, as DeepSpeed requires).
  std::string type;
  // The "params" as written, validated against the type's keys: numbers as they are, booleans
  // as 1 or 0. A key written as null (DeepSpeed's None, e.g. cycle_second_step_size) is absent.
  std::map<std::string, double> params;
  // warmup_type of WarmupLR, WarmupDecayLR and WarmupCosineLR: "log" (the default) or "linear".
  std::string warmupType = "log";

  bool enabled() const { return !type.empty(); }
  // The written value of params[key], else DeepSpeed's default for this type. Throws
  // std::out_of_range for a key the type does not have or that has no default (e.g.
  // total_num_steps of WarmupDecayLR, required when the type is read).
  double param(const std::string& key) const;
  bool has(const std::string& key) const { return params.count(key) != 0; }
};

// "zeroshard": keys DeepSpeed does not have.
struct ZeroshardExtras {
  double collectiveTimeoutSeconds = 600;
  // Stage 3: free a unit's gathered parameters after its forward (false keeps them until its
  // backward: fewer all-gathers, more memory, like FSDP's reshard_after_forward=False).
  bool reshardAfterForward = true;
  // Stage 3: module class names whose instances are units; empty = the children of the
  // model's largest nn.ModuleList (the usual transformer blocks).
  std::vector<std::string> unitClasses;
  // With bf16/fp16: "compute" reduces gradients in the compute dtype (half the bytes on the
  // wire), "fp32" in float32 (exact sums, twice the bytes).
  std::string reduceDtype = "compute";
  // save_checkpoint keeps this many complete checkpoints in its directory (the newest ones),
  // removing older ones only once the new one is complete; 0 keeps all.
  int64_t checkpointKeepLast = 2;
  // zeroshard.checkpoint.every_minutes / .dir: save a checkpoint into `dir` at the first
  // optimizer step that ends this many minutes after the last save (or the engine's start),
  // rank 0's clock deciding for every rank; 0 = off.
  double checkpointEveryMinutes = 0;
  std::string checkpointDir;
  // Resuming with a global batch other than the checkpoint's: "warn" (once, on rank 0) or
  // "error" (the load fails on every rank and changes nothing).
  std::string batchGuard = "warn";
  // fp32 and bf16 gradients holding an inf or NaN at a step (fp16's loss scaler skips those):
  // "error" names the step and the first parameter; "skip" skips the step on every rank, as
  // fp16 does, counting it; "off" checks nothing (no per-step read of the norm on the host).
  std::string nonfinite = "error";
  // When the host learns of such a step (docs/reliability.md, Note [deferred nonfinite check] in
  // optim/nonfinite_check.cpp): "immediate" reads the norm on the host at the step (a host
  // synchronisation per step on a GPU) and names the first non-finite parameter; "deferred"
  // lets the optimizer kernel skip the step on the device and reads the flag at the next
  // boundary, log line or checkpoint save; "auto": deferred where the gradients are on a GPU.
  std::string nonfiniteCheck = "auto";
  // Gradient reductions in flight at once during backward (overlap_comm on): launching one more
  // first waits for the oldest, so at stages 2 and 3 at most this many staging buffers plus the
  // one being filled exist (as FSDP2 bounds its reduce-scatter states).
  int64_t maxInflightReductions = 2;
  // Stage 3 on a GPU: issue prefetched unit all-gathers (and an offloaded shard's copy to the
  // device) from a side stream that waits only for what they read, not for the compute queued
  // before them, as FSDP2's all-gather stream does (Note [gather stream]). Off until a GPU run
  // has checked it; CPUs have no streams and ignore it.
  bool stage3GatherStream = false;
  // Hybrid sharding (zero_optimization.mics_shard_size, or zeroshard.shard_group_size): states
  // are sharded over groups of this many consecutive ranks and replicated across the groups.
  // 0 = one group of the whole world; kShardGroupNode = the ranks of one node (LOCAL_WORLD_SIZE).
  static constexpr int64_t kShardGroupNode = -1;
  int64_t shardGroupSize = 0;
};

// "compile": DeepSpeed's torch.compile section (its 0.10-0.13 keys). `enabled`: initialize
// compiles each unit in place (the Python layer's engine.compile(), docs/compile.md) with
// torch.compile(backend=backend, **kwargs); `backend` and `kwargs` are also engine.compile()'s
// defaults. torch.compile is Python's: an Engine built from C++ runs eagerly and warns when
// `enabled` is set. DeepCompile (deepcompile and the keys that tune it) is ignored with a warning.
struct CompileConfig {
  bool enabled = false;
  std::string backend = "inductor";
  std::string kwargs = "{}";  // torch.compile's keyword arguments: a JSON object
};

struct Config {
  // Unset batch sizes are derived by batchSizes() once the world size is known.
  std::optional<int64_t> trainBatchSize;
  std::optional<int64_t> trainMicroBatchSizePerGpu;
  std::optional<int64_t> gradientAccumulationSteps;
  double gradientClipping = 0;  // max global grad norm; 0 = no clipping
  Fp16Config fp16;
  Bf16Config bf16;
  OptimizerConfig optimizer;
  ZeroConfig zero;
  ZeroshardExtras extras;
  SchedulerConfig scheduler;
  CompileConfig compile;
  // steps_per_print: rank 0 logs step, lr, loss scale, loss and samples/s every this many
  // optimizer steps (DeepSpeed's default 10). wall_clock_breakdown: the log line adds forward,
  // backward, step and communication milliseconds.
  int64_t stepsPerPrint = 10;
  bool wallClockBreakdown = false;

  // Dotted paths of the keys written as "auto" (the Hugging Face Trainer's placeholder), in the
  // order the reader meets them (batch sizes first), e.g. "optimizer.params.lr". Their fields hold the defaults until resolved
  // (config/auto_values.h: resolveAuto); an Engine refuses a Config with any left.
  std::vector<std::string> autoKeys;
  // The config as written (JSON text), kept so that resolving "auto" can read it again with
  // the values filled in.
  std::string text;

  std::string source;                 // file path, "<string>" or "<dict>"; starts every message
  std::vector<std::string> warnings;  // one per known DeepSpeed key that is ignored

  // Parses and validates. Throws ConfigError.
  static Config fromJsonString(const std::string& text, const std::string& source = "<string>");
  // Reads the file, then as fromJsonString with the path as source. Throws ConfigError, also
  // for a missing or unreadable file.
  static Config fromFile(const std::string& path);

  // DeepSpeed's batch-size rules for `worldSize` ranks: the set sizes must agree, the unset
  // ones are derived and must divide exactly. Throws ConfigError.
  BatchSizes batchSizes(int64_t worldSize) const;

  // Every resolved field under its DeepSpeed key (unset batch sizes and an unset overlap_comm,
  // which the device decides, are left out). fromJsonString(toJsonString()) gives back the same values.
  std::string toJsonString() const;
};

}  // namespace zeroshard
