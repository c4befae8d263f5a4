// One rank of a multi-rank test of the gradient reducer or the stage-3 scheduler, driven
// directly (no Engine): `zeroshard_grad_worker SCENARIO`, started by spawnRanks() with the
// variables torchrun sets (tests/cpp/grad/test_grad_reducer.cpp, stage3/test_unit_scheduler.cpp).
// Exit 0 when the scenario's checks hold; otherwise print what differed and exit 1.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
// Complete type for the intrusive_ptr that initProcessGroupFromEnv() returns.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "grad_model.h"
#include "zeroshard/comm/communicator.h"
#include "zeroshard/comm/process_group.h"
#include "zeroshard/grad/grad_reducer.h"
#include "zeroshard/grad/grad_storage.h"
#include "zeroshard/layout/bucket.h"
#include "zeroshard/layout/param_groups.h"
#include "zeroshard/plan/sharding_plan.h"
#include "zeroshard/stage3/unit_builder.h"
#include "zeroshard/stage3/unit_scheduler.h"

#include <chrono>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

using zeroshard::Bucket;
using zeroshard::CollectiveKind;
using zeroshard::Communicator;
using zeroshard::GradReducer;
using zeroshard::GradStorage;
using zeroshard::ReductionOptions;
using zeroshard::ShardingPlan;
using zeroshard::UnitIndex;
using zeroshard::UnitScheduler;
using zeroshard::testing::expectedFlat;
using zeroshard::testing::gradOf;
using zeroshard::testing::kModel;
using zeroshard::testing::lossOf;
using zeroshard::testing::makeBuckets;

