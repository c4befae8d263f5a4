// LrSchedule (csrc/zeroshard/optim/lr_schedule.*): each of DeepSpeed's five schedules at the
// boundaries of its phases, with DeepSpeed's defaults and with params set. The expectations are
// closed forms written here from DeepSpeed's documented formulas (deepspeed/runtime/
// lr_schedules.py), not computed by the class: exact where the value is exact (a phase's end,
// a stair, a clamp), to 1e-14 relative where a log or cosine is involved. The bitwise match
// with DeepSpeed's own classes is tests/python/test_lr_schedule.py's.
#include "catch.h"

#include "zeroshard/config/config.h"
#include "zeroshard/optim/lr_schedule.h"

#include <cmath>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

using zeroshard::LrSchedule;
using zeroshard::SchedulerConfig;

namespace {

SchedulerConfig schedule(const std::string& type, std::map<std::string, double> params = {},
                         const std::string& warmupType = "log") {
  SchedulerConfig c;
  c.type = type;
  c.params = std::move(params);
  c.warmupType = warmupType;
  return c;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

double lrAt(const LrSchedule& s, int64_t iteration, size_t group = 0) {
  return s.valuesAt(iteration).at(group).lr;
}

// Equal to 1e-14 relative: for values through a log or cosine.
bool near(double got, double want) {
  return std::abs(got - want) <= 1e-14 * std::abs(want);
}

const double kPi = std::acos(-1.0);

} // namespace

TEST_CASE("WarmupLR with DeepSpeed's defaults warms each group up to its own lr over 1000 log steps",
          "[lr_schedule]") {
  const LrSchedule s(schedule("WarmupLR"), {0.01, 0.002});
  REQUIRE(s.lastBatchIteration() == -1);
  // Start values (iteration -1) and iteration 0 are both warmup_min_lr (0): log(1) = 0.
  REQUIRE(s.current().has_value());
  CHECK(s.current()->at(0).lr == 0.0);
  CHECK(s.current()->at(1).lr == 0.0);
  CHECK(lrAt(s, -1) == 0.0);
  CHECK(lrAt(s, 0) == 0.0);
  CHECK(near(lrAt(s, 1), 0.01 * std::log(2.0) / std::log(1000.0)));
  CHECK(near(lrAt(s, 999), 0.01));
  CHECK(near(lrAt(s, 999, 1), 0.002));
  // From warmup_num_steps on: exactly max.
  CHECK(lrAt(s, 1000) == 0.01);
  CHECK(lrAt(s, 1000, 1) == 0.002);
  CHECK(lrAt(s, 123456) == 0.01);
  CHECK_FALSE(s.valuesAt(5).at(0).beta1.has_value());
}

TEST_CASE("WarmupLR linear with set params and warmup_num_steps clamped to 2", "[lr_schedule]") {
  const LrSchedule s(schedule("WarmupLR", {{"warmup_min_lr", 0.25}, {"warmup_max_lr", 1.0}, {"warmup_num_steps", 1}},
                              "linear"),
                     {0.5});
  CHECK(s.current()->at(0).lr == 0.25);
  CHECK(lrAt(s, 0) == 0.25);
  CHECK(lrAt(s, 1) == 0.25 + 0.75 * 0.5);
  CHECK(lrAt(s, 2) == 1.0);
  // warmup_max_lr written: the group's lr is not used.
  const LrSchedule four(schedule("WarmupLR", {{"warmup_max_lr", 0.8}, {"warmup_num_steps", 4}}, "linear"), {0.5});
  CHECK(lrAt(four, 2) == 0.8 * 0.5);
  CHECK(lrAt(four, 3) == 0.8 * 0.75);
  CHECK(lrAt(four, 4) == 0.8);
}

TEST_CASE("WarmupDecayLR warms up then decays linearly to warmup_min_lr at total_num_steps", "[lr_schedule]") {
  const LrSchedule s(schedule("WarmupDecayLR", {{"total_num_steps", 10}, {"warmup_num_steps", 4},
                                                {"warmup_min_lr", 0.125}, {"warmup_max_lr", 1.125}},
                              "linear"),
                     {0.5});
  CHECK(s.current()->at(0).lr == 0.125);
  CHECK(lrAt(s, 0) == 0.125);
  CHECK(lrAt(s, 3) == 0.125 + 1.0 * 0.75);
  // Warm-up end: (10 - 4) / (10 - 4) = 1.
  CHECK(lrAt(s, 4) == 1.125);
  CHECK(lrAt(s, 7) == 0.125 + 1.0 * 0.5);
  CHECK(lrAt(s, 10) == 0.125);
  CHECK(lrAt(s, 15) == 0.125);  // clamped at 0, never below min
  // Defaults: log warm-up, 0 -> 0.001 over 1000 steps: the first two optimizer steps use lr 0.
  const LrSchedule d(schedule("WarmupDecayLR", {{"total_num_steps", 3000}}), {0.5});
  CHECK(d.current()->at(0).lr == 0.0);
  CHECK(lrAt(d, 0) == 0.0);
  CHECK(near(lrAt(d, 1), 0.001 * std::log(2.0) / std::log(1000.0)));
  CHECK(lrAt(d, 1000) == 0.001);
  CHECK(lrAt(d, 2000) == 0.001 * 0.5);
  CHECK(lrAt(d, 3000) == 0.0);
}

TEST_CASE("WarmupCosineLR scales each group's lr from warmup_min_ratio to 1 then down to cos_min_ratio",
          "[lr_schedule]") {
  const LrSchedule s(schedule("WarmupCosineLR", {{"total_num_steps", 10}, {"warmup_num_steps", 4},
                                                 {"warmup_min_ratio", 0.25}, {"cos_min_ratio", 0.0625}},
                              "linear"),
                     {0.5, 0.25});
  // Start: lr 0 (DeepSpeed's get_lr before the first step), whatever the group's lr.
  CHECK(s.current()->at(0).lr == 0.0);
  CHECK(s.current()->at(1).lr == 0.0);
  CHECK(lrAt(s, 0) == 0.5 * 0.25);
  CHECK(lrAt(s, 0, 1) == 0.25 * 0.25);
  CHECK(lrAt(s, 2) == 0.5 * (0.25 + 0.5 * 0.75));
  // First step after warm-up: progress 1 / (10 - 4).
  const double cosine = (1 + std::cos(kPi / 6)) / 2;
  CHECK(near(lrAt(s, 4), 0.5 * (0.0625 + 0.9375 * cosine)));
  // Halfway: cos(pi / 2) is 0 to rounding.
  CHECK(near(lrAt(s, 6, 1), 0.25 * (0.0625 + 0.9375 * 0.5)));
  // Decay end and after: exactly cos_min_ratio.
  CHECK(lrAt(s, 9) == 0.5 * 0.0625);
  CHECK(lrAt(s, 50, 1) == 0.25 * 0.0625);
  // Defaults: log warm-up over 1000 steps, cos_min_ratio 1e-4.
  const LrSchedule d(schedule("WarmupCosineLR", {{"total_num_steps", 2000}}), {0.5});
  CHECK(lrAt(d, 0) == 0.0);
  CHECK(near(lrAt(d, 999), 0.5));
  CHECK(near(lrAt(d, 1999), 0.5 * 0.0001));
}

TEST_CASE("LRRangeTest grows the lr continuously or in stairs", "[lr_schedule]") {
  const LrSchedule d(schedule("LRRangeTest"), {0.5});
  CHECK(d.current()->at(0).lr == 0.001);
  CHECK(lrAt(d, -1) == 0.001);
  CHECK(lrAt(d, 999) == 0.001 * 1.5);
  CHECK(lrAt(d, 1999) == 0.001 * 2);
  const LrSchedule s(schedule("LRRangeTest", {{"lr_range_test_min_lr", 0.25}, {"lr_range_test_step_size", 3},
                                              {"lr_range_test_step_rate", 2}, {"lr_range_test_staircase", 1}}),
                     {0.5});
  CHECK(lrAt(s, 0) == 0.25);
  CHECK(lrAt(s, 1) == 0.25);
  CHECK(lrAt(s, 2) == 0.25 * 3);
  CHECK(lrAt(s, 4) == 0.25 * 3);
  CHECK(lrAt(s, 5) == 0.25 * 5);
}

TEST_CASE("OneCycle cycles lr up and momentum down then decays, setting betas to (momentum, 0.99)",
          "[lr_schedule]") {
  const std::map<std::string, double> params = {{"cycle_min_lr", 0.125}, {"cycle_max_lr", 1.125},
                                                {"cycle_first_step_size", 4}, {"cycle_second_step_size", 4}};
  const LrSchedule s(schedule("OneCycle", params), {0.5});
  // Start: cycle_min_lr and betas (cycle_min_mom, 0.99), DeepSpeed's constructor.
  const auto& start = s.current()->at(0);
  CHECK(start.lr == 0.125);
  CHECK(start.beta1 == 0.8);
  CHECK(start.beta2 == 0.99);
  // The formula at -1 gives the top of the momentum cycle.
  CHECK(s.valuesAt(-1).at(0).beta1 == 0.9);
  // Batch 2 of 8 (iteration 1): a quarter cycle, half way up.
  CHECK(lrAt(s, 1) == 0.125 + 1.0 * 0.5);
  CHECK(near(s.valuesAt(1).at(0).beta1.value(), 0.9 - 0.1 * 0.5));
  // Peak at the end of the first half (batch 4).
  CHECK(lrAt(s, 3) == 1.125);
  CHECK(near(s.valuesAt(3).at(0).beta1.value(), 0.8));
  CHECK(s.valuesAt(3).at(0).beta2 == 0.99);
  CHECK(lrAt(s, 5) == 0.125 + 1.0 * 0.5);
  // Cycle end (batch 8) and after it without decay (decay_step_size 0): min lr, max momentum.
  CHECK(lrAt(s, 7) == 0.125);
  CHECK(lrAt(s, 8) == 0.125);
  CHECK(s.valuesAt(8).at(0).beta1 == 0.9);
  CHECK(lrAt(s, 100) == 0.125);

  auto decaying = params;
  decaying.insert({{"decay_step_size", 2}, {"decay_lr_rate", 0.5}, {"decay_mom_rate", 0.25}});
  const LrSchedule dec(schedule("OneCycle", decaying), {0.5});
  // Iteration 9 is decay batch 2: interval 1.
  CHECK(lrAt(dec, 9) == 0.125 / 1.5);
  CHECK(dec.valuesAt(9).at(0).beta1 == 0.9 * 1.25);
  CHECK(lrAt(dec, 11) == 0.125 / 2.0);
}

TEST_CASE("OneCycle staircase and without momentum", "[lr_schedule]") {
  const LrSchedule s(schedule("OneCycle", {{"cycle_min_lr", 0.125}, {"cycle_max_lr", 1.125},
                                           {"cycle_first_step_size", 4}, {"cycle_first_stair_count", 2},
                                           {"cycle_momentum", 0}}),
                     {0.5});
  CHECK_FALSE(s.current()->at(0).beta1.has_value());
  CHECK_FALSE(s.valuesAt(2).at(0).beta1.has_value());
  // Two stairs per half (the second half's count defaults to the first's): flat in between.
  CHECK(lrAt(s, 0) == 0.125);   // batch 1: position 0.5
  CHECK(lrAt(s, 1) == 0.625);   // batch 2: position 1
  CHECK(lrAt(s, 2) == 0.625);   // batch 3
  CHECK(lrAt(s, 3) == 1.125);   // batch 4: the peak
  CHECK(lrAt(s, 4) == 0.625);   // batch 5: (8 - 5) * 2 / 4 = 1.5
  CHECK(lrAt(s, 6) == 0.125);   // batch 7: 0.5
}

TEST_CASE("step advances last_batch_iteration and restore resumes it", "[lr_schedule]") {
  LrSchedule s(schedule("WarmupLR", {{"warmup_num_steps", 4}}, "linear"), {0.5});
  CHECK(s.step().at(0).lr == 0.0);  // iteration 0
  CHECK(s.lastBatchIteration() == 0);
  CHECK(s.step().at(0).lr == 0.5 * 0.25);  // up to the group's lr
  CHECK(s.current()->at(0).lr == 0.5 * 0.25);
  s.restore(3);
  CHECK(s.lastBatchIteration() == 3);
  CHECK(s.current()->at(0).lr == 0.5 * 0.75);
  CHECK(s.step().at(0).lr == 0.5);

  // Restored to -1: DeepSpeed's start values, not the formula (OneCycle starts at min momentum).
  LrSchedule cycle(schedule("OneCycle", {{"cycle_min_lr", 0.125}, {"cycle_max_lr", 1.125}}), {0.5});
  cycle.step();
  cycle.restore(-1);
  CHECK(cycle.current()->at(0).beta1 == 0.8);
  CHECK_THROWS_AS(cycle.restore(-2), std::invalid_argument);
}

TEST_CASE("a schedule configured at another last_batch_iteration sets nothing before its first step",
          "[lr_schedule]") {
  LrSchedule s(schedule("WarmupLR", {{"warmup_num_steps", 4}, {"last_batch_iteration", 1}}, "linear"), {0.5});
  CHECK(s.lastBatchIteration() == 1);
  CHECK_FALSE(s.current().has_value());
  CHECK(s.step().at(0).lr == 0.5 * 0.5);
}

TEST_CASE("values DeepSpeed's classes refuse are refused naming the key", "[lr_schedule]") {
  auto message = [](const SchedulerConfig& c) {
    try {
      LrSchedule s(c, {0.5});
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(contains(message(schedule("LRRangeTest", {{"lr_range_test_step_size", 0}})),
                 "scheduler.params.lr_range_test_step_size must be a positive integer"));
  CHECK(contains(message(schedule("WarmupLR", {{"warmup_num_steps", 0}})),
                 "scheduler.params.warmup_num_steps must be a positive integer"));
  CHECK(contains(message(schedule("OneCycle", {{"cycle_max_lr", 1.0}})),
                 "scheduler.params.cycle_min_lr is required"));
  CHECK(contains(message(schedule("WarmupCosineLR")), "scheduler.params.total_num_steps is required"));
  CHECK(contains(message(schedule("StepLR")), "scheduler.type \"StepLR\" is not one of"));
  CHECK(contains(message(schedule("WarmupLR", {}, "cosine")), "warmup_type is \"cosine\""));
}

TEST_CASE("rewind undoes the last step: iteration and current values, one level", "[lr_schedule]") {
  LrSchedule s(schedule("WarmupLR", {{"warmup_min_lr", 1e-3}, {"warmup_max_lr", 1e-2}, {"warmup_num_steps", 10}},
                        "linear"),
               {0.01});
  CHECK_THROWS_AS(s.rewind(), std::logic_error);  // nothing to undo
  s.step();
  const auto atZero = *s.current();
  s.step();
  REQUIRE(s.current()->at(0).lr != atZero.at(0).lr);
  s.rewind();
  CHECK(s.lastBatchIteration() == 0);
  CHECK(s.current()->at(0).lr == atZero.at(0).lr);
  CHECK_THROWS_AS(s.rewind(), std::logic_error);  // one level only
  s.step();
  s.restore(5);
  CHECK_THROWS_AS(s.rewind(), std::logic_error);  // a restore is not undone
  // Constructed at another iteration it sets nothing until its first step; undone, nothing again.
  LrSchedule resumed(schedule("WarmupLR", {{"last_batch_iteration", 4}}), {0.01});
  REQUIRE_FALSE(resumed.current().has_value());
  resumed.step();
  resumed.rewind();
  CHECK(resumed.lastBatchIteration() == 4);
  CHECK_FALSE(resumed.current().has_value());
}
