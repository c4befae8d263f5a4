#include "zeroshard/optim/optimizer.h"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/full.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace zeroshard {

int ShardedAdamW::addGroup(const AdamWHyper& hyper) {
  TORCH_CHECK(hyper.lr >= 0, "zeroshard AdamW: lr must be >= 0, got ", hyper.lr);
  TORCH_CHECK(hyper.eps > 0, "zeroshard AdamW: eps must be > 0, got ", hyper.eps);
  TORCH_CHECK(hyper.beta1 >= 0 && hyper.beta1 < 1 && hyper.beta2 >= 0 && hyper.beta2 < 1,
              "zeroshard AdamW: betas must be in [0, 1), got (", hyper.beta1, ", ", hyper.beta2, ")");
  TORCH_CHECK(hyper.weightDecay >= 0, "zeroshard AdamW: weight_decay must be >= 0, got ", hyper.weightDecay);
  Group group;
  group.hyper = hyper;
  groups_.push_back(std::move(group));
  return static_cast<int>(groups_.size()) - 1;
}

size_t ShardedAdamW::addShard(int group, const at::Tensor& master, const at::Tensor& grad) {
  TORCH_CHECK(master.scalar_type() == at::kFloat, "zeroshard AdamW: master weights must be float32");
  TORCH_CHECK(at::isFloatingType(grad.scalar_type()), "zeroshard AdamW: gradients must be floating point");
  TORCH_CHECK(master.sizes() == grad.sizes(), "zeroshard AdamW: master and gradient shards differ in size");
  auto& g = groups_.at(group);
  g.masters.push_back(master);
  g.grads.push_back(grad);
  g.expAvgs.push_back(at::zeros_like(master));
  g.expAvgSqs.push_back(at::zeros_like(master));
  g.steps.push_back(at::full({}, static_cast<double>(steps_), master.options()));
  return g.masters.size() - 1;
}

ShardedAdamW::ShardState ShardedAdamW::shardState(int group, size_t index) const {
  const auto& g = groups_.at(group);
  return {g.masters.at(index), g.expAvgs.at(index), g.expAvgSqs.at(index)};
}

void ShardedAdamW::setStepCount(int64_t steps) {
  TORCH_CHECK(steps >= 0, "zeroshard AdamW: step count must be >= 0, got ", steps);
  steps_ = steps;
  for (auto& g : groups_) {
    for (auto& s : g.steps) s.fill_(static_cast<double>(steps));
  }
}

// Note [fp32 gradients one shard at a time]: AdamW, the overflow check and the norm work on
// fp32 gradients. With 16-bit gradients, converting every shard up front would hold 4 more
// bytes per element of this rank's shards until the step ends (a quarter of the 16 bytes per
// parameter of model state). Instead each shard is converted when it is needed and dropped
// right after, and the multiplications of the step (the fp16 unscale, the clipping factor) are
// applied to each conversion in the order they were asked for, so the values are bit for bit
// those of converting once: at most one shard's fp32 copy exists at a time.
void ShardedAdamW::prepareGrads() {
  pendingFactors_.clear();
  factorCopies_.clear();
  liveConvertedBytes_ = 0;
  peakConvertedBytes_ = 0;
  for (auto& g : groups_) {
    g.prepared.clear();
    for (const auto& grad : g.grads) g.prepared.push_back(grad.scalar_type() == at::kFloat ? grad : at::Tensor());
  }
}

at::Tensor ShardedAdamW::fp32Grad(const Group& g, size_t i) {
  if (g.prepared[i].defined()) return g.prepared[i];
  auto grad = g.grads[i].to(at::kFloat);
  for (const auto& factor : pendingFactors_) grad.mul_(factorOn(factor, grad.device()));
  liveConvertedBytes_ += static_cast<int64_t>(grad.nbytes());
  peakConvertedBytes_ = std::max(peakConvertedBytes_, liveConvertedBytes_);
  return grad;
}

void ShardedAdamW::dropConverted(const at::Tensor& grad) {
  liveConvertedBytes_ -= static_cast<int64_t>(grad.nbytes());
}

const at::Tensor& ShardedAdamW::factorOn(const at::Tensor& factor, const c10::Device& device) {
  if (factor.device() == device) return factor;
  for (const auto& [original, copy] : factorCopies_) {
    if (original.is_same(factor) && copy.device() == device) return copy;
  }
  return factorCopies_.emplace_back(factor, factor.to(device)).second;
}

