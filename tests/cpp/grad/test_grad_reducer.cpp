// GradStorage (csrc/zeroshard/grad/grad_storage.*) and GradReducer (grad_reducer.*) on their
// own, without the Engine: parameters in Buckets, a real autograd backward whose gradients are
// known exactly (loss = sum_j (p_j * g_j).sum(), so p_j's gradient is g_j, small integers that
// every sum and mean below keeps exact), and a real Communicator over a Gloo group of one rank
// in this process, which reduces in place without calling the backend (Note [a group of one]).
// At one rank the mean over ranks is each rank's own gradient; the two-rank scenarios, where
// it is not and Gloo carries every collective, run in tests/cpp/grad_worker.cpp.
#include "error_text.h"
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

using zeroshard::Bucket;
using zeroshard::CollectiveKind;
using zeroshard::Communicator;
using zeroshard::GradReducer;
using zeroshard::GradStorage;
using zeroshard::ReductionOptions;
using zeroshard::ShardingPlan;
using zeroshard::testing::errorText;
using zeroshard::testing::kTimeout;
using zeroshard::testing::singleRankGroup;
using zeroshard::testing::kModel;
using zeroshard::testing::makeBuckets;
using zeroshard::testing::lossOf;
using zeroshard::testing::expectedFlat;
using zeroshard::testing::allCalls;
using zeroshard::testing::bytesPerElement;
using zeroshard::testing::calls;
using zeroshard::testing::expectedOptimizerGrad;
using zeroshard::testing::runBackward;
using zeroshard::testing::sameValues;
using zeroshard::testing::storageFor;

TEST_CASE("forPlan gives gradients that accumulate in place at stages 0 and 1 and sharded ones at 2 and 3",
          "[grad_reducer]") {
  for (int world : {1, 2, 4}) {
    const int rank = world - 1;
    for (int64_t stage : {0, 1, 2, 3}) {
      INFO("stage " << stage << ", world size " << world << ", rank " << rank);
      auto buckets = makeBuckets(kModel, rank, world);
      auto grads = storageFor(stage, buckets, rank, world);
      CHECK(grads->accumulatesInPlace() == (stage <= 1));
      for (size_t b = 0; b < buckets.size(); ++b) {
        INFO("bucket " << b);
        const auto& layout = buckets[b].layout();
        const auto range = layout.shardRange(rank);
        const at::Tensor og = grads->optimizerGrad(b);
        CHECK(og.dim() == 1);
        CHECK(og.scalar_type() == at::kFloat);
        CHECK(og.is_contiguous());
        CHECK(at::equal(og, at::zeros_like(og)));
        if (stage <= 1) {
          // The optimizer reads the whole flat buffer (stage 0) or this rank's slice of it
          // (stage 1); no parameter has a .grad before its first gradient (Note [first gradient
          // of a window]).
          for (const auto& p : buckets[b].params()) CHECK_FALSE(p.grad().defined());
          if (stage == 0) {
            CHECK(og.numel() == layout.paddedNumel());
          } else {
            CHECK(og.numel() == layout.shardNumel());
            CHECK(og.storage_offset() == range.begin);
          }
        } else {
          // Only the shard exists between backwards; no parameter holds a .grad.
          CHECK(og.numel() == layout.shardNumel());
          CHECK_FALSE(og.storage().is_alias_of(buckets[b].flatParams().storage()));
          for (const auto& p : buckets[b].params()) CHECK_FALSE(p.grad().defined());
        }
      }
    }
  }
}

