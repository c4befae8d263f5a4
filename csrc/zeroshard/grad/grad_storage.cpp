#include "zeroshard/grad/grad_storage.h"

#include "zeroshard/grad/host_grads.h"
#include "zeroshard/grad/replica_reduce.h"

#include <ATen/ops/_foreach_zero.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace zeroshard {

void TransientBytes::add(int64_t bytes) {
  live_ += bytes;
  peak_ = std::max(peak_, live_);
}

namespace {

// Every defined buffer of `buffers` zeroed in one call (one fused kernel per device on a GPU).
void zeroAll(const std::vector<at::Tensor>& buffers) {
  std::vector<at::Tensor> defined;
  for (const auto& b : buffers) {
    if (b.defined()) defined.push_back(b);
  }
  if (!defined.empty()) at::_foreach_zero_(defined);
}

// `grad` written over `view` (the parameter's shape): copy_ takes no sparse source
// (nn.Embedding(sparse=True)), whose rows are added into zeros instead.
void writeFirst(const at::Tensor& view, const at::Tensor& grad) {
  if (grad.is_sparse()) {
    view.zero_();
    view.add_(grad);
  } else {
    view.copy_(grad);
  }
}

// Note [first gradient of a window]: nothing zeroes the flat buffers after a step. zero()
// only forgets which parameters have a gradient in the window and sets their .grad to None, as
// torch's zero_grad() does. The first gradient a parameter receives in a window is then copied
// into its view of the flat buffer before AccumulateGrad runs (gradArriving, from a pre-hook on
// the parameter's accumulator), and the view is handed on as the gradient: AccumulateGrad finds
// no .grad and makes the view it (it steals a tensor nothing else holds; where it copies
// instead, as under create_graph, gradReady copies the result back and attaches the view).
// Later gradients of the window accumulate into the view in place. At the boundary the views of
// parameters that got no gradient in the window are zeroed before the reduction, and the
// padding is never written. So a window costs one copy of each gradient, where zeroing and then
// adding cost a write and a read-modify-write; the values are the same (x + 0 is x).
class FullGradStorage final : public GradStorage {
 public:
  FullGradStorage(const std::vector<Bucket>& buckets, int rank, bool shardedOptimizer, bool wideShard)
      : shardedOptimizer_(shardedOptimizer), reduced_(buckets.size(), 0) {
    for (const auto& b : buckets) {
      const auto& flat = flat_.emplace_back(at::zeros({b.layout().paddedNumel()}, b.flatParams().options()));
      const auto range = b.layout().shardRange(rank);
      slice_.push_back(flat.narrow(0, range.begin, range.numel()));
      // fp32 sums are kept unrounded, as stages 2 and 3 keep them (Note [gradient shard dtype]).
      wideShard_.push_back(wideShard ? at::zeros({b.layout().shardNumel()}, b.flatParams().options().dtype(at::kFloat))
                                     : at::Tensor());
      params_.push_back(b.params());
      written_.emplace_back(b.size(), 0);
    }
  }

  bool accumulatesInPlace() const override { return true; }

  at::Tensor optimizerGrad(size_t index) const override {
    if (wideShard_[index].defined()) return wideShard_[index];
    return shardedOptimizer_ ? slice_[index] : flat_[index];
  }

  void beginBackward(const Bucket& bucket, size_t index, bool /*boundary*/) override {
    for (size_t i = 0; i < bucket.size(); ++i) {
      auto& grad = bucket.params()[i].mutable_grad();
      if (!grad.defined() && !written_[index][i]) continue;  // its first gradient goes in through gradArriving
      const auto view = viewOf(bucket, index, i);
      if (grad.defined() && grad.data_ptr() == view.data_ptr()) continue;
      // Keep what the user accumulated elsewhere: it is the start of this window's sum.
      if (grad.defined()) writeFirst(view, grad);
      written_[index][i] = 1;
      grad = view;
    }
  }

  at::Tensor gradArriving(const Bucket& bucket, size_t index, size_t param, const at::Tensor& grad) override {
    if (written_[index][param] || bucket.params()[param].grad().defined()) return grad;
    auto view = viewOf(bucket, index, param);
    writeFirst(view, grad);
    written_[index][param] = 1;
    return view;
  }

  void gradReady(const Bucket& bucket, size_t index, size_t param, TransientBytes& /*transient*/) override {
    auto& grad = bucket.params()[param].mutable_grad();
    if (!grad.defined()) return;
    const auto view = viewOf(bucket, index, param);
    if (grad.data_ptr() == view.data_ptr()) return;
    // AccumulateGrad made a new tensor (it did not steal the view, or added out of place).
    writeFirst(view, grad);
    written_[index][param] = 1;
    grad = view;
  }