at::Tensor ShardedAdamW::unscaleAndFindNonFinite(double inverseScale, const at::Device& device) {
  // One flag per device the shards are on (the kernel only ever sets it to 1); the others are
  // added into the one on `device`.
  std::vector<std::pair<at::Tensor, at::Tensor>> flags;  // (found, inverse), one per device
  auto flagOn = [&](const c10::Device& on) -> std::pair<at::Tensor, at::Tensor>& {
    for (auto& f : flags) {
      if (f.first.device() == on) return f;
    }
    const auto options = at::TensorOptions().dtype(at::kFloat).device(on);
    return flags.emplace_back(at::zeros({1}, options), at::full({}, inverseScale, options));
  };
  flagOn(device);
  for (auto& g : groups_) {
    for (size_t i = 0; i < g.prepared.size(); ++i) {
      if (g.prepared[i].defined()) {
        flagOn(g.prepared[i].device());
        continue;
      }
      // Checked (and unscaled) in a copy; later conversions apply the same factor.
      auto grad = fp32Grad(g, i);
      auto& [found, inverse] = flagOn(grad.device());
      at::_amp_foreach_non_finite_check_and_unscale_({grad}, found, inverse);
      dropConverted(grad);
    }
    for (auto& [found, inverse] : flags) {
      std::vector<at::Tensor> inPlace;
      for (const auto& grad : g.prepared) {
        if (grad.defined() && grad.device() == found.device()) inPlace.push_back(grad);
      }
      if (!inPlace.empty()) at::_amp_foreach_non_finite_check_and_unscale_(inPlace, found, inverse);
    }
  }
  at::Tensor found = flags.front().first;
  for (size_t f = 1; f < flags.size(); ++f) found.add_(flags[f].first.to(device));
  pendingFactors_.push_back(flags.front().second);
  return found;
}

void ShardedAdamW::discardPrepared() {
  for (auto& g : groups_) g.prepared.clear();
  pendingFactors_.clear();
  factorCopies_.clear();
}

at::Tensor ShardedAdamW::localGradSquareSum(const at::Device& device) {
  at::Tensor sum = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
  for (auto& g : groups_) {
    for (size_t i = 0; i < g.prepared.size(); ++i) {
      // Each shard's norm in fp32 (a reduction that makes no copy; casting a shard to double
      // first would hold 8 bytes per element for the moment), squared and summed in double.
      const bool converted = !g.prepared[i].defined();
      auto grad = fp32Grad(g, i);
      sum.add_(at::linalg_vector_norm(grad, 2).to(at::kDouble).square().to(device));
      if (converted) dropConverted(grad);
    }
  }
  return sum;
}

// Note [probe by at::sum]: the finite probe is each shard's at::sum with an fp32 accumulator:
// one read of the shard, no copy. Two ways to read it faster were measured and dropped (2^24 fp32
// values on CPU, benchmarks/README.md, "The engine's own step cost"): a matrix-vector product
// with ones was 1.5x faster than at::sum on one machine and 1.7x slower on another, and plain
// sixteen-lane partial sums on torch's threads were slower than at::sum on the second. On a CPU
// the probe costs about a quarter of the fused AdamW kernel's time (seven times its bytes at a
// higher bandwidth), which is what nonfinite "off" saves.
at::Tensor ShardedAdamW::shardSum(const at::Tensor& grad) {
  return at::sum(grad, at::kFloat);
}

at::Tensor ShardedAdamW::localGradSum(const at::Device& device) {
  at::Tensor sum = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
  for (auto& g : groups_) {
    for (size_t i = 0; i < g.grads.size(); ++i) {
      const at::Tensor& grad = i < g.prepared.size() && g.prepared[i].defined() ? g.prepared[i] : g.grads[i];
      sum.add_(shardSum(grad).to(at::kDouble).to(device));
    }
  }
  return sum;
}

void ShardedAdamW::scaleGrads(const at::Tensor& factor) {
  for (auto& g : groups_) {
    for (auto& grad : g.prepared) {
      if (grad.defined()) grad.mul_(factorOn(factor, grad.device()));
    }
  }
  pendingFactors_.push_back(factor);
}

void ShardedAdamW::step(const at::Tensor& foundInf) {
  beginStep(foundInf);
  std::vector<ShardRef> all;
  for (size_t group = 0; group < groups_.size(); ++group) {
    for (size_t i = 0; i < groups_[group].masters.size(); ++i) all.push_back({static_cast<int>(group), i});
  }
  stepShards(all);
  endStep();
}

