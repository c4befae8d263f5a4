// LossScaler (csrc/zeroshard/optim/loss_scaler.*) as a state machine: DeepSpeed's dynamic loss
// scaling (runtime/fp16/loss_scaler.py, DynamicLossScaler with consecutive_hysteresis=False,
// the scaler DeepSpeed's ZeRO optimizers use), static scales, and state()/restore().
//
// Note [reference scaler]: ReferenceScaler below is written from DeepSpeed's documented rules,
// in its own terms (the length of the current run of clean steps), not from loss_scaler.cpp:
//   - the scale starts at 2^initial_scale_power;
//   - an overflow either spends one unit of the hysteresis budget or, when one unit is left
//     (always, for hysteresis 1), halves the scale, never below min_loss_scale; it ends the
//     current run of clean steps;
//   - a clean step lengthens the run; when the run reaches a multiple of loss_scale_window the
//     scale doubles and the hysteresis budget is restored. Nothing else restores it
//     (consecutive_hysteresis=False: a clean step between two overflows does not).
// One deliberate difference from DeepSpeed: an overflow at min_loss_scale raises there
// (raise_error_at_min_scale) and stays at the floor here (docs/config.md: "never drops below").
#include "catch.h"

#include "zeroshard/config/config.h"
#include "zeroshard/optim/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

using zeroshard::Fp16Config;
using zeroshard::LossScaler;

namespace {

Fp16Config dynamicConfig(int64_t power, int64_t window, int64_t hysteresis, double minScale) {
  Fp16Config c;
  c.enabled = true;
  c.lossScale = 0;
  c.initialScalePower = power;
  c.lossScaleWindow = window;
  c.hysteresis = hysteresis;
  c.minLossScale = minScale;
  return c;
}

std::string describe(const Fp16Config& c) {
  std::ostringstream out;
  out << "loss_scale " << c.lossScale << ", initial_scale_power " << c.initialScalePower << ", loss_scale_window "
      << c.lossScaleWindow << ", hysteresis " << c.hysteresis << ", min_loss_scale " << c.minLossScale;
  return out.str();
}

// Note [reference scaler].
class ReferenceScaler {
 public:
  explicit ReferenceScaler(const Fp16Config& c)
      : dynamic_(c.lossScale == 0),
        scale_(c.lossScale == 0 ? std::pow(2.0, static_cast<double>(c.initialScalePower)) : c.lossScale),
        minScale_(c.minLossScale),
        window_(c.lossScaleWindow),
        hysteresis_(c.hysteresis),
        budget_(c.hysteresis) {}

  void update(bool overflow) {
    if (!dynamic_) return;
    if (overflow) {
      cleanRun_ = 0;
      if (budget_ == 1) {
        scale_ = std::max(scale_ / 2, minScale_);
      } else {
        budget_ -= 1;
      }
      return;
    }
    cleanRun_ += 1;
    if (cleanRun_ % window_ == 0) {
      scale_ *= 2;
      budget_ = hysteresis_;
    }
  }
  double scale() const { return scale_; }
  int64_t budget() const { return budget_; }