  StartedReduction reduce(const Bucket& bucket, size_t index, const std::vector<char>& /*ready*/,
                          Communicator& comm, const ReductionOptions& options, TransientBytes& transient) override {
    const at::Tensor& flat = flat_[index];
    for (size_t i = 0; i < bucket.size(); ++i) {
      if (written_[index][i]) continue;
      // No gradient in this window here, but other ranks' may come in: .grad is the view on
      // every rank, as for every other parameter (stage 0: the all-reduced mean, as DDP gives a
      // parameter this rank did not use; stage 1: this rank's shard of it is reduced, the rest
      // of the view holds this rank's zeros, as any stage-1 .grad outside the shard is local).
      auto view = viewOf(bucket, index, i);
      view.zero_();
      bucket.params()[i].mutable_grad() = view;
    }
    reduced_[index] = 1;
    double mean = 1.0 / comm.worldSize();
    if (options.preDivide) {
      flat.mul_(mean);
      mean = 1.0;
    }
    if (options.reduceInFloat && flat.scalar_type() != at::kFloat) {
      // Sum in fp32. Stage 0 rounds the result into its 16-bit gradients once; stage 1
      // reduce-scatters into the fp32 gradient shard the optimizer reads, unrounded, as stages 2
      // and 3 do (so stages 1-3 give bitwise the same weights).
      auto wide = flat.to(at::kFloat);
      const auto wideBytes = static_cast<int64_t>(wide.nbytes());
      transient.add(wideBytes);
      if (!shardedOptimizer_) {
        return {comm.allReduce(wide, mean), [flat, wide]() mutable { flat.copy_(wide); }, wideBytes};
      }
      TORCH_CHECK(wideShard_[index].defined(), "zeroshard: stage 1 with fp32 reduction needs the bucket's fp32 gradient shard");
      return {comm.reduceScatter(wide, wideShard_[index], mean), [wide]() {}, wideBytes};
    }
    if (!shardedOptimizer_) return {comm.allReduce(flat, mean), {}};
    return {comm.reduceScatter(flat, slice_[index], mean), {}};
  }

  void zero() override {
    for (size_t b = 0; b < params_.size(); ++b) {
      for (auto& p : params_[b]) p.mutable_grad() = at::Tensor();
      std::fill(written_[b].begin(), written_[b].end(), 0);
      reduced_[b] = 0;
    }
  }

  void finishCopies() override {
    std::vector<at::Tensor> unwritten;  // a step without a backward in its window reads zeros
    for (size_t b = 0; b < flat_.size(); ++b) {
      if (reduced_[b]) continue;
      unwritten.push_back(flat_[b]);
      unwritten.push_back(wideShard_[b]);
      reduced_[b] = 1;
    }
    zeroAll(unwritten);
  }

  int64_t bytes() const override {
    int64_t total = 0;
    for (size_t i = 0; i < flat_.size(); ++i) {
      total += static_cast<int64_t>(flat_[i].nbytes());
      if (wideShard_[i].defined()) total += static_cast<int64_t>(wideShard_[i].nbytes());
    }
    return total;
  }

 private:
  at::Tensor viewOf(const Bucket& bucket, size_t index, size_t param) const {
    const auto& place = bucket.layout().params()[param];
    return flat_[index].narrow(0, place.offset, place.numel).view(place.shape);
  }

  bool shardedOptimizer_;
  std::vector<at::Tensor> flat_;
  std::vector<at::Tensor> slice_;  // this rank's slice of each flat buffer (stage 1's reduce-scatter target)
  std::vector<at::Tensor> wideShard_;  // stage 1, 16-bit gradients reduced in fp32
  std::vector<std::vector<at::Tensor>> params_;  // each bucket's parameters, whose .grad zero() drops
  std::vector<std::vector<char>> written_;  // per bucket and parameter: has a gradient in this window
  std::vector<char> reduced_;  // per bucket: reduced since zero() (else finishCopies() zeroes it)
};

// Stages 2 and 3.
class ShardedGradStorage final : public GradStorage {
 public:
  ShardedGradStorage(const std::vector<Bucket>& buckets, at::ScalarType shardDtype)
      : staging_(buckets.size()), hasData_(buckets.size(), 0) {
    for (const auto& b : buckets) {
      shards_.push_back(at::zeros({b.layout().shardNumel()}, b.flatParams().options().dtype(shardDtype)));
    }
  }

  bool accumulatesInPlace() const override { return false; }
  at::Tensor optimizerGrad(size_t index) const override { return shards_[index]; }

