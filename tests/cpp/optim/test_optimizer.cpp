// ShardedAdamW (csrc/zeroshard/optim/optimizer.*): AdamW on flat fp32 shards, held to
// torch::optim::AdamW on the same values, with two param groups of different hyper-parameters
// and several shards per group; 16-bit gradients against fp32 gradients of the same values;
// the steps of an fp16 / clipped boundary (prepare, unscale and find inf/NaN, sum of squares,
// scale, discard); exact byte counts; and the checkpoint round trip.
#include "error_text.h"
#include "optim/optimizer_fixtures.h"
#include "zeroshard/optim/optimizer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adamw.h>

// c10's logging (pulled in by the ATen and torch headers above) defines a glog-style CHECK
// that aborts; the tests' CHECK must be Catch2's, so it is dropped before catch.h defines it.
#undef CHECK
#include "catch.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

using zeroshard::AdamWHyper;
using zeroshard::ShardedAdamW;
using zeroshard::testing::contains;
using zeroshard::testing::errorText;

namespace {

struct Snapshot {
  std::vector<at::Tensor> masters, expAvgs, expAvgSqs;
};

Snapshot snapshot(const ShardedAdamW& opt, const std::vector<GroupSpec>& specs) {
  Snapshot out;
  for (size_t g = 0; g < specs.size(); ++g) {
    for (size_t i = 0; i < specs[g].shardNumels.size(); ++i) {
      const auto st = opt.shardState(static_cast<int>(g), i);
      out.masters.push_back(st.master.clone());
      out.expAvgs.push_back(st.expAvg.clone());
      out.expAvgSqs.push_back(st.expAvgSq.clone());
    }
  }
  return out;
}

bool unchangedSince(const Snapshot& before, const ShardedAdamW& opt, const std::vector<GroupSpec>& specs) {
  const Snapshot now = snapshot(opt, specs);
  bool same = true;
  for (size_t k = 0; k < before.masters.size(); ++k) {
    same = same && sameBits(before.masters[k], now.masters[k]) && sameBits(before.expAvgs[k], now.expAvgs[k]) &&
           sameBits(before.expAvgSqs[k], now.expAvgSqs[k]);
  }
  return same;
}

int64_t largestShard(const std::vector<GroupSpec>& specs) {
  int64_t n = 0;
  for (const auto& spec : specs) {
    for (int64_t numel : spec.shardNumels) n = std::max(n, numel);
  }
  return n;
}

double sumOfSquares(const Shards& s) {
  double sum = 0;
  for (const auto& group : s.grads) {
    for (const auto& g : group) sum += g.to(at::kDouble).square().sum().item<double>();
  }
  return sum;
}

double relativeError(double value, double expected) { return std::abs(value - expected) / std::abs(expected); }

// Note [tolerance against torch::optim::AdamW]: the two are not bit for bit equal after the
// first step, and cannot be. torch::optim::AdamW's step is a chain of separate ATen ops (mul_,
// add_ with alpha, addcmul_, sqrt, a division by sqrt(bias_correction2), add_ of eps, addcdiv_),
// each rounding to fp32, some through a fused multiply-add; at::_fused_adamw_ evaluates the
// whole update of an element in one expression with its own order of operations (e.g. exp_avg
// as exp_avg * beta1 + grad * (1 - beta1): two products and a sum). The first step agrees bit
// for bit here (exp_avg and exp_avg_sq start at 0, so most roundings coincide); from the
// second on the results differ by about an ulp of the terms each op combines. So each state is
// held to the scale of what it is made of, in units of fp32 epsilon (2^-23), with about twice
// the worst seen over 200 steps of these two groups (1.1, 0.45 and 8 eps at 200 steps, 1.0,
// 0.45 and 1.7 eps at the 20 steps held here):
//   - master: |difference| <= 2 eps * max |master| of the shard (an ulp of its largest value);
//   - exp_avg: |difference| <= 1 eps * max |gradient| of the shard over the steps so far. Not
//     relative to exp_avg itself: its terms cancel where gradients change sign, and an ulp of a
//     term is then any multiple of the small sum (elementwise up to 1e-4 relative);
//   - exp_avg_sq: elementwise relative difference <= 4 eps (its terms are all >= 0, no
//     cancellation; the rounding differences accumulate slowly over 1 / (1 - beta2) steps).
// Any error of substance (a bias correction one step off, a group's hyper-parameters used for
// another, weight decay coupled into the gradient) is orders of magnitude above these.
constexpr double kEps = std::numeric_limits<float>::epsilon();
constexpr double kMasterTolerance = 2 * kEps;
constexpr double kExpAvgTolerance = 1 * kEps;
constexpr double kExpAvgSqTolerance = 4 * kEps;

// The larger of the two, where a NaN is larger than anything (std::max would drop it).
void keepWorst(double& worst, double value) {
  if (!std::isnan(worst) && (std::isnan(value) || value > worst)) worst = value;
}

double maxAbs(const at::Tensor& t) { return t.abs().max().item<double>(); }
double maxAbsDifference(const at::Tensor& a, const at::Tensor& b) {
  return maxAbs(a.to(at::kDouble) - b.to(at::kDouble));
}
double maxRelativeDifference(const at::Tensor& a, const at::Tensor& b) {
  const auto da = a.to(at::kDouble), db = b.to(at::kDouble);
  return ((da - db).abs() / db.abs().clamp_min(std::numeric_limits<double>::min())).max().item<double>();
}

} // namespace

