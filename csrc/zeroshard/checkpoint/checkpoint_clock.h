// Checkpoints on a clock (zeroshard.checkpoint.every_minutes and .dir): rank 0's clock decides,
// at an optimizer step's boundary, and every rank learns its decision from one broadcast, so
// the ranks never disagree on whether to save (their clocks may).
#pragma once

#include <c10/core/Device.h>

#include <functional>

namespace zeroshard {

class Communicator;

class CheckpointClock {
 public:
  // `everyMinutes` <= 0: never due. Counts from now.
  explicit CheckpointClock(double everyMinutes);

  // Whether this boundary is the first at least everyMinutes after the last save (or the
  // start) by rank 0's clock. Collective over `world` (every rank calls it at the same boundary
  // and gets rank 0's answer; uncounted); `device` is where the flag goes when the group has no
  // CPU backend. False, without a collective, when the clock is off.
  bool due(Communicator& world, at::Device device) const;
  // A checkpoint was saved now: the next is due everyMinutes from here.
  void saved() { lastSaveMinutes_ = now_(); }
  // Replaces the clock (minutes, any origin; for tests) and counts from its now.
  void setClock(std::function<double()> minutesNow);
  // Whether the engine's step saves by itself when due (the Python layer saves itself, after
  // its scheduler step).
  bool savesOnStep() const { return savesOnStep_; }
  void setSavesOnStep(bool on) { savesOnStep_ = on; }

 private:
  static double steadyMinutes();

  double everyMinutes_;
  std::function<double()> now_ = &CheckpointClock::steadyMinutes;
  double lastSaveMinutes_ = steadyMinutes();
  bool savesOnStep_ = true;
};

} // namespace zeroshard
