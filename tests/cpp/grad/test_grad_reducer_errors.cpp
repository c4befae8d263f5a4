// GradReducer's errors: a second gradient after its bucket's reduction, a gradient outside
// beginBackward / finishBackward, and the calls out of order, each naming what went wrong.
// The model and group as in test_grad_reducer.cpp.
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

using zeroshard::CollectiveKind;
using zeroshard::Communicator;
using zeroshard::GradReducer;
using zeroshard::ReductionOptions;
using zeroshard::testing::contains;
using zeroshard::testing::errorText;
using zeroshard::testing::kTimeout;
using zeroshard::testing::singleRankGroup;
using zeroshard::testing::kModel;
using zeroshard::testing::makeBuckets;
using zeroshard::testing::lossOf;
using zeroshard::testing::allCalls;
using zeroshard::testing::calls;
using zeroshard::testing::runBackward;
using zeroshard::testing::storageFor;

TEST_CASE("a second gradient for a parameter after its bucket was reduced is an error naming it",
          "[grad_reducer]") {
  for (int64_t stage : {0, 1, 2, 3}) {
    INFO("stage " << stage);
    auto buckets = makeBuckets(kModel, 0, 1);
    auto grads = storageFor(stage, buckets, 0, 1);
    Communicator comm(singleRankGroup(), kTimeout);
    GradReducer reducer(buckets, *grads, comm, ReductionOptions{});
    // Two backwards inside one beginBackward/finishBackward, as a reentrant checkpoint would run.
    reducer.beginBackward(true);
    lossOf(buckets, 0, 0).backward();
    const std::string error = errorText([&] { lossOf(buckets, 1, 0).backward(); });
    reducer.abortBackward();
    // embedding is the first gradient the second backward produces.
    CHECK(contains(error, "parameter 'embedding' received a second gradient in one backward, after "));
    CHECK(contains(error, stage <= 1 ? "its bucket's reduction had started" : "it was reduced"));
    CHECK(contains(error, "use_reentrant=False"));
  }
}

TEST_CASE("a gradient that arrives outside beginBackward and finishBackward is an error naming the parameter",
          "[grad_reducer]") {
  for (int64_t stage : {0, 2}) {
    INFO("stage " << stage);
    auto buckets = makeBuckets(kModel, 0, 1);
    auto grads = storageFor(stage, buckets, 0, 1);
    Communicator comm(singleRankGroup(), kTimeout);
    GradReducer reducer(buckets, *grads, comm, ReductionOptions{});
    const std::string before = errorText([&] { (buckets[2].params()[0] * 2).sum().backward(); });
    CHECK(contains(before, "a gradient for 'embedding' arrived outside engine.backward()"));
    CHECK(contains(before, "call engine.backward(loss) instead of loss.backward()"));
    runBackward(reducer, buckets, true, 0);
    const std::string after = errorText([&] { (buckets[1].params()[1] * 2).sum().backward(); });
    CHECK(contains(after, "a gradient for 'fc.weight' arrived outside engine.backward()"));
    CHECK(allCalls(comm) == 3);  // the stray gradients started nothing
  }
}

TEST_CASE("beginBackward twice and finishBackward alone are errors", "[grad_reducer]") {
  auto buckets = makeBuckets(kModel, 0, 1);
  auto grads = storageFor(2, buckets, 0, 1);
  Communicator comm(singleRankGroup(), kTimeout);
  GradReducer reducer(buckets, *grads, comm, ReductionOptions{});
  CHECK(contains(errorText([&] { reducer.finishBackward(); }), "finishBackward without beginBackward"));
  reducer.beginBackward(true);
  CHECK(contains(errorText([&] { reducer.beginBackward(true); }), "the previous one is unfinished"));
  reducer.finishBackward();
  CHECK(calls(comm, CollectiveKind::kReduceScatter) == 3);  // a backward with no gradient at all
}
