#include "zeroshard/config/config_keys.h"

#include <algorithm>
#include <stdexcept>

namespace zeroshard::detail {
namespace {

// Key names follow DeepSpeed (deepspeed/runtime/constants.py, runtime/zero/config.py). A key in
// ignoredKeys is one a DeepSpeed user may well have in a working config; naming it a warning
// rather than an error lets that config run here unchanged, while nothing is dropped silently.
const std::vector<ConfigSection>& allSections() {
  static const std::vector<ConfigSection> sections = {
      {"",
       {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "gradient_clipping", "fp16", "bf16", "bfloat16", "optimizer", "zero_optimization",
        "zeroshard", "scheduler", "steps_per_print", "wall_clock_breakdown", "tensor_parallel", "compile"},
       {"dump_state", "activation_checkpointing", "flops_profiler", "tensorboard", "wandb",
        "csv_monitor", "comms_logger", "comms_config", "monitor_config", "amp",
        "zero_allow_untested_optimizer", "prescale_gradients", "gradient_predivide_factor",
        "sparse_gradients", "communication_data_type", "data_types", "elasticity", "checkpoint",
        "aio", "memory_breakdown", "zero_force_ds_cpu_optimizer", "compression_training",
        "data_efficiency", "autotuning", "fp32_allreduce", "disable_allgather", "sparse_attention",
        "pipeline", "curriculum_learning", "progressive_layer_drop", "eigenvalue",
        "quantize_training", "dataloader_drop_last", "hybrid_engine", "nebula",
        "torch_autocast", "timers"}},
      // DeepSpeed 0.10-0.13's torch.compile keys are read; DeepCompile's (0.16 on) are DeepSpeed's
      // own graph passes, and `disable` is a later version's switch.
      {"compile",
       {"enabled", "backend", "kwargs"},
       {"disable", "deepcompile", "free_activation", "free_activation_threshold", "offload_activation",
        "offload_opt_states", "double_buffer", "symmetric_memory", "debug_log", "offload_parameters",
        "sync_before_reduce", "sync_after_reduce", "sync_before_allgather", "sync_after_allgather",
        "keep_int_input_tensors", "keep_all_input_tensors", "passes", "dump_graphs"}},
      {"fp16",
       {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
        "min_loss_scale"},
       {"auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads"}},
      {"bf16", {"enabled"}, {"immediate_grad_update"}},
      {"optimizer", {"type", "params"}, {"legacy_fusion"}},
      // adam_w_mode, amsgrad and bias_correction are read so that the values that mean AdamW
      // pass and the others fail loudly instead of training a different optimizer.
      {"optimizer.params",
       {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "amsgrad", "bias_correction"},
       {"torch_adam", "fused"}},
      // The short names are DeepSpeed's aliases of the stage3_ ones (populate_by_name).
      {"zero_optimization",
       {"stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
        "contiguous_gradients", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
        "stage3_max_live_parameters", "prefetch_bucket_size", "param_persistence_threshold",
        "max_live_parameters", "stage3_gather_16bit_weights_on_model_save",
        "gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
        "offload_optimizer", "offload_param", "reduce_scatter", "allgather_partitions", "mics_shard_size",
        "zero_hpz_partition_size"},
       {"load_from_fp32_weights", "elastic_checkpoint", "sub_group_size", "round_robin_gradients",
        "stage3_max_reuse_distance", "max_reuse_distance", "stage3_model_persistence_threshold",
        "model_persistence_threshold", "stage3_module_granularity_threshold",
        "stage3_use_all_reduce_for_fetch_params", "ignore_unused_parameters", "cpu_offload",
        "cpu_offload_param", "cpu_offload_use_pin_memory", "legacy_stage1", "zero_quantized_weights",
        "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "zeropp_loco_param",
        "mics_hierarchical_params_gather", "use_multi_rank_bucket_allreduce",
        "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply"}},
      // The inert keys tune NVMe offload (ZeRO-Infinity), which "cpu" and "none" switch off.
      {"zero_optimization.offload_optimizer",
       {"device", "pin_memory", "ratio"},
       {},
       {"nvme_path", "buffer_count", "pipeline_read", "pipeline_write", "fast_init", "pipeline"}},
      {"zero_optimization.offload_param",
       {"device", "pin_memory"},
       {},
       {"nvme_path", "buffer_count", "buffer_size", "max_in_cpu"}},
      {"scheduler", {"type", "params"}, {}},
      // DeepSpeed's AutoTP: a size above 1 is an error; at 0 or 1 the other keys tune nothing.
      {"tensor_parallel",
       {"autotp_size", "tp", "tensor_parallel"},
       {},
       {"dtype", "tp_overlap_comm", "vocab_parallel_lm_head", "vocab_parallel_ce_backend",
        "injection_policy_tuple", "partition_config", "preset_model", "keep_module_on_host",
        "replace_with_kernel_inject", "quantize_groups", "quantize_bits", "mlp_exp_bias"}},
      {"tensor_parallel.tp", {"tp_size"}, {}, {"tp_grain_size", "mpu", "tp_group", "enabled"}},
      {"zeroshard",
       {"collective_timeout_seconds", "reshard_after_forward", "stage3_unit_classes", "reduce_dtype",
        "nonfinite_check",
        "checkpoint", "max_inflight_reductions", "shard_group_size", "batch_guard",
        "nonfinite", "stage3_gather_stream"},
       {}},
      {"zeroshard.checkpoint", {"keep_last", "every_minutes", "dir"}, {}},
  };
  return sections;
}

bool contains(const std::vector<std::string_view>& keys, std::string_view key) {
  return std::find(keys.begin(), keys.end(), key) != keys.end();
}

std::string join(std::string_view path, std::string_view key) {
  return path.empty() ? std::string(key) : std::string(path) + "." + std::string(key);
}

// Appended piecewise: `"\"" + std::string(s)` trips GCC 12's -Wrestrict false positive at -O3.
std::string quoted(std::string_view s) {
  std::string result;
  result.reserve(s.size() + 2);
  result += '"';
  result += s;
  result += '"';
  return result;
}

}  // namespace

const std::vector<std::string_view>& schedulerTypes() {
  static const std::vector<std::string_view> types = {"LRRangeTest", "OneCycle", "WarmupLR",
                                                      "WarmupDecayLR", "WarmupCosineLR"};
  return types;
}

const std::vector<SchedulerParamSpec>* schedulerParams(std::string_view type) {
  using K = SchedulerParamSpec::Kind;
  // Defaults are those of DeepSpeed's classes (deepspeed/runtime/lr_schedules.py); a key
  // without one is a required argument there.
  static const std::vector<SchedulerParamSpec> rangeTest = {
      {"lr_range_test_min_lr", K::Number, 1e-3},
      {"lr_range_test_step_size", K::Steps, 2000},
      {"lr_range_test_step_rate", K::Number, 1.0},
      {"lr_range_test_staircase", K::Bool, 0},
      {"last_batch_iteration", K::Iteration, -1},
  };
  static const std::vector<SchedulerParamSpec> oneCycle = {
      {"cycle_min_lr", K::Number, std::nullopt},
      {"cycle_max_lr", K::Number, std::nullopt},
      {"decay_lr_rate", K::Number, 0.0},
      {"cycle_first_step_size", K::Steps, 2000},
      {"cycle_second_step_size", K::Steps, std::nullopt, true},
      {"cycle_first_stair_count", K::Steps, 0},
      {"cycle_second_stair_count", K::Steps, std::nullopt, true},
      {"decay_step_size", K::Steps, 0},
      {"cycle_momentum", K::Bool, 1},
      {"cycle_min_mom", K::Number, 0.8},
      {"cycle_max_mom", K::Number, 0.9},
      {"decay_mom_rate", K::Number, 0.0},
      {"last_batch_iteration", K::Iteration, -1},
  };
  // WarmupLR's warmup_max_lr defaults to None: each group's own lr. WarmupDecayLR's to 0.001.
  static const std::vector<SchedulerParamSpec> warmup = {
      {"warmup_min_lr", K::Number, 0.0},
      {"warmup_max_lr", K::Number, std::nullopt, true},
      {"warmup_num_steps", K::Steps, 1000},
      {"warmup_type", K::WarmupType, std::nullopt},
      {"last_batch_iteration", K::Iteration, -1},
  };
  static const std::vector<SchedulerParamSpec> warmupDecay = [] {
    std::vector<SchedulerParamSpec> specs = warmup;
    specs[1] = {"warmup_max_lr", K::Number, 0.001};
    specs.insert(specs.begin(), {"total_num_steps", K::Steps, std::nullopt});
    return specs;
  }();
  static const std::vector<SchedulerParamSpec> warmupCosine = {
      {"total_num_steps", K::Steps, std::nullopt},
      {"warmup_min_ratio", K::Number, 0.0},
      {"warmup_num_steps", K::Steps, 1000},
      {"cos_min_ratio", K::Number, 0.0001},
      {"warmup_type", K::WarmupType, std::nullopt},
      {"last_batch_iteration", K::Iteration, -1},
  };
  if (type == "LRRangeTest") return &rangeTest;
  if (type == "OneCycle") return &oneCycle;
  if (type == "WarmupLR") return &warmup;
  if (type == "WarmupDecayLR") return &warmupDecay;
  if (type == "WarmupCosineLR") return &warmupCosine;
  return nullptr;
}

bool ConfigSection::reads(std::string_view key) const { return contains(readKeys, key); }
bool ConfigSection::ignores(std::string_view key) const { return contains(ignoredKeys, key); }
bool ConfigSection::inert(std::string_view key) const { return contains(inertKeys, key); }

namespace {

// The closest known key at this level, or empty. Close enough means at most max(2, length / 3)
// edits, and fewer edits than half the longer name, so that short keys ("foo") are not matched
// to unrelated short keys ("aio"); read keys come first, so they win ties.
std::string_view closestKey(const ConfigSection& section, const std::string& key) {
  const size_t limit = std::max<size_t>(2, key.size() / 3);
  std::string_view best;
  size_t bestDistance = limit + 1;
  for (const auto* keys : {&section.readKeys, &section.ignoredKeys, &section.inertKeys}) {
    for (std::string_view candidate : *keys) {
      const size_t distance = editDistance(key, candidate);
      if (distance < bestDistance && 2 * distance < std::max(key.size(), candidate.size())) {
        best = candidate;
        bestDistance = distance;
      }
    }
  }
  return best;
}

// The other section that takes `key`, if any ("stage" written at the top level).
const ConfigSection* sectionTaking(const ConfigSection& section, const std::string& key) {
  for (const ConfigSection& other : allSections()) {
    if (&other != &section && (other.reads(key) || other.ignores(key) || other.inert(key))) return &other;
  }
  return nullptr;
}

}  // namespace

bool isNearMiss(const ConfigSection& section, const std::string& key) {
  return !closestKey(section, key).empty();
}

std::string unknownTopLevelMessage(const ConfigSection& section, const std::string& key) {
  std::string message = "unknown top-level key " + quoted(key) + " is ignored, as DeepSpeed ignores it";
  if (const ConfigSection* other = sectionTaking(section, key)) {
    message += " (\"" + key + "\" is a key of " + quoted(other->path) + "; did you mean " +
               quoted(join(other->path, key)) + "?)";
  }
  return message;
}

const std::vector<ConfigSection>& configSections() { return allSections(); }

const ConfigSection& configSection(std::string_view path) {
  for (const ConfigSection& section : allSections()) {
    if (section.path == path) return section;
  }
  throw std::logic_error("zeroshard: no config section \"" + std::string(path) + "\"");
}

size_t editDistance(std::string_view a, std::string_view b) {
  // d[i][j]: distance between the first i chars of a and the first j of b.
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t substitution = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + substitution});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

