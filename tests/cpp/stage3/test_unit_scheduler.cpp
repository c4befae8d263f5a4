// Stage 3 without the Engine: the UnitScheduler (csrc/zeroshard/stage3/unit_scheduler.*), which
// gathers and releases units (cut by buildStage3Units, tested in test_unit_builder.cpp) around a
// real forward and backward, over a Gloo group of one rank in this process. The gradients go through a real
// GradReducer, whose start of each unit's reduce-scatter releases the unit, as in the engine.
// Two ranks (gathers that combine both ranks' shards, the cross-rank order check) run in
// tests/cpp/grad_worker.cpp.
#include "error_text.h"
#include "single_rank_group.h"
#include "unit_fixtures.h"
#include "spawn_ranks.h"
#include "zeroshard/comm/communicator.h"
#include "zeroshard/comm/process_group.h"
#include "zeroshard/grad/grad_reducer.h"
#include "zeroshard/grad/grad_storage.h"
#include "zeroshard/layout/param_groups.h"
#include "zeroshard/plan/sharding_plan.h"
#include "zeroshard/stage3/unit_builder.h"
#include "zeroshard/stage3/unit_scheduler.h"

#include <ATen/ATen.h>
// Complete type for the intrusive_ptr that initProcessGroupFromEnv() returns.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

// c10's logging (pulled in by the ATen headers above) defines a glog-style CHECK that aborts;
// the tests' CHECK must be Catch2's, so it is dropped before catch.h defines it.
#undef CHECK
#include "catch.h"


#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

using zeroshard::CollectiveKind;
using zeroshard::Communicator;
using zeroshard::GradReducer;
using zeroshard::GradStorage;
using zeroshard::ParamGroupSpec;
using zeroshard::ReductionOptions;
using zeroshard::ShardingPlan;
using zeroshard::Stage3Units;
using zeroshard::UnitIndex;
using zeroshard::UnitOptions;
using zeroshard::UnitScheduler;
using zeroshard::UnitSpec;
using zeroshard::testing::contains;
using zeroshard::testing::errorText;
using zeroshard::testing::kTimeout;
using zeroshard::testing::leaf;
using zeroshard::testing::namesIn;
using zeroshard::testing::singleRankGroup;

namespace {

constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max();

// ---- the model the scheduler runs ------------------------------------------------------------
//
//   unit "blocks.0": w0 [60]          s0 = (w0 * x).sum()
//   unit "blocks.1": w1 [40]          h1 = w1 * s0
//   root:            head [40]        loss = (h1 * head).sum()
//   (with `norm`, a root parameter of 6 elements that the persistence threshold 6 keeps gathered)
//
// At one rank the units are 64, 48 and 48 elements padded (256, 192, 192 bytes in fp32), the
// kept unit 16 (64 bytes). Backward needs w1 and head again (saved by the products), so a unit
// that was not gathered again would be read while released.
constexpr UnitIndex kBlock0{0};
constexpr UnitIndex kBlock1{1};
constexpr UnitIndex kRoot{2};
constexpr UnitIndex kKept{3};
constexpr int64_t kBlock0Bytes = 64 * 4;
constexpr int64_t kBlock1Bytes = 48 * 4;
constexpr int64_t kRootBytes = 48 * 4;

struct Net {
  std::map<std::string, at::Tensor> params;
  std::map<std::string, at::Tensor> initial;  // the values before the units took the parameters
  Stage3Units units;

