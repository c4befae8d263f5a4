// The engine's progress line: DeepSpeed's steps_per_print and wall_clock_breakdown.
//
// Rank 0 prints one line every steps_per_print accumulation boundaries (DeepSpeed's
// global_steps: optimizer steps taken plus fp16 steps skipped), after that boundary's step and
// schedule step, so `lr` is what the next optimizer step uses, as in DeepSpeed's line:
//
//   step=20, skipped=0, lr=[0.001, 0.0002], loss_scale=1, loss=2.3126, samples/s=1843.2
//
// loss is the last micro-batch's loss as given to backward() (read from the device only on
// print steps); samples/s is train_batch_size over the mean seconds per boundary since the
// last print (from the first forward or backward after it). With wall_clock_breakdown the line
// adds the mean milliseconds per boundary of forward (beginForward/endForward), backward
// (engine.backward), step (engine.step at the boundary) and comm (host time blocked waiting on
// collectives, counted inside the other three): ", forward_ms=.., backward_ms=.., step_ms=..,
// comm_ms=..". On a GPU each timed phase then ends (and starts) with a device synchronisation,
// as DeepSpeed's wall-clock timers do, so that the device's work is counted where it is queued.
// Other ranks, and steps_per_print 0, time and print nothing.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace zeroshard {

enum class StepPhase { kForward = 0, kBackward, kStep };

// One printed line's values; the breakdown (milliseconds per boundary) only with
// wall_clock_breakdown.
struct StepLogLine {
  int64_t step = 0;
  int64_t skipped = 0;
  std::vector<double> lrs;
  double lossScale = 1;
  std::optional<double> loss;  // none before any backward
  double samplesPerSecond = 0;
  struct Breakdown {
    double forwardMs = 0, backwardMs = 0, stepMs = 0, commMs = 0;
  };
  std::optional<Breakdown> breakdown;
};

// The line's text, without a prefix (the lrs and loss scale in the shortest form that reads
// back to the same double).
std::string formatStepLogLine(const StepLogLine& line);

class StepLog {
 public:
  using Sink = std::function<void(const std::string& line)>;
  // `prints`: this rank prints (rank 0). `commNanos`: the communicator's running total of host
  // time blocked in waits. `syncDevice`: waits for the device (empty on CPU), used at the edges
  // of timed phases with wall_clock_breakdown only.
  StepLog(bool prints, int64_t stepsPerPrint, bool wallClockBreakdown, std::function<int64_t()> commNanos,
          std::function<void()> syncDevice);

  bool prints() const { return prints_; }
  // Where lines go; an empty function restores the default: stdout, "zeroshard: " prefixed.
  void setSink(Sink sink);

  // Phases nest (an inner begin/end of the same phase is not counted twice); an end() without
  // its begin() is ignored. Not blocking, except for the device synchronisation above.
  void begin(StepPhase phase);
  void end(StepPhase phase);

  // Called once per accumulation boundary with the boundaries passed so far; true when this one
  // prints, and the caller then calls print() with the line's values (its timing fields are
  // filled in here).
  bool boundary(int64_t boundaries);
  void print(StepLogLine line, int64_t trainBatchSize);
  // Closes a phase left by an exception: not timed, no device synchronisation.
  void cancel(StepPhase phase);

 private:
  using Clock = std::chrono::steady_clock;
  void startInterval();

  bool prints_;
  int64_t stepsPerPrint_;
  bool breakdown_;
  std::function<int64_t()> commNanos_;
  std::function<void()> syncDevice_;
  Sink sink_;

  std::optional<Clock::time_point> intervalStart_;  // none until the first phase after a print
  int64_t intervalCommNanos_ = 0;                   // commNanos_() at the interval's start
  int64_t intervalBoundaries_ = 0;
  std::array<int64_t, 3> phaseNanos_{};
  std::array<Clock::time_point, 3> phaseStart_{};
  std::array<int, 3> phaseDepth_{};
};

// begin(phase) for its lifetime; an exception leaving the scope cancels the phase instead.
class TimedPhase {
 public:
  TimedPhase(StepLog& log, StepPhase phase) : log_(log), phase_(phase), exceptions_(std::uncaught_exceptions()) {
    log_.begin(phase_);
  }
  ~TimedPhase() noexcept(false) {
    if (std::uncaught_exceptions() > exceptions_) {
      log_.cancel(phase_);
    } else {
      log_.end(phase_);
    }
  }
  TimedPhase(const TimedPhase&) = delete;
  TimedPhase& operator=(const TimedPhase&) = delete;

 private:
  StepLog& log_;
  StepPhase phase_;
  int exceptions_;
};

} // namespace zeroshard