TEST_CASE("gradient dtypes follow the gradient shard dtype note and bytes counts every gradient buffer",
          "[grad_reducer]") {
  struct Row {
    int64_t stage;
    at::ScalarType compute;
    int64_t accumulation;
    bool reduceInFloat;
    at::ScalarType optimizerDtype;
  };
  // Note [gradient shard dtype] in grad_storage.cpp: full buffers keep the compute dtype (stage 1
  // adds an fp32 shard for fp32 sums of 16-bit gradients); a shard is fp32 when it accumulates
  // micro-batches or takes fp32 sums, the compute dtype otherwise.
  const std::vector<Row> rows = {
      {0, at::kFloat, 1, false, at::kFloat},      {0, at::kBFloat16, 1, false, at::kBFloat16},
      {0, at::kBFloat16, 4, true, at::kBFloat16}, {1, at::kBFloat16, 4, false, at::kBFloat16},
      {1, at::kBFloat16, 1, true, at::kFloat},    {1, at::kFloat, 1, true, at::kFloat},
      {1, at::kHalf, 2, false, at::kHalf},        {2, at::kBFloat16, 1, false, at::kBFloat16},
      {2, at::kBFloat16, 2, false, at::kFloat},   {2, at::kBFloat16, 1, true, at::kFloat},
      {3, at::kHalf, 1, false, at::kHalf},        {3, at::kHalf, 3, false, at::kFloat},
      {3, at::kFloat, 2, true, at::kFloat},       {2, at::kFloat, 1, false, at::kFloat},
  };
  const int world = 2;
  const int rank = 1;
  for (const auto& row : rows) {
    INFO("stage " << row.stage << ", " << row.compute << ", " << row.accumulation << " micro-batches, reduceInFloat "
                  << row.reduceInFloat);
    auto buckets = makeBuckets(kModel, rank, world, row.compute);
    auto grads = storageFor(row.stage, buckets, rank, world, {row.compute, row.accumulation, row.reduceInFloat});
    const bool wideStage1Shard = row.stage == 1 && row.reduceInFloat && row.compute != at::kFloat;
    int64_t expectedBytes = 0;
    for (size_t b = 0; b < buckets.size(); ++b) {
      const auto& layout = buckets[b].layout();
      CHECK(grads->optimizerGrad(b).scalar_type() == row.optimizerDtype);
      CHECK(grads->optimizerGrad(b).numel() == (row.stage == 0 ? layout.paddedNumel() : layout.shardNumel()));
      if (row.stage <= 1) {
        // The flat buffer holds .grad in the compute dtype, whatever the optimizer reads.
        expectedBytes += layout.paddedNumel() * bytesPerElement(row.compute);
        if (wideStage1Shard) expectedBytes += layout.shardNumel() * 4;
      } else {
        expectedBytes += layout.shardNumel() * bytesPerElement(row.optimizerDtype);
      }
    }
    CHECK(grads->bytes() == expectedBytes);
  }
  // The same model at one rank and stage 2, bf16 with accumulation: 4 bytes x (32 + 64 + 48).
  auto buckets = makeBuckets(kModel, 0, 1, at::kBFloat16);
  CHECK(storageFor(2, buckets, 0, 1, {at::kBFloat16, 2, false})->bytes() == 4 * (32 + 64 + 48));
  CHECK(storageFor(0, buckets, 0, 1, {at::kBFloat16, 2, false})->bytes() == 2 * (32 + 64 + 48));
}

