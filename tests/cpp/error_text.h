// The message of the c10::Error that `f` throws ("" when it returns): tests match on it without
// Catch2's matchers, which v2 and v3 spell differently.
#pragma once

#include <c10/util/Exception.h>

#include <functional>
#include <string>

namespace zeroshard::testing {

inline std::string errorText(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

} // namespace zeroshard::testing