TEST_CASE("ShardedAdamW matches torch optim AdamW with two groups of several shards", "[optimizer]") {
  const auto specs = groupSpecs();
  Shards shards = makeShards(specs, {at::kFloat, at::kFloat});

  // The reference: one parameter per shard, each group with its own hyper-parameters.
  std::vector<torch::optim::OptimizerParamGroup> refGroups;
  std::vector<std::vector<at::Tensor>> refParams;
  for (size_t g = 0; g < specs.size(); ++g) {
    const auto& hp = specs[g].hyper;
    refParams.emplace_back();
    for (const auto& m : shards.masters[g]) refParams[g].push_back(m.clone().set_requires_grad(true));
    auto options = std::make_unique<torch::optim::AdamWOptions>(hp.lr);
    options->betas(std::make_tuple(hp.beta1, hp.beta2)).eps(hp.eps).weight_decay(hp.weightDecay).amsgrad(false);
    refGroups.emplace_back(refParams[g], std::move(options));
  }
  torch::optim::AdamW reference(std::move(refGroups));

  ShardedAdamW opt;
  registerShards(opt, specs, shards);

  // Note [tolerance against torch::optim::AdamW]: the worst of each measure, in eps.
  double worstMaster = 0, worstExpAvg = 0, worstExpAvgSq = 0;
  std::vector<std::vector<double>> gradScale(specs.size());  // max |gradient| so far, per shard
  for (size_t g = 0; g < specs.size(); ++g) gradScale[g].assign(specs[g].shardNumels.size(), 0.0);
  constexpr int kSteps = 20;
  for (int step = 0; step < kSteps; ++step) {
    plainStep(opt, shards, step);
    for (size_t g = 0; g < specs.size(); ++g) {
      for (size_t i = 0; i < refParams[g].size(); ++i) {
        refParams[g][i].mutable_grad() = gradValues(step, static_cast<int>(g), i, refParams[g][i].numel());
        gradScale[g][i] = std::max(gradScale[g][i], maxAbs(refParams[g][i].grad()));
      }
    }
    reference.step();
    for (size_t g = 0; g < specs.size(); ++g) {
      for (size_t i = 0; i < refParams[g].size(); ++i) {
        const auto p = refParams[g][i].detach();
        const auto& state = static_cast<const torch::optim::AdamWParamState&>(
            *reference.state().at(refParams[g][i].unsafeGetTensorImpl()));
        REQUIRE(state.step() == step + 1);
        const auto mine = opt.shardState(static_cast<int>(g), i);
        keepWorst(worstMaster, maxAbsDifference(mine.master, p) / maxAbs(p) / kEps);
        keepWorst(worstExpAvg, maxAbsDifference(mine.expAvg, state.exp_avg()) / gradScale[g][i] / kEps);
        keepWorst(worstExpAvgSq, maxRelativeDifference(mine.expAvgSq, state.exp_avg_sq()) / kEps);
      }
    }
  }
  INFO("worst over " << kSteps << " steps, in fp32 eps: master " << worstMaster << ", exp_avg " << worstExpAvg
                     << ", exp_avg_sq " << worstExpAvgSq);
  CHECK(opt.stepCount() == kSteps);
  CHECK(worstMaster <= kMasterTolerance / kEps);
  CHECK(worstExpAvg <= kExpAvgTolerance / kEps);
  CHECK(worstExpAvgSq <= kExpAvgSqTolerance / kEps);
  // The masters did move: the comparison is not of two untouched copies.
  CHECK(maxAbsDifference(shards.masters[0][0], refParams[0][0].detach()) <
        maxAbsDifference(shards.masters[0][0], makeShards(specs, {at::kFloat, at::kFloat}).masters[0][0]));
}

