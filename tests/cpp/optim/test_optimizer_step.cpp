// The optimizer step (csrc/zeroshard/optim/optimizer_step.*, nonfinite_check.cpp) driven without an
// Engine: a model state over the one-rank Gloo group, its gradients made by a backward through
// its reducer, then OptimizerStep::take. Clipping, the immediate non-finite check and the
// config's schedule; the deferred check and fp16's scaler at 2 ranks are held by
// tests/python/test_nonfinite.py and test_fp16.py, bitwise by scripts/fingerprint.py.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#undef CHECK
#include "catch.h"

#include "error_text.h"
#include "single_rank_group.h"
#include "zeroshard/comm/engine_groups.h"
#include "zeroshard/config/config.h"
#include "zeroshard/grad/grad_reducer.h"
#include "zeroshard/layout/param_storage.h"
#include "zeroshard/optim/optimizer_step.h"
#include "zeroshard/state/model_state.h"

#include <cmath>
#include <string>
#include <vector>

using zeroshard::Config;
using zeroshard::EngineGroups;
using zeroshard::ModelInputs;
using zeroshard::ModelState;
using zeroshard::OptimizerStep;
using zeroshard::ShardingPlan;
using zeroshard::testing::contains;
using zeroshard::testing::errorText;
using zeroshard::testing::kTimeout;
using zeroshard::testing::singleRankGroup;

namespace {

struct Stepped {
  at::Tensor a = at::arange(6, at::kFloat).mul(0.25).set_requires_grad(true);
  at::Tensor b = at::ones({3}, at::kFloat).set_requires_grad(true);
  Config config;
  ShardingPlan plan;
  EngineGroups groups;
  ModelState state;
  OptimizerStep step;

  static ModelInputs inputs(const at::Tensor& a, const at::Tensor& b) {
    zeroshard::ParamGroupSpec group;
    group.names = {"a", "b"};
    group.params = {a, b};
    ModelInputs out;
    out.groups = {group};
    return out;
  }
  Stepped(int stage, const std::string& keys)
      : config(Config::fromJsonString(R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": )" +
                                      std::to_string(stage) + "}, " + keys + "}")),
        plan(ShardingPlan::fromConfig(config, 1)),
        groups(singleRankGroup(), kTimeout, plan),
        state(inputs(a, b), config, plan, groups),
        step(config, state.stepped(), 0) {}

  bool take(int64_t boundary) { return step.take(state.stepped(), groups.shard(), boundary); }

  // The gradients of sum(a * ga) + sum(b * gb) are ga and gb.
  void backward(const at::Tensor& ga, const at::Tensor& gb) {
    state.reducer().beginBackward(true);
    torch::autograd::backward({(a * ga).sum() + (b * gb).sum()});
    state.reducer().finishBackward();
    state.params().finishBackward();
  }
  at::Tensor values() {
    state.params().gatherAll();
    at::Tensor out = at::cat({state.namedParameters()[0].second.detach().clone(),
                              state.namedParameters()[1].second.detach().clone()});
    state.params().reshardAll();
    return out;
  }
};

} // namespace

TEST_CASE("the step clips to gradient_clipping by the global norm over every shard, which it keeps",
          "[optimizer_step]") {
  for (int stage : {0, 1, 2}) {
    INFO("stage " << stage);
    // eps 1 makes AdamW's first update lr * g / (|g| + 1): it depends on the clipped gradient.
    Stepped s(stage, R"("gradient_clipping": 0.5, "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "eps": 1.0,
                        "weight_decay": 0.0}})");
    const at::Tensor ga = at::arange(6, at::kFloat).sub(2.0);
    const at::Tensor gb = at::full({3}, 3.0, at::kFloat);
    const at::Tensor before = s.values();
    s.backward(ga, gb);
    CHECK(s.take(1));
    const at::Tensor g = at::cat({ga, gb});
    const double norm = g.norm().item<double>();
    CHECK(s.step.lastGradNorm() == Approx(norm).epsilon(1e-6));
    const at::Tensor clipped = g * (0.5 / (norm + 1e-6));
    const at::Tensor expected = before - 0.1 * clipped / (clipped.abs() + 1.0);
    CHECK(at::allclose(s.values(), expected, 1e-6, 1e-7));
    CHECK(s.state.optimizer().stepCount() == 1);
  }
}

TEST_CASE("a non-finite gradient stops the step naming the first parameter, or is skipped and counted",
          "[optimizer_step]") {
  const at::Tensor ga = at::ones({6}, at::kFloat);
  at::Tensor gb = at::ones({3}, at::kFloat);
  gb[1] = std::nan("");
  for (int stage : {1, 2}) {
    INFO("stage " << stage);
    Stepped error(stage, R"("zeroshard": {"nonfinite": "error"})");
    const at::Tensor before = error.values();
    error.backward(ga, gb);
    const std::string text = errorText([&] { error.take(1); });
    CHECK(contains(text, "the gradients of step 1 hold an inf or NaN"));
    CHECK(contains(text, "the first parameter with a non-finite gradient is 'b'"));
    CHECK(at::equal(error.values(), before));
    CHECK(error.state.optimizer().stepCount() == 0);

    Stepped skip(stage, R"("zeroshard": {"nonfinite": "skip"})");
    skip.backward(ga, gb);
    CHECK_FALSE(skip.take(1));
    CHECK(skip.step.skippedSteps() == 1);
    CHECK(at::equal(skip.values(), before));
    // The skipped step's gradients are gone: the next finite step is AdamW's first.
    skip.backward(ga, at::ones({3}, at::kFloat));
    CHECK(skip.take(2));
    CHECK(skip.state.optimizer().stepCount() == 1);
  }
}

TEST_CASE("the config's schedule owns the lr: its start values, one step per step taken, set_lr refused",
          "[optimizer_step]") {
  const std::string keys = R"("optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                                    "warmup_num_steps": 4, "warmup_type": "linear"}})";
  Stepped s(1, keys);
  zeroshard::LrSchedule reference(s.config.scheduler, {0.1});
  REQUIRE(reference.current());
  CHECK(OptimizerStep::learningRates(s.state.optimizer()) == std::vector<double>{reference.current()->at(0).lr});
  for (int64_t boundary = 1; boundary <= 3; ++boundary) {
    s.backward(at::ones({6}), at::ones({3}));
    CHECK(s.take(boundary));
    CHECK(OptimizerStep::learningRates(s.state.optimizer()) == std::vector<double>{reference.step().at(0).lr});
  }
  CHECK(contains(errorText([&] { s.step.setLearningRate(s.state.optimizer(), 0.5, -1); }),
                 "the config's scheduler (WarmupLR) sets the learning rate after every optimizer step"));
}
