// zeroshard.nonfinite: fp32 and bf16 gradients with an inf or NaN (fp16's loss scaler handles
// its own). The check reads one value a step that is finite exactly when every gradient is
// (Note [finite probe], optimizer_step.cpp): the squared global norm the step computes for
// clipping anyway, or without clipping the gradients' sum (one more read of the gradient
// shards); one host read a step. Only then, on the rare bad step, a second pass finds the
// first parameter whose gradient is not finite, over every rank's shards, in the order of the
// flat buffers (the model's at stages 0-2; at stage 3 the units', the root unit's last).
//
// Note [deferred nonfinite check]: on a GPU that host read is a synchronisation per step, so
// where the gradients are on one (zeroshard.nonfinite_check "auto", or "deferred" anywhere)
// the device decides instead: the flag "the probe is not finite" is computed on the device
// from finiteProbe() (reduced over the shard group, so every rank holds the
// same flag and skips alike, without a collective of its own) and given to the fused AdamW
// kernel as found_inf, which then leaves weights and moments untouched; the step tensors take
// back their increment on the device (ShardedAdamW::step). Master weights pushed into 16-bit
// parameters and gathered after the step are the unchanged ones: no non-finite value reaches
// the weights. The host counts the step as taken and lets a config schedule step, and
// learns the flag later (optim/deferred_skip.h: copied into pinned memory without blocking):
// at the next boundary, before that step reads the lr and the step count, and before anything
// that reports steps (the log line, global_steps, skipped_steps, a checkpoint save or load,
// checkLastStep). It then takes the step back where the host counted it: the optimizer's step
// count, the schedule's iteration and the groups' lr and betas (those the skipped step used),
// so training goes on with the numbers of a run that skipped the step at once. A client
// scheduler (the Python layer's lr_scheduler) cannot be rewound, so the Python layer keeps the
// immediate check with one (python/zeroshard/engine.py, initialize). The price: the error
// comes a step late and cannot name the parameter (its gradients are gone by then); an
// offloaded optimizer and fp16 keep the immediate check, their host step and loss scaler
// reading their flag at the step anyway.
#include "zeroshard/optim/optimizer_step.h"

#include <ATen/ops/isfinite.h>
#include <c10/util/Exception.h>

#include "zeroshard/comm/communicator.h"
#include "zeroshard/comm/gather_values.h"
#include "zeroshard/grad/grad_storage.h"
#include "zeroshard/optim/optimizer.h"
#include "zeroshard/plan/sharding_plan.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace zeroshard {

bool OptimizerStep::gradsFinite(const SteppedState& state, Communicator& shardComm, int64_t boundary) {
  if (std::isfinite(finiteProbe(state, shardComm).item<double>())) return true;
  const std::vector<Bucket>& buckets = state.buckets;
  const ShardingPlan& plan = state.plan;
  // This rank's first parameter (by index over all buckets, in buffer order) holding a non-finite
  // gradient element in the range it steps; every rank's, then the smallest.
  int64_t first = -1;
  int64_t before = 0;
  for (size_t b = 0; b < buckets.size() && first < 0; ++b) {
    const auto& layout = buckets[b].layout();
    const ShardRange held =
        plan.optimizerSharded() ? layout.shardRange(shardComm.rank()) : ShardRange{0, layout.paddedNumel()};
    const at::Tensor& grad = state.grads.optimizerGrad(b);
    for (const auto& piece : layout.piecesIn(held)) {
      const auto values = grad.narrow(0, piece.shardOffset, piece.paramEnd - piece.paramBegin);
      if (!at::isfinite(values).all().item<bool>()) {
        first = before + static_cast<int64_t>(piece.param);
        break;
      }
    }
    before += static_cast<int64_t>(layout.params().size());
  }
  if (plan.optimizerSharded()) {
    int64_t smallest = -1;
    for (const auto& theirs : allGatherValues(shardComm, {first}, state.device())) {
      if (theirs.at(0) >= 0 && (smallest < 0 || theirs[0] < smallest)) smallest = theirs[0];
    }
    first = smallest;
  }
  std::string name = "(none found)";
  for (size_t b = 0, offset = 0; b < buckets.size() && first >= 0; ++b) {
    const auto& params = buckets[b].layout().params();
    if (first < static_cast<int64_t>(offset + params.size())) {
      name = "'" + params[static_cast<size_t>(first) - offset].name + "'";
      break;
    }
    offset += params.size();
  }
  const int64_t step = boundary;
  const std::string what = "zeroshard: the gradients of step " + std::to_string(step) +
                           " hold an inf or NaN (a non-finite loss, or an overflow in backward); the first "
                           "parameter with a non-finite gradient is " + name;
  if (nonfinite_ == "skip") {
    if (warns_) TORCH_WARN(what, "; the step is skipped on every rank (zeroshard.nonfinite \"skip\")");
    return false;
  }
  state.optimizer.discardPrepared();
  state.grads.zero();
  stepSquares_ = at::Tensor();
  stepSum_ = at::Tensor();
  TORCH_CHECK(false, what, ". Nothing was updated. zeroshard.nonfinite \"skip\" skips such steps instead, as "
                           "fp16's loss scaling does; lower the learning rate or clip (gradient_clipping) if it "
                           "recurs");
  return false;
}

