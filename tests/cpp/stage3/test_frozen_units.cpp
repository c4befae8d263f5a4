// Frozen parameters at stage 3 (Note [frozen parameters] in csrc/zeroshard/stage3/unit_builder.cpp,
// Note [release after backward] in unit_scheduler.cpp): how the builder lays them out, and when
// the scheduler may release a unit that holds them. The scheduler runs over a Gloo group of
// one rank, its gradients through a real GradReducer, whose start of each unit's reduce-scatter
// reports the unit's trained gradients reduced, as in the engine.
#include "error_text.h"
#include "single_rank_group.h"
#include "unit_fixtures.h"
#include "zeroshard/comm/communicator.h"
#include "zeroshard/grad/grad_reducer.h"
#include "zeroshard/grad/grad_storage.h"
#include "zeroshard/layout/param_groups.h"
#include "zeroshard/plan/sharding_plan.h"
#include "zeroshard/stage3/unit_builder.h"
#include "zeroshard/stage3/unit_scheduler.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

// c10's logging defines a glog-style CHECK that aborts; the tests' CHECK must be Catch2's.
#undef CHECK
#include "catch.h"

#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

using zeroshard::Communicator;
using zeroshard::GradReducer;
using zeroshard::GradStorage;
using zeroshard::ParamGroupSpec;
using zeroshard::ReductionOptions;
using zeroshard::ShardingPlan;
using zeroshard::Stage3Units;
using zeroshard::UnitIndex;
using zeroshard::UnitScheduler;
using zeroshard::UnitSpec;
using zeroshard::testing::contains;
using zeroshard::testing::errorText;
using zeroshard::testing::kTimeout;
using zeroshard::testing::leaf;
using zeroshard::testing::namesIn;
using zeroshard::testing::singleRankGroup;

TEST_CASE("assignUnits places frozen parameters by the trained ones' rule", "[unit_builder]") {
  auto w0 = leaf(8, 1), f0 = leaf(8, 1, false), f1 = leaf(8, 1, false), shared = leaf(8, 1, false);
  auto loose = leaf(4, 1, false);
  const std::vector<std::pair<std::string, at::Tensor>> model = {
      {"b0.w", w0}, {"b0.f", f0}, {"b1.f", f1}, {"shared", shared}, {"loose", loose}};
  const auto specs = zeroshard::assignUnits(model, {"b0", "b1"}, {{w0, f0, shared}, {f1, shared}});
  REQUIRE(specs.size() == 3);
  CHECK(specs[0].paramNames == std::vector<std::string>{"b0.w"});
  CHECK(specs[0].frozenNames == std::vector<std::string>{"b0.f"});
  CHECK(specs[1].paramNames.empty());
  CHECK(specs[1].frozenNames == std::vector<std::string>{"b1.f"});
  CHECK(specs[2].frozenNames == std::vector<std::string>{"shared", "loose"});
}

