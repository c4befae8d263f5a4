#include "zeroshard/config/auto_values.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "zeroshard/config/config_reader.h"

namespace zeroshard {
namespace {

using Json = nlohmann::ordered_json;

std::vector<std::string> split(const std::string& path) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    parts.push_back(path.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) return parts;
    start = dot + 1;
  }
}

// The object holding the last part of `path`, and that part. The path is one the reader
// recorded, so every object on the way exists.
std::pair<Json*, std::string> parentOf(Json& root, const std::string& path) {
  std::vector<std::string> parts = split(path);
  Json* object = &root;
  for (size_t i = 0; i + 1 < parts.size(); ++i) object = &(*object)[parts[i]];
  return {object, parts.back()};
}

bool startsWith(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

bool isBatchKey(const std::string& path) {
  return path == "train_batch_size" || path == "train_micro_batch_size_per_gpu" ||
         path == "gradient_accumulation_steps";
}

// Keys of the sections DeepSpeed reads through its pydantic config models, whose constructor
// drops "auto" values so that the field's default applies (deepspeed/runtime/config_utils.py),
// and zeroshard's own section, which follows the same rule.
bool hasDeepSpeedDefault(const std::string& path) {
  for (const char* section : {"fp16.", "bf16.", "bfloat16.", "zero_optimization.", "zeroshard.",
                              "tensor_parallel."}) {
    if (startsWith(path, section)) return true;
  }
  return false;
}

// The model-derived value of `path`, as the Hugging Face integration computes it
// (transformers/integrations/deepspeed.py, trainer_config_finalize); the stage-3 keys only at
// stage 3, as there.
struct Derived {
  int64_t value;
  const char* formula;
};
std::optional<Derived> fromHiddenSize(const std::string& path, int64_t stage, int64_t h) {
  const std::string key = path.substr(path.rfind('.') + 1);
  if (!startsWith(path, "zero_optimization.")) return std::nullopt;
  if (key == "reduce_bucket_size") return Derived{h * h, "h*h"};
  if (stage != 3) return std::nullopt;
  if (key == "stage3_prefetch_bucket_size" || key == "prefetch_bucket_size") {
    return Derived{static_cast<int64_t>(0.9 * static_cast<double>(h * h)), "int(0.9*h*h)"};
  }
  if (key == "stage3_param_persistence_threshold" || key == "param_persistence_threshold") {
    return Derived{10 * h, "10*h"};
  }
  return std::nullopt;
}

std::string quotedList(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) out += (out.empty() ? "\"" : ", \"") + k + "\"";
  return out;
}

// The value a resolved config holds at `path`, as JSON text, looked up in its canonical form
// (the reader's aliases are written under their main names by toJsonString).
std::string resolvedValue(const Json& resolved, const std::string& path) {
  static const std::map<std::string, std::string> aliases = {
      {"bfloat16", "bf16"},
      {"prefetch_bucket_size", "stage3_prefetch_bucket_size"},
      {"param_persistence_threshold", "stage3_param_persistence_threshold"},
      {"max_live_parameters", "stage3_max_live_parameters"},
      {"gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"},
      {"stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"},
  };
  const Json* at = &resolved;
  for (std::string part : split(path)) {
    if (auto it = aliases.find(part); it != aliases.end()) part = it->second;
    if (!at->is_object() || !at->contains(part)) return "";
    at = &(*at)[part];
  }
  return at->dump();
}

}  // namespace