void ShardedAdamW::beginStep(const at::Tensor& foundInf) {
  TORCH_CHECK(!foundInf.defined() || (foundInf.scalar_type() == at::kFloat && foundInf.dim() == 0),
              "zeroshard AdamW: found_inf must be a 0-dim float32 tensor, got ", foundInf.scalar_type(), " of shape ",
              foundInf.sizes());
  foundInf_ = foundInf;
  ++steps_;
  for (const auto& g : groups_) {
    TORCH_CHECK(g.prepared.size() == g.masters.size(), "zeroshard AdamW: step() without prepareGrads()");
  }
}

void ShardedAdamW::stepShards(const std::vector<ShardRef>& shards) {
  for (size_t group = 0; group < groups_.size(); ++group) {
    auto& g = groups_[group];
    std::vector<size_t> mine;
    for (const auto& s : shards) {
      if (s.group == static_cast<int>(group)) mine.push_back(s.index);
    }
    if (mine.empty()) continue;
    const auto& hp = g.hyper;
    // The fused kernel reads the step it is given; torch.optim increments it first too (one
    // foreach call for the group's shards, as torch.optim's fused AdamW does).
    std::vector<at::Tensor> stepsOfMine;
    for (size_t i : mine) stepsOfMine.push_back(g.steps[i]);
    at::_foreach_add_(stepsOfMine, 1);
    std::optional<at::Tensor> found;
    if (foundInf_.defined()) found = foundInf_;
    // fp32 gradients: one call per device over the shards there.
    std::vector<size_t> wide;
    for (size_t i : mine) {
      if (g.prepared[i].defined()) wide.push_back(i);
    }
    while (!wide.empty()) {
      const c10::Device device = g.masters[wide.front()].device();
      std::vector<at::Tensor> masters, grads, expAvgs, expAvgSqs, steps;
      std::vector<size_t> elsewhere;
      for (size_t i : wide) {
        if (g.masters[i].device() != device) {
          elsewhere.push_back(i);
          continue;
        }
        masters.push_back(g.masters[i]);
        grads.push_back(g.prepared[i]);
        expAvgs.push_back(g.expAvgs[i]);
        expAvgSqs.push_back(g.expAvgSqs[i]);
        steps.push_back(g.steps[i]);
      }
      at::_fused_adamw_(masters, grads, expAvgs, expAvgSqs, /*max_exp_avg_sqs=*/{}, steps, hp.lr, hp.beta1,
                        hp.beta2, hp.weightDecay, hp.eps, /*amsgrad=*/false, /*maximize=*/false,
                        /*grad_scale=*/std::nullopt, onDevice(found, device));
      wide = std::move(elsewhere);
    }
    // Note [fp32 gradients one shard at a time]. The kernel treats every tensor of its lists on
    // its own, so a call per shard computes what one call for the group would.
    for (size_t i : mine) {
      if (g.prepared[i].defined()) continue;
      auto grad = fp32Grad(g, i);
      at::_fused_adamw_({g.masters[i]}, {grad}, {g.expAvgs[i]}, {g.expAvgSqs[i]}, /*max_exp_avg_sqs=*/{},
                        {g.steps[i]}, hp.lr, hp.beta1, hp.beta2, hp.weightDecay, hp.eps, /*amsgrad=*/false,
                        /*maximize=*/false, /*grad_scale=*/std::nullopt, onDevice(found, g.masters[i].device()));
      dropConverted(grad);
    }
    // A skipped step does not count: the kernel left the step tensors as they were given.
    if (found) {
      for (size_t i : mine) g.steps[i].sub_(*onDevice(found, g.steps[i].device()));
    }
  }
}

void ShardedAdamW::takeBackStep() {
  TORCH_CHECK(steps_ > 0, "zeroshard AdamW: takeBackStep() without a step to take back");
  --steps_;
}

std::optional<at::Tensor> ShardedAdamW::onDevice(const std::optional<at::Tensor>& flag, const c10::Device& device) {
  if (!flag) return std::nullopt;
  return factorOn(*flag, device);
}

void ShardedAdamW::endStep() {
  foundInf_ = at::Tensor();
  for (auto& g : groups_) g.prepared.clear();
  pendingFactors_.clear();
  factorCopies_.clear();
}

int64_t ShardedAdamW::stateBytes() const {
  int64_t bytes = 0;
  for (const auto& g : groups_) {
    for (size_t i = 0; i < g.masters.size(); ++i) {
      bytes += static_cast<int64_t>(g.expAvgs[i].nbytes() + g.expAvgSqs[i].nbytes());
    }
  }
  return bytes;
}

} // namespace zeroshard
