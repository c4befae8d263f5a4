// The stage-3 scheduler's backward and what follows it (stage3/unit_scheduler.h): the gathers
// before each unit's backward and their prefetch, when a unit is released after it (Note
// [release after backward]), the end of a backward (what is still gathered is released and the
// recorded order is compared across ranks once), and the start of the gathers after the
// optimizer step (finishAfterStep, in unit_scheduler.cpp, waits for them).
#include "zeroshard/stage3/unit_scheduler.h"

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "zeroshard/comm/gather_values.h"

#include <algorithm>

namespace zeroshard {

// Note [backward prefetch order]: backward runs the units in the reverse of the order their
// forwards finished, not started. The two differ when a unit's forward encloses others: the
// root unit (embeddings, head), whose module is the whole model, starts first and finishes
// last, and its gradient arrives first. Walking the start order backwards from the root finds
// nothing before it, so no block would ever be prefetched; walking the finish order backwards
// goes root, last block, ..., first block, as FSDP2's post-forward order does.
void UnitScheduler::preBackward(UnitIndex unit) {
  const size_t u = unit.value;
  inBackward_ = true;
  if (!recording_ && backwardPos_ == postOrder_.size()) markPassStart(buffers_[u].front()->flatParams());
  unshard(u);
  if (recording_) return;
  // The unit before this one in the finish order runs its backward next.
  size_t pos = std::min(backwardPos_, postOrder_.size());
  while (pos > 0 && postOrder_[pos - 1] != u) --pos;
  if (pos > 0) {
    backwardPos_ = pos - 1;
    if (backwardPos_ > 0) prefetch(postOrder_[backwardPos_ - 1]);
  }
}

// Note [release after backward]: a unit's trained parameters are done with once their
// gradients are: the node that computes a weight's gradient computes its input's gradient
// too. A frozen weight has no gradient to say so; it is needed until every gradient its unit
// computes is computed: those of its trained parameters (reported by the reducer) and those of
// its inputs (a hook on each input that requires grad fires once that input's gradient is
// whole, after the unit's backward). Inside a LoRA layer the base weight's input-gradient
// matmul runs after the adapters' gradients are ready, so releasing on those alone would free
// it too early. Released at the end of the backward instead: a unit whose inputs need no
// gradient (the first decoder layer after a frozen embedding: its frozen weights may still feed
// the gradient of a trained parameter outside its bucket, a persistent norm weight, which
// the reducer does not wait for), the root unit, which encloses the others (gradients computed
// with its frozen weights flow into other units), and a unit whose inputs were not given (a C++
// runUnit). A backward that raises, or a forward dropped without one, leaves no watch behind
// (abortBackward(), and the reset at the first unit of the next training forward).
void UnitScheduler::afterGradReduce(UnitIndex unit) {
  const size_t u = unit.value;
  if (!hasFrozen_.at(u)) {
    reshard(u);
    return;
  }
  gradsReduced_[u] = true;
  releaseAfterBackward(u);
}

void UnitScheduler::watchInputs(UnitIndex unit, const std::vector<at::Tensor>& inputs) {
  const size_t u = unit.value;
  if (!watchesInputs(unit) || !c10::GradMode::is_enabled()) return;
  // A forward run again inside the backward (activation checkpointing) of a unit whose forward
  // was watched: its inputs' hooks are the forward's, which fire; the recomputation's inputs
  // (non-reentrant: recomputed views) get no gradient. Reentrant checkpointing's forward ran
  // without grad and watched nothing: its recomputation is watched, and its backward fires them.
  if (inBackward_ && inputsWatched_[u]) return;
  bool any = false;
  for (const auto& input : inputs) {
    if (!input.defined() || !input.requires_grad()) continue;
    ++inputGradsPending_[u];
    input.register_hook([this, u](const at::TensorBase&) { inputGradReady(u); });
    any = true;
  }
  // Inputs that need no gradient say nothing about when the unit's backward ends (its frozen
  // weights may still feed a gradient of a trained parameter of another unit, a persistent
  // norm): such a forward leaves the unit to the end of the backward, as FSDP2 does.
  inputsWatched_[u] = true;
  if (!any) unwatchable_[u] = true;
}

void UnitScheduler::inputGradReady(size_t u) {
  if (inputGradsPending_[u] > 0) --inputGradsPending_[u];
  releaseAfterBackward(u);
}

void UnitScheduler::releaseAfterBackward(size_t u) {
  if (!inputsWatched_[u] || unwatchable_[u] || inputGradsPending_[u] > 0) return;
  if (trainedOf_[u] && !gradsReduced_[u]) return;
  reshard(u);
}

void UnitScheduler::resetWatches() {
  std::fill(inputsWatched_.begin(), inputsWatched_.end(), false);
  std::fill(unwatchable_.begin(), unwatchable_.end(), false);
  std::fill(inputGradsPending_.begin(), inputGradsPending_.end(), 0);
  std::fill(gradsReduced_.begin(), gradsReduced_.end(), false);
  inBackward_ = false;
}

void UnitScheduler::abortBackward() {
  for (size_t u = 0; u < buffers_.size(); ++u) reshard(u);
  resetWatches();
  forwardPos_ = 0;
  backwardPos_ = postOrder_.size();
}

void UnitScheduler::finishBackward() {
  for (size_t u = 0; u < buffers_.size(); ++u) reshard(u);
  resetWatches();
  if (recording_) {
    checkOrderAcrossRanks();
    recording_ = false;
  }
  forwardPos_ = 0;
  backwardPos_ = postOrder_.size();
}

void UnitScheduler::checkOrderAcrossRanks() {
  const std::vector<int64_t> mine(order_.begin(), order_.end());
  const auto orders = allGatherValues(comm_, mine, buffers_.front().front()->flatParams().device());
  const auto n = static_cast<int64_t>(mine.size());
  for (int r = 0; r < comm_.worldSize(); ++r) {
    const auto& theirs = orders[static_cast<size_t>(r)];
    TORCH_CHECK(static_cast<int64_t>(theirs.size()) == n, "zeroshard stage 3: rank ", comm_.rank(), " ran ", n,
                " unit forwards in its first step but rank ", r, " ran ", theirs.size(),
                "; every rank must run the same units in the same order");
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(theirs[i] == mine[i], "zeroshard stage 3: at position ", i, " of the first step rank ", comm_.rank(),
                  " ran unit '", nameOf(mine[i]), "' but rank ", r, " ran unit '", nameOf(theirs[i]),
                  "'; every rank must run the units in the same order");
    }
  }
}

void UnitScheduler::refreshKeptUnits() {
  for (size_t b = 0; b < unitOfBucket_.size(); ++b) afterStepOf(b);
  finishAfterStep();
}

// The step changed the trained shards: a kept-gathered unit (trained parameters only) gathers
// them again, and secondary shards are dropped (hpZ keeps them between a forward and its
// backward only).
void UnitScheduler::afterStepOf(size_t bucket) {
  const size_t u = unitOfBucket_.at(bucket);
  dropSecondaryShard(u);
  if (policies_[u].keepGathered) refreshing_.emplace_back(u, startGather(u, 0));
}

} // namespace zeroshard