TEST_CASE("stages 0 and 1 accumulate in place and reduce only at the accumulation boundary", "[grad_reducer]") {
  for (int64_t stage : {0, 1}) {
    INFO("stage " << stage);
    const auto plan = ShardingPlan::forStage(stage, 1);
    auto buckets = makeBuckets(kModel, 0, 1);
    auto grads = GradStorage::forPlan(plan, buckets, 0, {at::kFloat, 3, false});
    Communicator comm(singleRankGroup(), kTimeout);
    GradReducer reducer(buckets, *grads, comm, ReductionOptions{});

    // Two micro-batches inside the window: no collective at all, the gradients add up in place.
    runBackward(reducer, buckets, false, 0);
    runBackward(reducer, buckets, false, 1);
    CHECK(allCalls(comm) == 0);
    for (size_t b = 0; b < buckets.size(); ++b) {
      CHECK(sameValues(grads->optimizerGrad(b), expectedOptimizerGrad(plan, buckets, b, {0, 1}, 1, 0)));
    }

    // The boundary: one collective per bucket over the whole flat buffer.
    runBackward(reducer, buckets, true, 2);
    const auto kind = stage == 0 ? CollectiveKind::kAllReduce : CollectiveKind::kReduceScatter;
    CHECK(calls(comm, kind) == 3);
    CHECK(comm.stats()[kind].bytes == 4 * (32 + 64 + 48));
    CHECK(allCalls(comm) == 3);
    for (size_t b = 0; b < buckets.size(); ++b) {
      INFO("bucket " << b);
      const at::Tensor og = grads->optimizerGrad(b);
      CHECK(sameValues(og, expectedOptimizerGrad(plan, buckets, b, {0, 1, 2}, 1, 0)));
      // .grad of every parameter is a view of the one flat buffer at its offset.
      for (size_t i = 0; i < buckets[b].size(); ++i) {
        const auto& place = buckets[b].layout().params()[i];
        const at::Tensor& grad = buckets[b].params()[i].grad();
        REQUIRE(grad.defined());
        CHECK(grad.storage().is_alias_of(og.storage()));
        CHECK(grad.storage_offset() == place.offset);
        CHECK(sameValues(grad.reshape({-1}), expectedFlat(buckets, b, {0, 1, 2}, 1).narrow(0, place.offset, place.numel)));
      }
    }

    // zero(): .grad is None again and the next window starts from nothing: the buffers are not
    // written, so a value planted in them after zero() must not reach the next window's sum.
    grads->zero();
    for (size_t b = 0; b < buckets.size(); ++b) {
      for (const auto& p : buckets[b].params()) CHECK_FALSE(p.grad().defined());
      grads->optimizerGrad(b).narrow(0, 0, buckets[b].layout().numel()).fill_(1000);
    }
    comm.resetStats();
    runBackward(reducer, buckets, false, 3);
    runBackward(reducer, buckets, true, 4);
    CHECK(calls(comm, kind) == 3);
    for (size_t b = 0; b < buckets.size(); ++b) {
      CHECK(sameValues(grads->optimizerGrad(b), expectedOptimizerGrad(plan, buckets, b, {3, 4}, 1, 0)));
    }

    // A step whose window had no backward reads zeros (finishCopies), not the last window's.
    grads->zero();
    grads->finishCopies();
    for (size_t b = 0; b < buckets.size(); ++b) {
      CHECK(at::equal(grads->optimizerGrad(b), at::zeros_like(grads->optimizerGrad(b))));
    }
  }
}

TEST_CASE("stages 0 and 1 zero at the boundary a parameter that got no gradient in the window, and take one "
          "that arrives in a later micro-batch", "[grad_reducer]") {
  for (int64_t stage : {0, 1}) {
    INFO("stage " << stage);
    const auto plan = ShardingPlan::forStage(stage, 1);
    auto buckets = makeBuckets(kModel, 0, 1);
    auto grads = GradStorage::forPlan(plan, buckets, 0, {at::kFloat, 2, false});
    Communicator comm(singleRankGroup(), kTimeout);
    GradReducer reducer(buckets, *grads, comm, ReductionOptions{});
    runBackward(reducer, buckets, true, 0);
    grads->zero();
    for (size_t b = 0; b < buckets.size(); ++b) grads->optimizerGrad(b).narrow(0, 0, buckets[b].layout().numel()).fill_(1000);
    // fc.bias only in the second micro-batch, the embedding in neither.
    runBackward(reducer, buckets, false, 1, {"fc.bias", "embedding"});
    runBackward(reducer, buckets, true, 2, {"embedding"});
    for (size_t b = 0; b < buckets.size(); ++b) {
      INFO("bucket " << b);
      auto expected = expectedFlat(buckets, b, {1}, 1, {"fc.bias", "embedding"})
                          .add(expectedFlat(buckets, b, {2}, 1, {"embedding"}));
      CHECK(sameValues(grads->optimizerGrad(b), expected));
      // Every parameter's .grad is its view of the reduced buffer, the one without a gradient
      // too (at more ranks it holds the others' mean).
      for (size_t i = 0; i < buckets[b].size(); ++i) {
        const auto& grad = buckets[b].params()[i].grad();
        INFO("parameter " << i);
        REQUIRE(grad.defined());
        const auto& place = buckets[b].layout().params()[i];
        // One rank: the optimizer's gradient is the whole flat buffer at stage 1 too.
        CHECK(grad.data_ptr() == grads->optimizerGrad(b).narrow(0, place.offset, place.numel).data_ptr());
      }
    }
  }
}

