#include "zeroshard/config/config_reader.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "zeroshard/config/config_reader_impl.h"

namespace zeroshard::detail {

void ConfigReader::checkKeys(const Json& object, const std::string& writtenPath, const ConfigSection& section) {
  for (const auto& [key, value] : object.items()) {
    if (section.reads(key) || section.inert(key)) continue;
    if (section.ignores(key)) {
      config_.warnings.push_back("\"" + join(writtenPath, key) +
                                 "\" is a DeepSpeed key zeroshard does not implement yet; it is "
                                 "ignored");
      continue;
    }
    // DeepSpeed ignores unknown top-level keys ("_comment", "comms_config", ...); so does
    // zeroshard, with a warning, unless the key is a near miss of a known one: a typo such as
    // "zero_optimisation" would otherwise silently train with the defaults.
    if (section.path.empty() && !isNearMiss(section, key)) {
      config_.warnings.push_back(unknownTopLevelMessage(section, key));
      continue;
    }
    fail(unknownKeyMessage(section, writtenPath, key));
  }
}

Json ConfigReader::parse(const std::string& text) const {
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) {
    fail("the config is empty; it must be a JSON object, e.g. "
         "{\"train_micro_batch_size_per_gpu\": 4}");
  }

  // DeepSpeed loads with object_pairs_hook=dict_raise_error_on_duplicate_keys; the JSON parser
  // here would keep one of the two values silently, so duplicates are found while parsing.
  struct Frame {
    std::string path;
    bool isArray = false;
    std::set<std::string> keys;
    std::string lastKey;
  };
  std::vector<Frame> frames;
  std::string duplicate;
  auto onEvent = [&](int depth, nlohmann::json::parse_event_t event, Json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start || event == Event::array_start) {
      std::string path;
      if (!frames.empty()) {
        const Frame& parent = frames.back();
        path = parent.isArray ? parent.path + "[]" : join(parent.path, parent.lastKey);
      }
      // Note [JSON nesting bound] (json_input.h).
      if (opensTooDeep(depth, event)) fail(path + ": " + jsonTooDeepMessage() + "; no config key nests like that");
      frames.push_back(Frame{path, event == Event::array_start, {}, {}});
    } else if (event == Event::object_end || event == Event::array_end) {
      frames.pop_back();
    } else if (event == Event::key && !frames.empty()) {
      Frame& frame = frames.back();
      frame.lastKey = parsed.get<std::string>();
      if (!frame.keys.insert(frame.lastKey).second && duplicate.empty()) {
        duplicate = join(frame.path, frame.lastKey);
      }
    }
    return true;
  };

  Json root;
  try {
    root = Json::parse(text, onEvent);
  } catch (const nlohmann::json::parse_error& e) {
    // Line and column of the offending character, counted here so the message does not depend
    // on how a given nlohmann version words its own.
    const size_t at = std::min<size_t>(e.byte == 0 ? 0 : e.byte - 1, text.size());
    size_t line = 1;
    size_t lineStart = 0;
    for (size_t i = 0; i < at; ++i) {
      if (text[i] == '\n') {
        ++line;
        lineStart = i + 1;
      }
    }
    std::string detail = e.what();
    const size_t cut = detail.find("syntax error");
    if (cut != std::string::npos) detail = detail.substr(cut);
    fail("invalid JSON at line " + std::to_string(line) + ", column " +
         std::to_string(at - lineStart + 1) + ": " + detail);
  } catch (const nlohmann::json::exception& e) {
    // E.g. out_of_range 406, a number too large for a double ("1e999").
    std::string detail = e.what();
    const size_t cut = detail.find("] ");
    if (cut != std::string::npos) detail = detail.substr(cut + 2);
    fail("invalid JSON: " + detail);
  }
  if (!duplicate.empty()) {
    fail("duplicate key \"" + duplicate + "\"; a JSON object may hold a key once (DeepSpeed "
         "rejects this too), keep one of them");
  }
  return root;
}

