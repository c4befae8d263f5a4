// The deferred nonfinite check's parts (Note [deferred nonfinite check] in
// csrc/zeroshard/optim/nonfinite_check.cpp): ShardedAdamW::step with a found-inf flag, which the
// fused kernel reads, and DeferredSkip (csrc/zeroshard/optim/deferred_skip.*), which brings
// the flag to the host a step later and takes the step back there. On CPU tensors; the device
// path (a pinned copy and an event) needs a GPU (tests/python/test_cuda.py).
#include "catch.h"

#include "error_text.h"
#include "optim/optimizer_fixtures.h"

#include "zeroshard/optim/deferred_skip.h"
#include "zeroshard/optim/lr_schedule.h"

#include <limits>

using zeroshard::DeferredSkip;
using zeroshard::LrSchedule;
using zeroshard::testing::contains;
using zeroshard::testing::errorText;

namespace {

at::Tensor flag(float value) {
  return at::full({}, value, at::TensorOptions().dtype(at::kFloat));
}

// Step `step`'s gradients with an inf in one shard and a NaN in another.
void loadBadGrads(Shards& s, int step, at::ScalarType valuesOf) {
  loadGrads(s, step, valuesOf);
  s.grads[0][1][3] = std::numeric_limits<float>::infinity();
  s.grads[1][2][0] = std::numeric_limits<float>::quiet_NaN();
}

zeroshard::SchedulerConfig warmup() {
  zeroshard::SchedulerConfig c;
  c.type = "WarmupLR";
  c.params = {{"warmup_min_lr", 1e-3}, {"warmup_max_lr", 1e-2}, {"warmup_num_steps", 10}};
  c.warmupType = "linear";
  return c;
}

} // namespace

TEST_CASE("a step given found_inf 1 changes no master, moment or step, and later steps are as if it never was",
          "[optimizer][nonfinite]") {
  const auto specs = groupSpecs();
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    INFO("gradients " << dtype);
    Shards skipping = makeShards(specs, {dtype, dtype});
    Shards straight = makeShards(specs, {dtype, dtype});
    ShardedAdamW a, b;
    registerShards(a, specs, skipping);
    registerShards(b, specs, straight);
    for (int step = 0; step < 3; ++step) {
      // found_inf 0 is a plain step, bit for bit.
      loadGrads(skipping, step, at::kBFloat16);
      a.prepareGrads();
      a.step(flag(0));
      plainStep(b, straight, step, at::kBFloat16);
    }
    REQUIRE(sameState(a, b, specs));
    loadBadGrads(skipping, 99, at::kBFloat16);
    a.prepareGrads();
    a.step(flag(1));
    // The host counted the step; it learns later that the kernel skipped it.
    CHECK(a.stepCount() == b.stepCount() + 1);
    a.takeBackStep();
    CHECK(sameState(a, b, specs));
    // The step tensors took back their increment on the device: the bias corrections of the
    // next steps are those of a run without the bad step.
    for (int step = 3; step < 6; ++step) {
      plainStep(a, skipping, step, at::kBFloat16);
      plainStep(b, straight, step, at::kBFloat16);
    }
    CHECK(sameState(a, b, specs));
  }
}

TEST_CASE("found_inf must be a 0-dim float tensor", "[optimizer][nonfinite]") {
  const auto specs = groupSpecs();
  Shards s = makeShards(specs, {at::kFloat, at::kFloat});
  ShardedAdamW opt;
  registerShards(opt, specs, s);
  opt.prepareGrads();
  CHECK(contains(errorText([&] { opt.step(at::zeros({}, at::kDouble)); }), "found_inf must be a 0-dim float32"));
  CHECK(opt.stepCount() == 0);
}

TEST_CASE("DeferredSkip takes a step found skipped back from the step count, the schedule and the lr",
          "[optimizer][nonfinite]") {
  const auto specs = groupSpecs();
  Shards s = makeShards(specs, {at::kFloat, at::kFloat});
  ShardedAdamW opt;
  registerShards(opt, specs, s);
  LrSchedule schedule(warmup(), {opt.hyper(0).lr, opt.hyper(1).lr});
  auto apply = [&](const std::vector<zeroshard::ScheduledValues>& values) {
    for (int g = 0; g < opt.numGroups(); ++g) opt.hyper(g).lr = values[g].lr;
  };
  apply(*schedule.current());
  DeferredSkip deferred;
  CHECK_FALSE(deferred.settle(opt, &schedule).has_value());  // nothing pending

  // A good step: recorded, settled, nothing taken back.
  plainStep(opt, s, 0);
  deferred.record(flag(0), 1, opt);
  apply(schedule.step());
  CHECK(deferred.pending());
  CHECK_FALSE(deferred.settle(opt, &schedule).has_value());
  CHECK_FALSE(deferred.pending());
  CHECK(opt.stepCount() == 1);
  CHECK(schedule.lastBatchIteration() == 0);
  const double lrOfStep2 = opt.hyper(0).lr;
  const double lrOfStep2Group1 = opt.hyper(1).lr;

  // A bad one: the schedule moved the lr on before the host knew.
  loadBadGrads(s, 1, at::kFloat);
  opt.prepareGrads();
  opt.step(flag(1));
  deferred.record(flag(1), 2, opt);
  apply(schedule.step());
  REQUIRE(opt.hyper(0).lr != lrOfStep2);
  const auto settled = deferred.settle(opt, &schedule);
  REQUIRE(settled.has_value());
  CHECK(*settled == 2);
  CHECK(opt.stepCount() == 1);
  CHECK(schedule.lastBatchIteration() == 0);
  // The next step uses the lr the skipped one used, as after a step skipped at once.
  CHECK(opt.hyper(0).lr == lrOfStep2);
  CHECK(opt.hyper(1).lr == lrOfStep2Group1);
  CHECK_FALSE(deferred.settle(opt, &schedule).has_value());  // read once

  // Without a schedule the lr is the client's: left alone.
  plainStep(opt, s, 2);
  deferred.record(flag(1), 3, opt);
  opt.hyper(0).lr = 0.5;  // set between the steps
  CHECK(deferred.settle(opt, nullptr) == std::optional<int64_t>(3));
  CHECK(opt.hyper(0).lr == 0.5);
  CHECK(opt.stepCount() == 1);
}