  const at::Tensor& p(const std::string& name) const { return params.at(name); }
};

std::unique_ptr<Net> makeNet(UnitOptions options = {}, bool withNorm = false) {
  auto net = std::make_unique<Net>();
  ParamGroupSpec group;
  const std::vector<std::pair<std::string, at::Tensor>> made = {
      {"blocks.0.w", leaf(60, 0.25)}, {"blocks.1.w", leaf(40, 0.5)}, {"head", leaf(40, 0.125)}, {"norm", leaf(6, 2)}};
  for (const auto& [name, tensor] : made) {
    if (name == "norm" && !withNorm) continue;
    group.names.push_back(name);
    group.params.push_back(tensor);
    net->params[name] = tensor;
    net->initial[name] = tensor.detach().clone();
  }
  std::vector<UnitSpec> specs = {{"blocks.0", {"blocks.0.w"}, false}, {"blocks.1", {"blocks.1.w"}, false},
                                 {"<root>", {"head"}, true}};
  if (withNorm) specs.back().paramNames.push_back("norm");
  net->units = zeroshard::buildStage3Units({group}, specs, options, /*rank=*/0, /*worldSize=*/1, at::kFloat);
  return net;
}

int64_t liveBytes(const zeroshard::Bucket& unit) {
  return static_cast<int64_t>(unit.flatParams().storage().nbytes());
}

bool released(const Net& net, UnitIndex u) {
  const auto& unit = net.units.buckets[u.value];
  if (liveBytes(unit) != 0) return false;
  for (const auto& p : unit.params()) {
    if (p.storage().nbytes() != 0) return false;
  }
  return true;
}

bool gathered(const Net& net, UnitIndex u) {
  const auto& unit = net.units.buckets[u.value];
  return liveBytes(unit) == unit.layout().paddedNumel() * 4;
}

// The unit's parameters hold what its shard holds (one rank: the shard is the whole buffer).
bool holdsShard(const Net& net, UnitIndex u) {
  const auto& unit = net.units.buckets[u.value];
  return gathered(net, u) && at::equal(unit.flatParams(), unit.paramShard());
}

// Each unit's forward between the scheduler's hooks, as Engine::runUnit runs it. A unit that
// preForward left released fails the forward before it is read.
struct Outputs {
  at::Tensor s0, h1, loss;
};
Outputs forward(UnitScheduler& scheduler, const Net& net, const at::Tensor& x) {
  auto run = [&](UnitIndex u) {
    scheduler.preForward(u);
    TORCH_CHECK(gathered(net, u), "unit ", u.value, " is not gathered after preForward");
  };
  Outputs out;
  run(kBlock0);
  out.s0 = (net.p("blocks.0.w") * x).sum();
  scheduler.postForward(kBlock0, {out.s0});
  run(kBlock1);
  out.h1 = net.p("blocks.1.w") * out.s0;
  scheduler.postForward(kBlock1, {out.h1});
  run(kRoot);
  out.loss = (out.h1 * net.p("head")).sum();
  scheduler.postForward(kRoot, {out.loss});
  return out;
}

at::Tensor input() {
  return at::arange(60, at::kFloat).remainder(3).sub(1);
}

// The same forward on plain tensors with the initial values: its loss and gradients.
struct Reference {
  at::Tensor loss;
  std::map<std::string, at::Tensor> grads;
};
Reference reference(const Net& net) {
  std::map<std::string, at::Tensor> p;
  for (const auto& [name, value] : net.initial) p[name] = value.clone().set_requires_grad(true);
  // The operations of forward(), in its order.
  auto s0 = (p["blocks.0.w"] * input()).sum();
  auto h1 = p["blocks.1.w"] * s0;
  auto loss = (h1 * p["head"]).sum();
  loss.backward();
  Reference ref{loss.detach(), {}};
  for (const auto& name : {"blocks.0.w", "blocks.1.w", "head"}) ref.grads[name] = p[name].grad();
  return ref;
}

// The scheduler, the gradient storage and the reducer as the engine wires them at stage 3.
struct Stage3 {
  Stage3(Net& net, int64_t prefetch = kNoLimit, int64_t maxLive = kNoLimit)
      : comm(singleRankGroup(), kTimeout),
        scheduler(net.units.buckets, net.units.policies, comm, prefetch, maxLive),
        grads(GradStorage::forPlan(ShardingPlan::forStage(3, 1), net.units.buckets, 0, {})),
        reducer(net.units.buckets, *grads, comm, [this] {
          ReductionOptions options;
          options.onLaunched = [this](size_t unit) { scheduler.afterGradReduce(UnitIndex{unit}); };
          return options;
        }()) {}

