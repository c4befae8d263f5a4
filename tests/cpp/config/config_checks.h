#pragma once

// What the config tests check messages with (test_config.cpp, test_config_deepspeed.cpp).

#include <string>

#include "zeroshard/config/config.h"

namespace zeroshard::testing {

// The message of the ConfigError that reading `json` throws, or a note that none was thrown.
inline std::string errorOf(const std::string& json) {
  try {
    Config::fromJsonString(json, "test.json");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "<no ConfigError for " + json + ">";
}

// "" when `message` contains `part`; otherwise both, so that a failing REQUIRE shows them.
inline std::string missing(const std::string& message, const std::string& part) {
  if (message.find(part) != std::string::npos) return "";
  return "\"" + part + "\" is not in: " + message;
}

inline bool hasWarningFor(const Config& config, const std::string& path) {
  for (const std::string& w : config.warnings) {
    if (w.find("\"" + path + "\" is a DeepSpeed key zeroshard does not implement yet") == 0) return true;
  }
  return false;
}

}  // namespace zeroshard::testing