TEST_CASE("buildStage3Units gives each unit one frozen buffer per dtype and keeps small ones whole",
          "[unit_builder]") {
  ParamGroupSpec group;
  group.names = {"b0.lora"};
  group.params = {leaf(6, 1)};
  const auto bf16 = [](int64_t n) { return leaf(n, 1, false).to(at::kBFloat16); };
  const std::vector<std::pair<std::string, at::Tensor>> frozen = {
      {"b0.w", bf16(40)}, {"b0.norm", leaf(20, 1, false)}, {"b0.v", bf16(30)}, {"b0.bias", bf16(3)},
      {"b1.w", bf16(50)}, {"embed", bf16(64)}};
  const std::vector<UnitSpec> specs = {{"b0", {"b0.lora"}, false, {"b0.w", "b0.norm", "b0.v", "b0.bias"}},
                                       {"b1", {}, false, {"b1.w"}},
                                       {"<root>", {}, true, {}}};
  const Stage3Units units =
      zeroshard::buildStage3Units({group}, specs, {/*persistenceThreshold=*/4, true}, 0, 2, at::kFloat,
                                  std::nullopt, frozen);
  // b0: its trained bucket, then a bf16 and an fp32 buffer; b1: frozen only; root: the embedding,
  // which no spec listed.
  REQUIRE(units.buffers.size() == 3);
  CHECK(units.buffers[0].trained == std::optional<size_t>(0));
  REQUIRE(units.buffers[0].frozen.size() == 2);
  CHECK(namesIn(units.frozenBuckets[units.buffers[0].frozen[0]]) == std::vector<std::string>{"b0.w", "b0.v"});
  CHECK(units.frozenBuckets[units.buffers[0].frozen[0]].flatParams().scalar_type() == at::kBFloat16);
  CHECK(namesIn(units.frozenBuckets[units.buffers[0].frozen[1]]) == std::vector<std::string>{"b0.norm"});
  CHECK(units.frozenBuckets[units.buffers[0].frozen[1]].flatParams().scalar_type() == at::kFloat);
  CHECK_FALSE(units.buffers[1].trained);
  CHECK(namesIn(units.frozenBuckets[units.buffers[1].frozen.at(0)]) == std::vector<std::string>{"b1.w"});
  CHECK(namesIn(units.frozenBuckets[units.buffers[2].frozen.at(0)]) == std::vector<std::string>{"embed"});
  REQUIRE(units.unitOf.size() == 3);
  for (size_t i = 0; i < 3; ++i) CHECK(units.unitOf[i]->value == i);
  REQUIRE(units.frozenWhole.size() == 1);
  CHECK(units.frozenWhole[0].first == "b0.bias");
  CHECK(units.infos[0].frozen == std::vector<std::string>{"b0.w", "b0.norm", "b0.v"});
  CHECK(units.infos[0].frozenNumel == 90);
  CHECK(units.policies[2].root);

  const std::vector<std::pair<std::string, at::Tensor>> quantized = {
      {"b0.q", at::zeros({16}, at::kByte)}};
  CHECK(contains(errorText([&] {
                   zeroshard::buildStage3Units({group}, {{"b0", {"b0.lora"}, true, {"b0.q"}}}, {}, 0, 1, at::kFloat,
                                               std::nullopt, quantized);
                 }),
                 "frozen parameter 'b0.q' is Byte"));
}

namespace {

constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max();

//   block:  x = p0 * input                  (trained p0)
//   lora:   y = w * x + a * c               (frozen w, trained a; c a constant)
//   root:   loss = (y * head).sum()
// In the lora unit's backward, a's MulBackward was created last, so autograd runs it first: a's
// gradient (the unit's only trained one) is reduced while w's MulBackward, which reads w, is
// still to run. Releasing the unit then would free w under it.
struct LoraNet {
  ParamGroupSpec group;
  at::Tensor w = leaf(16, 0.5, /*requiresGrad=*/false);
  at::Tensor wValue = w.clone();  // a unit's storage is released between uses
  at::Tensor headValue;
  Stage3Units units;
  LoraNet() {
    group.names = {"p0", "a", "head"};
    group.params = {leaf(16, 0.25), leaf(16, 0.125), leaf(16, 1)};
    headValue = group.params[2].detach().clone();
    units = zeroshard::buildStage3Units({group},
                                        {{"block", {"p0"}, false, {}}, {"lora", {"a"}, false, {"w"}},
                                         {"<root>", {"head"}, true, {}}},
                                        {}, 0, 1, at::kFloat, std::nullopt, {{"w", w}});
  }
  const at::Tensor& param(size_t i) const { return group.params[i]; }
};

struct LoraStage3 {
  explicit LoraStage3(LoraNet& net)
      : comm(singleRankGroup(), kTimeout),
        scheduler(net.units.buckets, net.units.frozenBuckets, net.units.buffers, net.units.policies, comm, kNoLimit,
                  kNoLimit),
        grads(GradStorage::forPlan(ShardingPlan::forStage(3, 1), net.units.buckets, 0, {})),
        reducer(net.units.buckets, *grads, comm, [this] {
          ReductionOptions options;
          options.onLaunched = [this](size_t bucket) { scheduler.afterBucketReduce(bucket); };
          return options;
        }()) {}