  // Backward through a forward's outputs, as Engine::backward runs it. A unit that is not
  // gathered when the gradient reaches its output fails the backward before it reads the
  // released parameters.
  void backward(const Net& net, const Outputs& out) {
    auto guard = [&net](UnitIndex u) {
      return [&net, u](const at::TensorBase&) {
        TORCH_CHECK(gathered(net, u), "unit ", u.value, " is not gathered when its backward starts");
      };
    };
    out.loss.register_hook(guard(kRoot));
    out.h1.register_hook(guard(kBlock1));
    out.s0.register_hook(guard(kBlock0));
    reducer.beginBackward(true);
    try {
      out.loss.backward();
    } catch (...) {
      reducer.abortBackward();
      throw;
    }
    reducer.finishBackward();
    scheduler.finishBackward();
  }

  // One training step's forward and backward; its loss.
  at::Tensor step(const Net& net) {
    const auto out = forward(scheduler, net, input());
    backward(net, out);
    return out.loss;
  }

  int64_t gathers() const { return comm.stats()[CollectiveKind::kAllGather].calls; }
  int64_t gatheredBytes() const { return comm.stats()[CollectiveKind::kAllGather].bytes; }

  Communicator comm;
  UnitScheduler scheduler;
  std::unique_ptr<GradStorage> grads;
  GradReducer reducer;
};

} // namespace

// ---- assignUnits -----------------------------------------------------------------------------

TEST_CASE("after construction every unit but the kept one is released and each keeps its shard",
          "[unit_scheduler]") {
  auto net = makeNet({6, true}, /*withNorm=*/true);
  REQUIRE(net->units.buckets.size() == 4);
  Stage3 s(*net);
  for (UnitIndex u : {kBlock0, kBlock1, kRoot}) {
    INFO("unit " << u.value);
    CHECK(released(*net, u));
    CHECK(s.scheduler.isReleasable(u));
  }
  const auto& blocks0 = net->units.buckets[0];
  auto expectedShard = at::zeros({64});
  expectedShard.narrow(0, 0, 60).copy_(net->initial.at("blocks.0.w"));
  CHECK(at::equal(blocks0.paramShard(), expectedShard));
  CHECK_FALSE(s.scheduler.isReleasable(kKept));
  REQUIRE(gathered(*net, kKept));
  CHECK(at::equal(net->p("norm").detach(), net->initial.at("norm")));
  CHECK(s.scheduler.peakGatheredBytes() == 0);
  CHECK(s.gathers() == 0);
  // Held between steps: every unit's shard (at one rank, the whole padded buffer) and the kept
  // unit's full buffer besides.
  CHECK(s.scheduler.bytes() == (64 + 48 + 48 + 16) * 4 + 16 * 4);
}

TEST_CASE("preForward gathers a unit from its shard and postForward releases it unless its policy keeps it",
          "[unit_scheduler]") {
  auto net = makeNet();
  Stage3 s(*net);
  // What the parameters get is the shard's: change the shard and see it gathered.
  net->units.buckets[0].paramShard().add_(1);
  s.scheduler.preForward(kBlock0);
  REQUIRE(holdsShard(*net, kBlock0));
  CHECK(at::equal(net->p("blocks.0.w").detach(), net->initial.at("blocks.0.w") + 1));
  CHECK(s.gathers() == 1);
  CHECK(s.gatheredBytes() == kBlock0Bytes);
  CHECK(s.scheduler.peakGatheredBytes() == kBlock0Bytes);
  auto s0 = (net->p("blocks.0.w") * input()).sum();
  s.scheduler.postForward(kBlock0, {s0});
  CHECK(released(*net, kBlock0));

  // The root stays gathered after its forward (backward starts with it), and a gathered unit is
  // not gathered again.
  s.scheduler.preForward(kRoot);
  auto loss = (net->p("head") * 2).sum();
  s.scheduler.postForward(kRoot, {loss});
  CHECK(holdsShard(*net, kRoot));
  s.scheduler.preForward(kRoot);
  CHECK(s.gathers() == 2);
  CHECK(s.scheduler.peakGatheredBytes() == kBlock0Bytes);

  // afterGradReduce releases a gathered unit (the reducer calls it when the reduce-scatter starts).
  s.scheduler.afterGradReduce(kRoot);
  CHECK(released(*net, kRoot));

  // With reshard_after_forward false the blocks stay gathered too.
  auto keep = makeNet({0, false});
  Stage3 k(*keep);
  k.scheduler.preForward(kBlock1);
  k.scheduler.postForward(kBlock1, {(keep->p("blocks.1.w") * 3).sum()});
  CHECK(holdsShard(*keep, kBlock1));
}

