#include "zeroshard/optimizer.h"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/full.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>

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

void ShardedAdamW::prepareGrads() {
  for (auto& g : groups_) {
    g.prepared.clear();
    for (const auto& grad : g.grads) {
      g.prepared.push_back(grad.scalar_type() == at::kFloat ? grad : grad.to(at::kFloat));
    }
  }
}

at::Tensor ShardedAdamW::unscaleAndFindNonFinite(double inverseScale, const at::Device& device) {
  const auto options = at::TensorOptions().dtype(at::kFloat).device(device);
  // One flag for every group: the kernel only ever sets it to 1.
  auto found = at::zeros({1}, options);
  const auto inverse = at::full({}, inverseScale, options);
  for (auto& g : groups_) {
    if (!g.prepared.empty()) at::_amp_foreach_non_finite_check_and_unscale_(g.prepared, found, inverse);
  }
  return found;
}

void ShardedAdamW::discardPrepared() {
  for (auto& g : groups_) g.prepared.clear();
}

at::Tensor ShardedAdamW::localGradSquareSum(const at::Device& device) const {
  at::Tensor sum = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
  for (const auto& g : groups_) {
    // Each shard's norm in fp32 (a reduction that makes no copy; casting a shard to double
    // first would hold 8 bytes per element for the moment), squared and summed in double.
    for (const auto& grad : g.prepared) sum.add_(at::linalg_vector_norm(grad, 2).to(at::kDouble).square());
  }
  return sum;
}

void ShardedAdamW::scaleGrads(const at::Tensor& factor) {
  for (auto& g : groups_) {
    for (auto& grad : g.prepared) grad.mul_(factor);
  }
}

void ShardedAdamW::step() {
  ++steps_;
  for (auto& g : groups_) {
    if (g.masters.empty()) continue;
    TORCH_CHECK(g.prepared.size() == g.masters.size(), "zeroshard AdamW: step() without prepareGrads()");
    // The fused kernel reads the step it is given; torch.optim increments it first too.
    for (auto& s : g.steps) s.add_(1);
    at::_fused_adamw_(g.masters, g.prepared, g.expAvgs, g.expAvgSqs, /*max_exp_avg_sqs=*/{}, g.steps, g.hyper.lr,
                      g.hyper.beta1, g.hyper.beta2, g.hyper.weightDecay, g.hyper.eps, /*amsgrad=*/false,
                      /*maximize=*/false);
    g.prepared.clear();
  }
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
