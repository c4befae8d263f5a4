#include "zeroshard/config/config.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "zeroshard/config/config_keys.h"
#include "zeroshard/config/config_reader.h"

namespace zeroshard {
namespace {

using detail::configMessagePrefix;

// a * b, or a ConfigError naming what overflowed (only absurd configs get here).
int64_t multiply(int64_t a, int64_t b, const std::string& source, const std::string& what) {
  int64_t result = 0;
  if (__builtin_mul_overflow(a, b, &result)) {
    throw ConfigError(configMessagePrefix(source) + what + " overflows a 64-bit integer");
  }
  return result;
}

}  // namespace

double SchedulerConfig::param(const std::string& key) const {
  if (auto it = params.find(key); it != params.end()) return it->second;
  if (const auto* specs = detail::schedulerParams(type)) {
    for (const auto& spec : *specs) {
      if (spec.key == key && spec.defaultValue) return *spec.defaultValue;
    }
  }
  throw std::out_of_range("zeroshard: scheduler " + (type.empty() ? std::string("(none)") : type) +
                          " has no value for \"" + key + "\"");
}

bool ZeroConfig::overlapCommResolved(bool gradsOnGpu) const { return overlapComm.value_or(stage == 3 || gradsOnGpu); }

Config Config::fromJsonString(const std::string& text, const std::string& source) {
  return detail::readConfig(text, source);
}

Config Config::fromFile(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (!fs::exists(status)) {
    std::string where;
    if (fs::path(path).is_relative()) {
      const fs::path cwd = fs::current_path(ec);
      where = " (a relative path starts at the current directory, " + cwd.string() + ")";
    }
    throw ConfigError(configMessagePrefix(path) + "no such file" + where);
  }
  if (fs::is_directory(status)) {
    throw ConfigError(configMessagePrefix(path) +
                      "this is a directory; give the path of a .json config file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw ConfigError(configMessagePrefix(path) + "cannot open the file: " + std::strerror(errno));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) {
    throw ConfigError(configMessagePrefix(path) + "cannot read the file: " + std::strerror(errno));
  }
  return fromJsonString(text.str(), path);
}

BatchSizes Config::batchSizes(int64_t worldSize) const {
  const std::string p = configMessagePrefix(source);
  if (worldSize < 1) {
    throw ConfigError(p + "the world size must be >= 1, got " + std::to_string(worldSize));
  }
  const std::string world = "world size (" + std::to_string(worldSize) + ")";
  auto named = [](const char* name, int64_t value) {
    return std::string(name) + " (" + std::to_string(value) + ")";
  };
  // Fails unless `numerator` is a whole multiple of `denominator`; returns the quotient.
  auto divide = [&](int64_t numerator, int64_t denominator, const std::string& denominatorText,
                    const char* derived) {
    if (numerator % denominator != 0) {
      throw ConfigError(p + named("train_batch_size", numerator) + " is not divisible by " +
                        denominatorText + ", so " + derived +
                        " cannot be derived; change train_batch_size or set " + derived);
    }
    return numerator / denominator;
  };

  const auto& train = trainBatchSize;
  const auto& micro = trainMicroBatchSizePerGpu;
  const auto& accum = gradientAccumulationSteps;

  if (train && micro && accum) {
    const int64_t product = multiply(multiply(*micro, *accum, source, "train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size, the global batch size,"), worldSize,
                                     source, "train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size, the global batch size,");
    if (*train != product) {
      throw ConfigError(p + named("train_batch_size", *train) + " != " +
                        named("train_micro_batch_size_per_gpu", *micro) + " * " +
                        named("gradient_accumulation_steps", *accum) + " * " + world + " = " +
                        std::to_string(product) +
                        "; fix one of them, or leave train_batch_size out to derive it");
    }
    return {*train, *micro, *accum};
  }
  if (train && micro) {
    const int64_t perStep = multiply(*micro, worldSize, source, "train_micro_batch_size_per_gpu * world size");
    const std::string text = named("train_micro_batch_size_per_gpu", *micro) + " * " + world +
                             " = " + std::to_string(perStep);
    return {*train, *micro, divide(*train, perStep, text, "gradient_accumulation_steps")};
  }
  if (train && accum) {
    const int64_t perMicro = multiply(*accum, worldSize, source, "gradient_accumulation_steps * world size");
    const std::string text = named("gradient_accumulation_steps", *accum) + " * " + world +
                             " = " + std::to_string(perMicro);
    return {*train, divide(*train, perMicro, text, "train_micro_batch_size_per_gpu"), *accum};
  }
  if (train) return {*train, divide(*train, worldSize, world, "train_micro_batch_size_per_gpu"), 1};
  if (micro) {
    const int64_t steps = accum.value_or(1);
    const int64_t total = multiply(multiply(*micro, steps, source, "train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size, the global batch size,"), worldSize,
                                   source, "train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size, the global batch size,");
    return {total, *micro, steps};
  }
  throw ConfigError(p + "train_batch_size or train_micro_batch_size_per_gpu is needed" +
                    (accum ? " (only gradient_accumulation_steps is set)" : "") +
                    "; set train_micro_batch_size_per_gpu to keep the per-GPU batch fixed at any "
                    "world size");
}

std::string Config::toJsonString() const {
  // ordered_json: the keys come out in the order docs/config.md lists them.
  using Json = nlohmann::ordered_json;
  Json j = Json::object();
  if (trainBatchSize) j["train_batch_size"] = *trainBatchSize;
  if (trainMicroBatchSizePerGpu) j["train_micro_batch_size_per_gpu"] = *trainMicroBatchSizePerGpu;
  if (gradientAccumulationSteps) j["gradient_accumulation_steps"] = *gradientAccumulationSteps;
  j["gradient_clipping"] = gradientClipping;
  j["fp16"] = {{"enabled", fp16.enabled},
               {"loss_scale", fp16.lossScale},
               {"initial_scale_power", fp16.initialScalePower},
               {"loss_scale_window", fp16.lossScaleWindow},
               {"hysteresis", fp16.hysteresis},
               {"min_loss_scale", fp16.minLossScale}};
  j["bf16"] = {{"enabled", bf16.enabled}};
  j["optimizer"] = {{"type", optimizer.type},
                    {"params",
                     {{"lr", optimizer.lr},
                      {"betas", Json::array({optimizer.beta1, optimizer.beta2})},
                      {"eps", optimizer.eps},
                      {"weight_decay", optimizer.weightDecay}}}};
  j["zero_optimization"] = {
      {"stage", zero.stage},
      {"reduce_bucket_size", zero.reduceBucketSize},
      {"allgather_bucket_size", zero.allgatherBucketSize},
      {"stage3_prefetch_bucket_size", zero.stage3PrefetchBucketSize},
      {"stage3_param_persistence_threshold", zero.stage3ParamPersistenceThreshold},
      {"stage3_max_live_parameters", zero.stage3MaxLiveParameters}};
  // Unset below stage 3 it depends on the device (on with GPU gradients): left out, so that a
  // config written back decides the same way wherever it is read.
  if (zero.overlapComm || zero.stage == 3) j["zero_optimization"]["overlap_comm"] = zero.overlapCommResolved(false);
  j["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = zero.gather16bitWeightsOnModelSave;
  j["zero_optimization"]["offload_optimizer"] = {{"device", zero.offloadOptimizer.toHost ? "cpu" : "none"},
                                                 {"pin_memory", zero.offloadOptimizer.pinMemory},
                                                 {"ratio", zero.offloadOptimizer.ratio}};
  j["zero_optimization"]["offload_param"] = {{"device", zero.offloadParam.toHost ? "cpu" : "none"},
                                             {"pin_memory", zero.offloadParam.pinMemory}};
  j["zero_optimization"]["zero_hpz_partition_size"] = zero.hpzPartitionSize;
  if (scheduler.enabled()) {
    Json params = Json::object();
    for (const auto& [key, value] : scheduler.params) {
      // Whole numbers as integers and flags as booleans, so the text reads like the input.
      const auto* specs = detail::schedulerParams(scheduler.type);
      const auto spec = std::find_if(specs->begin(), specs->end(), [&](const auto& s) { return s.key == key; });
      if (spec != specs->end() && spec->kind == detail::SchedulerParamSpec::Kind::Bool) {
        params[key] = value != 0;
      } else if (spec != specs->end() && spec->kind != detail::SchedulerParamSpec::Kind::Number) {
        params[key] = static_cast<int64_t>(value);
      } else {
        params[key] = value;
      }
    }
    const bool hasWarmupType = std::any_of(
        detail::schedulerParams(scheduler.type)->begin(), detail::schedulerParams(scheduler.type)->end(),
        [](const auto& s) { return s.kind == detail::SchedulerParamSpec::Kind::WarmupType; });
    if (hasWarmupType) params["warmup_type"] = scheduler.warmupType;
    j["scheduler"] = {{"type", scheduler.type}, {"params", params}};
  }
  j["steps_per_print"] = stepsPerPrint;
  j["wall_clock_breakdown"] = wallClockBreakdown;
  j["compile"] = {{"enabled", compile.enabled}, {"backend", compile.backend}, {"kwargs", Json::parse(compile.kwargs)}};
  j["zeroshard"] = {{"collective_timeout_seconds", extras.collectiveTimeoutSeconds},
                    {"reshard_after_forward", extras.reshardAfterForward},
                    {"stage3_unit_classes", extras.unitClasses},
                    {"reduce_dtype", extras.reduceDtype},
                    {"checkpoint", {{"keep_last", extras.checkpointKeepLast},
                                    {"every_minutes", extras.checkpointEveryMinutes}}},
                    {"max_inflight_reductions", extras.maxInflightReductions},
                    {"stage3_gather_stream", extras.stage3GatherStream},
                    {"batch_guard", extras.batchGuard},
                    {"nonfinite", extras.nonfinite}};
  j["zeroshard"]["nonfinite_check"] = extras.nonfiniteCheck;
  if (!extras.checkpointDir.empty()) j["zeroshard"]["checkpoint"]["dir"] = extras.checkpointDir;
  if (extras.shardGroupSize == ZeroshardExtras::kShardGroupNode) {
    j["zeroshard"]["shard_group_size"] = "node";
  } else if (extras.shardGroupSize > 0) {
    j["zeroshard"]["shard_group_size"] = extras.shardGroupSize;
  }
  return j.dump(2);
}

}  // namespace zeroshard