AutoResolution resolveAuto(const Config& config, const AutoInputs& inputs) {
  const std::string prefix = detail::configMessagePrefix(config.source);
  const auto& autos = config.autoKeys;
  for (const auto& [path, value] : inputs.given) {
    if (std::find(autos.begin(), autos.end(), path) == autos.end()) {
      throw ConfigError(prefix + "auto={\"" + path + "\": " + value + "} is given, but the config does not write \"" +
                        path + "\" as \"auto\"" +
                        (autos.empty() ? std::string(" (it has no \"auto\" value)")
                                       : "; its \"auto\" keys are " + quotedList(autos)));
    }
  }
  if (autos.empty()) return {config, ""};
  if (config.text.empty()) {
    throw ConfigError(prefix + "the config records \"auto\" keys but not the text they were read from; "
                      "build it with Config::fromJsonString or fromFile");
  }

  Json root = Json::parse(config.text);
  std::vector<std::pair<std::string, std::string>> how;  // path, why (the value comes later)
  std::vector<std::string> open;
  std::vector<std::string> batchAutos;
  bool usedHiddenSize = false;
  for (const std::string& path : autos) {
    auto [parent, key] = parentOf(root, path);
    if (auto it = inputs.given.find(path); it != inputs.given.end()) {
      try {
        (*parent)[key] = Json::parse(it->second);
      } catch (const nlohmann::json::exception&) {
        throw ConfigError(prefix + "auto[\"" + path + "\"]: the value must be JSON (a number, a "
                          "boolean, a string or null), got " + it->second);
      }
      how.emplace_back(path, "given");
    } else if (auto derived = inputs.hiddenSize ? fromHiddenSize(path, config.zero.stage, *inputs.hiddenSize)
                                                : std::nullopt) {
      (*parent)[key] = derived->value;
      how.emplace_back(path, derived->formula);
      usedHiddenSize = true;
    } else if (isBatchKey(path)) {
      parent->erase(key);
      batchAutos.push_back(path);
    } else if (hasDeepSpeedDefault(path)) {
      parent->erase(key);
      how.emplace_back(path, "DeepSpeed's default");
    } else {
      open.push_back(path);
    }
  }
  if (!batchAutos.empty()) {
    // Determined by the rule when train_batch_size or the micro batch is still set.
    const bool determined = root.contains("train_batch_size") || root.contains("train_micro_batch_size_per_gpu");
    for (const auto& path : batchAutos) {
      if (determined) {
        how.emplace_back(path, "batch rule");
      } else {
        open.push_back(path);
      }
    }
  }
  if (!open.empty()) {
    std::string example;
    for (const auto& path : open) example += (example.empty() ? "" : ", ") + ("\"" + path + "\": ...");
    throw ConfigError(prefix + "\"auto\" has no value for " + quotedList(open) +
                      ": nothing zeroshard knows determines " + (open.size() == 1 ? "it" : "them") +
                      " (the Hugging Face Trainer fills them from its arguments); pass them to "
                      "initialize as auto={" + example + "}, or write the values in the config");
  }

  AutoResolution out{Config::fromJsonString(root.dump(2), config.source), ""};
  const Json resolved = Json::parse(out.config.toJsonString());
  const BatchSizes sizes = out.config.batchSizes(inputs.worldSize);
  std::string line;
  for (const auto& [path, why] : how) {
    std::string value = resolvedValue(resolved, path);
    if (path == "train_batch_size") value = std::to_string(sizes.train);
    if (path == "train_micro_batch_size_per_gpu") value = std::to_string(sizes.microPerRank);
    if (path == "gradient_accumulation_steps") value = std::to_string(sizes.accumulationSteps);
    line += (line.empty() ? "" : ", ") + path + "=" + value + " (" + why + ")";
  }
  out.summary = prefix + "\"auto\" resolved: " + line;
  if (usedHiddenSize) {
    out.summary += "; h = " + std::to_string(*inputs.hiddenSize) + ", the hidden size from " + inputs.hiddenSizeSource;
  }
  return out;
}

std::optional<int64_t> hiddenSizeFromShapes(const std::vector<std::vector<int64_t>>& shapes) {
  std::map<int64_t, int64_t> counts;
  for (const auto& shape : shapes) {
    if (shape.size() == 2) ++counts[shape[1]];
  }
  std::optional<int64_t> best;
  int64_t bestCount = 0;
  for (const auto& [size, count] : counts) {  // ascending size: >= keeps the larger on a tie
    if (count >= bestCount) {
      best = size;
      bestCount = count;
    }
  }
  return best;
}

}  // namespace zeroshard