TEST_CASE("16-bit gradients step exactly as fp32 gradients of the same values", "[optimizer]") {
  const auto specs = groupSpecs();
  for (const auto sixteenBit : {at::kBFloat16, at::kHalf}) {
    // Group 0 with 16-bit gradients and group 1 with fp32 ones, then both 16-bit.
    for (const auto& dtypes : std::vector<std::vector<at::ScalarType>>{{sixteenBit, at::kFloat},
                                                                      {sixteenBit, sixteenBit}}) {
      Shards sixteen = makeShards(specs, dtypes);
      Shards fp32 = makeShards(specs, {at::kFloat, at::kFloat});
      ShardedAdamW a, b;
      registerShards(a, specs, sixteen);
      registerShards(b, specs, fp32);
      INFO("gradients " << dtypes[0] << " and " << dtypes[1]);
      bool same = true;
      for (int step = 0; step < 6; ++step) {
        // The boundary of an fp16 / clipped step: unscale, sum of squares, scale, step.
        loadGrads(sixteen, step, sixteenBit);
        loadGrads(fp32, step, sixteenBit);
        a.prepareGrads();
        b.prepareGrads();
        const double inverse = 1.0 / 1024;
        const auto foundA = a.unscaleAndFindNonFinite(inverse, at::kCPU);
        const auto foundB = b.unscaleAndFindNonFinite(inverse, at::kCPU);
        same = same && foundA.item<float>() == 0 && foundB.item<float>() == 0;
        const auto squaresA = a.localGradSquareSum(at::kCPU);
        const auto squaresB = b.localGradSquareSum(at::kCPU);
        same = same && squaresA.item<double>() == squaresB.item<double>();
        const auto factor = at::full({}, 0.3 + 0.1 * step, at::kDouble);
        a.scaleGrads(factor);
        b.scaleGrads(factor);
        // A second sum after the scaling sees the scaled values in both.
        same = same && a.localGradSquareSum(at::kCPU).item<double>() == b.localGradSquareSum(at::kCPU).item<double>();
        a.step();
        b.step();
        same = same && sameState(a, b, specs);
      }
      CHECK(same);
      // The registered 16-bit gradients are left as they were (only fp32 ones are scaled in place).
      bool untouched = true;
      for (size_t g = 0; g < specs.size(); ++g) {
        if (dtypes[g] == at::kFloat) continue;
        for (size_t i = 0; i < sixteen.grads[g].size(); ++i) {
          untouched = untouched && sameBits(sixteen.grads[g][i],
                                            gradValues(5, static_cast<int>(g), i, sixteen.grads[g][i].numel())
                                                .to(sixteenBit));
        }
      }
      CHECK(untouched);
    }
  }
}

TEST_CASE("a discarded step leaves masters and state unchanged and later steps as if it never was",
          "[optimizer]") {
  const auto specs = groupSpecs();
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    INFO("gradients " << dtype);
    Shards skipping = makeShards(specs, {dtype, dtype});
    Shards straight = makeShards(specs, {dtype, dtype});
    ShardedAdamW a, b;
    registerShards(a, specs, skipping);
    registerShards(b, specs, straight);
    for (int step = 0; step < 3; ++step) {
      plainStep(a, skipping, step, at::kBFloat16);
      plainStep(b, straight, step, at::kBFloat16);
    }
    const Snapshot before = snapshot(a, specs);
    // An overflowed fp16 boundary: prepared, unscaled, found non-finite, dropped.
    loadGrads(skipping, 99, at::kBFloat16);
    skipping.grads[1][2][5] = std::numeric_limits<float>::infinity();
    a.prepareGrads();
    const auto found = a.unscaleAndFindNonFinite(1.0 / 8, at::kCPU);
    CHECK(found.item<float>() != 0);
    a.scaleGrads(at::full({}, 0.5, at::kDouble));
    a.discardPrepared();
    CHECK(unchangedSince(before, a, specs));
    CHECK(a.stepCount() == 3);
    CHECK(sameState(a, b, specs));
    // The multiplications of the discarded step do not leak into the next one.
    for (int step = 3; step < 6; ++step) {
      plainStep(a, skipping, step, at::kBFloat16);
      plainStep(b, straight, step, at::kBFloat16);
    }
    CHECK(sameState(a, b, specs));
  }
}

