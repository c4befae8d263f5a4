// Stage 3's backward prefetch on a model shaped like every real one: a root unit (embedding and
// head) whose forward encloses the blocks' forwards (Note [backward prefetch order] in
// csrc/zeroshard/stage3/unit_scheduler.cpp). The scheduler runs over a Gloo group of one rank,
// its gradients through a real GradReducer, whose start of each unit's reduce-scatter releases
// the unit, as in the engine.
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

#include <algorithm>
#include <limits>
#include <map>
#include <memory>
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
using zeroshard::testing::kTimeout;
using zeroshard::testing::leaf;
using zeroshard::testing::singleRankGroup;

namespace {

constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max();
constexpr size_t kBlocks = 4;

//   root:        embed [16], head [16]   x = embed * input; ...; loss = (x * head).sum()
//   blocks.i:    w [24 + 8i]             x = (w[:16] * x) * w[16:].sum()
// The root's forward starts first and finishes last (its module is the whole model), so its
// pre-forward comes before every block's and its post-forward after them.
struct NestedNet {
  std::map<std::string, at::Tensor> params;
  Stage3Units units;
};

std::unique_ptr<NestedNet> makeNested() {
  auto net = std::make_unique<NestedNet>();
  ParamGroupSpec group;
  std::vector<UnitSpec> specs;
  auto add = [&](const std::string& name, int64_t numel, double scale) {
    group.names.push_back(name);
    group.params.push_back(leaf(numel, scale));
    net->params[name] = group.params.back();
  };
  for (size_t i = 0; i < kBlocks; ++i) {
    const std::string name = "blocks." + std::to_string(i) + ".w";
    add(name, 24 + 8 * static_cast<int64_t>(i), 0.125);
    specs.push_back({"blocks." + std::to_string(i), {name}, false});
  }
  add("embed", 16, 0.25);
  add("head", 16, 0.5);
  specs.push_back({"<root>", {"embed", "head"}, true});
  net->units = zeroshard::buildStage3Units({group}, specs, {}, /*rank=*/0, /*worldSize=*/1, at::kFloat);
  return net;
}

constexpr UnitIndex kRoot{kBlocks};

struct NestedStage3 {
  explicit NestedStage3(NestedNet& net)
      : comm(singleRankGroup(), kTimeout),
        scheduler(net.units.buckets, net.units.policies, comm, /*prefetchElements=*/kNoLimit, kNoLimit),
        grads(GradStorage::forPlan(ShardingPlan::forStage(3, 1), net.units.buckets, 0, {})),
        reducer(net.units.buckets, *grads, comm, [this] {
          ReductionOptions options;
          options.onLaunched = [this](size_t unit) { scheduler.afterGradReduce(UnitIndex{unit}); };
          return options;
        }()) {}

  // One training step. In each block's backward (a hook on its output, registered after the
  // scheduler's), records whether the block that runs its backward next was gathered already.
  std::vector<bool> step(const NestedNet& net) {
    std::vector<bool> nextReady(kBlocks, false);
    scheduler.preForward(kRoot);
    at::Tensor x = net.params.at("embed") * at::arange(16, at::kFloat).remainder(5).sub(2);
    for (size_t i = 0; i < kBlocks; ++i) {
      scheduler.preForward(UnitIndex{i});
      const auto& w = net.params.at("blocks." + std::to_string(i) + ".w");
      x = (w.narrow(0, 0, 16) * x) * w.narrow(0, 16, w.numel() - 16).sum();
      scheduler.postForward(UnitIndex{i}, {x});
      if (i > 0) {
        x.register_hook([this, i, &nextReady](const at::TensorBase&) {
          nextReady[i] = scheduler.isUnsharded(UnitIndex{i - 1});
        });
      }
    }
    at::Tensor loss = (x * net.params.at("head")).sum();
    scheduler.postForward(kRoot, {loss});
    reducer.beginBackward(true);
    loss.backward();
    reducer.finishBackward();
    scheduler.finishBackward();
    grads->zero();
    return nextReady;
  }

  Communicator comm;
  UnitScheduler scheduler;
  std::unique_ptr<GradStorage> grads;
  GradReducer reducer;
};

}  // namespace

TEST_CASE("with a root unit around the blocks, each block's backward finds the next block gathered ahead",
          "[unit_scheduler]") {
  auto net = makeNested();
  NestedStage3 s(*net);
  // The first step records the orders and prefetches nothing.
  CHECK(s.step(*net) == std::vector<bool>(kBlocks, false));
  // Later steps walk the order the forwards finished in backwards: root, blocks.3, ..., blocks.0.
  // Each block from blocks.3 down finds the one before it already gathering (blocks.0 has none).
  const std::vector<bool> expected = {false, true, true, true};
  for (int step = 0; step < 2; ++step) {
    INFO("step " << step + 1);
    CHECK(s.step(*net) == expected);
    for (size_t u = 0; u <= kBlocks; ++u) CHECK_FALSE(s.scheduler.isUnsharded(UnitIndex{u}));
  }
  // Prefetching holds the root and two neighbouring blocks at most, in forward and in backward.
  auto padded = [&](size_t u) { return net->units.buckets[u].layout().paddedNumel() * 4; };
  int64_t pair = 0;
  for (size_t i = 1; i < kBlocks; ++i) pair = std::max(pair, padded(i - 1) + padded(i));
  CHECK(s.scheduler.peakGatheredBytes() == padded(kRoot.value) + pair);
}