 private:
  bool dynamic_;
  double scale_;
  double minScale_;
  int64_t window_;
  int64_t hysteresis_;
  int64_t budget_;
  int64_t cleanRun_ = 0;
};

// The scale after each update, for a sequence written as "C" (clean) and "O" (overflow).
std::vector<double> scalesAfter(LossScaler& scaler, const std::string& steps) {
  std::vector<double> out;
  for (char s : steps) {
    scaler.update(s == 'O');
    out.push_back(scaler.scale());
  }
  return out;
}

// Overflow sequences of two kinds. Bursts: clean runs of up to two windows, then up to
// hysteresis + 2 overflows in a row, which reach every branch even with a window of 1000.
std::vector<bool> burstySequence(std::mt19937& rng, size_t length, int64_t window, int64_t hysteresis) {
  std::uniform_int_distribution<int64_t> cleanRun(0, 2 * window + 1);
  std::uniform_int_distribution<int64_t> burst(1, hysteresis + 2);
  std::vector<bool> out;
  while (out.size() < length) {
    for (int64_t i = cleanRun(rng); i > 0 && out.size() < length; --i) out.push_back(false);
    for (int64_t i = burst(rng); i > 0 && out.size() < length; --i) out.push_back(true);
  }
  return out;
}

// Training-like: gradients overflow (mostly) when the scale is above a threshold that moves
// every 500 steps, rarely below it, so the scale rides that edge as it does in training and
// stays finite.
class EdgeRider {
 public:
  EdgeRider(uint32_t seed, int64_t window) : rng_(seed), rareOverflow_(std::min(0.01, 0.2 / window)) {}
  bool next(double scale) {
    if (step_++ % 500 == 0) threshold_ = std::uniform_int_distribution<int>(0, 24)(rng_);
    const double p = scale > std::ldexp(1.0, threshold_) ? 0.9 : rareOverflow_;
    return std::bernoulli_distribution(p)(rng_);
  }

 private:
  std::mt19937 rng_;
  double rareOverflow_;
  int threshold_ = 0;
  int64_t step_ = 0;
};

bool sameState(const LossScaler::State& a, const LossScaler::State& b) {
  return a.scale == b.scale && a.hysteresisLeft == b.hysteresisLeft && a.iteration == b.iteration &&
         a.lastOverflowIteration == b.lastOverflowIteration;
}

std::string describe(const LossScaler::State& s) {
  std::ostringstream out;
  out << "{scale " << s.scale << ", hysteresisLeft " << s.hysteresisLeft << ", iteration " << s.iteration
      << ", lastOverflowIteration " << s.lastOverflowIteration << "}";
  return out.str();
}

const Fp16Config kRandomConfigs[] = {
    dynamicConfig(16, 1000, 2, 1),  // DeepSpeed's defaults
    dynamicConfig(8, 1, 1, 1),      dynamicConfig(8, 1, 3, 1),     dynamicConfig(4, 2, 2, 1),
    dynamicConfig(10, 3, 1, 0.25),  dynamicConfig(0, 7, 5, 0.125), dynamicConfig(20, 50, 4, 1024),
    dynamicConfig(12, 13, 2, 3.0),
};

} // namespace

TEST_CASE("a dynamic scale starts at 2 to the initial_scale_power", "[loss_scaler]") {
  for (int64_t power : {0, 1, 8, 16, 32, 63}) {
    LossScaler scaler(dynamicConfig(power, 1000, 2, 1));
    INFO("initial_scale_power " << power);
    CHECK(scaler.scale() == std::ldexp(1.0, static_cast<int>(power)));
    const auto s = scaler.state();
    CHECK(s.scale == scaler.scale());
    CHECK(s.hysteresisLeft == 2);
    CHECK(s.iteration == 0);
    CHECK(s.lastOverflowIteration == -1);
  }
}

TEST_CASE("hysteresis overflows halve the scale and a clean step between them does not restore the budget",
          "[loss_scaler]") {
  // A window longer than the sequence: no growth, so the hysteresis budget alone decides.
  LossScaler three(dynamicConfig(8, 1000, 3, 1));
  CHECK(scalesAfter(three, "OCOCOOO") == std::vector<double>{256, 256, 256, 256, 128, 64, 32});
  CHECK(three.state().hysteresisLeft == 1);
  CHECK(three.state().iteration == 7);
  CHECK(three.state().lastOverflowIteration == 6);

  LossScaler one(dynamicConfig(8, 1000, 1, 1));
  CHECK(scalesAfter(one, "OCO") == std::vector<double>{128, 128, 64});
}

