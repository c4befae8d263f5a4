// The model state the plan chose (csrc/zeroshard/state/model_state.*), built and driven without an
// Engine over the one-rank Gloo group in this process: what it holds (memoryStats against the
// stages' formulas), the trained parameters by name (read, written, the fp32 masters), and the
// stage-3 unit hooks' errors. Sharded and multi-rank states are held by the engine's tests and
// scripts/fingerprint.py.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#undef CHECK
#include "catch.h"

#include "error_text.h"
#include "single_rank_group.h"
#include "zeroshard/comm/engine_groups.h"
#include "zeroshard/config/config.h"
#include "zeroshard/state/model_state.h"

#include <string>
#include <utility>
#include <vector>

using zeroshard::Config;
using zeroshard::EngineGroups;
using zeroshard::ModelInputs;
using zeroshard::ModelState;
using zeroshard::ShardingPlan;
using zeroshard::testing::contains;
using zeroshard::testing::errorText;
using zeroshard::testing::kTimeout;
using zeroshard::testing::singleRankGroup;

namespace {

Config configFor(int stage, const std::string& extra = "") {
  // No persistent parameters at stage 3: every byte held is the shard.
  return Config::fromJsonString(R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": )" +
                                std::to_string(stage) + R"(, "stage3_param_persistence_threshold": 0})" + extra +
                                "}");
}

// Two trained parameters (12 and 5 elements) in one group.
ModelInputs twoParams(at::Tensor& a, at::Tensor& b) {
  a = at::arange(12, at::kFloat).mul(0.5).reshape({3, 4}).set_requires_grad(true);
  b = at::arange(5, at::kFloat).neg().set_requires_grad(true);
  zeroshard::ParamGroupSpec group;
  group.names = {"a", "b"};
  group.params = {a, b};
  ModelInputs inputs;
  inputs.groups = {group};
  return inputs;
}

struct Built {
  Config config;
  ShardingPlan plan;
  EngineGroups groups;
  ModelState state;
  Built(int stage, at::Tensor& a, at::Tensor& b, const std::string& extra = "")
      : config(configFor(stage, extra)),
        plan(ShardingPlan::fromConfig(config, 1)),
        groups(singleRankGroup(), kTimeout, plan),
        state(twoParams(a, b), config, plan, groups) {}
};

} // namespace

TEST_CASE("the model state holds the stage's bytes: fp32 parameters, gradients and two AdamW moments",
          "[model_state]") {
  for (int stage : {0, 1, 2, 3}) {
    INFO("stage " << stage);
    at::Tensor a, b;
    Built built(stage, a, b);
    const auto stats = built.state.memoryStats();
    // 17 elements, padded so that shards start aligned (padding is held, and counted).
    int64_t elements = 0;
    for (const auto& bucket : built.state.buckets()) elements += bucket.layout().paddedNumel();
    CHECK(elements >= 17);
    CHECK(elements < 17 + 32);
    CHECK(stats.paramBytes == elements * 4);
    CHECK(stats.gradBytes == elements * 4);
    // fp32: the masters are the parameters' own storage, not a copy.
    CHECK(stats.optimizerBytes == 2 * elements * 4);
    CHECK(stats.hostOptimizerBytes == 0);
    CHECK(built.state.computeDtype() == at::kFloat);
  }
}

TEST_CASE("bf16 keeps a separate fp32 master of every trained element", "[model_state]") {
  at::Tensor a, b;
  Built built(1, a, b, R"(, "bf16": {"enabled": true})");
  const auto stats = built.state.memoryStats();
  const int64_t elements = built.state.buckets().at(0).layout().paddedNumel();
  CHECK(built.state.computeDtype() == at::kBFloat16);
  CHECK(stats.paramBytes == elements * 2);
  CHECK(stats.gradBytes == elements * 2);
  CHECK(stats.optimizerBytes == 2 * elements * 4 + elements * 4);
}

TEST_CASE("the model state names its parameters, writes whole values by name and gathers the masters",
          "[model_state]") {
  for (int stage : {0, 1, 2, 3}) {
    INFO("stage " << stage);
    at::Tensor a, b;
    Built built(stage, a, b);
    const at::Tensor newA = at::full({3, 4}, 2.5, at::kFloat);
    built.state.setParameters({{"a", newA}});
    built.state.params().gatherAll();
    const auto named = built.state.namedParameters();
    REQUIRE(named.size() == 2);
    CHECK(named[0].first == "a");
    CHECK(named[1].first == "b");
    CHECK(at::equal(named[0].second, newA));
    CHECK(at::equal(named[1].second, at::arange(5, at::kFloat).neg()));
    built.state.params().reshardAll();
    const auto masters = built.state.masterWeights(built.groups.shard());
    REQUIRE(masters.size() == 2);
    CHECK(at::equal(masters[0].second, newA));
    CHECK(masters[0].second.device().is_cpu());
  }
}

TEST_CASE("a bad write names the parameter and changes nothing", "[model_state]") {
  at::Tensor a, b;
  Built built(1, a, b);
  const at::Tensor before = built.state.namedParameters()[0].second.clone();
  CHECK(contains(errorText([&] { built.state.setParameters({{"a", at::zeros({3, 4})}, {"c", at::zeros({1})}}); }),
                 "'c' is not a parameter of this engine"));
  CHECK(contains(errorText([&] { built.state.setParameters({{"b", at::zeros({4})}}); }),
                 "'b' has shape [5] but the value given has shape [4]"));
  CHECK(at::equal(built.state.namedParameters()[0].second, before));
}

TEST_CASE("unit hooks are refused below stage 3 and for a unit that does not exist", "[model_state]") {
  at::Tensor a, b;
  Built below(2, a, b);
  CHECK(contains(errorText([&] { below.state.preForward(0, std::nullopt); }), "unit hooks are for stage 3"));
  at::Tensor c, d;
  Built stage3(3, c, d);
  REQUIRE(stage3.state.units() != nullptr);
  CHECK(stage3.state.unitInfos().size() == 1);  // no specs: one root unit
  CHECK(contains(errorText([&] { stage3.state.postForward(5, {}); }), "unit 5 does not exist (1 units)"));
}