TEST_CASE("step without prepareGrads is an error", "[optimizer]") {
  const auto specs = groupSpecs();
  Shards shards = makeShards(specs, {at::kFloat, at::kFloat});
  ShardedAdamW opt;
  registerShards(opt, specs, shards);
  CHECK(contains(errorText([&] { opt.step(); }), "step() without prepareGrads()"));
  plainStep(opt, shards, 0);
  // After a step, and after a discarded one, the gradients must be prepared again.
  CHECK(contains(errorText([&] { opt.step(); }), "step() without prepareGrads()"));
  opt.prepareGrads();
  opt.discardPrepared();
  CHECK(contains(errorText([&] { opt.step(); }), "step() without prepareGrads()"));
}

TEST_CASE("unscaleAndFindNonFinite unscales and flags an inf or NaN in any shard", "[optimizer]") {
  const auto specs = groupSpecs();
  const float kInf = std::numeric_limits<float>::infinity();
  const float kNaN = std::numeric_limits<float>::quiet_NaN();
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    INFO("gradients " << dtype);
    {  // finite gradients: not flagged, and fp32 ones unscaled in place
      Shards shards = makeShards(specs, {dtype, dtype});
      ShardedAdamW opt;
      registerShards(opt, specs, shards);
      loadGrads(shards, 0, at::kBFloat16);
      const double before = sumOfSquares(shards);
      opt.prepareGrads();
      const auto found = opt.unscaleAndFindNonFinite(0.25, at::kCPU);
      CHECK(found.scalar_type() == at::kFloat);
      CHECK(found.numel() == 1);
      CHECK(found.device().is_cpu());
      CHECK(found.item<float>() == 0);
      // The sum of squares sees the unscaled values (0.25 is a power of two: exact).
      CHECK(relativeError(opt.localGradSquareSum(at::kCPU).item<double>(), before / 16) <= 1e-6);
      if (dtype == at::kFloat) {
        CHECK(sumOfSquares(shards) == before / 16);
      } else {
        CHECK(sumOfSquares(shards) == before);
      }
    }
    for (const float bad : {kInf, -kInf, kNaN}) {
      for (const auto& [group, shard] : std::vector<std::pair<int, size_t>>{{0, 0}, {0, 2}, {1, 3}}) {
        Shards shards = makeShards(specs, {dtype, dtype});
        ShardedAdamW opt;
        registerShards(opt, specs, shards);
        loadGrads(shards, 0, at::kBFloat16);
        const int64_t at = shards.grads[group][shard].numel() - 1;
        shards.grads[group][shard][at] = bad;
        opt.prepareGrads();
        INFO(bad << " in group " << group << " shard " << shard);
        CHECK(opt.unscaleAndFindNonFinite(0.5, at::kCPU).item<float>() == 1);
      }
    }
  }
}

TEST_CASE("localGradSquareSum is the sum of squares and scaleGrads scales", "[optimizer]") {
  const auto specs = groupSpecs();
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    INFO("gradients " << dtype);
    Shards shards = makeShards(specs, {dtype, dtype});
    ShardedAdamW opt;
    registerShards(opt, specs, shards);
    loadGrads(shards, 3, at::kBFloat16);
    const double expected = sumOfSquares(shards);
    opt.prepareGrads();
    const auto squares = opt.localGradSquareSum(at::kCPU);
    CHECK(squares.scalar_type() == at::kDouble);
    CHECK(squares.dim() == 0);
    // fp32 norms per shard (Note in optimizer.cpp), summed in double: to fp32 rounding.
    CHECK(relativeError(squares.item<double>(), expected) <= 1e-6);

    const auto factor = at::full({}, 0.375, at::kDouble);  // exact in binary
    std::vector<std::vector<at::Tensor>> before;
    for (const auto& group : shards.grads) {
      before.emplace_back();
      for (const auto& g : group) before.back().push_back(g.clone());
    }
    opt.scaleGrads(factor);
    CHECK(relativeError(opt.localGradSquareSum(at::kCPU).item<double>(), expected * 0.375 * 0.375) <= 1e-6);
    bool asExpected = true;
    for (size_t g = 0; g < shards.grads.size(); ++g) {
      for (size_t i = 0; i < shards.grads[g].size(); ++i) {
        // fp32 gradients are scaled in place; 16-bit ones stay, their scaled fp32 copy is used.
        const auto want = dtype == at::kFloat ? before[g][i].mul(0.375) : before[g][i];
        asExpected = asExpected && sameBits(shards.grads[g][i], want);
      }
    }
    CHECK(asExpected);
  }
}