TEST_CASE("a backward through postForward outputs gathers each unit again and the reducer releases it",
          "[unit_scheduler]") {
  auto net = makeNet();
  Stage3 s(*net);
  const auto ref = reference(*net);
  const auto out = forward(s.scheduler, *net, input());
  CHECK(at::equal(out.loss.detach(), ref.loss));
  CHECK(released(*net, kBlock0));
  CHECK(released(*net, kBlock1));
  CHECK(gathered(*net, kRoot));
  CHECK(s.gathers() == 3);

  // When the gradient reaches a unit's output (these hooks run after the scheduler's, which
  // postForward registered first) the unit must be gathered: its backward reads the parameters
  // the products saved. Failing here stops backward before it reads released memory.
  std::vector<size_t> seen;
  auto expectGathered = [&](UnitIndex u) {
    return [&, u](const at::TensorBase&) {
      TORCH_CHECK(holdsShard(*net, u), "unit ", u.value, " is not gathered from its shard when its backward starts");
      seen.push_back(u.value);
    };
  };
  out.loss.register_hook(expectGathered(kRoot));
  out.h1.register_hook(expectGathered(kBlock1));
  out.s0.register_hook(expectGathered(kBlock0));
  const auto& loss = out.loss;
  s.reducer.beginBackward(true);
  loss.backward();
  s.reducer.finishBackward();
  CHECK(seen == std::vector<size_t>{2, 1, 0});
  // Every unit was released as soon as its reduce-scatter started; nothing is left gathered.
  for (UnitIndex u : {kBlock0, kBlock1, kRoot}) CHECK(released(*net, u));
  // Forward: 3 gathers; backward: blocks.1 and blocks.0 again (the root was still gathered).
  CHECK(s.gathers() == 5);
  CHECK(s.gatheredBytes() == kBlock0Bytes + kBlock1Bytes + kRootBytes + kBlock1Bytes + kBlock0Bytes);
  s.scheduler.finishBackward();
  // The gradients are the plain model's, bit for bit.
  const std::vector<std::pair<UnitIndex, std::string>> owners = {
      {kBlock0, "blocks.0.w"}, {kBlock1, "blocks.1.w"}, {kRoot, "head"}};
  for (const auto& [u, name] : owners) {
    INFO(name);
    const auto& grad = ref.grads.at(name);
    CHECK(at::equal(s.grads->optimizerGrad(u.value).narrow(0, 0, grad.numel()), grad));
  }
}