std::string unknownKeyMessage(const ConfigSection& section, const std::string& writtenPath,
                              const std::string& key) {
  std::string message = "unknown key " + quoted(join(writtenPath, key));

  std::string_view best = closestKey(section, key);
  // A known key that starts with the given one: a name cut short ("collective_timeout").
  if (best.empty() && key.size() >= 4) {
    for (std::string_view candidate : section.readKeys) {
      if (candidate.substr(0, key.size()) == key) {
        best = candidate;
        break;
      }
    }
  }
  if (!best.empty()) return message + "; did you mean " + quoted(join(writtenPath, best)) + "?";

  // A key put at the wrong level ("stage" at the top, "lr" beside "type") is a common slip.
  if (const ConfigSection* other = sectionTaking(section, key)) {
    return message + "; did you mean " + quoted(join(other->path, key)) + "? (\"" + key +
           "\" belongs inside " + quoted(other->path) + ")";
  }

  if (section.path.empty()) {
    return message + ": it is neither a DeepSpeed key nor a zeroshard one; docs/config.md lists "
                     "every key zeroshard reads";
  }
  std::string known;
  for (std::string_view k : section.readKeys) known += (known.empty() ? "" : ", ") + std::string(k);
  return message + ": " + quoted(writtenPath) + " takes " + known;
}

}  // namespace zeroshard::detail
