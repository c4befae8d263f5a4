#pragma once

// Internal to config.cpp: the keys each object of a config may hold, and the message for a key
// that is not one of them. Kept apart from the reader so that the tables read as a list.

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace zeroshard::detail {

// One JSON object of the config ("" is the top level, else a dotted path such as
// "optimizer.params").
struct ConfigSection {
  std::string_view path;
  std::vector<std::string_view> readKeys;     // zeroshard reads and validates these
  std::vector<std::string_view> ignoredKeys;  // DeepSpeed keys zeroshard ignores with a warning
  // DeepSpeed keys accepted without effect, any value: they tune a feature that another key of
  // the section switches off (offload with device "none", tensor parallelism of size 1), in
  // zeroshard as in DeepSpeed. The reader warns or fails on the switch, not on these.
  std::vector<std::string_view> inertKeys = {};

  bool reads(std::string_view key) const;
  bool ignores(std::string_view key) const;
  bool inert(std::string_view key) const;
};

// The section at `path`; `path` must be one of the sections the reader descends into.
const ConfigSection& configSection(std::string_view path);
// Every section the reader descends into (tests/python/test_config.py holds each key to an
// effect or a warning).
const std::vector<ConfigSection>& configSections();

// One parameter of a DeepSpeed scheduler type (deepspeed/runtime/lr_schedules.py: the keyword
// arguments of the class "scheduler.type" names, which DeepSpeed calls with "scheduler.params").
struct SchedulerParamSpec {
  enum class Kind {
    Number,      // a finite number >= 0
    Steps,       // a whole number >= 0 (a step count or size)
    Bool,        // true or false
    WarmupType,  // "log" or "linear"
    Iteration,   // last_batch_iteration: a whole number >= -1
  };
  std::string_view key;
  Kind kind;
  std::optional<double> defaultValue;  // none: required (or, with nullable, None)
  bool nullable = false;               // null is DeepSpeed's None: "same as the first"
};

// The five types DeepSpeed implements, in its documentation's order.
const std::vector<std::string_view>& schedulerTypes();
// The parameters of `type`, or nullptr when it is not one of schedulerTypes().
const std::vector<SchedulerParamSpec>* schedulerParams(std::string_view type);

// Whether `key` (not a key of `section`) is a near miss of one of its keys: a typo to report.
bool isNearMiss(const ConfigSection& section, const std::string& key);
// The warning for a top-level key that is neither a DeepSpeed key nor a zeroshard one.
std::string unknownTopLevelMessage(const ConfigSection& section, const std::string& key);

// Optimal string alignment distance: Levenshtein plus adjacent transpositions, so "stgae" is one
// edit from "stage", as a person counts it.
size_t editDistance(std::string_view a, std::string_view b);

// The message for `key` found in `section` (written at `writtenPath`, which differs from
// section.path only for the alias "bfloat16"), without the "zeroshard config (...)" prefix:
// the full key path, then the closest known key at that level when one is close enough, else
// the section where that exact key belongs, else the keys this section takes.
std::string unknownKeyMessage(const ConfigSection& section, const std::string& writtenPath,
                              const std::string& key);

}  // namespace zeroshard::detail
