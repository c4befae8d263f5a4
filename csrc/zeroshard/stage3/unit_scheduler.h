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

// A unit's index (the gradient reducer and the optimizer index trained buckets, which are
// not units: a unit may hold only frozen parameters; the type says a unit is meant).
struct UnitIndex {
  size_t value;
};

// Stage 3: one unit's flat buffers: its trained parameters' (an index into the trained
// buckets, which the gradient reducer and the optimizer use) and its frozen parameters' (into
// the frozen buckets, one per dtype; Note [frozen parameters] in unit_builder.cpp). Every unit
// has at least one.
struct UnitBuffers {
  std::optional<size_t> trained;
  std::vector<size_t> frozen;
};

enum class UnitState { kSharded, kGathering, kGathered };

struct UnitPolicy {
  bool reshardAfterForward = true;  // false for the root unit: its outputs are needed at once
  bool keepGathered = false;        // persistent parameters: never released
  // The root unit encloses the others: its backward ends with the whole backward, so with
  // frozen parameters it is released only then (Note [release after backward]).
  bool root = false;
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
  //
  // `units[u]` names unit u's buffers in `trained` and `frozen`, which the caller owns and keeps
  // for the scheduler's life (neither vector may grow).
  UnitScheduler(std::vector<Bucket>& trained, std::vector<Bucket>& frozen, std::vector<UnitBuffers> units,
                std::vector<UnitPolicy> policies, Communicator& comm, int64_t prefetchElements,
                int64_t maxLiveElements, bool shardsOnHost = false, bool pin = false,
                Communicator* secondary = nullptr, bool gatherStream = false);
  // No frozen parameters: unit u is trained bucket u.
  UnitScheduler(std::vector<Bucket>& units, std::vector<UnitPolicy> policies, Communicator& comm,
               int64_t prefetchElements, int64_t maxLiveElements, bool shardsOnHost = false, bool pin = false,
               Communicator* secondary = nullptr, bool gatherStream = false);

  // Module hooks (the Python layer, or a C++ unit wrapper, calls these around unit u's forward).
  void preForward(UnitIndex unit);
  // A training forward's inputs of unit u (before its forward): a unit with frozen parameters
  // is released in backward once the gradients of those that require grad are computed (and
  // its trained parameters' are reduced), Note [release after backward]. A unit whose inputs
  // were never given stays gathered until the end of the backward.
  void watchInputs(UnitIndex unit, const std::vector<at::Tensor>& inputs);
  bool hasFrozen(UnitIndex unit) const { return hasFrozen_.at(unit.value); }
  // Whether watchInputs() does anything for the unit: it holds frozen parameters and is not the root.
  bool watchesInputs(UnitIndex unit) const { return hasFrozen_.at(unit.value) && !policies_.at(unit.value).root; }
  // Registers a pre-backward hook on every output that requires grad, then frees the unit's
  // parameters if its policy says so.
  void postForward(UnitIndex unit, const std::vector<at::Tensor>& outputs);
  // From autograd: the gradient of one of the unit's outputs is about to flow into it.
  void preBackward(UnitIndex unit);
  // The unit's gradients were handed to the reducer: its gathered parameters can go (a unit
  // with frozen parameters: Note [release after backward]). afterBucketReduce: the same, by
  // the trained bucket's index, as the gradient reducer reports it.
  void afterGradReduce(UnitIndex unit);
  void afterBucketReduce(size_t bucket) { afterGradReduce(UnitIndex{unitOfBucket_.at(bucket)}); }
  // End of a backward: releases what is still gathered, checks the order once.
  void finishBackward() override;
  // A backward that raised: releases what is gathered and forgets the pass's watches.
  void abortBackward() override;
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
  // Bytes of unit parameters gathered now, frozen ones included (kept-gathered units, always
  // whole, not included).
  int64_t gatheredBytes() const { return liveBytes_; }
  // Between steps a unit holds its shard; kept-gathered units also hold the full buffer.
  // Trained parameters only; frozenBytes() and frozenHostBytes() count the frozen shards.
  int64_t bytes() const override;
  int64_t hostBytes() const override;
  int64_t frozenBytes() const;
  int64_t frozenHostBytes() const;
  size_t numUnits() const { return buffers_.size(); }
  // The unit that holds trained bucket `bucket`, and frozen bucket `frozenBucket`.
  UnitIndex unitOfBucket(size_t bucket) const { return UnitIndex{unitOfBucket_.at(bucket)}; }
  UnitIndex unitOfFrozen(size_t frozenBucket) const { return UnitIndex{unitOfFrozen_.at(frozenBucket)}; }

  bool isReleasable(UnitIndex unit) const { return !policies_.at(unit.value).keepGathered; }
  int64_t peakGatheredBytes() const override { return peakBytes_; }
  // hpZ: drops every secondary shard (the shards were written outside a step).
  void dropSecondaryShards() {
    for (size_t u = 0; u < buffers_.size(); ++u) dropSecondaryShard(u);
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
  // An all-gather of buffer i of unit u's shard into its full buffer (started; the device copy
  // of a host shard is kept until finished() is called for the unit).
  CommHandle startGather(size_t u, size_t i);
  void finished(size_t u);
  const std::string& nameOf(size_t unit) const;
  void inputGradReady(size_t unit);
  void resetWatches();
  void releaseAfterBackward(size_t unit);

  // Every unit's buffers, its trained one first (the engine owns them).
  std::vector<std::vector<Bucket*>> buffers_;
  std::vector<std::optional<size_t>> trainedOf_;  // unit -> its trained bucket
  std::vector<size_t> unitOfBucket_;              // trained bucket -> its unit
  std::vector<size_t> unitOfFrozen_;              // frozen bucket -> its unit
  std::vector<bool> hasFrozen_;
  std::vector<UnitPolicy> policies_;
  Communicator& comm_;
  int64_t prefetchElements_;
  int64_t maxLiveElements_;
  std::vector<UnitState> states_;
  std::vector<std::vector<CommHandle>> pending_;  // per unit, one per buffer while gathering
  // offload_param: a host shard's device copy, during its gather (per unit and buffer)
  std::vector<std::vector<at::Tensor>> stagedShards_;
  Communicator* secondary_;                // hpZ: the secondary group, or none
  std::vector<std::vector<at::Tensor>> secondaryShards_;  // hpZ: each buffer's secondary shard, while it has one
  // Note [release after backward], per unit during a backward: whether its inputs were
  // watched, how many of their gradients are still to come, and whether its trained
  // parameters' gradients were reduced.
  std::vector<bool> inputsWatched_;
  std::vector<bool> unwatchable_;  // a forward of it had no input that requires grad
  std::vector<int64_t> inputGradsPending_;
  std::vector<bool> gradsReduced_;
  bool inBackward_ = false;  // a unit's backward began since the last finishBackward()
  std::vector<std::pair<size_t, CommHandle>> refreshing_;  // kept units' gathers after a step (trained only)
  // The stream each gathered unit's storage was allocated on (Note [release after use]).
  std::vector<std::optional<c10::Stream>> allocStreams_;
  std::vector<size_t> order_;      // the units in the order their forwards started (first step)
  std::vector<size_t> postOrder_;  // ... and those with a backward in the order their forwards finished
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
