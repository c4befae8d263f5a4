// Progress (csrc/zeroshard/progress.*): what the line says, how often it is redrawn, that it is
// always ended, and that nothing is drawn (or timed) where no one watches.
#include "catch.h"

#include "zeroshard/checkpoint/progress.h"

#include <unistd.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

using zeroshard::Progress;
using zeroshard::ProgressClock;
using zeroshard::ProgressOutput;

namespace {

using std::chrono::milliseconds;

// A terminal that keeps every write, and a clock the test moves by hand.
struct FakeTerminal {
  std::vector<std::string> writes;
  ProgressClock::time_point now{};
  int clockReads = 0;

  ProgressOutput output() {
    return {[this](const std::string& text) { writes.push_back(text); },
            [this] {
              ++clockReads;
              return now;
            }};
  }
  std::string all() const {
    std::string out;
    for (const auto& w : writes) out += w;
    return out;
  }
};

} // namespace

TEST_CASE("a quick operation shows only its final line, ended by a newline", "[progress]") {
  FakeTerminal term;
  Progress progress("save 'global_step8'", 3, "tensors", term.output());
  for (int i = 0; i < 3; ++i) {
    term.now += milliseconds(10);
    progress.advance(40'000'000);
  }
  CHECK(term.writes.empty());
  progress.finish();
  REQUIRE(term.writes.size() == 1);
  CHECK(term.writes[0] == "\rzeroshard save 'global_step8': 3/3 tensors, 120 MB, 0.0 s\n");
  progress.finish();  // once
  progress.stop();    // the line is already ended
  CHECK(term.writes.size() == 1);
}

TEST_CASE("a long operation redraws at most once per kProgressRedraw", "[progress]") {
  FakeTerminal term;
  Progress progress("load '/runs/ckpt'", 1000, "tensors", term.output());
  // 1000 tensors over 2 s, one every 2 ms: 20 redraws of the interval's length, not 1000.
  for (int i = 0; i < 1000; ++i) {
    term.now += milliseconds(2);
    progress.advance(1500);
  }
  CHECK(term.writes.size() == 20);
  CHECK(term.writes[9] == "\rzeroshard load '/runs/ckpt': 500/1000 tensors, 750 KB, 1.0 s");
  for (const auto& w : term.writes) CHECK(w.find('\n') == std::string::npos);
  progress.finish();
  CHECK(term.writes.back() == "\rzeroshard load '/runs/ckpt': 1000/1000 tensors, 1.5 MB, 2.0 s\n");
}

TEST_CASE("a shorter line blanks what is left of the longer one it replaces", "[progress]") {
  FakeTerminal term;
  Progress progress("convert 'x'", 2, "tensors", term.output());
  term.now += milliseconds(100);
  progress.advance(9'900);  // "9.9 KB"
  term.now += milliseconds(100);
  progress.advance(100);  // "10 KB": one character shorter
  progress.finish();
  REQUIRE(term.writes.size() == 3);
  CHECK(term.writes[0] == "\rzeroshard convert 'x': 1/2 tensors, 9.9 KB, 0.1 s");
  CHECK(term.writes[1] == "\rzeroshard convert 'x': 2/2 tensors, 10 KB, 0.2 s ");
  CHECK(term.writes[2] == "\rzeroshard convert 'x': 2/2 tensors, 10 KB, 0.2 s\n");
}

TEST_CASE("an operation that fails leaves its line ended, so the error starts on its own", "[progress]") {
  FakeTerminal term;
  try {
    Progress progress("load_pretrained 'model.safetensors'", 4, "tensors", term.output());
    term.now += milliseconds(150);
    progress.advance(10);
    throw std::runtime_error("a file changed while being read");
  } catch (const std::runtime_error&) {
  }
  CHECK(term.all() == "\rzeroshard load_pretrained 'model.safetensors': 1/4 tensors, 10 B, 0.1 s\n");
}

TEST_CASE("where no one watches, nothing is drawn and the clock is not read", "[progress]") {
  FakeTerminal term;
  {
    ProgressOutput hidden = term.output();
    hidden.write = nullptr;  // no one watches: the clock alone is not reason enough to draw
    Progress progress("save 't'", 2, "tensors", std::move(hidden));
    progress.advance(1);
    term.now += milliseconds(500);
    progress.advance(1);
    progress.finish();
  }
  CHECK(term.clockReads == 0);
  CHECK(term.writes.empty());
  // The terminal's own rule: other ranks never; rank 0 only when stderr is a terminal.
  CHECK_FALSE(zeroshard::terminalProgress(1).shown());
  CHECK_FALSE(zeroshard::terminalProgress(3).shown());
  CHECK(zeroshard::terminalProgress(0).shown() == (::isatty(STDERR_FILENO) == 1));
}

TEST_CASE("bytes read as the docs count them", "[progress]") {
  using zeroshard::progressBytes;
  CHECK(progressBytes(0) == "0 B");
  CHECK(progressBytes(999) == "999 B");
  CHECK(progressBytes(1500) == "1.5 KB");
  CHECK(progressBytes(120'000'000) == "120 MB");
  CHECK(progressBytes(1'400'000'000) == "1.4 GB");
  CHECK(progressBytes(16'000'000'000'000) == "16 TB");
}