void ConfigReader::readTopLevel(const Json& root) {
  readOptionalInt(root, "train_batch_size", config_.trainBatchSize);
  readOptionalInt(root, "train_micro_batch_size_per_gpu", config_.trainMicroBatchSizePerGpu);
  readOptionalInt(root, "gradient_accumulation_steps", config_.gradientAccumulationSteps);
  readNumber(root, "", "gradient_clipping", kNonNegative, config_.gradientClipping);

  if (const Json* fp16 = object(root, "", "fp16")) readFp16(*fp16, "fp16");

  const std::string bf16Key = aliased(root, "the top level", "bf16", "bfloat16");
  if (const Json* bf16 = object(root, "", bf16Key)) {
    checkKeys(*bf16, bf16Key, configSection("bf16"));
    readBool(*bf16, bf16Key, "enabled", config_.bf16.enabled);
  }
  if (config_.fp16.enabled && config_.bf16.enabled) {
    fail("fp16.enabled and " + bf16Key + ".enabled are both true; enable one of them (bf16 needs "
         "no loss scaling, so prefer it where the GPU supports it)");
  }

  if (const Json* optimizer = object(root, "", "optimizer")) readOptimizer(*optimizer, "optimizer");
  if (const Json* zero = object(root, "", "zero_optimization")) {
    readZero(*zero, "zero_optimization");
  }
  if (const Json* extras = object(root, "", "zeroshard")) readExtras(*extras, "zeroshard");
  if (const Json* tp = object(root, "", "tensor_parallel")) readTensorParallel(*tp, "tensor_parallel");
  if (const Json* scheduler = object(root, "", "scheduler")) readScheduler(*scheduler, "scheduler");
  if (const Json* compile = object(root, "", "compile")) readCompile(*compile, "compile");
  readInt(root, "", "steps_per_print", kPositiveInt, config_.stepsPerPrint);
  readBool(root, "", "wall_clock_breakdown", config_.wallClockBreakdown);
}

void ConfigReader::readFp16(const Json& o, const std::string& path) {
  checkKeys(o, path, configSection("fp16"));
  Fp16Config& fp16 = config_.fp16;
  readBool(o, path, "enabled", fp16.enabled);
  readNumber(o, path, "loss_scale", kNonNegative, fp16.lossScale);
  // 2^63 is far past any useful scale and still an exact double.
  readInt(o, path, "initial_scale_power", IntRange{0, 63, "in 0..63"}, fp16.initialScalePower);
  readInt(o, path, "loss_scale_window", kPositiveInt, fp16.lossScaleWindow);
  readInt(o, path, "hysteresis", kPositiveInt, fp16.hysteresis);
  readNumber(o, path, "min_loss_scale", kPositive, fp16.minLossScale);
}

void ConfigReader::readOptimizer(const Json& o, const std::string& path) {
  checkKeys(o, path, configSection("optimizer"));
  if (const Json* type = member(o, "type")) {
    const std::string typePath = join(path, "type");
    if (!type->is_string()) fail(typePath + ": must be a string, got " + describe(*type));
    std::string lower = type->get<std::string>();
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (lower != "adamw" && lower != "adam") {
      fail(typePath + ": zeroshard implements AdamW only; write \"AdamW\" (or \"Adam\", which "
                      "DeepSpeed also runs as AdamW), got " + describe(*type));
    }
    config_.optimizer.type = "AdamW";
  }
  if (const Json* params = object(o, path, "params")) {
    readOptimizerParams(*params, join(path, "params"));
  }
}

void ConfigReader::readOptimizerParams(const Json& o, const std::string& path) {
  checkKeys(o, path, configSection("optimizer.params"));
  OptimizerConfig& opt = config_.optimizer;
  readNumber(o, path, "lr", kNonNegative, opt.lr);
  if (const Json* betas = member(o, "betas"); betas != nullptr && !takeAuto(*betas, join(path, "betas"))) {
    const std::string betasPath = join(path, "betas");
    if (!betas->is_array() || betas->size() != 2) {
      fail(betasPath + ": must be an array of two numbers in [0, 1), e.g. [0.9, 0.999], got " +
           describe(*betas));
    }
    opt.beta1 = toNumber((*betas)[0], betasPath + "[0]", kBeta);
    opt.beta2 = toNumber((*betas)[1], betasPath + "[1]", kBeta);
  }
  readNumber(o, path, "eps", kPositive, opt.eps);
  readNumber(o, path, "weight_decay", kNonNegative, opt.weightDecay);

  // Flags whose other value would ask for a different optimizer than the one zeroshard runs.
  const struct {
    const char* key;
    bool supported;
    const char* why;
  } flags[] = {
      {"adam_w_mode", true, "zeroshard implements AdamW (decoupled weight decay) only"},
      {"amsgrad", false, "zeroshard implements AdamW without AMSGrad"},
      {"bias_correction", true, "zeroshard's AdamW always applies bias correction"},
  };
  for (const auto& flag : flags) {
    bool value = flag.supported;
    readBool(o, path, flag.key, value);
    if (value != flag.supported) {
      fail(join(path, flag.key) + ": " + flag.why + ", so it must be " +
           (flag.supported ? "true" : "false") + " or left out, got " +
           (value ? "true" : "false"));
    }
  }
}