namespace {

// ---- gradients -------------------------------------------------------------------------------

void expectValues(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  TORCH_CHECK(actual.sizes() == expected.sizes() && at::equal(actual.to(at::kDouble), expected.to(at::kDouble)),
              what, ": got ", actual, " expected ", expected);
}

void expectCalls(const Communicator& comm, CollectiveKind kind, int64_t calls, const std::string& what) {
  TORCH_CHECK(comm.stats()[kind].calls == calls, what, ": ", zeroshard::collectiveName(kind), " ran ",
              comm.stats()[kind].calls, " times, expected ", calls);
}

// Every stage at this world size: the optimizer's gradients are the mean over ranks of the
// ranks' (different) gradients, summed over two micro-batches: the whole buffer at stage 0,
// this rank's slice at stage 1 (at its offset in the flat buffer), the shard at stages 2 and 3.
// Then, after zero(), a step where every rank leaves fc.bias and the whole of bucket 2 without
// a gradient: those buckets are reduced at finishBackward, with zeros for them.
void gradMean(Communicator& comm) {
  const int rank = comm.rank();
  const int world = comm.worldSize();
  for (int64_t stage : {0, 1, 2, 3}) {
    const std::string where = "stage " + std::to_string(stage) + " rank " + std::to_string(rank);
    const auto plan = ShardingPlan::forStage(stage, world);
    auto buckets = makeBuckets(kModel, rank, world);
    auto grads = GradStorage::forPlan(plan, buckets, rank, {at::kFloat, 2, false});
    comm.resetStats();
    GradReducer reducer(buckets, *grads, comm, ReductionOptions{});
    auto expected = [&](size_t b, const std::vector<int>& micros, const std::set<std::string>& skip = {}) {
      auto flat = expectedFlat(buckets, b, micros, world, skip);
      if (!plan.optimizerSharded()) return flat;
      const auto range = buckets[b].layout().shardRange(rank);
      return flat.narrow(0, range.begin, range.numel());
    };
    const auto kind = stage == 0 ? CollectiveKind::kAllReduce : CollectiveKind::kReduceScatter;

    for (int micro : {0, 1}) {
      reducer.beginBackward(micro == 1);
      lossOf(buckets, micro, rank).backward();
      reducer.finishBackward();
      expectCalls(comm, kind, plan.gradsSharded() ? 3 * (micro + 1) : 3 * micro, where + " micro-batch " +
                  std::to_string(micro));
    }
    for (size_t b = 0; b < buckets.size(); ++b) {
      const auto og = grads->optimizerGrad(b);
      expectValues(og, expected(b, {0, 1}), where + " bucket " + std::to_string(b));
      if (stage == 1) {
        const auto* base = static_cast<const char*>(buckets[b].params()[0].grad().data_ptr());
        TORCH_CHECK(static_cast<const char*>(og.data_ptr()) == base + buckets[b].layout().shardRange(rank).begin * 4,
                    where, ": the optimizer's gradient of bucket ", b, " is not this rank's slice of the flat buffer");
      }
    }

    grads->zero();
    comm.resetStats();
    const std::set<std::string> skip = {"fc.bias", "embedding"};
    reducer.beginBackward(true);
    lossOf(buckets, 2, rank, skip).backward();
    reducer.finishBackward();
    expectCalls(comm, kind, 3, where + " with parameters that got no gradient");
    for (size_t b = 0; b < buckets.size(); ++b) {
      expectValues(grads->optimizerGrad(b), expected(b, {2}, skip),
                   where + " bucket " + std::to_string(b) + " with parameters that got no gradient");
    }
  }
}

// A single-bucket model of one parameter of 40 elements (64 padded at two ranks) whose gradient
// is `value[rank]` everywhere, reduced once.
at::Tensor reduceOnce(Communicator& comm, int64_t stage, at::ScalarType dtype, bool preDivide, bool reduceInFloat,
                      const std::vector<double>& value) {
  const int rank = comm.rank();
  const auto plan = ShardingPlan::forStage(stage, comm.worldSize());
  auto buckets = makeBuckets({{{"weight", {40}}}}, rank, comm.worldSize(), dtype);
  auto grads = GradStorage::forPlan(plan, buckets, rank, {dtype, 1, reduceInFloat});
  ReductionOptions options;
  options.preDivide = preDivide;
  options.reduceInFloat = reduceInFloat;
  GradReducer reducer(buckets, *grads, comm, options);
  reducer.beginBackward(true);
  const auto& p = buckets[0].params()[0];
  (p * at::full({40}, value[rank], p.options().requires_grad(false))).sum().to(at::kFloat).backward();
  reducer.finishBackward();
  // The parameter's 40 elements among what the optimizer reads (rank 1's shard starts at 32).
  const auto og = grads->optimizerGrad(0);
  if (!plan.optimizerSharded()) return og.narrow(0, 0, 40);
  return rank == 0 ? og : og.narrow(0, 0, 8);
}

// fp16: 40000 on each of two ranks sums to 80000, past fp16's 65504. Dividing first
// (preDivide) keeps the mean, 40000; summing first gives inf. bf16: 1 and 1 + 2^-7 have the
// mean 1 + 2^-8, which bf16 cannot hold: summed in bf16 it rounds (to even) to 1, summed in
// fp32 (reduceInFloat) the fp32 shard of stages 1-3 keeps it, and stage 0 rounds it into its
// bf16 gradients once (again 1).
void gradPrecision(Communicator& comm) {
  TORCH_CHECK(comm.worldSize() == 2, "grad_precision needs 2 ranks");
  for (int64_t stage : {0, 1, 2, 3}) {
    const std::string where = "stage " + std::to_string(stage) + " rank " + std::to_string(comm.rank());
    for (bool reduceInFloat : {false, true}) {
      const auto divided = reduceOnce(comm, stage, at::kHalf, true, reduceInFloat, {40000, 40000});
      expectValues(divided, at::full(divided.sizes(), 40000.0, at::kDouble),
                   where + " fp16 with preDivide, reduceInFloat " + std::to_string(reduceInFloat));
    }
    const auto summed = reduceOnce(comm, stage, at::kHalf, false, false, {40000, 40000});
    TORCH_CHECK(summed.isinf().all().item<bool>(), where, ": fp16 summed before dividing should overflow, got ",
                summed);

    const auto narrow = reduceOnce(comm, stage, at::kBFloat16, false, false, {1.0, 1.0078125});
    TORCH_CHECK(narrow.scalar_type() == at::kBFloat16, where, ": bf16 gradients reduced in bf16 are ",
                narrow.scalar_type());
    expectValues(narrow, at::full(narrow.sizes(), 1.0, at::kDouble), where + " bf16 reduced in bf16");
    const auto wide = reduceOnce(comm, stage, at::kBFloat16, false, true, {1.0, 1.0078125});
    TORCH_CHECK(wide.scalar_type() == (stage == 0 ? at::kBFloat16 : at::kFloat), where,
                ": bf16 gradients reduced in fp32 are ", wide.scalar_type());
    expectValues(wide, at::full(wide.sizes(), stage == 0 ? 1.0 : 1.00390625, at::kDouble),
                 where + " bf16 reduced in fp32");
  }
}

// ---- stage-3 units ---------------------------------------------------------------------------

constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max();

// Units "u0", "u1" and the root, one parameter each, whose values differ by rank (+100 x rank),
// so a gathered unit shows whose slice came from where.
struct Units {
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  zeroshard::Stage3Units built;
  std::vector<at::Tensor> expected;  // each unit's flat buffer gathered: slice q from rank q
};

Units makeUnits(const std::vector<int64_t>& numels, int rank, int world) {
  Units u;
  zeroshard::ParamGroupSpec group;
  std::vector<zeroshard::UnitSpec> specs;
  for (size_t i = 0; i < numels.size(); ++i) {
    const bool root = i + 1 == numels.size();
    u.names.push_back(root ? "head.weight" : "blocks." + std::to_string(i) + ".weight");
    u.params.push_back(at::arange(numels[i], at::kFloat).remainder(7).add(1 + 100 * rank).set_requires_grad(true));
    group.names.push_back(u.names.back());
    group.params.push_back(u.params.back());
    specs.push_back({root ? "<root>" : "blocks." + std::to_string(i), {u.names.back()}, root});
  }
  u.built = zeroshard::buildStage3Units({group}, specs, {}, rank, world, at::kFloat);
  for (size_t i = 0; i < numels.size(); ++i) {
    const auto& layout = u.built.buckets[i].layout();
    auto flat = at::zeros({layout.paddedNumel()});
    for (int q = 0; q < world; ++q) {
      const auto range = layout.shardRange(q);
      auto theirs = at::zeros({layout.paddedNumel()});
      theirs.narrow(0, 0, numels[i]).copy_(at::arange(numels[i], at::kFloat).remainder(7).add(1 + 100 * q));
      flat.narrow(0, range.begin, range.numel()).copy_(theirs.narrow(0, range.begin, range.numel()));
    }
    u.expected.push_back(flat);
  }
  return u;
}

bool isReleased(const zeroshard::Bucket& unit) {
  return unit.flatParams().storage().nbytes() == 0;
}

// Each unit gathered holds slice q of rank q's values, in forward, again in backward (checked by
// a hook on each output when the gradient reaches it) and in gatherAll; the ranks ran the same
// order, so the first finishBackward's check passes, and every unit is released after it.
void unitsGather(Communicator& comm) {
  const int rank = comm.rank();
  auto u = makeUnits({40, 24, 20}, rank, comm.worldSize());
  auto& units = u.built.buckets;
  UnitScheduler scheduler(units, u.built.policies, comm, kNoLimit, kNoLimit);
  for (size_t i = 0; i < units.size(); ++i) {
    TORCH_CHECK(isReleased(units[i]), "unit ", i, " is gathered after construction");
  }
  // Between steps each rank holds its shards only: 32 + 16 + 16 elements of 64 + 32 + 32.
  TORCH_CHECK(scheduler.bytes() == (32 + 16 + 16) * 4, "rank ", rank, " holds ", scheduler.bytes(),
              " bytes of parameters, expected its shards' ", (32 + 16 + 16) * 4);
  auto expectGathered = [&](size_t i, const std::string& when) {
    TORCH_CHECK(!isReleased(units[i]) && at::equal(units[i].flatParams(), u.expected[i]), "rank ", rank, " unit ", i,
                " ", when, ": got ", units[i].flatParams(), " expected ", u.expected[i]);
  };
  std::vector<at::Tensor> outputs;
  at::Tensor carry = at::ones({});
  for (size_t i = 0; i < units.size(); ++i) {
    scheduler.preForward(UnitIndex{i});
    expectGathered(i, "in forward");
    auto out = (u.params[i] * carry).sum();
    scheduler.postForward(UnitIndex{i}, {out});
    out.register_hook([&, i](const at::TensorBase&) { expectGathered(i, "when its backward starts"); });
    carry = out;
  }
  carry.backward();
  scheduler.finishBackward();
  for (size_t i = 0; i < units.size(); ++i) {
    TORCH_CHECK(isReleased(units[i]), "rank ", rank, " unit ", i, " is gathered after finishBackward");
  }
  scheduler.gatherAll();
  for (size_t i = 0; i < units.size(); ++i) expectGathered(i, "after gatherAll");
  scheduler.reshardAll();
}

// Rank 1 runs the two blocks in the other order in its first step. The units have the same
// size, so the mismatched all-gathers pair up instead of failing; finishBackward's order check
// must then fail on both ranks, naming both units.
void unitsOrderMismatch(Communicator& comm) {
  const int rank = comm.rank();
  auto u = makeUnits({30, 30, 30}, rank, comm.worldSize());
  UnitScheduler scheduler(u.built.buckets, u.built.policies, comm, kNoLimit, kNoLimit);
  const std::vector<size_t> order = rank == 0 ? std::vector<size_t>{0, 1, 2} : std::vector<size_t>{1, 0, 2};
  for (size_t i : order) {
    scheduler.preForward(UnitIndex{i});
    scheduler.postForward(UnitIndex{i}, {(u.params[i] * 2).sum()});
  }
  try {
    scheduler.finishBackward();
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    const std::string mine = rank == 0 ? "blocks.0.weight" : "blocks.1.weight";
    const std::string theirs = rank == 0 ? "blocks.1.weight" : "blocks.0.weight";
    const std::string wanted = "at position 0 of the first step rank " + std::to_string(rank) + " ran unit '" + mine +
                               "' but rank " + std::to_string(1 - rank) + " ran unit '" + theirs + "'";
    TORCH_CHECK(what.find(wanted) != std::string::npos, "the order error does not say \"", wanted, "\": ", what);
    std::cout << "expected error: " << what << "\n";
    return;
  }
  TORCH_CHECK(false, "rank ", rank, ": different unit orders on the two ranks passed the first step's check");
}

} // namespace

int main(int argc, char** argv) {
  const std::map<std::string, std::function<void(Communicator&)>> scenarios = {
      {"grad_mean", gradMean},
      {"grad_precision", gradPrecision},
      {"units_gather", unitsGather},
      {"units_order_mismatch", unitsOrderMismatch},
  };
  if (argc != 2 || !scenarios.count(argv[1])) {
    std::cerr << "usage: zeroshard_grad_worker SCENARIO, one of:";
    for (const auto& [name, run] : scenarios) std::cerr << " " << name;
    std::cerr << "\n";
    return 2;
  }
  try {
    Communicator comm(zeroshard::initProcessGroupFromEnv(std::chrono::seconds(60)), std::chrono::seconds(30));
    scenarios.at(argv[1])(comm);
  } catch (const std::exception& e) {
    std::cerr << "rank " << std::getenv("RANK") << " failed: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