TEST_CASE("peakGatheredBytes is the most gathered at once with and without prefetch", "[unit_scheduler]") {
  // The first step records the order and prefetches nothing: the largest unit, blocks.0, alone
  // (the root is released by its reduce-scatter before blocks.1 is gathered again).
  struct Case {
    int64_t prefetch;
    int64_t maxLive;
    int64_t forwardPeak;
    int64_t backwardPeak;
  };
  // Later steps prefetch one unit ahead along the recorded order: in forward blocks.1 while
  // blocks.0 runs (then the root while blocks.1 runs); in backward blocks.1 while the root runs,
  // then blocks.0 while blocks.1 runs. stage3_max_live_parameters 111 (< 64 + 48 elements)
  // forbids blocks.0 with blocks.1 but not blocks.1 with the root; prefetch 0 turns it off.
  const std::vector<Case> cases = {{1, kNoLimit, kBlock0Bytes + kBlock1Bytes, kBlock0Bytes + kBlock1Bytes},
                                   {1 << 20, 111, kBlock1Bytes + kRootBytes, kRootBytes + kBlock1Bytes},
                                   {0, kNoLimit, kBlock0Bytes, kBlock0Bytes}};
  for (const auto& c : cases) {
    INFO("prefetch " << c.prefetch << ", max live " << c.maxLive);
    auto net = makeNet();
    Stage3 s(*net, c.prefetch, c.maxLive);
    const auto ref = reference(*net);
    s.step(*net);
    CHECK(s.scheduler.peakGatheredBytes() == kBlock0Bytes);
    for (UnitIndex u : {kBlock0, kBlock1, kRoot}) CHECK(released(*net, u));
    s.scheduler.resetPeak();
    CHECK(s.scheduler.peakGatheredBytes() == 0);
    s.grads->zero();

    const auto out = forward(s.scheduler, *net, input());
    CHECK(at::equal(out.loss.detach(), ref.loss));
    CHECK(s.scheduler.peakGatheredBytes() == c.forwardPeak);
    s.scheduler.resetPeak();  // from what is gathered now: the root
    CHECK(s.scheduler.peakGatheredBytes() == kRootBytes);
    s.backward(*net, out);
    CHECK(s.scheduler.peakGatheredBytes() == c.backwardPeak);
    for (UnitIndex u : {kBlock0, kBlock1, kRoot}) CHECK(released(*net, u));
    CHECK(at::equal(s.grads->optimizerGrad(1).narrow(0, 0, 40), ref.grads.at("blocks.1.w")));
  }
}

TEST_CASE("later training forwards must run the units in the recorded order", "[unit_scheduler]") {
  auto net = makeNet();
  Stage3 s(*net);
  s.step(*net);
  s.grads->zero();
  const int64_t before = s.gathers();
  // blocks.1 where the first step ran blocks.0; the unit is named by its first parameter.
  const std::string error = errorText([&] { s.scheduler.preForward(kBlock1); });
  CHECK(contains(error, "unit 'blocks.1.w' ran at position 0 of this forward, but the first step ran 'blocks.0.w' "
                        "there; every training forward must run the units in the same order on every rank"));
  CHECK(released(*net, kBlock1));
  CHECK(s.gathers() == before);
  // Further along: blocks.0 twice.
  s.scheduler.preForward(kBlock0);
  CHECK(contains(errorText([&] { s.scheduler.preForward(kBlock0); }),
                 "unit 'blocks.0.w' ran at position 1 of this forward, but the first step ran 'blocks.1.w' there"));
  s.scheduler.reshardAll();
  // finishBackward starts the order over; the recorded order runs, and so does a training
  // forward after one that had no backward.
  s.scheduler.finishBackward();
  forward(s.scheduler, *net, input());
  s.scheduler.reshardAll();
  CHECK(errorText([&] { s.step(*net); }).empty());
}

TEST_CASE("no_grad forwards run units in any order and release every unit", "[unit_scheduler]") {
  auto net = makeNet();
  Stage3 s(*net);
  auto evaluate = [&](std::vector<UnitIndex> order) {
    at::NoGradGuard noGrad;
    for (UnitIndex u : order) {
      s.scheduler.preForward(u);
      REQUIRE(holdsShard(*net, u));
      s.scheduler.postForward(u, {net->units.buckets[u.value].params()[0] * 2});
      CHECK(released(*net, u));  // the root too: no backward will follow
    }
  };
  // Before the first training step: not recorded.
  evaluate({kRoot, kBlock1, kBlock0, kBlock1});
  const auto ref = reference(*net);
  CHECK(at::equal(s.step(*net).detach(), ref.loss));
  // Between training steps: neither checked nor counted as the next training forward's units.
  evaluate({kBlock1, kRoot});
  s.grads->zero();
  CHECK(errorText([&] { s.step(*net); }).empty());
  CHECK(at::equal(s.grads->optimizerGrad(0).narrow(0, 0, 60), ref.grads.at("blocks.0.w")));
}

