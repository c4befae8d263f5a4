#include "zeroshard/config/config_reader.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "zeroshard/config/config_keys.h"

namespace zeroshard::detail {
namespace {

// ordered_json keeps the file's key order, so the first problem reported is the first one in
// the file and warnings come in the order a person reads them.
using Json = nlohmann::ordered_json;

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr double kInfinity = std::numeric_limits<double>::infinity();

struct IntRange {
  int64_t min;
  int64_t max;
  const char* allowed;  // as it reads after "must be "
};
constexpr IntRange kPositiveInt{1, kInt64Max, ">= 1"};
constexpr IntRange kNonNegativeInt{0, kInt64Max, ">= 0"};

struct NumberRange {
  double min;
  bool minIncluded;
  double max;
  bool maxIncluded;
  const char* allowed;
};
constexpr NumberRange kPositive{0, false, kInfinity, false, "> 0"};
constexpr NumberRange kNonNegative{0, true, kInfinity, false, ">= 0"};
constexpr NumberRange kBeta{0, true, 1, false, "in [0, 1)"};

std::string join(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

// A value as a person should see it in a message: its JSON text, with the type named where the
// text alone would not say it, and cut short if long.
std::string describe(const Json& value) {
  std::string text = value.dump();
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  if (value.is_string()) return "string " + text;
  if (value.is_boolean()) return "boolean " + text;
  if (value.is_object()) return "object " + text;
  if (value.is_array()) return "array " + text;
  return text;
}

const Json* member(const Json& object, const std::string& key) {
  auto it = object.find(key);
  return it == object.end() ? nullptr : &*it;
}

// Reads one config text. Holds the source name, so that every message can start with it, and
// the Config being filled, so that warnings land in it.
class ConfigReader {
 public:
  explicit ConfigReader(std::string source) { config_.source = std::move(source); }

  Config read(const std::string& text) {
    const Json root = parse(text);
    if (!root.is_object()) {
      fail("the top level must be a JSON object {...}, got " + describe(root));
    }
    checkKeys(root, "", configSection(""));
    readTopLevel(root);
    config_.text = text;
    return std::move(config_);
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw ConfigError(configMessagePrefix(config_.source) + what);
  }

  Json parse(const std::string& text) const;

  // Unknown keys are errors; DeepSpeed keys zeroshard does not implement become warnings.
  void checkKeys(const Json& object, const std::string& writtenPath, const ConfigSection& section) {
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

  // The nested object at parent[key], or nullptr when absent.
  const Json* object(const Json& parent, const std::string& path, const std::string& key) const {
    const Json* value = member(parent, key);
    if (value != nullptr && !value->is_object()) {
      fail(join(path, key) + ": must be a JSON object {...}, got " + describe(*value));
    }
    return value;
  }

  // "auto" is the Hugging Face Trainer's placeholder: the key is recorded in Config::autoKeys
  // and its field keeps its default until resolveAuto (auto_values.h) fills it in.
  bool takeAuto(const Json& value, const std::string& path) {
    if (!value.is_string() || value.get<std::string>() != "auto") return false;
    config_.autoKeys.push_back(path);
    return true;
  }

  void checkRange(bool ok, const std::string& path, const char* allowed, const Json& value) const {
    if (!ok) fail(path + ": must be " + allowed + ", got " + describe(value));
  }

  int64_t toInt(const Json& value, const std::string& path, const IntRange& range) const {
    int64_t result = 0;
    if (value.is_number_integer() && !value.is_number_unsigned()) {
      result = value.get<int64_t>();
    } else if (value.is_number_unsigned()) {
      checkRange(value.get<uint64_t>() <= static_cast<uint64_t>(kInt64Max), path,
                 "at most 9223372036854775807", value);
      result = static_cast<int64_t>(value.get<uint64_t>());
    } else if (value.is_number_float()) {
      // 5e8 is a float to the JSON parser; DeepSpeed configs write bucket sizes that way.
      const double d = value.get<double>();
      checkRange(std::trunc(d) == d, path, "a whole number", value);
      checkRange(std::fabs(d) < 9.2e18, path, "at most 9223372036854775807", value);
      result = static_cast<int64_t>(d);
    } else {
      fail(path + ": must be a whole number, got " + describe(value));
    }
    checkRange(result >= range.min && result <= range.max, path, range.allowed, value);
    return result;
  }

  double toNumber(const Json& value, const std::string& path, const NumberRange& range) const {
    if (!value.is_number()) fail(path + ": must be a number, got " + describe(value));
    const double d = value.get<double>();
    checkRange(std::isfinite(d), path, "a finite number", value);
    const bool aboveMin = range.minIncluded ? d >= range.min : d > range.min;
    const bool belowMax = range.maxIncluded ? d <= range.max : d < range.max;
    checkRange(aboveMin && belowMax, path, range.allowed, value);
    return d;
  }

  bool toBool(const Json& value, const std::string& path) const {
    if (!value.is_boolean()) fail(path + ": must be true or false, got " + describe(value));
    return value.get<bool>();
  }

  // The read* helpers leave `out` at its default when the key is absent or "auto".
  void readInt(const Json& o, const std::string& path, const std::string& key,
               const IntRange& range, int64_t& out) {
    const Json* v = member(o, key);
    if (v != nullptr && !takeAuto(*v, join(path, key))) out = toInt(*v, join(path, key), range);
  }
  void readNumber(const Json& o, const std::string& path, const std::string& key,
                  const NumberRange& range, double& out) {
    const Json* v = member(o, key);
    if (v != nullptr && !takeAuto(*v, join(path, key))) out = toNumber(*v, join(path, key), range);
  }
  void readBool(const Json& o, const std::string& path, const std::string& key, bool& out) {
    const Json* v = member(o, key);
    if (v != nullptr && !takeAuto(*v, join(path, key))) out = toBool(*v, join(path, key));
  }
  // For keys whose absence means something (derive it, or let the stage decide); DeepSpeed
  // treats null the same as absent for these.
  void readOptionalInt(const Json& o, const std::string& key, std::optional<int64_t>& out) {
    const Json* v = member(o, key);
    if (v != nullptr && !v->is_null() && !takeAuto(*v, key)) out = toInt(*v, key, kPositiveInt);
  }

  // The key written in `o` among a name and its alias; both at once is an error.
  const char* aliased(const Json& o, const std::string& path, const char* name,
                      const char* alias) const {
    const bool hasName = member(o, name) != nullptr;
    if (hasName && member(o, alias) != nullptr) {
      fail(path + ": both \"" + name + "\" and its alias \"" + alias +
           "\" are set; keep one of them");
    }
    return hasName ? name : alias;
  }

  void readTopLevel(const Json& root);
  void readExtras(const Json& o, const std::string& path);
  void readTensorParallel(const Json& o, const std::string& path);
  void readScheduler(const Json& o, const std::string& path);
  void readSchedulerParam(const Json& value, const std::string& path, const SchedulerParamSpec& spec);
  void readOffload(const Json& o, const std::string& path);
  void readFp16(const Json& o, const std::string& path);
  void readOptimizer(const Json& o, const std::string& path);
  void readOptimizerParams(const Json& o, const std::string& path);
  void readZero(const Json& o, const std::string& path);

  Config config_;
};

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
  auto onEvent = [&](int /*depth*/, nlohmann::json::parse_event_t event, Json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start || event == Event::array_start) {
      std::string path;
      if (!frames.empty()) {
        const Frame& parent = frames.back();
        path = parent.isArray ? parent.path + "[]" : join(parent.path, parent.lastKey);
      }
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
  readInt(root, "", "steps_per_print", kPositiveInt, config_.stepsPerPrint);
  readBool(root, "", "wall_clock_breakdown", config_.wallClockBreakdown);
}

void ConfigReader::readExtras(const Json& o, const std::string& path) {
  checkKeys(o, path, configSection("zeroshard"));
  ZeroshardExtras& extras = config_.extras;
  readNumber(o, path, "collective_timeout_seconds", kPositive, extras.collectiveTimeoutSeconds);
  readBool(o, path, "reshard_after_forward", extras.reshardAfterForward);
  readInt(o, path, "max_inflight_reductions", kPositiveInt, extras.maxInflightReductions);
  if (const Json* checkpoint = object(o, path, "checkpoint")) {
    const std::string checkpointPath = join(path, "checkpoint");
    checkKeys(*checkpoint, checkpointPath, configSection("zeroshard.checkpoint"));
    readInt(*checkpoint, checkpointPath, "keep_last", kNonNegativeInt, extras.checkpointKeepLast);
  }
  if (const Json* value = member(o, "reduce_dtype"); value != nullptr && !takeAuto(*value, join(path, "reduce_dtype"))) {
    if (!value->is_string() || (*value != "compute" && *value != "fp32")) {
      fail(join(path, "reduce_dtype") + ": must be \"compute\" or \"fp32\", got " + describe(*value));
    }
    extras.reduceDtype = value->get<std::string>();
  }
  if (const Json* classes = member(o, "stage3_unit_classes")) {
    const std::string where = join(path, "stage3_unit_classes");
    if (!classes->is_array()) fail(where + ": must be a list of module class names, got " + describe(*classes));
    for (const auto& name : *classes) {
      if (!name.is_string() || name.get<std::string>().empty()) {
        fail(where + ": every entry must be a non-empty class name string, got " + describe(name));
      }
      extras.unitClasses.push_back(name.get<std::string>());
    }
  }
}

// DeepSpeed's AutoTP training config. zeroshard shards data-parallel only, so a tensor-parallel
// size above 1 would train a different layout than asked: an error, not a warning.
void ConfigReader::readTensorParallel(const Json& o, const std::string& path) {
  checkKeys(o, path, configSection("tensor_parallel"));
  auto checkSize = [&](const Json& parent, const std::string& parentPath, const char* key) {
    int64_t size = 1;
    readInt(parent, parentPath, key, kNonNegativeInt, size);
    if (size > 1) {
      fail(join(parentPath, key) + ": zeroshard does not implement tensor parallelism (it shards "
           "parameters, gradients and optimizer state over data-parallel ranks), so the size must "
           "be 0 or 1 or left out, got " + std::to_string(size));
    }
  };
  checkSize(o, path, "autotp_size");
  const std::string tpKey = aliased(o, path, "tp", "tensor_parallel");
  if (const Json* tp = object(o, path, tpKey)) {
    const std::string tpPath = join(path, tpKey);
    checkKeys(*tp, tpPath, configSection("tensor_parallel.tp"));
    checkSize(*tp, tpPath, "tp_size");
  }
}

void ConfigReader::readScheduler(const Json& o, const std::string& path) {
  checkKeys(o, path, configSection("scheduler"));
  const Json* type = member(o, "type");
  const std::string typePath = join(path, "type");
  std::string names;
  for (std::string_view t : schedulerTypes()) names += (names.empty() ? "" : ", ") + std::string(t);
  if (type == nullptr || type->is_null()) {
    if (member(o, "params") != nullptr) fail(typePath + ": is needed with scheduler.params; one of " + names);
    return;  // DeepSpeed: no type, no scheduler
  }
  if (!type->is_string() || schedulerParams(type->get<std::string>()) == nullptr) {
    fail(typePath + ": must be one of DeepSpeed's schedules " + names + ", got " + describe(*type));
  }
  SchedulerConfig& scheduler = config_.scheduler;
  scheduler.type = type->get<std::string>();
  const std::vector<SchedulerParamSpec>& specs = *schedulerParams(scheduler.type);
  const std::string paramsPath = join(path, "params");
  const Json* params = object(o, path, "params");
  const Json empty = Json::object();
  if (params == nullptr) params = &empty;
  for (const auto& [key, value] : params->items()) {
    const auto spec = std::find_if(specs.begin(), specs.end(), [&](const auto& s) { return s.key == key; });
    if (spec == specs.end()) {
      std::string known;
      for (const auto& s : specs) known += (known.empty() ? "" : ", ") + std::string(s.key);
      fail("unknown key \"" + join(paramsPath, key) + "\": " + scheduler.type + " takes " + known);
    }
    readSchedulerParam(value, join(paramsPath, key), *spec);
  }
  for (const auto& spec : specs) {
    const bool written = member(*params, std::string(spec.key)) != nullptr;
    if (!written && !spec.defaultValue && !spec.nullable && spec.kind != SchedulerParamSpec::Kind::WarmupType) {
      fail(join(paramsPath, std::string(spec.key)) + ": " + scheduler.type +
           " needs it (DeepSpeed has no default for it)");
    }
  }
}

void ConfigReader::readSchedulerParam(const Json& value, const std::string& path,
                                      const SchedulerParamSpec& spec) {
  using Kind = SchedulerParamSpec::Kind;
  SchedulerConfig& scheduler = config_.scheduler;
  const std::string key(spec.key);
  if (takeAuto(value, path)) return;
  if (value.is_null()) {
    if (!spec.nullable) fail(path + ": must be set (null is allowed only where DeepSpeed takes None), got null");
    return;
  }
  switch (spec.kind) {
    case Kind::Number: scheduler.params[key] = toNumber(value, path, kNonNegative); break;
    case Kind::Steps: scheduler.params[key] = static_cast<double>(toInt(value, path, kNonNegativeInt)); break;
    case Kind::Iteration:
      scheduler.params[key] = static_cast<double>(toInt(value, path, IntRange{-1, kInt64Max, ">= -1"}));
      break;
    case Kind::Bool: scheduler.params[key] = toBool(value, path) ? 1.0 : 0.0; break;
    case Kind::WarmupType:
      if (!value.is_string() || (value != "log" && value != "linear")) {
        fail(path + ": must be \"log\" or \"linear\", got " + describe(value));
      }
      scheduler.warmupType = value.get<std::string>();
      break;
  }
}

// offload_optimizer / offload_param: device "none" (DeepSpeed's default) is what zeroshard
// does; "cpu" and "nvme" are not implemented yet and warn.
void ConfigReader::readOffload(const Json& o, const std::string& path) {
  checkKeys(o, path, configSection(path));
  const Json* device = member(o, "device");
  if (device == nullptr || device->is_null() || takeAuto(*device, join(path, "device"))) return;
  if (!device->is_string() || (*device != "none" && *device != "cpu" && *device != "nvme")) {
    fail(join(path, "device") + ": must be \"none\", \"cpu\" or \"nvme\", got " + describe(*device));
  }
  if (*device != "none") {
    config_.warnings.push_back("\"" + path + "\" is a DeepSpeed key zeroshard does not implement yet; it is "
                               "ignored: \"" + join(path, "device") + "\": \"" + device->get<std::string>() +
                               "\" asks for offload, "
                               "and every state stays on the device");
  }
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
  for (const char* key : {"offload_optimizer", "offload_param"}) {
    if (const Json* offload = object(o, path, key)) readOffload(*offload, join(path, key));
  }
}

}  // namespace

std::string configMessagePrefix(const std::string& source) {
  return "zeroshard config (" + source + "): ";
}

Config readConfig(const std::string& text, const std::string& source) {
  return ConfigReader(source).read(text);
}

}  // namespace zeroshard::detail
