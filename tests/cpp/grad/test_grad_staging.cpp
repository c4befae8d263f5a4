// GradReducer's staging buffers (Note [staging lifetime], grad/grad_reducer.cpp): with overlap
// off one at a time, with overlap on at most maxInFlight + 1, none for full gradients unless
// 16-bit gradients are reduced in fp32. The model and group as in test_grad_reducer.cpp.
#include "error_text.h"
#include "grad/grad_reducer_cases.h"
#include "grad_model.h"
#include "single_rank_group.h"
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

using zeroshard::Communicator;
using zeroshard::GradReducer;
using zeroshard::ReductionOptions;
using zeroshard::testing::contains;
using zeroshard::testing::errorText;
using zeroshard::testing::kTimeout;
using zeroshard::testing::singleRankGroup;
using zeroshard::testing::kModel;
using zeroshard::testing::kEqualBuckets;
using zeroshard::testing::makeBuckets;
using zeroshard::testing::expectedFlat;
using zeroshard::testing::runBackward;
using zeroshard::testing::sameValues;
using zeroshard::testing::storageFor;

TEST_CASE("with overlap off at most one staging buffer is alive at a time", "[grad_reducer]") {
  for (int64_t stage : {2, 3}) {
    INFO("stage " << stage);
    auto buckets = makeBuckets(kModel, 0, 1);
    auto grads = storageFor(stage, buckets, 0, 1);
    Communicator comm(singleRankGroup(), kTimeout);
    ReductionOptions options;
    options.overlap = false;
    GradReducer reducer(buckets, *grads, comm, options);
    CHECK(reducer.peakStagingBytes() == 0);
    runBackward(reducer, buckets, true, 0);
    // The largest bucket's fp32 staging buffer (64 elements), never two of them together.
    CHECK(reducer.peakStagingBytes() == 64 * 4);
    // Everything was released: the peak restarts from nothing.
    reducer.resetPeak();
    CHECK(reducer.peakStagingBytes() == 0);
    runBackward(reducer, buckets, true, 1, {"fc.bias", "fc.weight"});
    CHECK(reducer.peakStagingBytes() == 64 * 4);  // bucket 1's zeros, made at finishBackward
    reducer.resetPeak();
    runBackward(reducer, buckets, true, 2, {"embedding"});
    CHECK(reducer.peakStagingBytes() == 64 * 4);
    reducer.resetPeak();
    CHECK(reducer.peakStagingBytes() == 0);
  }
  // bf16 gradients reduced in fp32: while the largest bucket's bf16 staging buffer is widened,
  // both copies exist (64 x 2 + 64 x 4 bytes); then only the fp32 one, until its reduction ends.
  for (int64_t stage : {2, 3}) {
    INFO("stage " << stage << ", bf16 reduced in fp32");
    auto buckets = makeBuckets(kModel, 0, 1, at::kBFloat16);
    auto grads = storageFor(stage, buckets, 0, 1, {at::kBFloat16, 1, true});
    Communicator comm(singleRankGroup(), kTimeout);
    ReductionOptions options;
    options.overlap = false;
    options.reduceInFloat = true;
    GradReducer reducer(buckets, *grads, comm, options);
    runBackward(reducer, buckets, true, 0);
    CHECK(reducer.peakStagingBytes() == 64 * 2 + 64 * 4);
    reducer.resetPeak();
    CHECK(reducer.peakStagingBytes() == 0);
  }
}

// Over a group of one every reduction is complete when it is launched (Note [a group of one] in
// comm/communicator.cpp), so the next launch retires it: the buffer being filled and the one
// before it are alive, whatever the cap. The cap itself, where Gloo reports a reduce-scatter
// complete only once it is waited for (Note [staging lifetime]), is held at 2 ranks by
// tests/python/test_grad_reducer.py's staging_peak formulas.
TEST_CASE("with overlap on at most maxInFlight + 1 staging buffers are alive at a time", "[grad_reducer]") {
  const int64_t staging = 32 * 4;
  for (int64_t maxInFlight : {1, 2, 3, 5}) {
    INFO("maxInFlight " << maxInFlight);
    auto buckets = makeBuckets(kEqualBuckets, 0, 1);
    auto grads = storageFor(2, buckets, 0, 1);
    Communicator comm(singleRankGroup(), kTimeout);
    ReductionOptions options;
    options.overlap = true;
    options.maxInFlight = maxInFlight;
    GradReducer reducer(buckets, *grads, comm, options);
    runBackward(reducer, buckets, true, 0);
    CHECK(reducer.peakStagingBytes() == std::min<int64_t>(2, maxInFlight + 1) * staging);
    CHECK(reducer.peakStagingBytes() <= (maxInFlight + 1) * staging);
    for (size_t b = 0; b < buckets.size(); ++b) {
      CHECK(sameValues(grads->optimizerGrad(b), expectedFlat(buckets, b, {0}, 1)));
    }
    reducer.resetPeak();
    CHECK(reducer.peakStagingBytes() == 0);
  }
  ReductionOptions none;
  none.maxInFlight = 0;
  auto buckets = makeBuckets(kEqualBuckets, 0, 1);
  auto grads = storageFor(2, buckets, 0, 1);
  Communicator comm(singleRankGroup(), kTimeout);
  CHECK(contains(errorText([&] { GradReducer reducer(buckets, *grads, comm, none); }),
                 "max_inflight_reductions must be >= 1, got 0"));
}

TEST_CASE("full gradients need no staging unless 16-bit gradients are reduced in fp32", "[grad_reducer]") {
  for (int64_t stage : {0, 1}) {
    for (bool reduceInFloat : {false, true}) {
      INFO("stage " << stage << ", reduceInFloat " << reduceInFloat);
      auto buckets = makeBuckets(kModel, 0, 1, at::kBFloat16);
      auto grads = storageFor(stage, buckets, 0, 1, {at::kBFloat16, 1, reduceInFloat});
      Communicator comm(singleRankGroup(), kTimeout);
      ReductionOptions options;
      options.overlap = false;
      options.reduceInFloat = reduceInFloat;
      GradReducer reducer(buckets, *grads, comm, options);
      runBackward(reducer, buckets, true, 0);
      // The fp32 copy of the largest bucket (64 elements), one at a time.
      CHECK(reducer.peakStagingBytes() == (reduceInFloat ? 64 * 4 : 0));
    }
  }
}
