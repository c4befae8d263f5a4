// 16-bit gradients through GradReducer: reduced in fp32 or pre-divided they give the mean at
// every stage, fp16 sums stay finite and bf16 sums unrounded at two ranks, and stage 1's fp32
// shard holds only the window's sums. The model and group as in test_grad_reducer.cpp.
#include "grad/grad_reducer_cases.h"
#include "grad_model.h"
#include "single_rank_group.h"
#include "spawn_ranks.h"
#include "zeroshard/comm/communicator.h"
#include "zeroshard/grad/grad_reducer.h"
#include "zeroshard/grad/grad_storage.h"
#include "zeroshard/layout/bucket.h"
#include "zeroshard/plan/sharding_plan.h"

#include <ATen/ATen.h>
// Complete type for the intrusive_ptr that initProcessGroupFromEnv() returns.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

// c10's logging (pulled in by the ATen headers above) defines a glog-style CHECK that aborts;
// the tests' CHECK must be Catch2's, so it is dropped before catch.h defines it.
#undef CHECK
#include "catch.h"


#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

using zeroshard::CollectiveKind;
using zeroshard::Communicator;
using zeroshard::GradReducer;
using zeroshard::GradStorage;
using zeroshard::ReductionOptions;
using zeroshard::ShardingPlan;
using zeroshard::testing::kTimeout;
using zeroshard::testing::singleRankGroup;
using zeroshard::testing::kModel;
using zeroshard::testing::makeBuckets;
using zeroshard::testing::expectedOptimizerGrad;
using zeroshard::testing::runBackward;
using zeroshard::testing::sameValues;

TEST_CASE("16-bit gradients reduced in fp32 or pre-divided give the mean at every stage", "[grad_reducer]") {
  struct Case {
    at::ScalarType compute;
    bool preDivide;
    bool reduceInFloat;
  };
  for (const auto& c : {Case{at::kBFloat16, false, true}, Case{at::kBFloat16, false, false},
                        Case{at::kHalf, true, false}, Case{at::kHalf, true, true}}) {
    for (int64_t stage : {0, 1, 2, 3}) {
      INFO("stage " << stage << ", " << c.compute << ", preDivide " << c.preDivide << ", reduceInFloat "
                    << c.reduceInFloat);
      const auto plan = ShardingPlan::forStage(stage, 1);
      auto buckets = makeBuckets(kModel, 0, 1, c.compute);
      auto grads = GradStorage::forPlan(plan, buckets, 0, {c.compute, 2, c.reduceInFloat});
      Communicator comm(singleRankGroup(), kTimeout);
      ReductionOptions options;
      options.preDivide = c.preDivide;
      options.reduceInFloat = c.reduceInFloat;
      GradReducer reducer(buckets, *grads, comm, options);
      runBackward(reducer, buckets, false, 0);
      runBackward(reducer, buckets, true, 1);
      // The widened reduction is what goes over the wire.
      const auto kind = stage == 0 ? CollectiveKind::kAllReduce : CollectiveKind::kReduceScatter;
      const int64_t wire = c.reduceInFloat ? 4 : 2;
      CHECK(comm.stats()[kind].bytes == (stage <= 1 ? 1 : 2) * wire * (32 + 64 + 48));
      for (size_t b = 0; b < buckets.size(); ++b) {
        INFO("bucket " << b);
        CHECK(sameValues(grads->optimizerGrad(b), expectedOptimizerGrad(plan, buckets, b, {0, 1}, 1, 0)));
      }
    }
  }
}

TEST_CASE("two ranks keep fp16 sums finite with preDivide and bf16 sums unrounded with reduceInFloat",
          "[grad_reducer]") {
  auto outcomes = zeroshard::testing::spawnRanks(ZEROSHARD_GRAD_WORKER, "grad_precision", 2);
  INFO(zeroshard::testing::describeFailures(outcomes));
  CHECK(zeroshard::testing::describeFailures(outcomes).empty());
}

// Stage 1's fp32 gradient shard of 16-bit gradients reduced in fp32 is the reduce-scatter's
// output: the next window's sums overwrite it, and a step without a backward in its window reads
// zeros from it (finishCopies), not the last window's sums.
TEST_CASE("after zero() stage 1's fp32 gradient shard of 16-bit gradients holds only the next window's sums",
          "[grad_reducer]") {
  const auto plan = ShardingPlan::forStage(1, 1);
  auto buckets = makeBuckets(kModel, 0, 1, at::kBFloat16);
  auto grads = GradStorage::forPlan(plan, buckets, 0, {at::kBFloat16, 1, true});
  Communicator comm(singleRankGroup(), kTimeout);
  ReductionOptions options;
  options.reduceInFloat = true;
  GradReducer reducer(buckets, *grads, comm, options);
  runBackward(reducer, buckets, true, 0);
  REQUIRE(grads->optimizerGrad(0).scalar_type() == at::kFloat);
  REQUIRE(sameValues(grads->optimizerGrad(0), expectedOptimizerGrad(plan, buckets, 0, {0}, 1, 0)));
  grads->zero();
  grads->finishCopies();
  for (size_t b = 0; b < buckets.size(); ++b) {
    INFO("bucket " << b);
    CHECK(at::equal(grads->optimizerGrad(b), at::zeros_like(grads->optimizerGrad(b))));
  }
  grads->zero();
  for (size_t b = 0; b < buckets.size(); ++b) grads->optimizerGrad(b).fill_(1000);
  runBackward(reducer, buckets, true, 1);
  for (size_t b = 0; b < buckets.size(); ++b) {
    INFO("bucket " << b);
    CHECK(sameValues(grads->optimizerGrad(b), expectedOptimizerGrad(plan, buckets, b, {1}, 1, 0)));
  }
}
