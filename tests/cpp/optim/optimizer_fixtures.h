// What the ShardedAdamW tests share (test_optimizer.cpp, test_optimizer_by_shard.cpp): two
// param groups of several shards with different hyper-parameters, deterministic values, and
// bit-for-bit comparisons of every shard's state. Included by test files only (each gets its
// own copy of these internal-linkage helpers).
#pragma once

#include "zeroshard/optim/optimizer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using zeroshard::AdamWHyper;
using zeroshard::ShardedAdamW;

struct GroupSpec {
  AdamWHyper hyper;
  std::vector<int64_t> shardNumels;
};

// Two groups as an engine makes them: one with weight decay, one (biases, norms) without, with
// other betas and eps too; shards of awkward sizes.
std::vector<GroupSpec> groupSpecs() {
  AdamWHyper decayed;
  decayed.lr = 1e-2;
  decayed.beta1 = 0.9;
  decayed.beta2 = 0.999;
  decayed.eps = 1e-8;
  decayed.weightDecay = 0.1;
  AdamWHyper plain;
  plain.lr = 3e-3;
  plain.beta1 = 0.8;
  plain.beta2 = 0.95;
  plain.eps = 1e-6;
  plain.weightDecay = 0;
  return {{decayed, {37, 64, 5}}, {plain, {16, 16, 48, 1}}};
}

at::Tensor randomValues(uint64_t seed, int64_t numel) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randn({numel}, gen, at::TensorOptions().dtype(at::kFloat));
}

// The gradient of shard `shard` of group `group` at step `step`: magnitudes from 1e-4 to 10
// across shards, some exact zeros, the same values for every optimizer under test.
at::Tensor gradValues(int step, int group, size_t shard, int64_t numel) {
  const uint64_t seed = 1000003ULL * static_cast<uint64_t>(step) + 7919ULL * static_cast<uint64_t>(group) + shard;
  auto g = randomValues(seed, numel).mul_(std::pow(10.0, static_cast<double>((group + 2 * shard) % 6) - 4.0));
  if (numel > 3) g.narrow(0, 1, 2).zero_();
  return g;
}

// One rank's shards, as the engine registers them: every group's masters are views into one
// flat fp32 buffer, and the gradients are registered tensors the steps copy new values into.
struct Shards {
  std::vector<at::Tensor> flatMasters;                 // per group
  std::vector<std::vector<at::Tensor>> masters, grads;  // per group, per shard
};

// `gradDtypes[g]`: the registered gradient dtype of group g (fp32 or 16-bit).
Shards makeShards(const std::vector<GroupSpec>& specs, const std::vector<at::ScalarType>& gradDtypes,
                  uint64_t seed = 42) {
  Shards s;
  for (size_t g = 0; g < specs.size(); ++g) {
    int64_t total = 0;
    for (int64_t n : specs[g].shardNumels) total += n;
    s.flatMasters.push_back(randomValues(seed + g, total));
    s.masters.emplace_back();
    s.grads.emplace_back();
    int64_t offset = 0;
    for (int64_t n : specs[g].shardNumels) {
      s.masters[g].push_back(s.flatMasters[g].narrow(0, offset, n));
      s.grads[g].push_back(at::zeros({n}, at::TensorOptions().dtype(gradDtypes[g])));
      offset += n;
    }
  }
  return s;
}

void registerShards(ShardedAdamW& opt, const std::vector<GroupSpec>& specs, const Shards& s) {
  for (size_t g = 0; g < specs.size(); ++g) {
    const int id = opt.addGroup(specs[g].hyper);
    TORCH_CHECK(id == static_cast<int>(g), "group ", g, " registered as ", id);
    for (size_t i = 0; i < s.masters[g].size(); ++i) {
      const size_t index = opt.addShard(id, s.masters[g][i], s.grads[g][i]);
      TORCH_CHECK(index == i, "shard ", i, " of group ", g, " registered as ", index);
    }
  }
}

// Copies step `step`'s gradients into the registered tensors, rounded through `valuesOf` first,
// so that an fp32 optimizer gets exactly the values a 16-bit one holds.
void loadGrads(Shards& s, int step, at::ScalarType valuesOf = at::kFloat) {
  for (size_t g = 0; g < s.grads.size(); ++g) {
    for (size_t i = 0; i < s.grads[g].size(); ++i) {
      auto values = gradValues(step, static_cast<int>(g), i, s.grads[g][i].numel());
      values = values.to(valuesOf);
      s.grads[g][i].copy_(values);
    }
  }
}

void plainStep(ShardedAdamW& opt, Shards& s, int step, at::ScalarType valuesOf = at::kFloat) {
  loadGrads(s, step, valuesOf);
  opt.prepareGrads();
  opt.step();
}

// Bit for bit: memcmp, so that -0 differs from 0 and a NaN equals the same NaN.
bool sameBits(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  const auto ca = a.contiguous();
  const auto cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

// Every shard's master, exp_avg and exp_avg_sq bit for bit equal in the two optimizers.
bool sameState(const ShardedAdamW& a, const ShardedAdamW& b, const std::vector<GroupSpec>& specs) {
  bool same = a.stepCount() == b.stepCount();
  for (size_t g = 0; g < specs.size(); ++g) {
    for (size_t i = 0; i < specs[g].shardNumels.size(); ++i) {
      const auto sa = a.shardState(static_cast<int>(g), i);
      const auto sb = b.shardState(static_cast<int>(g), i);
      same = same && sameBits(sa.master, sb.master) && sameBits(sa.expAvg, sb.expAvg) &&
             sameBits(sa.expAvgSq, sb.expAvgSq);
    }
  }
  return same;
}

}  // namespace
