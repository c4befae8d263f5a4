// AccumulationWindow (csrc/zeroshard/optim/accumulation_window.h): which micro-step ends a window,
// counted or forced, and the counts it keeps. The engine acting on it: test_engine_accumulation.cpp.
#include "catch.h"

#include "zeroshard/optim/accumulation_window.h"

#include <optional>
#include <vector>

using zeroshard::AccumulationWindow;

namespace {

// Runs one micro-step per entry (the override set before its backward: nullopt clears it);
// returns which ended a window.
std::vector<bool> run(AccumulationWindow& window, const std::vector<std::optional<bool>>& overrides) {
  std::vector<bool> ended;
  for (const auto& value : overrides) {
    window.setOverride(value);
    window.recordBackward(window.isBoundary());
    ended.push_back(window.finishMicroStep());
  }
  return ended;
}

} // namespace

TEST_CASE("without an override a window ends every gradient_accumulation_steps micro-steps", "[accumulation]") {
  AccumulationWindow window(3);
  CHECK(run(window, std::vector<std::optional<bool>>(7)) ==
        std::vector<bool>{false, false, true, false, false, true, false});
  CHECK(window.microSteps() == 7);
  CHECK(window.boundaries() == 2);
  CHECK(window.inWindow() == 1);
  CHECK_FALSE(window.betweenWindows());
}

TEST_CASE("a window forced short restarts the count: windows of 4, 2 and 4 are three boundaries",
          "[accumulation]") {
  AccumulationWindow window(4);
  const std::optional<bool> count;
  // The Trainer's pattern: the override on every micro-step, true at the end of each window.
  const std::vector<std::optional<bool>> forced = {false, false, false, true, false, true, false, false, false, true};
  CHECK(run(window, forced) == std::vector<bool>{false, false, false, true, false, true, false, false, false, true});
  CHECK(window.boundaries() == 3);
  CHECK(window.microSteps() == 10);
  CHECK(window.betweenWindows());
  // Counting again after the short window: a whole window of 4 before the next boundary.
  AccumulationWindow counted(4);
  const std::vector<std::optional<bool>> mixed = {count, count, count, count, false, true, count, count, count, count};
  CHECK(run(counted, mixed) == std::vector<bool>{false, false, false, true, false, true, false, false, false, true});
  CHECK(counted.boundaries() == 3);
}

TEST_CASE("an override of false at the natural boundary keeps accumulating until it is cleared",
          "[accumulation]") {
  AccumulationWindow window(2);
  CHECK(run(window, {std::nullopt, false, false}) == std::vector<bool>{false, false, false});
  CHECK(window.inWindow() == 3);
  CHECK(window.override() == std::optional<bool>(false));  // it stays until set again
  window.recordBackward(window.isBoundary());
  CHECK_FALSE(window.finishMicroStep());
  // Cleared: the window is past its length, so the next micro-step ends it.
  CHECK(run(window, {std::nullopt, std::nullopt, std::nullopt}) == std::vector<bool>{true, false, true});
  CHECK(window.boundaries() == 2);
}

TEST_CASE("the step follows the decision its backward took, not an override set after it", "[accumulation]") {
  AccumulationWindow window(4);
  window.recordBackward(window.isBoundary());  // false: 1 of 4
  window.setOverride(true);
  CHECK_FALSE(window.isBoundary());  // this micro-step's decision stands
  CHECK(window.awaitingStep());
  CHECK_FALSE(window.finishMicroStep());
  CHECK(window.isBoundary());  // the next one takes the override
  window.recordBackward(window.isBoundary());
  window.setOverride(false);
  CHECK(window.finishMicroStep());
  CHECK(window.boundaries() == 1);
}

TEST_CASE("a step without a backward is an error, and restore() leaves no window open", "[accumulation]") {
  AccumulationWindow window(4);
  CHECK_THROWS_WITH(window.finishMicroStep(), Catch::Contains("engine.step() called without engine.backward()"));
  CHECK_THROWS_WITH(AccumulationWindow(0), Catch::Contains("gradient_accumulation_steps must be at least 1, got 0"));
  run(window, {false, true, std::nullopt});
  window.setOverride(true);
  window.restore(5);
  CHECK(window.boundaries() == 5);
  CHECK(window.microSteps() == 20);
  CHECK(window.betweenWindows());
  CHECK(window.override() == std::optional<bool>(true));
}