TEST_CASE("stages 2 and 3 reduce every micro-batch into the shard and accumulate it there", "[grad_reducer]") {
  for (int64_t stage : {2, 3}) {
    INFO("stage " << stage);
    const auto plan = ShardingPlan::forStage(stage, 1);
    auto buckets = makeBuckets(kModel, 0, 1);
    auto grads = GradStorage::forPlan(plan, buckets, 0, {at::kFloat, 2, false});
    Communicator comm(singleRankGroup(), kTimeout);
    std::vector<size_t> launched;
    ReductionOptions options;
    options.onLaunched = [&](size_t bucket) { launched.push_back(bucket); };
    GradReducer reducer(buckets, *grads, comm, options);

    // Not a boundary, and still one reduce-scatter per bucket; .grad is freed once copied.
    runBackward(reducer, buckets, false, 0);
    CHECK(calls(comm, CollectiveKind::kReduceScatter) == 3);
    CHECK(comm.stats()[CollectiveKind::kReduceScatter].bytes == 4 * (32 + 64 + 48));
    CHECK(allCalls(comm) == 3);
    CHECK(launched == std::vector<size_t>{2, 1, 0});
    for (const auto& bucket : buckets) {
      for (const auto& p : bucket.params()) CHECK_FALSE(p.grad().defined());
    }
    for (size_t b = 0; b < buckets.size(); ++b) {
      CHECK(sameValues(grads->optimizerGrad(b), expectedOptimizerGrad(plan, buckets, b, {0}, 1, 0)));
    }
    runBackward(reducer, buckets, true, 1);
    CHECK(calls(comm, CollectiveKind::kReduceScatter) == 6);
    for (size_t b = 0; b < buckets.size(); ++b) {
      INFO("bucket " << b);
      CHECK(sameValues(grads->optimizerGrad(b), expectedOptimizerGrad(plan, buckets, b, {0, 1}, 1, 0)));
    }

    // zero() writes nothing, and the first reduction after it writes the shard instead of adding
    // to it: what was there before (here a value planted after zero()) is gone.
    grads->zero();
    for (size_t b = 0; b < buckets.size(); ++b) grads->optimizerGrad(b).fill_(1000);
    runBackward(reducer, buckets, false, 2);
    runBackward(reducer, buckets, true, 3);
    for (size_t b = 0; b < buckets.size(); ++b) {
      INFO("bucket " << b);
      CHECK(sameValues(grads->optimizerGrad(b), expectedOptimizerGrad(plan, buckets, b, {2, 3}, 1, 0)));
    }

    // A step whose window had no backward reads zeros (finishCopies), not the last window's.
    grads->zero();
    grads->finishCopies();
    for (size_t b = 0; b < buckets.size(); ++b) {
      CHECK(at::equal(grads->optimizerGrad(b), at::zeros_like(grads->optimizerGrad(b))));
    }
  }
}