TEST_CASE("gatherAll gathers every unit and reshardAll releases all but the kept one", "[unit_scheduler]") {
  auto net = makeNet({6, true}, /*withNorm=*/true);
  REQUIRE(net->units.buckets.size() == 4);
  Stage3 s(*net);
  s.scheduler.gatherAll();
  for (UnitIndex u : {kBlock0, kBlock1, kRoot, kKept}) {
    INFO("unit " << u.value);
    REQUIRE(holdsShard(*net, u));
  }
  for (const auto& name : {"blocks.0.w", "blocks.1.w", "head", "norm"}) {
    CHECK(at::equal(net->p(name).detach(), net->initial.at(name)));
  }
  // One all-gather per released unit (the kept one is gathered already), all of them at once.
  CHECK(s.gathers() == 3);
  CHECK(s.scheduler.peakGatheredBytes() == kBlock0Bytes + kBlock1Bytes + kRootBytes);
  CHECK(s.scheduler.bytes() == (64 + 48 + 48 + 16) * 4 + 16 * 4);  // gathered buffers are transient
  s.scheduler.reshardAll();
  for (UnitIndex u : {kBlock0, kBlock1, kRoot}) CHECK(released(*net, u));
  REQUIRE(holdsShard(*net, kKept));
  CHECK(at::equal(net->p("norm").detach(), net->initial.at("norm")));
}

TEST_CASE("refreshKeptUnits all-gathers the kept unit's updated shard", "[unit_scheduler]") {
  auto net = makeNet({6, true}, /*withNorm=*/true);
  REQUIRE(net->units.buckets.size() == 4);
  Stage3 s(*net);
  net->units.buckets[kKept.value].paramShard().mul_(3);  // what an optimizer step would do
  s.scheduler.refreshKeptUnits();
  CHECK(s.gathers() == 1);
  CHECK(s.gatheredBytes() == 16 * 4);
  REQUIRE(gathered(*net, kKept));
  CHECK(at::equal(net->p("norm").detach(), net->initial.at("norm") * 3));
  for (UnitIndex u : {kBlock0, kBlock1, kRoot}) CHECK(released(*net, u));
}

TEST_CASE("finishBackward releases the units a backward left gathered", "[unit_scheduler]") {
  // reshard_after_forward false and no reducer to release units at their reduce-scatter.
  auto net = makeNet({0, false});
  Communicator comm(singleRankGroup(), kTimeout);
  UnitScheduler scheduler(net->units.buckets, net->units.policies, comm, kNoLimit, kNoLimit);
  const auto out = forward(scheduler, *net, input());
  for (UnitIndex u : {kBlock0, kBlock1, kRoot}) CHECK(holdsShard(*net, u));
  CHECK(scheduler.peakGatheredBytes() == kBlock0Bytes + kBlock1Bytes + kRootBytes);
  out.loss.backward();
  for (UnitIndex u : {kBlock0, kBlock1, kRoot}) CHECK(gathered(*net, u));
  scheduler.finishBackward();
  for (UnitIndex u : {kBlock0, kBlock1, kRoot}) CHECK(released(*net, u));
  const auto ref = reference(*net);
  CHECK(at::equal(net->p("head").grad(), ref.grads.at("head")));
  CHECK(at::equal(net->p("blocks.0.w").grad(), ref.grads.at("blocks.0.w")));
}

TEST_CASE("two ranks gather every rank's shard and agree on the unit order", "[unit_scheduler]") {
  auto outcomes = zeroshard::testing::spawnRanks(ZEROSHARD_GRAD_WORKER, "units_gather", 2);
  INFO(zeroshard::testing::describeFailures(outcomes));
  CHECK(zeroshard::testing::describeFailures(outcomes).empty());
}

TEST_CASE("ranks that run the units in different orders fail the first step with the units named",
          "[unit_scheduler]") {
  auto outcomes = zeroshard::testing::spawnRanks(ZEROSHARD_GRAD_WORKER, "units_order_mismatch", 2);
  INFO(zeroshard::testing::describeFailures(outcomes));
  REQUIRE(zeroshard::testing::describeFailures(outcomes).empty());
  for (const auto& outcome : outcomes) CHECK(contains(outcome.output, "expected error"));
}
