#include "zeroshard/checkpoint/progress.h"

#include <unistd.h>

#include <cstdio>
#include <utility>

namespace zeroshard {

ProgressOutput terminalProgress(int rank) {
  if (rank != 0 || ::isatty(STDERR_FILENO) != 1) return {};
  return {[](const std::string& text) {
            std::fwrite(text.data(), 1, text.size(), stderr);
            std::fflush(stderr);
          },
          [] { return ProgressClock::now(); }};
}

std::string progressBytes(int64_t bytes) {
  static constexpr const char* kUnits[] = {"KB", "MB", "GB", "TB"};
  if (bytes < 1000) return std::to_string(bytes) + " B";
  double value = static_cast<double>(bytes);
  const char* unit = "B";
  for (const char* u : kUnits) {
    if (value < 1000) break;
    value /= 1000;
    unit = u;
  }
  char text[32];
  std::snprintf(text, sizeof(text), value < 10 ? "%.1f %s" : "%.0f %s", value, unit);
  return text;
}

Progress::Progress(std::string title, int64_t total, std::string unit, ProgressOutput output)
    : title_(std::move(title)), total_(total), unit_(std::move(unit)), output_(std::move(output)) {
  if (output_.shown()) start_ = lastDraw_ = output_.now();
}

Progress::~Progress() {
  try {
    stop();
  } catch (...) {  // a failed write to stderr is no reason to end the program
  }
}

void Progress::advance(int64_t bytes) {
  ++done_;
  bytes_ += bytes;
  if (!output_.shown() || finished_) return;
  const auto now = output_.now();
  if (now - lastDraw_ >= kProgressRedraw) draw(now, false);
}

void Progress::finish() {
  if (!output_.shown() || finished_) return;
  draw(output_.now(), true);
  finished_ = true;
}

void Progress::stop() {
  if (!open_) return;
  open_ = false;
  finished_ = true;
  output_.write("\n");
}

void Progress::draw(ProgressClock::time_point now, bool last) {
  char seconds[32];
  std::snprintf(seconds, sizeof(seconds), "%.1f s",
                std::chrono::duration<double>(now - start_).count());
  std::string line = "zeroshard " + title_ + ": " + std::to_string(done_) + "/" + std::to_string(total_) + " " +
                     unit_ + ", " + progressBytes(bytes_) + ", " + seconds;
  const size_t width = line.size();
  if (width < drawnWidth_) line.append(drawnWidth_ - width, ' ');
  output_.write("\r" + line + (last ? "\n" : ""));
  drawnWidth_ = width;
  lastDraw_ = now;
  open_ = !last;
}

} // namespace zeroshard