TEST_CASE("a parameter that gets no gradient still has its bucket reduced at finishBackward with zeros for it",
          "[grad_reducer]") {
  // fc.bias gets no gradient (its bucket cannot start during backward) and neither does any
  // parameter of bucket 2 (its staging buffer is never made).
  const std::set<std::string> skip = {"fc.bias", "embedding"};
  for (int64_t stage : {0, 1, 2, 3}) {
    INFO("stage " << stage);
    const auto plan = ShardingPlan::forStage(stage, 1);
    auto buckets = makeBuckets(kModel, 0, 1);
    auto grads = GradStorage::forPlan(plan, buckets, 0, {at::kFloat, 1, false});
    Communicator comm(singleRankGroup(), kTimeout);
    std::vector<size_t> launched;
    ReductionOptions options;
    options.onLaunched = [&](size_t bucket) { launched.push_back(bucket); };
    GradReducer reducer(buckets, *grads, comm, options);

    // A first step with every gradient, so that the staging memory the next backward gets may
    // well hold old gradients: the skipped regions must be zeroed, not left as found.
    runBackward(reducer, buckets, true, 0);
    grads->zero();
    launched.clear();
    comm.resetStats();

    runBackward(reducer, buckets, true, 1, skip);
    const auto kind = stage == 0 ? CollectiveKind::kAllReduce : CollectiveKind::kReduceScatter;
    CHECK(calls(comm, kind) == 3);
    CHECK(allCalls(comm) == 3);
    // Bucket 0 was complete during backward; 1 and 2 are started by finishBackward, in order.
    CHECK(launched == std::vector<size_t>{0, 1, 2});
    for (size_t b = 0; b < buckets.size(); ++b) {
      INFO("bucket " << b);
      CHECK(sameValues(grads->optimizerGrad(b), expectedOptimizerGrad(plan, buckets, b, {1}, 1, 0, skip)));
    }
  }
}

TEST_CASE("inside an accumulation window a second gradient adds to the full gradients", "[grad_reducer]") {
  for (int64_t stage : {0, 1}) {
    INFO("stage " << stage);
    const auto plan = ShardingPlan::forStage(stage, 1);
    auto buckets = makeBuckets(kModel, 0, 1);
    auto grads = GradStorage::forPlan(plan, buckets, 0, {at::kFloat, 2, false});
    Communicator comm(singleRankGroup(), kTimeout);
    GradReducer reducer(buckets, *grads, comm, ReductionOptions{});
    reducer.beginBackward(false);
    lossOf(buckets, 0, 0).backward();
    CHECK(errorText([&] { lossOf(buckets, 1, 0).backward(); }).empty());
    reducer.finishBackward();
    CHECK(allCalls(comm) == 0);
    for (size_t b = 0; b < buckets.size(); ++b) {
      CHECK(sameValues(grads->optimizerGrad(b), expectedOptimizerGrad(plan, buckets, b, {0, 1}, 1, 0)));
    }
  }
}

TEST_CASE("beginBackward takes a .grad the user replaced back into the flat buffer", "[grad_reducer]") {
  const auto plan = ShardingPlan::forStage(0, 1);
  auto buckets = makeBuckets(kModel, 0, 1);
  auto grads = GradStorage::forPlan(plan, buckets, 0, {at::kFloat, 2, false});
  Communicator comm(singleRankGroup(), kTimeout);
  GradReducer reducer(buckets, *grads, comm, ReductionOptions{});
  const auto& weight = buckets[1].params()[1];  // fc.weight, offset 7 in bucket 1
  weight.mutable_grad() = at::full(weight.sizes(), 5.0);
  buckets[0].params()[0].mutable_grad() = at::Tensor();  // head.bias: set to None
  runBackward(reducer, buckets, false, 0);
  auto expected = expectedFlat(buckets, 1, {0}, 1);
  expected.narrow(0, 7, 56).add_(5);
  CHECK(sameValues(grads->optimizerGrad(1), expected));
  CHECK(sameValues(grads->optimizerGrad(0), expectedFlat(buckets, 0, {0}, 1)));
  CHECK(weight.grad().storage().is_alias_of(grads->optimizerGrad(1).storage()));
  CHECK(buckets[0].params()[0].grad().storage().is_alias_of(grads->optimizerGrad(0).storage()));
}

TEST_CASE("two ranks reduce to the mean over ranks at every stage", "[grad_reducer]") {
  auto outcomes = zeroshard::testing::spawnRanks(ZEROSHARD_GRAD_WORKER, "grad_mean", 2);
  INFO(zeroshard::testing::describeFailures(outcomes));
  CHECK(zeroshard::testing::describeFailures(outcomes).empty());
}