TEST_CASE("the scale never drops below min_loss_scale", "[loss_scaler]") {
  LossScaler powerOfTwo(dynamicConfig(2, 1000, 1, 1));
  CHECK(scalesAfter(powerOfTwo, "OOOO") == std::vector<double>{2, 1, 1, 1});

  // A floor that is not a power of two is reached exactly, not skipped past.
  LossScaler odd(dynamicConfig(0, 1000, 1, 0.3));
  CHECK(scalesAfter(odd, "OOO") == std::vector<double>{0.5, 0.3, 0.3});

  // The floor applies when the hysteresis budget runs out, too.
  LossScaler withHysteresis(dynamicConfig(1, 1000, 2, 1));
  CHECK(scalesAfter(withHysteresis, "OOOO") == std::vector<double>{2, 1, 1, 1});
}

TEST_CASE("a static loss scale never changes", "[loss_scaler]") {
  for (double fixed : {1.0, 128.0, 128.5, 65536.0}) {
    Fp16Config c = dynamicConfig(16, 1, 1, 1);  // dynamic settings that would move a dynamic scale
    c.lossScale = fixed;
    LossScaler scaler(c);
    INFO(describe(c));
    CHECK(scaler.scale() == fixed);
    std::mt19937 rng(7);
    bool alwaysFixed = true;
    for (bool overflow : burstySequence(rng, 2000, 1, 1)) {
      scaler.update(overflow);
      alwaysFixed = alwaysFixed && scaler.scale() == fixed && scaler.state().scale == fixed;
    }
    CHECK(alwaysFixed);
  }
}

// These sequences have the same outcome whether the scale doubles on the window-th clean step
// (DeepSpeed) or one step later (loss_scaler.cpp until the fix below), so they hold the rest of
// the growth rule independently of the window rule.
TEST_CASE("growth restores the hysteresis budget and an overflow restarts the count of clean steps",
          "[loss_scaler]") {
  // O spends one unit; three clean steps grow the scale once (on the 2nd or 3rd) and restore
  // the budget, so of the next two overflows only the second halves.
  LossScaler restored(dynamicConfig(8, 2, 2, 1));
  scalesAfter(restored, "OCCC");
  CHECK(restored.scale() == 512);
  CHECK(restored.state().hysteresisLeft == 2);
  CHECK(scalesAfter(restored, "OO") == std::vector<double>{512, 256});

  // Runs of two clean steps with a window of 3: never a full window, so never growth. A large
  // hysteresis keeps the overflows from halving.
  LossScaler restarted(dynamicConfig(8, 3, 100, 1));
  std::string steps;
  for (int i = 0; i < 20; ++i) steps += "CCO";
  scalesAfter(restarted, steps);
  CHECK(restarted.scale() == 256);
  CHECK(restarted.state().hysteresisLeft == 80);
}

// The next three cases hold the window rule: the scale doubles on the window-th clean step
// (DynamicLossScaler.update_scale: (cur_iter - last_overflow_iter) % scale_window == 0), not on
// the (loss_scale_window + 1)-th one (FP16_Optimizer's "stable_interval" rule in DeepSpeed's
// fused_optimizer.py, which has no hysteresis), as loss_scaler.cpp did until these tests found it.
TEST_CASE("the scale doubles on every loss_scale_window-th clean step", "[loss_scaler]") {
  LossScaler scaler(dynamicConfig(4, 3, 2, 1));
  CHECK(scalesAfter(scaler, "CCCCCCC") == std::vector<double>{16, 16, 32, 32, 32, 64, 64});

  // Window 1: every clean step doubles, also the first one after an overflow.
  LossScaler everyStep(dynamicConfig(0, 1, 1, 0.3));
  CHECK(scalesAfter(everyStep, "OOOCC") == std::vector<double>{0.5, 0.3, 0.3, 0.3 * 2, 0.3 * 4});
}

