#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "zeroshard/config/config_reader_impl.h"

namespace zeroshard::detail {

void ConfigReader::readExtras(const Json& o, const std::string& path) {
  checkKeys(o, path, configSection("zeroshard"));
  ZeroshardExtras& extras = config_.extras;
  readNumber(o, path, "collective_timeout_seconds", kPositive, extras.collectiveTimeoutSeconds);
  readBool(o, path, "reshard_after_forward", extras.reshardAfterForward);
  readInt(o, path, "max_inflight_reductions", kPositiveInt, extras.maxInflightReductions);
  readBool(o, path, "stage3_gather_stream", extras.stage3GatherStream);
  readShardGroupSize(o, path, "shard_group_size");
  if (const Json* checkpoint = object(o, path, "checkpoint")) {
    const std::string checkpointPath = join(path, "checkpoint");
    checkKeys(*checkpoint, checkpointPath, configSection("zeroshard.checkpoint"));
    readInt(*checkpoint, checkpointPath, "keep_last", kNonNegativeInt, extras.checkpointKeepLast);
    readNumber(*checkpoint, checkpointPath, "every_minutes", kNonNegative, extras.checkpointEveryMinutes);
    const std::string dirKey = join(checkpointPath, "dir");
    if (const Json* dir = member(*checkpoint, "dir"); dir != nullptr && !dir->is_null() && !takeAuto(*dir, dirKey)) {
      if (!dir->is_string() || dir->get<std::string>().empty()) {
        fail(dirKey + ": must be a directory path (a non-empty string), got " + describe(*dir));
      }
      extras.checkpointDir = dir->get<std::string>();
    }
    if (extras.checkpointEveryMinutes > 0 && extras.checkpointDir.empty()) {
      fail(join(checkpointPath, "every_minutes") + ": saving every " + describe(checkpoint->at("every_minutes")) +
           " minutes needs " + dirKey + ", the directory to save into");
    }
  }
  readChoice(o, path, "batch_guard", {"warn", "error"}, extras.batchGuard);
  readChoice(o, path, "nonfinite", {"error", "skip", "off"}, extras.nonfinite);
  readChoice(o, path, "nonfinite_check", {"auto", "immediate", "deferred"}, extras.nonfiniteCheck);
  readChoice(o, path, "reduce_dtype", {"compute", "fp32"}, extras.reduceDtype);
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

// A string that must be one of `choices`, e.g. "warn" or "error".
void ConfigReader::readChoice(const Json& o, const std::string& path, const char* key,
                              const std::vector<std::string>& choices, std::string& out) {
  const Json* value = member(o, key);
  if (value == nullptr || takeAuto(*value, join(path, key))) return;
  const bool known = value->is_string() && std::find(choices.begin(), choices.end(), value->get<std::string>()) !=
                                               choices.end();
  if (!known) {
    std::string listed;
    for (size_t i = 0; i < choices.size(); ++i) {
      listed += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + ("\"" + choices[i] + "\"");
    }
    fail(join(path, key) + ": must be " + listed + ", got " + describe(*value));
  }
  out = value->get<std::string>();
}

// zeroshard.shard_group_size / zero_optimization.mics_shard_size: a whole number >= 1, or "node"
// (DeepSpeed's -1 for mics_shard_size is off). Written in both places, they must agree.
void ConfigReader::readShardGroupSize(const Json& o, const std::string& path, const char* key) {
  const Json* v = member(o, key);
  const std::string where = join(path, key);
  if (v == nullptr || v->is_null() || takeAuto(*v, where)) return;
  int64_t size = 0;
  if (v->is_string() && *v == "node") {
    size = ZeroshardExtras::kShardGroupNode;
  } else {
    const bool mics = std::string(key) == "mics_shard_size";
    size = toInt(*v, where, mics ? IntRange{-1, kInt64Max, "-1 (off), >= 1 or \"node\""}
                                 : IntRange{1, kInt64Max, ">= 1 or \"node\""});
    if (size == 0) fail(where + ": must be -1 (off), >= 1 or \"node\", got 0");
    if (size == -1) return;  // DeepSpeed's "off"
  }
  auto& current = config_.extras.shardGroupSize;
  if (current != 0 && current != size) {
    fail(where + ": " + describe(*v) + " differs from the shard group size set by the other key "
         "(zero_optimization.mics_shard_size and zeroshard.shard_group_size name the same thing)");
  }
  current = size;
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

void ConfigReader::readCompile(const Json& o, const std::string& path) {
  checkKeys(o, path, configSection("compile"));
  CompileConfig& compile = config_.compile;
  readBool(o, path, "enabled", compile.enabled);
  if (const Json* backend = member(o, "backend")) {
    if (!backend->is_string() || backend->get<std::string>().empty()) {
      fail(join(path, "backend") + ": must be the name of a torch.compile backend (a non-empty string, e.g. "
           "\"inductor\"), got " + describe(*backend));
    }
    compile.backend = backend->get<std::string>();
  }
  if (const Json* kwargs = member(o, "kwargs"); kwargs != nullptr && !kwargs->is_null()) {
    if (!kwargs->is_object()) {
      fail(join(path, "kwargs") + ": must be an object of torch.compile's keyword arguments (e.g. "
           "{\"mode\": \"max-autotune\"}), got " + describe(*kwargs));
    }
    if (kwargs->contains("backend")) {
      fail(join(path, "kwargs") + ": \"backend\" goes in " + join(path, "backend") + ", not in kwargs");
    }
    compile.kwargs = kwargs->dump();
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

// offload_optimizer / offload_param (ZeRO-Offload): device "none" (DeepSpeed's default) is off,
// "cpu" puts the state in host memory; "nvme" (ZeRO-Infinity) is an error. The NVMe knobs
// (nvme_path, buffer_count, ...) are inert: "cpu" switches them off, in DeepSpeed as here.
void ConfigReader::readOffload(const Json& o, const std::string& path, OffloadConfig& offload) {
  checkKeys(o, path, configSection(path));
  const bool optimizer = path.size() >= 17 && path.compare(path.size() - 17, 17, "offload_optimizer") == 0;
  readBool(o, path, "pin_memory", offload.pinMemory);
  if (optimizer) {
    readNumber(o, path, "ratio", NumberRange{0, true, 1, true, "between 0 and 1"}, offload.ratio);
  }
  const Json* device = member(o, "device");
  if (device == nullptr || device->is_null() || takeAuto(*device, join(path, "device"))) return;
  if (!device->is_string() || (*device != "none" && *device != "cpu" && *device != "nvme")) {
    fail(join(path, "device") + ": must be \"none\", \"cpu\" or \"nvme\", got " + describe(*device));
  }
  if (*device == "nvme") {
    fail(join(path, "device") + ": \"nvme\" (ZeRO-Infinity) is not supported by zeroshard; use \"cpu\" to keep " +
         (optimizer ? "the optimizer state" : "the parameters") + " in host memory, or \"none\"");
  }
  offload.toHost = *device == "cpu";
  const int64_t stage = config_.zero.stage;
  const int64_t needed = optimizer ? 1 : 3;
  if (offload.toHost && stage < needed) {
    config_.warnings.push_back("\"" + join(path, "device") + "\": \"cpu\" is ignored at zero_optimization.stage " +
                               std::to_string(stage) + "; " + (optimizer ? "the optimizer state" : "the parameters") +
                               " go to host memory at stage " + (optimizer ? "1, 2 or 3" : "3") +
                               " only, as in DeepSpeed");
    offload.toHost = false;
  }
}

}  // namespace zeroshard::detail
