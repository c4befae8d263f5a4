// Progress of a long operation (save_checkpoint, load_checkpoint, load_pretrained, convert) as
// one line of stderr that updates in place, for the person watching a terminal:
//
//   zeroshard save 'global_step8': 30/36 tensors, 120 MB, 2.4 s
//
// Note [progress where a person watches]: it is drawn on rank 0 only (every rank would draw the
// same line over the others) and only when stderr is a terminal (isatty): a log file, a pipe or
// a CI run gets no byte of it. Redraws are rate-limited by a steady clock (at most one per
// kProgressRedraw) so a loop of many small tensors costs nothing, and the clock is not even read
// when nothing is shown. The counts and bytes are rank 0's share of the work.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace zeroshard {

using ProgressClock = std::chrono::steady_clock;
constexpr ProgressClock::duration kProgressRedraw = std::chrono::milliseconds(100);

// Where a Progress draws: `write` takes its text ("\r" and a line for a redraw, "\n" to end it),
// `now` tells the time. Empty, the default: nothing is drawn and the clock is never read.
struct ProgressOutput {
  std::function<void(const std::string&)> write;
  std::function<ProgressClock::time_point()> now;

  bool shown() const { return static_cast<bool>(write); }
};

// stderr and the steady clock for rank 0 when stderr is a terminal; empty otherwise.
ProgressOutput terminalProgress(int rank);

// "0 B", "512 B", "1.5 KB", "120 MB", "1.4 GB" (powers of 1000, as the docs count bytes).
std::string progressBytes(int64_t bytes);

// One operation's line. Not thread-safe: advanced by the loop that does the work.
class Progress {
 public:
  // `title` names the operation and what it works on ("save 'global_step8'"); `total` items of
  // `unit` ("tensors") are expected. Draws nothing yet.
  Progress(std::string title, int64_t total, std::string unit, ProgressOutput output);
  ~Progress();  // stop()
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // One item done, `bytes` more moved. Redraws when kProgressRedraw has passed since the start
  // or the last redraw (so an operation quicker than that shows only its final line).
  void advance(int64_t bytes);
  // Draws the final line and ends it with a newline. Once; later calls do nothing.
  void finish();
  // Ends a line left open (the operation failed: an error message then starts on its own
  // line), drawing nothing more. Does nothing when no line is open.
  void stop();

 private:
  void draw(ProgressClock::time_point now, bool last);

  std::string title_;
  int64_t total_;
  std::string unit_;
  ProgressOutput output_;
  int64_t done_ = 0;
  int64_t bytes_ = 0;
  ProgressClock::time_point start_{};
  ProgressClock::time_point lastDraw_{};
  size_t drawnWidth_ = 0;  // of the line on screen, to blank a longer one it replaces
  bool open_ = false;      // a line is drawn and not yet ended
  bool finished_ = false;
};

} // namespace zeroshard