  void gradReady(const Bucket& bucket, size_t index, size_t param, TransientBytes& transient) override {
    auto& staging = staging_[index];
    if (!staging.defined()) {
      // Uninitialized: every parameter's region is written by its gradient, and reduce()
      // zeroes the regions of parameters that got none, and the padding.
      staging = at::empty({bucket.layout().paddedNumel()}, bucket.flatParams().options());
      transient.add(static_cast<int64_t>(staging.nbytes()));
    }
    const auto& place = bucket.layout().params()[param];
    auto& grad = bucket.params()[param].mutable_grad();
    if (grad.defined()) writeFirst(staging.narrow(0, place.offset, place.numel).view(place.shape), grad);
    grad = at::Tensor();
  }

  StartedReduction reduce(const Bucket& bucket, size_t index, const std::vector<char>& ready, Communicator& comm,
                          const ReductionOptions& options, TransientBytes& transient) override {
    const auto& layout = bucket.layout();
    at::Tensor staging = std::move(staging_[index]);
    staging_[index] = at::Tensor();
    if (!staging.defined()) {
      staging = at::zeros({layout.paddedNumel()}, bucket.flatParams().options());
      transient.add(static_cast<int64_t>(staging.nbytes()));
    } else {
      for (size_t i = 0; i < bucket.size(); ++i) {
        if (!ready[i]) staging.narrow(0, layout.params()[i].offset, layout.params()[i].numel).zero_();
      }
      staging.narrow(0, layout.numel(), layout.paddedNumel() - layout.numel()).zero_();
    }
    if (options.reduceInFloat && staging.scalar_type() != at::kFloat) {  // the fp32 shard then takes the sum directly
      const auto narrowBytes = static_cast<int64_t>(staging.nbytes());
      staging = staging.to(at::kFloat);
      transient.add(static_cast<int64_t>(staging.nbytes()));
      transient.add(-narrowBytes);
    }
    const auto stagingBytes = static_cast<int64_t>(staging.nbytes());
    double mean = 1.0 / comm.worldSize();
    if (options.preDivide) {
      staging.mul_(mean);
      mean = 1.0;
    }
    const at::Tensor& shard = shards_[index];
    const bool first = !hasData_[index];
    hasData_[index] = 1;
    if (first && staging.scalar_type() == shard.scalar_type()) {
      // First micro-batch of the window: reduce straight into the shard (zero() left it as it was).
      return {comm.reduceScatter(staging, shard, mean), [staging]() {}, stagingBytes};
    }
    auto partial = at::empty({layout.shardNumel()}, staging.options());
    return {comm.reduceScatter(staging, partial, mean),
            [staging, partial, shard, first]() mutable { first ? shard.copy_(partial) : shard.add_(partial); },
            stagingBytes};
  }

  void zero() override { std::fill(hasData_.begin(), hasData_.end(), 0); }

  void finishCopies() override {
    std::vector<at::Tensor> unwritten;  // a step without a backward in its window reads zeros
    for (size_t b = 0; b < shards_.size(); ++b) {
      if (!hasData_[b]) unwritten.push_back(shards_[b]);
      hasData_[b] = 1;
    }
    zeroAll(unwritten);
  }

  int64_t bytes() const override {
    int64_t total = 0;
    for (const auto& shard : shards_) total += static_cast<int64_t>(shard.nbytes());
    return total;
  }

 private:
  std::vector<at::Tensor> shards_;
  std::vector<at::Tensor> staging_;
  std::vector<char> hasData_;
};

} // namespace

// Note [gradient shard dtype]: the shard holds what the reduce-scatter delivers. With 16-bit
// gradients on the wire and one micro-batch per step that is a 16-bit value already, so the
// shard is 16-bit (DESIGN.md's 2 bytes of gradient); it is fp32 when it must accumulate several
// micro-batches or receives fp32 sums (reduce_dtype "fp32").
std::unique_ptr<GradStorage> GradStorage::forPlan(const ShardingPlan& plan, const std::vector<Bucket>& buckets,
                                                  int rank, const GradStorageOptions& options,
                                                  Communicator* replicate) {
  std::unique_ptr<GradStorage> storage;
  if (plan.gradsSharded()) {
    const bool wide = options.accumulationSteps > 1 || options.reduceInFloat;
    storage = std::make_unique<ShardedGradStorage>(buckets, wide ? at::kFloat : options.computeDtype);
  } else {
    const bool wideShard = plan.optimizerSharded() && options.reduceInFloat && options.computeDtype != at::kFloat;
    storage = std::make_unique<FullGradStorage>(buckets, rank, plan.optimizerSharded(), wideShard);
  }
  if (replicate != nullptr) storage = withReplicaAllReduce(std::move(storage), *replicate);
  if (!plan.anyOptimizerOnHost(buckets.size())) return storage;
  return withHostGradShards(std::move(storage), buckets, plan.optimizerOnHostByBucket(buckets.size()),
                            plan.pinOptimizer());
}

} // namespace zeroshard
