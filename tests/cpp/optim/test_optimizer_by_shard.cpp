// ShardedAdamW stepped a few shards at a time (beginStep / stepShards / endStep), as offload
// steps it bucket by bucket: bit for bit the values of one step() over everything, in any order
// of the shards, with fp32 and 16-bit gradients and the fp16 / clipping multiplications between.
#include "optim/optimizer_fixtures.h"

#include <ATen/ATen.h>

#undef CHECK
#include "catch.h"

#include <algorithm>
#include <vector>

namespace {

// Every shard of every group, in an order that interleaves the groups and runs backwards, as
// buckets of mixed groups would.
std::vector<std::vector<ShardedAdamW::ShardRef>> bucketsOf(const std::vector<GroupSpec>& specs) {
  std::vector<ShardedAdamW::ShardRef> all;
  for (size_t g = 0; g < specs.size(); ++g) {
    for (size_t i = 0; i < specs[g].shardNumels.size(); ++i) all.push_back({static_cast<int>(g), i});
  }
  std::reverse(all.begin(), all.end());
  std::vector<std::vector<ShardedAdamW::ShardRef>> buckets;
  for (size_t k = 0; k < all.size(); k += 2) {
    buckets.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(k),
                         all.begin() + static_cast<std::ptrdiff_t>(std::min(k + 2, all.size())));
  }
  return buckets;
}

}  // namespace

TEST_CASE("stepShards bucket by bucket gives the values of one step over every shard", "[optimizer]") {
  const auto specs = groupSpecs();
  const auto buckets = bucketsOf(specs);
  REQUIRE(buckets.size() > 1);
  for (const auto& dtypes : std::vector<std::vector<at::ScalarType>>{{at::kFloat, at::kFloat},
                                                                    {at::kBFloat16, at::kFloat},
                                                                    {at::kHalf, at::kHalf}}) {
    Shards whole = makeShards(specs, dtypes);
    Shards byShard = makeShards(specs, dtypes);
    ShardedAdamW a, b;
    registerShards(a, specs, whole);
    registerShards(b, specs, byShard);
    INFO("gradients " << dtypes[0] << " and " << dtypes[1]);
    bool same = true;
    for (int step = 0; step < 5; ++step) {
      loadGrads(whole, step);
      loadGrads(byShard, step);
      for (ShardedAdamW* opt : {&a, &b}) {
        opt->prepareGrads();
        opt->unscaleAndFindNonFinite(1.0 / 512, at::kCPU);
        opt->localGradSquareSum(at::kCPU);
        opt->scaleGrads(at::full({}, 0.5 + 0.1 * step, at::kDouble));
      }
      a.step();
      b.beginStep();
      for (const auto& bucket : buckets) b.stepShards(bucket);
      b.endStep();
      same = same && sameState(a, b, specs);
    }
    CHECK(same);
    CHECK(a.peakConvertedBytes() == b.peakConvertedBytes());
  }
}

TEST_CASE("a shard left out of stepShards keeps its state and a stepped one moves", "[optimizer]") {
  const auto specs = groupSpecs();
  Shards s = makeShards(specs, {at::kFloat, at::kFloat});
  ShardedAdamW opt;
  registerShards(opt, specs, s);
  const at::Tensor before0 = opt.shardState(0, 0).master.clone();
  const at::Tensor before1 = opt.shardState(1, 0).master.clone();
  loadGrads(s, 0);
  opt.prepareGrads();
  opt.beginStep();
  opt.stepShards({{1, 0}});
  opt.endStep();
  CHECK(sameBits(opt.shardState(0, 0).master, before0));
  CHECK_FALSE(sameBits(opt.shardState(1, 0).master, before1));
}
