// ShardedAdamW::localGradSum, the nonfinite check's probe (Note [finite probe],
// Note [probe by at::sum]): finite exactly when every gradient element is, wherever in a shard
// the element falls (the first, the middle, the last; shards of several thousand elements, of
// 4096 and of fewer, so that a sum by blocks or rows would have a remainder to miss).
#include <ATen/ATen.h>

#include "zeroshard/optim/optimizer.h"

// c10's logging (pulled in by the ATen headers above) defines a glog-style CHECK that aborts;
// the tests' CHECK must be Catch2's, so it is dropped before catch.h defines it.
#undef CHECK
#include "catch.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

using zeroshard::AdamWHyper;
using zeroshard::ShardedAdamW;

namespace {

// Shards of 3 rows of 4096 and 17 more, one row exactly, and fewer than a row.
const std::vector<int64_t> kShardNumels = {3 * 4096 + 17, 4096, 100};

struct Probe {
  ShardedAdamW opt;
  std::vector<at::Tensor> masters, grads;

  explicit Probe(at::ScalarType dtype) {
    const int group = opt.addGroup(AdamWHyper{});
    for (size_t i = 0; i < kShardNumels.size(); ++i) {
      const auto numel = kShardNumels[i];
      masters.push_back(at::zeros({numel}));
      grads.push_back((at::arange(numel, at::kFloat).remainder(7).sub(3).mul(0.25)).to(dtype));
      opt.addShard(group, masters.back(), grads.back());
    }
    opt.prepareGrads();
  }

  double exactSum() const {
    double total = 0;
    for (const auto& g : grads) total += g.to(at::kDouble).sum().item<double>();
    return total;
  }
};

}  // namespace

TEST_CASE("the finite probe is the gradients' sum, and not finite for one inf or NaN anywhere", "[optimizer]") {
  const float kInf = std::numeric_limits<float>::infinity();
  const float kNaN = std::numeric_limits<float>::quiet_NaN();
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    INFO("gradients " << dtype);
    {
      Probe probe(dtype);
      const double sum = probe.opt.localGradSum(at::kCPU).item<double>();
      CHECK(std::isfinite(sum));
      // Multiples of 0.25 in a few thousand terms: every partial sum is exact in fp32.
      CHECK(sum == probe.exactSum());
    }
    for (const float bad : {kInf, -kInf, kNaN}) {
      // The first element, one in the middle of the rows, the last of the rows, the first and
      // last after them, and in the shards that are one row and less than one.
      const std::vector<std::pair<size_t, int64_t>> places = {
          {0, 0}, {0, 5000}, {0, 3 * 4096 - 1}, {0, 3 * 4096}, {0, 3 * 4096 + 16}, {1, 4095}, {2, 99}};
      for (const auto& [shard, at] : places) {
        INFO(bad << " in shard " << shard << " at " << at);
        Probe probe(dtype);
        probe.grads[shard][at] = bad;
        probe.opt.prepareGrads();
        CHECK_FALSE(std::isfinite(probe.opt.localGradSum(at::kCPU).item<double>()));
      }
    }
  }
}