  // One step; `watch`: the lora unit's input is given (as the Python hooks do); `constantInput`:
  // what it is given is a tensor that needs no gradient. Returns whether the lora unit was still
  // gathered when the block's backward began, and p0's gradient.
  std::pair<bool, at::Tensor> step(const LoraNet& net, bool watch, bool constantInput = false) {
    const UnitIndex block{0}, lora{1}, root{2};
    scheduler.preForward(root);
    scheduler.preForward(block);
    at::Tensor x = net.param(0) * at::arange(16, at::kFloat).remainder(3).sub(1);
    scheduler.postForward(block, {x});
    if (watch) scheduler.watchInputs(lora, {constantInput ? at::ones({16}) : x});
    scheduler.preForward(lora);
    at::Tensor y = net.w * x + net.param(1) * at::full({16}, 2.0);
    scheduler.postForward(lora, {y});
    bool loraGathered = false;
    x.register_hook([&](const at::TensorBase&) { loraGathered = scheduler.isUnsharded(lora); });
    at::Tensor loss = (y * net.param(2)).sum();
    scheduler.postForward(root, {loss});
    reducer.beginBackward(true);
    loss.backward();
    reducer.finishBackward();
    scheduler.finishBackward();
    at::Tensor grad = grads->optimizerGrad(0).clone();
    grads->zero();
    return {loraGathered, grad};
  }

  Communicator comm;
  UnitScheduler scheduler;
  std::unique_ptr<GradStorage> grads;
  GradReducer reducer;
};

}  // namespace

TEST_CASE("a unit with frozen parameters is released once its input gradients are computed, not before",
          "[unit_scheduler]") {
  LoraNet net;
  LoraStage3 s(net);
  const at::Tensor input = at::arange(16, at::kFloat).remainder(3).sub(1);
  // d loss / d p0 = head * w * input: w must still be whole when its MulBackward runs.
  const at::Tensor expected = net.headValue * net.wValue * input;
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    const auto [gathered, grad] = s.step(net, /*watch=*/true);
    CHECK(at::allclose(grad.narrow(0, 0, 16), expected));
    // Released by the hook on its input, before the block's backward: not held to the end.
    CHECK_FALSE(gathered);
    for (size_t u = 0; u < 3; ++u) CHECK_FALSE(s.scheduler.isUnsharded(UnitIndex{u}));
  }
  // Without its inputs (a C++ runUnit), or with inputs that need no gradient (which say nothing
  // of when its backward ends), the unit is held until the end of the backward.
  for (const bool constant : {false, true}) {
    INFO("inputs given: " << constant);
    const auto [gathered, grad] = s.step(net, /*watch=*/constant, constant);
    CHECK(gathered);
    CHECK(at::allclose(grad.narrow(0, 0, 16), expected));
  }
  // And the next step, watched again, releases it early again (no watch left behind).
  CHECK_FALSE(s.step(net, /*watch=*/true).first);
  CHECK(s.scheduler.frozenBytes() == net.units.frozenBuckets[0].layout().paddedNumel() * 4);
  CHECK(s.scheduler.bytes() > 0);
}

TEST_CASE("with two forwards before one backward, a frozen unit waits for both forwards' input gradients",
          "[unit_scheduler]") {
  LoraNet net;
  LoraStage3 s(net);
  const UnitIndex block{0}, lora{1}, root{2};
  const at::Tensor input = at::arange(16, at::kFloat).remainder(3).sub(1);
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    // Two losses summed: each forward watches its own input. In each backward the adapter's
    // gradient (the sum of both forwards') is reduced before the first forward's w * x runs.
    std::vector<bool> gatheredAtUse;
    at::Tensor loss;
    for (int pass = 0; pass < 2; ++pass) {
      s.scheduler.preForward(root);
      s.scheduler.preForward(block);
      at::Tensor x = net.param(0) * input;
      s.scheduler.postForward(block, {x});
      s.scheduler.watchInputs(lora, {x});
      s.scheduler.preForward(lora);
      at::Tensor wx = net.w * x;
      wx.register_hook([&](const at::TensorBase&) { gatheredAtUse.push_back(s.scheduler.isUnsharded(lora)); });
      at::Tensor y = wx + net.param(1) * at::full({16}, 2.0);
      s.scheduler.postForward(lora, {y});
      at::Tensor part = (y * net.param(2)).sum();
      s.scheduler.postForward(root, {part});
      loss = pass == 0 ? part : loss + part;
    }
    s.reducer.beginBackward(true);
    loss.backward();
    s.reducer.finishBackward();
    s.scheduler.finishBackward();
    CHECK(at::allclose(s.grads->optimizerGrad(0).narrow(0, 0, 16), 2 * net.headValue * net.wValue * input));
    s.grads->zero();
    CHECK(gatheredAtUse == std::vector<bool>{true, true});
  }
}