bool OptimizerStep::decideDeferred(const SteppedState& state) const {
  const std::string& check = nonfiniteCheck_;
  std::string immediate;  // why the deferred check is not used, where it cannot be
  if (nonfinite_ == "off") {
    immediate = "zeroshard.nonfinite is \"off\": nothing is checked";
  } else if (scaler_) {
    immediate = "with fp16 the loss scaler checks every step for an overflow, on the host";
  } else if (state.plan.anyOptimizerOnHost(state.buckets.size())) {
    immediate = "the offloaded optimizer steps on the host, which has the gradients' norm there anyway";
  }
  if (!immediate.empty()) {
    if (check == "deferred" && warns_) {
      TORCH_WARN("zeroshard: zeroshard.nonfinite_check \"deferred\" is not used: ", immediate);
    }
    return false;
  }
  const bool onCpu = state.buckets.empty() || state.device().is_cpu();
  return check == "deferred" || (check == "auto" && !onCpu);
}

at::Tensor OptimizerStep::nonfiniteOnDevice(const SteppedState& state, Communicator& shardComm) {
  // 0-dim float, 0 or 1 (the kernel skips at exactly 1): no host read.
  return at::isfinite(finiteProbe(state, shardComm)).logical_not().to(at::kFloat);
}

void OptimizerStep::settle(const SteppedState& state, int64_t boundary, const std::optional<std::string>& where) {
  const std::optional<int64_t> step = deferredSkip_.settle(state.optimizer, schedule());
  if (!step) return;
  const std::string what = "zeroshard: the gradients of step " + std::to_string(*step) +
                           " hold an inf or NaN (a non-finite loss, or an overflow in backward); the optimizer "
                           "skipped that step on the device, so nothing was updated by it";
  const std::string found =
      where ? "found " + *where : "found at step " + std::to_string(boundary);
  if (nonfinite_ == "skip") {
    ++skippedSteps_;
    if (warns_) TORCH_WARN(what, "; it is skipped on every rank (zeroshard.nonfinite \"skip\"; ", found, ")");
    return;
  }
  const std::string dropped = where ? "" : ", whose gradients are dropped too";
  state.grads.zero();
  stepSquares_ = at::Tensor();
  stepSum_ = at::Tensor();
  TORCH_CHECK(false, what, " (", found, dropped, "). zeroshard.nonfinite \"skip\" skips such steps instead, as fp16's loss "
              "scaling does; lower the learning rate or clip (gradient_clipping) if it recurs. "
              "zeroshard.nonfinite_check \"immediate\" stops at the step itself and names the first parameter "
              "whose gradient is not finite, at a host synchronisation per step");
}

} // namespace zeroshard
