// The stage-3 scheduler: parameters exist only as shards between uses. A unit (one FlatLayout,
// usually one transformer block) is all-gathered before its forward, freed after it, gathered
// again before its backward and freed once its gradients are reduce-scattered.
//
// The first forward records the order units start their forward in, and the order they finish
// it in; later forwards prefetch the next unit's all-gather (in start order) while the current
// one computes, and backwards prefetch along the reversed finish order (Note [backward
// prefetch order]). The recorded order is compared across ranks once (a mismatch is an error
// naming the units), and every later training forward must follow it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include "zeroshard/layout/bucket.h"
#include "zeroshard/comm/communicator.h"
#include "zeroshard/layout/param_storage.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace zeroshard {

// A unit's index. Each unit is one bucket (one flat buffer), so the unit's index is also its
// bucket's, and the gradient reducer reports buckets; the type says a unit is meant.
struct UnitIndex {
  size_t value;
};

enum class UnitState { kSharded, kGathering, kGathered };

struct UnitPolicy {
  bool reshardAfterForward = true;  // false for the root unit: its outputs are needed at once
  bool keepGathered = false;        // persistent parameters: never released
};

// The sharded parameter storage of stage 3 (layout/param_storage.h).
class UnitScheduler final : public ParamStorage {
 public:
  // `shardsOnHost` (offload_param): every unit's shard lives in host memory (pinned with `pin`
  // on a GPU); a gather first copies it to the device, as part of the gather, so a prefetched
  // gather prefetches the copy too, and the device copy is dropped once the gather is done.
  //
  // `secondary` (hpZ): a group of consecutive ranks inside `comm`'s. A unit released after a
  // training forward keeps this rank's 1/secondary->worldSize() slice of the gathered unit (a
  // secondary shard, in the compute dtype); gathers from then on until its gradients are
  // reduced (its backward, a recomputed forward) run over `secondary` from those slices, and
  // it is dropped once the unit's gradients are reduced or the shards change (a step).
  //
  // `gatherStream` (zeroshard.stage3_gather_stream, GPUs only): prefetched gathers and their
  // host-to-device copies are issued from a side stream (Note [gather stream]).
  UnitScheduler(std::vector<Bucket>& units, std::vector<UnitPolicy> policies, Communicator& comm,
               int64_t prefetchElements, int64_t maxLiveElements, bool shardsOnHost = false, bool pin = false,
               Communicator* secondary = nullptr, bool gatherStream = false);

  // Module hooks (the Python layer, or a C++ unit wrapper, calls these around unit u's forward).
  void preForward(UnitIndex unit);
  // Registers a pre-backward hook on every output that requires grad, then frees the unit's
  // parameters if its policy says so.
  void postForward(UnitIndex unit, const std::vector<at::Tensor>& outputs);
  // From autograd: the gradient of one of the unit's outputs is about to flow into it.
  void preBackward(UnitIndex unit);
  // The unit's gradients were handed to the reducer: its gathered parameters can go.
  void afterGradReduce(UnitIndex unit);
  // End of a backward: releases what is still gathered, checks the order once.
  void finishBackward() override;
  // After the optimizer step: kept-gathered units all-gather their updated shards (the others
  // gather from their shards when next used).
  void refreshKeptUnits();
  void afterStep() override { refreshKeptUnits(); }
  void afterStepOf(size_t unit) override;
  void finishAfterStep() override;

  // gathered_parameters() and full state dicts.
  void gatherAll() override;
  void reshardAll() override;
  // One unit whole outside forward and backward (saving the model unit by unit), blocking.
  // Returns false when it was gathered already (then it is not this caller's to release);
  // releaseUnit() undoes a true. Both are counted in peakGatheredBytes() like any gather.
  bool gatherUnit(UnitIndex unit);
  void releaseUnit(UnitIndex unit) { reshard(unit.value); }
  // Whether unit u's gather has been issued (gathering or gathered): after a prefetch, before
  // the unit's own hook. Kept-gathered units always are.
  bool isUnsharded(UnitIndex unit) const { return states_.at(unit.value) != UnitState::kSharded; }
  // Bytes of unit parameters gathered now (kept-gathered units, always whole, not included).
  int64_t gatheredBytes() const { return liveBytes_; }
  // Between steps a unit holds its shard; kept-gathered units also hold the full buffer.
  int64_t bytes() const override;
  int64_t hostBytes() const override;

  bool isReleasable(UnitIndex unit) const { return !policies_.at(unit.value).keepGathered; }
  int64_t peakGatheredBytes() const override { return peakBytes_; }
  // hpZ: drops every secondary shard (the shards were written outside a step).
  void dropSecondaryShards() {
    for (size_t u = 0; u < units_.size(); ++u) dropSecondaryShard(u);
  }
  // hpZ: the bytes of secondary shards held now, and the most held at once since resetPeak().
  int64_t secondaryBytes() const { return secondaryBytes_; }
  int64_t peakSecondaryBytes() const override { return peakSecondaryBytes_; }
  void resetPeak() override {
    peakBytes_ = liveBytes_;
    peakSecondaryBytes_ = secondaryBytes_;
  }

 private:
  // `ahead`: a prefetch, issued from the gather stream when there is one.
  void startUnshard(size_t unit, bool ahead = false);
  // Gather stream: the compute stream's position at the start of a forward or backward, which
  // every gather issued ahead during it waits for (Note [gather stream]).
  void markPassStart(const at::Tensor& like);
  void unshard(size_t unit);
  // `keepSecondary` (hpZ, after a training forward): keep this rank's secondary shard of the
  // unit; otherwise it is dropped too.
  void reshard(size_t unit, bool keepSecondary = false);
  void keepSecondaryShard(size_t unit);
  void dropSecondaryShard(size_t unit);
  void prefetch(size_t unit);
  void orderAllocationAfterUse(size_t unit);
  void checkOrderAcrossRanks();
  // An all-gather of unit u's shard into its full buffer (started; the device copy of a host
  // shard is kept until finished() is called for it).
  CommHandle startGather(size_t u);
  void finished(size_t u);
  const std::string& nameOf(size_t unit) const;

  std::vector<Bucket>& units_;
  std::vector<UnitPolicy> policies_;
  Communicator& comm_;
  int64_t prefetchElements_;
  int64_t maxLiveElements_;
  std::vector<UnitState> states_;
  std::vector<std::optional<CommHandle>> pending_;
  std::vector<at::Tensor> stagedShards_;  // offload_param: a host shard's device copy, during its gather
  Communicator* secondary_;                // hpZ: the secondary group, or none
  std::vector<at::Tensor> secondaryShards_;  // hpZ: each unit's secondary shard, while it has one
  std::vector<std::pair<size_t, CommHandle>> refreshing_;  // kept units' gathers after a step
  // The stream each gathered unit's storage was allocated on (Note [release after use]).
  std::vector<std::optional<c10::Stream>> allocStreams_;
  std::vector<size_t> order_;      // the units in the order their forwards started (first step)
  std::vector<size_t> postOrder_;  // ... and in the order their forwards finished
  bool gatherStream_;
  std::optional<c10::Stream> sideStream_;  // the gather stream, made at the first prefetch on a GPU
  std::optional<c10::Event> passStart_;    // recorded on the compute stream at each pass's start
  bool recording_ = true;
  size_t forwardPos_ = 0;
  size_t backwardPos_ = 0;
  int64_t liveElements_ = 0;
  int64_t liveBytes_ = 0;
  int64_t peakBytes_ = 0;
  int64_t secondaryBytes_ = 0;
  int64_t peakSecondaryBytes_ = 0;
};

} // namespace zeroshard
