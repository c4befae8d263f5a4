// Where an engine is in its gradient accumulation: which micro-step ends a window (the
// accumulation boundary, where the optimizer steps) and the counts DeepSpeed reports.
//
// Note [accumulation boundary]: a window ends once it has gradient_accumulation_steps
// micro-steps, unless an override decides (DeepSpeed's set_gradient_accumulation_boundary):
// while one is set it says, for every micro-step until it is set again, whether that
// micro-step ends the window; none returns to counting. The Hugging Face Trainer (through
// accelerate) sets it on every micro-step, and ends the last window of an epoch early when the
// epoch's batches do not divide by the accumulation steps. The count restarts at every
// boundary, forced or counted, so the windows after a short one are whole again.
//
// The decision is taken once per micro-step, at its backward: the backward reduces the
// gradients for the boundary (stages 0 and 1 reduce only then) or keeps accumulating them, and
// step() acts on that decision, never on a later one. An override set between a backward and
// its step applies from the next micro-step.
#pragma once

#include <cstdint>
#include <optional>

namespace zeroshard {

class AccumulationWindow {
 public:
  // `steps`: gradient_accumulation_steps (at least 1).
  explicit AccumulationWindow(int64_t steps);

  // Whether the micro-step whose backward comes next ends the window; between a backward and
  // its step, the decision that backward took.
  bool isBoundary() const;
  void setOverride(std::optional<bool> boundary) { override_ = boundary; }
  std::optional<bool> override() const { return override_; }

  // A backward completed with decision `boundary` (isBoundary() when it began).
  void recordBackward(bool boundary);
  // Whether a backward is waiting for its step.
  bool awaitingStep() const { return decided_.has_value(); }
  // The step of the micro-step whose backward ran: counts it and, when its backward decided so,
  // ends the window. Returns that decision. Throws without a backward since the last step.
  bool finishMicroStep();

  // step() calls since the start (DeepSpeed's micro_steps).
  int64_t microSteps() const { return microSteps_; }
  // Windows ended (DeepSpeed's global_steps: optimizer steps taken plus those skipped).
  int64_t boundaries() const { return boundaries_; }
  // Micro-steps of the open window, stepped so far.
  int64_t inWindow() const { return inWindow_; }
  // No window open and no backward waiting: where checkpoints are taken.
  bool betweenWindows() const { return inWindow_ == 0 && !decided_; }
  // After a checkpoint load: `boundaries` windows ended, none open. micro steps become
  // boundaries x steps, as if every window had been whole. The override is kept.
  void restore(int64_t boundaries);

 private:
  int64_t steps_;
  std::optional<bool> override_;
  std::optional<bool> decided_;  // the current micro-step's decision, from its backward to its step
  int64_t microSteps_ = 0;
  int64_t boundaries_ = 0;
  int64_t inWindow_ = 0;
};

} // namespace zeroshard