void ConfigReader::readZero(const Json& o, const std::string& path) {
  checkKeys(o, path, configSection("zero_optimization"));
  ZeroConfig& zero = config_.zero;
  readInt(o, path, "stage", IntRange{0, 3, "0, 1, 2 or 3"}, zero.stage);
  // DeepSpeed's default for a true/false key that zeroshard implements only at that value.
  for (const char* key : {"reduce_scatter", "allgather_partitions"}) {
    bool value = true;
    readBool(o, path, key, value);
    if (!value) {
      config_.warnings.push_back("\"" + join(path, key) + "\": false is ignored; zeroshard always " +
                                 (std::string(key) == "reduce_scatter" ? "reduce-scatters gradients at stages 2 and 3"
                                                                       : "all-gathers parameter partitions"));
    }
  }
  readInt(o, path, "reduce_bucket_size", kPositiveInt, zero.reduceBucketSize);
  readInt(o, path, "allgather_bucket_size", kPositiveInt, zero.allgatherBucketSize);
  if (const Json* v = member(o, "overlap_comm"); v != nullptr && !v->is_null() &&
                                                  !takeAuto(*v, join(path, "overlap_comm"))) {
    zero.overlapComm = toBool(*v, join(path, "overlap_comm"));
  }
  bool contiguous = true;
  readBool(o, path, "contiguous_gradients", contiguous);
  if (!contiguous) {
    config_.warnings.push_back("\"" + join(path, "contiguous_gradients") +
                               "\": false is ignored; zeroshard always reduces gradients from contiguous "
                               "flat buffers (stages 0 and 1 accumulate into one, stages 2 and 3 copy each "
                               "final gradient into one)");
  }
  // 0 is allowed: DeepSpeed reads a prefetch bucket of 0 as "do not prefetch".
  readInt(o, path, aliased(o, path, "stage3_prefetch_bucket_size", "prefetch_bucket_size"),
          kNonNegativeInt, zero.stage3PrefetchBucketSize);
  readInt(o, path,
          aliased(o, path, "stage3_param_persistence_threshold", "param_persistence_threshold"),
          kNonNegativeInt, zero.stage3ParamPersistenceThreshold);
  readInt(o, path, aliased(o, path, "stage3_max_live_parameters", "max_live_parameters"),
          kNonNegativeInt, zero.stage3MaxLiveParameters);
  {
    const char* name = "stage3_gather_16bit_weights_on_model_save";
    const char* aliases[] = {"gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"};
    for (const char* alias : aliases) {
      if (member(o, alias) != nullptr) name = aliased(o, path, name, alias);
    }
    readBool(o, path, name, zero.gather16bitWeightsOnModelSave);
  }
  readShardGroupSize(o, path, "mics_shard_size");
  readInt(o, path, "zero_hpz_partition_size", kPositiveInt, zero.hpzPartitionSize);
  if (zero.hpzPartitionSize > 1 && zero.stage < 3) {
    config_.warnings.push_back("\"" + join(path, "zero_hpz_partition_size") + "\": " +
                               std::to_string(zero.hpzPartitionSize) + " is ignored at zero_optimization.stage " +
                               std::to_string(zero.stage) + "; hpZ keeps secondary parameter shards, which exist "
                               "at stage 3 only, as in DeepSpeed");
    zero.hpzPartitionSize = 1;
  }
  if (const Json* offload = object(o, path, "offload_optimizer")) {
    readOffload(*offload, join(path, "offload_optimizer"), zero.offloadOptimizer);
  }
  if (const Json* offload = object(o, path, "offload_param")) {
    readOffload(*offload, join(path, "offload_param"), zero.offloadParam);
  }
}

std::string configMessagePrefix(const std::string& source) {
  return "zeroshard config (" + source + "): ";
}

Config readConfig(const std::string& text, const std::string& source) {
  return ConfigReader(source).read(text);
}

}  // namespace zeroshard::detail