TEST_CASE("stateBytes and peakConvertedBytes are exact", "[optimizer]") {
  const auto specs = groupSpecs();
  int64_t elements = 0;
  for (const auto& spec : specs) {
    for (int64_t n : spec.shardNumels) elements += n;
  }
  SECTION("fp32 gradients: no conversions") {
    Shards shards = makeShards(specs, {at::kFloat, at::kFloat});
    ShardedAdamW opt;
    registerShards(opt, specs, shards);
    CHECK(opt.stateBytes() == 8 * elements);  // exp_avg and exp_avg_sq, fp32
    CHECK(opt.peakConvertedBytes() == 0);
    loadGrads(shards, 0);
    opt.prepareGrads();
    opt.unscaleAndFindNonFinite(1.0, at::kCPU);
    opt.localGradSquareSum(at::kCPU);
    opt.step();
    CHECK(opt.peakConvertedBytes() == 0);
    CHECK(opt.stateBytes() == 8 * elements);
  }
  SECTION("16-bit gradients: one shard's fp32 copy at a time") {
    Shards shards = makeShards(specs, {at::kBFloat16, at::kBFloat16});
    ShardedAdamW opt;
    registerShards(opt, specs, shards);
    CHECK(opt.stateBytes() == 8 * elements);
    loadGrads(shards, 0, at::kBFloat16);
    opt.prepareGrads();
    opt.unscaleAndFindNonFinite(1.0, at::kCPU);
    CHECK(opt.peakConvertedBytes() == 4 * largestShard(specs));
    opt.localGradSquareSum(at::kCPU);
    opt.scaleGrads(at::full({}, 0.5, at::kDouble));
    opt.step();
    CHECK(opt.peakConvertedBytes() == 4 * largestShard(specs));
    CHECK(opt.stateBytes() == 8 * elements);
    // The next boundary starts counting afresh.
    opt.prepareGrads();
    CHECK(opt.peakConvertedBytes() == 0);
  }
  SECTION("mixed: only the 16-bit group's shards are converted") {
    // Group 0 (largest shard 64) fp32, group 1 (largest 48) 16-bit.
    Shards shards = makeShards(specs, {at::kFloat, at::kBFloat16});
    ShardedAdamW opt;
    registerShards(opt, specs, shards);
    plainStep(opt, shards, 0, at::kBFloat16);
    CHECK(opt.peakConvertedBytes() == 4 * 48);
  }
}

TEST_CASE("a fresh optimizer given another's shardState and step count continues bit for bit",
          "[optimizer]") {
  const auto specs = groupSpecs();
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    INFO("gradients " << dtype);
    Shards first = makeShards(specs, {dtype, dtype});
    ShardedAdamW original;
    registerShards(original, specs, first);
    for (int step = 0; step < 4; ++step) plainStep(original, first, step, at::kBFloat16);

    // Other initial masters: everything must come from the saved state.
    Shards second = makeShards(specs, {dtype, dtype}, /*seed=*/777);
    ShardedAdamW restored;
    registerShards(restored, specs, second);
    bool sameTensors = true;
    for (size_t g = 0; g < specs.size(); ++g) {
      for (size_t i = 0; i < specs[g].shardNumels.size(); ++i) {
        const auto from = original.shardState(static_cast<int>(g), i);
        const auto to = restored.shardState(static_cast<int>(g), i);
        // shardState hands out the optimizer's own tensors: writes into them are the load.
        sameTensors = sameTensors && to.master.is_same(second.masters[g][i]);
        to.master.copy_(from.master);
        to.expAvg.copy_(from.expAvg);
        to.expAvgSq.copy_(from.expAvgSq);
      }
    }
    CHECK(sameTensors);
    restored.setStepCount(original.stepCount());
    CHECK(restored.stepCount() == 4);
    CHECK(sameState(original, restored, specs));
    for (int step = 4; step < 10; ++step) {
      plainStep(original, first, step, at::kBFloat16);
      plainStep(restored, second, step, at::kBFloat16);
    }
    CHECK(restored.stepCount() == 10);
    CHECK(sameState(original, restored, specs));
  }
}
