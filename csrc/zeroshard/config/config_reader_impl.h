#pragma once

// Internal to the config layer: the reader of one config text, shared by config_reader.cpp (the
// JSON parse, the top level, fp16, optimizer, zero_optimization) and config_sections.cpp (the
// zeroshard, tensor_parallel, scheduler and offload sections), so that each file reads in one
// sitting. Nothing outside csrc/zeroshard/config/ includes it.

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "zeroshard/config/config.h"
#include "zeroshard/config/config_keys.h"
#include "zeroshard/config/config_reader.h"
#include "zeroshard/config/json_input.h"

namespace zeroshard::detail {

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

inline std::string join(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

// A value as a person should see it in a message: its JSON text, with the type named where the
// text alone would not say it, and cut short if long.
inline std::string describe(const Json& value) {
  const std::string text = shortText(value.dump(), 60);
  if (value.is_string()) return "string " + text;
  if (value.is_boolean()) return "boolean " + text;
  if (value.is_object()) return "object " + text;
  if (value.is_array()) return "array " + text;
  return text;
}

inline const Json* member(const Json& object, const std::string& key) {
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
    // The source is the caller's path; `what` may quote the parser's last bytes.
    throw ConfigError(validUtf8(configMessagePrefix(config_.source) + what));
  }

  Json parse(const std::string& text) const;

  // Unknown keys are errors; DeepSpeed keys zeroshard does not implement become warnings.
  void checkKeys(const Json& object, const std::string& writtenPath, const ConfigSection& section);

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
  void readCompile(const Json& o, const std::string& path);
  void readSchedulerParam(const Json& value, const std::string& path, const SchedulerParamSpec& spec);
  void readOffload(const Json& o, const std::string& path, OffloadConfig& offload);
  void readShardGroupSize(const Json& o, const std::string& path, const char* key);
  void readChoice(const Json& o, const std::string& path, const char* key, const std::vector<std::string>& choices,
                  std::string& out);
  void readFp16(const Json& o, const std::string& path);
  void readOptimizer(const Json& o, const std::string& path);
  void readOptimizerParams(const Json& o, const std::string& path);
  void readZero(const Json& o, const std::string& path);

  Config config_;
};

}  // namespace zeroshard::detail