TEST_CASE("an overflow restarts the window and growth restores the hysteresis budget",
          "[loss_scaler]") {
  // DeepSpeed's engine test scenario (tests/python/test_fp16.py): overflow 1 spends the
  // hysteresis, overflow 2 halves, the 3rd clean step after it doubles.
  LossScaler scaler(dynamicConfig(8, 3, 2, 1));
  CHECK(scalesAfter(scaler, "COOCCCC") == std::vector<double>{256, 256, 128, 128, 128, 256, 256});

  // Growth at step 3 restores the budget to 3; overflows at 4 and 5 spend it to 1; the clean
  // step 6 does not restore it, so overflows 7 and 8 halve; growth at step 10 restores it.
  LossScaler budget(dynamicConfig(8, 2, 3, 1));
  CHECK(scalesAfter(budget, "OCCOOCOOCCO") ==
        std::vector<double>{256, 256, 512, 512, 512, 512, 256, 128, 128, 256, 256});
  CHECK(budget.state().hysteresisLeft == 2);
}

TEST_CASE("dynamic scaling follows the reference scaler over long random overflow sequences",
          "[loss_scaler]") {
  uint32_t seed = 1;
  for (const auto& config : kRandomConfigs) {
    for (const bool bursty : {true, false}) {
      std::mt19937 rng(seed);
      const auto bursts = burstySequence(rng, 20000, config.lossScaleWindow, config.hysteresis);
      EdgeRider edge(seed++, config.lossScaleWindow);
      LossScaler scaler(config);
      ReferenceScaler reference(config);
      // The first update after which the two disagree (-1: none), and what each held then.
      int64_t firstMismatch = -1;
      std::string detail;
      for (size_t i = 0; i < 20000 && firstMismatch < 0; ++i) {
        const bool overflow = bursty ? bursts[i] : edge.next(reference.scale());
        scaler.update(overflow);
        reference.update(overflow);
        if (scaler.scale() != reference.scale() || scaler.state().hysteresisLeft != reference.budget()) {
          firstMismatch = static_cast<int64_t>(i);
          std::ostringstream out;
          out << (overflow ? "overflow" : "clean") << " step: zeroshard " << describe(scaler.state())
              << ", reference scale " << reference.scale() << " budget " << reference.budget();
          detail = out.str();
        }
      }
      INFO(describe(config) << (bursty ? ", bursts" : ", riding the edge") << ": " << detail);
      CHECK(firstMismatch == -1);
    }
  }
}

TEST_CASE("restore of a saved state continues exactly as the scaler that saved it", "[loss_scaler]") {
  uint32_t seed = 100;
  for (const auto& config : kRandomConfigs) {
    // Save points at the start, inside hysteresis, just before a window boundary and late on.
    const size_t beforeWindow = config.lossScaleWindow > 1 ? static_cast<size_t>(config.lossScaleWindow - 1) : 2;
    for (const size_t savedAt : {size_t{0}, size_t{1}, beforeWindow, size_t{1234}, size_t{5000}}) {
      EdgeRider edge(seed++, config.lossScaleWindow);
      LossScaler original(config);
      for (size_t i = 0; i < savedAt; ++i) original.update(edge.next(original.scale()));
      const LossScaler::State saved = original.state();

      // A fresh scaler, and one with a history of its own: restore replaces all of it.
      LossScaler fresh(config);
      LossScaler used(config);
      for (int i = 0; i < 37; ++i) used.update(i % 3 == 0);
      fresh.restore(saved);
      used.restore(saved);
      INFO(describe(config) << ", saved after " << savedAt << " updates: " << describe(saved));
      CHECK(sameState(fresh.state(), saved));
      CHECK(sameState(used.state(), saved));
      CHECK(fresh.scale() == saved.scale);

      int64_t firstMismatch = -1;
      for (size_t i = savedAt; i < 8000 && firstMismatch < 0; ++i) {
        const bool overflow = edge.next(original.scale());
        original.update(overflow);
        fresh.update(overflow);
        used.update(overflow);
        if (!sameState(original.state(), fresh.state()) || !sameState(original.state(), used.state()) ||
            original.scale() != fresh.scale() || original.scale() != used.scale()) {
          firstMismatch = static_cast<int64_t>(i);
        }
      }
      CHECK(firstMismatch == -1);
    }
  }
}
