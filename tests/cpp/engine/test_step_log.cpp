// StepLog (csrc/zeroshard/step_log.*): which boundaries print, the line's text, and the
// per-boundary means of an interval (communication from the communicator's wait counter).
#include "catch.h"

#include "zeroshard/engine/step_log.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

using zeroshard::StepLog;
using zeroshard::StepLogLine;
using zeroshard::StepPhase;
using zeroshard::TimedPhase;

TEST_CASE("the step log line holds the lrs exactly and the breakdown when asked", "[step_log]") {
  StepLogLine line;
  line.step = 20;
  line.skipped = 1;
  line.lrs = {0.1, 2e-05};
  line.lossScale = 65536;
  line.loss = 2.3125;
  line.samplesPerSecond = 1843.25;
  CHECK(zeroshard::formatStepLogLine(line) ==
        "step=20, skipped=1, lr=[0.1, 2e-05], loss_scale=65536, loss=2.3125, samples/s=1843.2");
  line.breakdown = StepLogLine::Breakdown{1.5, 2.25, 0.125, 3};
  line.loss.reset();
  CHECK(zeroshard::formatStepLogLine(line) ==
        "step=20, skipped=1, lr=[0.1, 2e-05], loss_scale=65536, samples/s=1843.2, forward_ms=1.500, "
        "backward_ms=2.250, step_ms=0.125, comm_ms=3.000");
}

TEST_CASE("rank 0 prints every steps_per_print boundaries with the interval's means", "[step_log]") {
  int64_t commNanos = 1000000;
  int syncs = 0;
  StepLog log(true, 2, true, [&] { return commNanos; }, [&] { ++syncs; });
  std::vector<std::string> lines;
  log.setSink([&](const std::string& line) { lines.push_back(line); });
  for (int64_t boundary = 1; boundary <= 4; ++boundary) {
    {
      const TimedPhase backward(log, StepPhase::kBackward);
      const TimedPhase nested(log, StepPhase::kBackward);  // counted once
      commNanos += 3000000;                                // 3 ms waiting per boundary
    }
    log.end(StepPhase::kForward);  // without its begin: ignored
    const bool prints = log.boundary(boundary);
    CHECK(prints == (boundary % 2 == 0));
    if (prints) log.print(StepLogLine{boundary, 0, {0.5}, 1, 1.0, 0, {}}, 8);
  }
  REQUIRE(lines.size() == 2);
  CHECK(lines[0].rfind("step=2, skipped=0, lr=[0.5], loss_scale=1, loss=1, samples/s=", 0) == 0);
  CHECK(lines[1].rfind("step=4, ", 0) == 0);
  // Two boundaries per interval, 6 ms of waits in each: 3 ms per boundary; nothing forward.
  for (const auto& line : lines) {
    CHECK(line.find("forward_ms=0.000, backward_ms=") != std::string::npos);
    CHECK(line.find(", comm_ms=3.000") != std::string::npos);
  }
  CHECK(syncs == 8);  // each outer backward: at its start and its end
}

TEST_CASE("other ranks and steps_per_print 0 neither time nor print", "[step_log]") {
  int calls = 0;
  for (const auto& [prints, every] : {std::pair{false, int64_t{2}}, std::pair{true, int64_t{0}}}) {
    StepLog log(prints, every, true, [&] { return ++calls, int64_t{0}; }, [&] { ++calls; });
    log.setSink([&](const std::string&) { ++calls; });
    log.begin(StepPhase::kStep);
    log.end(StepPhase::kStep);
    CHECK_FALSE(log.boundary(2));
    CHECK_FALSE(log.prints());
  }
  CHECK(calls == 0);
}

TEST_CASE("a phase left by an exception is cancelled, untimed", "[step_log]") {
  int syncs = 0;
  StepLog log(true, 1, true, [] { return int64_t{0}; }, [&] { ++syncs; });
  std::vector<std::string> lines;
  log.setSink([&](const std::string& line) { lines.push_back(line); });
  CHECK_THROWS_AS(([&] {
                    const TimedPhase step(log, StepPhase::kStep);
                    throw std::runtime_error("step failed");
                  }()),
                  std::runtime_error);
  CHECK(syncs == 1);  // the start only
  // The next phase is timed again (the depth went back to 0).
  { const TimedPhase step(log, StepPhase::kStep); }
  CHECK(syncs == 3);
}
