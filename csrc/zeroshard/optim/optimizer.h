// AdamW on this rank's flat fp32 shards: one fused ATen kernel call per param group and device
// (per shard when the gradients are 16-bit, Note [fp32 gradients one shard at a time]). With
// offload some or all shards are host tensors (docs/offload.md): they are stepped on the host,
// with ATen's fused CPU kernel over the process's intra-op threads, the others on the device.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace zeroshard {

struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weightDecay = 0.01;
};

class ShardedAdamW {
 public:
  // Returns the new group's index.
  int addGroup(const AdamWHyper& hyper);
  // Registers one shard of `group`: `master` (fp32, updated in place) and its gradient (fp32,
  // or the 16-bit compute dtype), which must stay the same tensors between steps (views into
  // the engine's buffers). Allocates exp_avg and exp_avg_sq beside it. Returns the shard's index
  // within the group.
  size_t addShard(int group, const at::Tensor& master, const at::Tensor& grad);

  // A step is prepareGrads(), then optionally unscaleAndFindNonFinite() (fp16),
  // localGradSquareSum()/scaleGrads() (clipping), then step(). The step works on fp32
  // gradients: the registered ones when they are fp32, which the multiplications change in
  // place. 16-bit ones stay as they are (Note [fp32 gradients one shard at a time]).
  void prepareGrads();
  // fp16: gradients *= `inverseScale`; returns a 1-element float tensor on `device`, non-zero
  // when any of them holds an inf or NaN on this rank (no host synchronisation: the caller
  // reads it once, after combining ranks).
  at::Tensor unscaleAndFindNonFinite(double inverseScale, const at::Device& device);
  // Drops the prepared gradients of a step that is skipped.
  void discardPrepared();
  // Sum of squares of every gradient on this rank: a 0-dim double tensor on `device` (computed
  // there, no host synchronisation, no copy of an fp32 gradient).
  at::Tensor localGradSquareSum(const at::Device& device);
  // Sum of every gradient element on this rank, each shard summed in fp32 (16-bit ones read as
  // they are, without a converted copy): a 0-dim double tensor on `device`, finite exactly when
  // every element is, barring an overflow of the sum itself (Note [finite probe],
  // optimizer_step.cpp). No host synchronisation.
  at::Tensor localGradSum(const at::Device& device);
  // Gradients *= factor (clipping).
  // `factor` is a 0-dim tensor on the gradients' device (no host synchronisation).
  void scaleGrads(const at::Tensor& factor);
  // One AdamW step on every group (at::_fused_adamw_), with decoupled weight decay.
  // `foundInf` (optional): a 0-dim float tensor on the shards' device, 1 or 0, that the kernel
  // reads on the device: at 1 it leaves weights and moments untouched, and each shard's step
  // tensor takes back its increment on the device (steps -= found_inf, as torch.optim's fused
  // path does). The host's stepCount() still counts the step until takeBackStep(). Never
  // blocks on the flag.
  void step(const at::Tensor& foundInf = at::Tensor());
  // The host's count of a step whose foundInf turned out 1 (read later): the step tensors on
  // the device took it back themselves.
  void takeBackStep();
  // The same step, a few shards at a time (offload steps bucket by bucket, so that each one's
  // copy back and all-gather overlap the next one's host step): beginStep(), stepShards() over
  // every shard exactly once in any order, endStep(). The kernel treats every tensor of its
  // lists on its own, so the values are those of step().
  struct ShardRef {
    int group;
    size_t index;
  };
  void beginStep(const at::Tensor& foundInf = at::Tensor());
  void stepShards(const std::vector<ShardRef>& shards);
  void endStep();
  // The most bytes of fp32 copies of 16-bit gradients alive at once in the last step: the
  // largest shard's (4 bytes per element), or 0 when the gradients are fp32.
  int64_t peakConvertedBytes() const { return peakConvertedBytes_; }

  int numGroups() const { return static_cast<int>(groups_.size()); }
  AdamWHyper& hyper(int group) { return groups_.at(group).hyper; }
  const AdamWHyper& hyper(int group) const { return groups_.at(group).hyper; }
  int64_t stepCount() const { return steps_; }
  // Checkpoints: the state of one registered shard (the tensors themselves, written in place
  // on load), and the step count every shard's bias correction uses.
  struct ShardState {
    at::Tensor master, expAvg, expAvgSq;
  };
  ShardState shardState(int group, size_t index) const;
  void setStepCount(int64_t steps);
  // Bytes of exp_avg and exp_avg_sq held on this rank.
  int64_t stateBytes() const;

 private:
  struct Group {
    AdamWHyper hyper;
    std::vector<at::Tensor> masters, grads, expAvgs, expAvgSqs, steps;
    // The step in progress: the fp32 gradient of each shard, undefined where the registered
    // one is 16-bit (it is converted when needed, then dropped).
    std::vector<at::Tensor> prepared;
  };
  // The fp32 gradient of shard i of g: the prepared one, or a fresh fp32 copy of the 16-bit
  // one with the multiplications of this step applied, in the order they were asked for.
  at::Tensor fp32Grad(const Group& g, size_t i);
  void dropConverted(const at::Tensor& grad);
  // One shard's sum for the finite probe (Note [probe by at::sum]).
  at::Tensor shardSum(const at::Tensor& grad);
  // `factor` (a 0-dim tensor) on `device`: itself, or a copy made once per step.
  const at::Tensor& factorOn(const at::Tensor& factor, const c10::Device& device);
  std::optional<at::Tensor> onDevice(const std::optional<at::Tensor>& flag, const c10::Device& device);

  std::vector<Group> groups_;
  int64_t steps_ = 0;
  at::Tensor foundInf_;  // the step in progress's (step(), beginStep()), undefined without one
  std::vector<at::Tensor> pendingFactors_;  // for 16-bit gradients, applied at conversion
  std::vector<std::pair<at::Tensor, at::Tensor>> factorCopies_;  // (factor, copy on another device)
  int64_t liveConvertedBytes_ = 0;
  int64_t peakConvertedBytes_ = 0;
};

} // namespace zeroshard
