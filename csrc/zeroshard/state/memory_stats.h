// What Engine::memoryStats() reports: the bytes of model state a rank holds between steps, and
// the peaks of transient buffers during the last step (docs/design.md's per-rank formulas).
#pragma once

#include <cstdint>

namespace zeroshard {

// Bytes of model state this rank holds (padding included): compute-dtype parameters,
// gradients (full or sharded, by stage) and optimizer state (exp_avg, exp_avg_sq, and the fp32
// master weights where they are a separate copy). paramBytes, gradBytes and optimizerBytes
// count every place together; the host* fields count what of them is in host memory
// (offload: parameter shards, the fp32 gradient shards the host step reads, the optimizer
// state), the device* ones the rest.
struct MemoryStats {
  int64_t paramBytes = 0;
  int64_t gradBytes = 0;
  int64_t optimizerBytes = 0;
  // Frozen parameters (requires_grad=False, e.g. a LoRA base): whole below stage 3, this rank's
  // shards at stage 3 (plus those at or under the persistence threshold, whole). No gradient,
  // master or optimizer state goes with them.
  int64_t frozenBytes = 0;
  int64_t hostParamBytes = 0;
  int64_t hostGradBytes = 0;
  int64_t hostOptimizerBytes = 0;
  int64_t hostFrozenBytes = 0;
  int64_t hostTotalBytes() const { return hostParamBytes + hostGradBytes + hostOptimizerBytes + hostFrozenBytes; }
  int64_t deviceFrozenBytes() const { return frozenBytes - hostFrozenBytes; }
  int64_t deviceParamBytes() const { return paramBytes - hostParamBytes; }
  int64_t deviceGradBytes() const { return gradBytes - hostGradBytes; }
  int64_t deviceOptimizerBytes() const { return optimizerBytes - hostOptimizerBytes; }
  int64_t deviceTotalBytes() const { return totalBytes() - hostTotalBytes(); }
  // Stage 3: the most bytes of gathered unit parameters that existed at once since the last
  // step (not part of the total, which counts what is held between steps).
  int64_t gatheredPeakBytes = 0;
  // Stage 3 with hpZ: the most bytes of secondary shards (zero_hpz_partition_size) held at once
  // during the last step: 1/k of every unit released after its forward, until its backward.
  int64_t secondaryPeakBytes = 0;
  // The most bytes of full-size buffers that exist only for a gradient reduction alive at once
  // during the last step (not part of the total either): the staging buffers of stages 2 and
  // 3, and the fp32 copies of 16-bit gradients reduced in fp32. One bucket's worth with
  // overlap_comm off.
  int64_t stagingPeakBytes = 0;
  // 16-bit training: the most bytes of fp32 copies of gradient shards alive at once during the
  // last optimizer step (one shard's worth: they are made one at a time). Not in the total.
  int64_t fp32GradsPeakBytes = 0;
  int64_t totalBytes() const { return paramBytes + gradBytes + optimizerBytes + frozenBytes; }
};

} // namespace zeroshard
