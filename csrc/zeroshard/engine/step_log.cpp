#include "zeroshard/engine/step_log.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <utility>

namespace zeroshard {
namespace {

// The shortest text that reads back as the same double (Python's repr does the same).
std::string shortest(double v) {
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), v);
  return std::string(buffer, result.ptr);
}

std::string fixed(double v, int digits) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.*f", digits, v);
  return buffer;
}

void printToStdout(const std::string& line) {
  std::fprintf(stdout, "zeroshard: %s\n", line.c_str());
  std::fflush(stdout);
}

} // namespace

std::string formatStepLogLine(const StepLogLine& line) {
  std::string out = "step=" + std::to_string(line.step) + ", skipped=" + std::to_string(line.skipped) + ", lr=[";
  for (size_t g = 0; g < line.lrs.size(); ++g) out += (g ? ", " : "") + shortest(line.lrs[g]);
  out += "], loss_scale=" + shortest(line.lossScale);
  if (line.loss) {
    char loss[64];
    std::snprintf(loss, sizeof(loss), "%.6g", *line.loss);
    out += std::string(", loss=") + loss;
  }
  out += ", samples/s=" + fixed(line.samplesPerSecond, 1);
  if (const auto& b = line.breakdown) {
    out += ", forward_ms=" + fixed(b->forwardMs, 3) + ", backward_ms=" + fixed(b->backwardMs, 3) +
           ", step_ms=" + fixed(b->stepMs, 3) + ", comm_ms=" + fixed(b->commMs, 3);
  }
  return out;
}

StepLog::StepLog(bool prints, int64_t stepsPerPrint, bool wallClockBreakdown, std::function<int64_t()> commNanos,
                 std::function<void()> syncDevice)
    : prints_(prints && stepsPerPrint > 0),
      stepsPerPrint_(stepsPerPrint),
      breakdown_(wallClockBreakdown),
      commNanos_(std::move(commNanos)),
      syncDevice_(std::move(syncDevice)),
      sink_(printToStdout) {}

void StepLog::setSink(Sink sink) {
  sink_ = sink ? std::move(sink) : Sink(printToStdout);
}

void StepLog::startInterval() {
  intervalStart_ = Clock::now();
  intervalCommNanos_ = commNanos_ ? commNanos_() : 0;
}

void StepLog::begin(StepPhase phase) {
  if (!prints_) return;
  if (!intervalStart_) startInterval();
  const auto i = static_cast<size_t>(phase);
  if (phaseDepth_[i]++ > 0 || !breakdown_) return;
  if (syncDevice_) syncDevice_();
  phaseStart_[i] = Clock::now();
}

void StepLog::end(StepPhase phase) {
  if (!prints_) return;
  const auto i = static_cast<size_t>(phase);
  if (phaseDepth_[i] == 0 || --phaseDepth_[i] > 0 || !breakdown_) return;
  if (syncDevice_) syncDevice_();
  phaseNanos_[i] += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - phaseStart_[i]).count();
}

void StepLog::cancel(StepPhase phase) {
  auto& depth = phaseDepth_[static_cast<size_t>(phase)];
  if (depth > 0) --depth;
}

bool StepLog::boundary(int64_t boundaries) {
  if (!prints_) return false;
  ++intervalBoundaries_;
  return boundaries % stepsPerPrint_ == 0;
}

void StepLog::print(StepLogLine line, int64_t trainBatchSize) {
  if (!prints_) return;
  const auto now = Clock::now();
  const double n = static_cast<double>(std::max<int64_t>(1, intervalBoundaries_));
  const double seconds = intervalStart_ ? std::chrono::duration<double>(now - *intervalStart_).count() : 0.0;
  line.samplesPerSecond = seconds > 0 ? static_cast<double>(trainBatchSize) * n / seconds : 0.0;
  if (breakdown_) {
    auto perBoundaryMs = [n](int64_t nanos) { return static_cast<double>(nanos) / 1e6 / n; };
    const int64_t comm = (commNanos_ ? commNanos_() : 0) - intervalCommNanos_;
    line.breakdown = StepLogLine::Breakdown{perBoundaryMs(phaseNanos_[0]), perBoundaryMs(phaseNanos_[1]),
                                            perBoundaryMs(phaseNanos_[2]), perBoundaryMs(comm)};
  }
  intervalStart_.reset();
  intervalBoundaries_ = 0;
  phaseNanos_ = {};
  sink_(formatStepLogLine(line));
}

} // namespace zeroshard
