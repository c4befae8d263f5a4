#include "zeroshard/grad/grad_reducer.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>

namespace zeroshard {

namespace {

// Runs after AccumulateGrad has written the parameter's .grad for this backward.
class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(GradReducer* reducer, size_t bucket, size_t param)
      : reducer_(reducer), bucket_(bucket), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    reducer_->onGradReady(bucket_, param_);
    return outputs;
  }

 private:
  GradReducer* reducer_;
  size_t bucket_;
  size_t param_;
};

using AccumulatorPtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

} // namespace

// The accumulator must be kept alive: a parameter only holds it weakly, and a new one (without
// our hook) would be created on the next forward otherwise.
struct GradReducer::HookHandle {
  AccumulatorPtr accumulator;
  uintptr_t key;
};

GradReducer::GradReducer(std::vector<Bucket>& buckets, Communicator& comm, const ShardingPlan& plan,
                         ReductionOptions options)
    : buckets_(buckets), comm_(comm), plan_(plan), options_(std::move(options)) {
  TORCH_CHECK(options_.maxInFlight >= 1, "zeroshard: zeroshard.max_inflight_reductions must be >= 1, got ",
              options_.maxInFlight);
  for (const auto& b : buckets_) {
    ready_.emplace_back(b.size(), 0);
  }
  readyCount_.assign(buckets_.size(), 0);
  launched_.assign(buckets_.size(), 0);
  shardHasData_.assign(buckets_.size(), 0);
  registerHooks();
}

GradReducer::~GradReducer() {
  removeHooks();
}

void GradReducer::registerHooks() {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    for (size_t i = 0; i < buckets_[b].size(); ++i) {
      auto accumulator = torch::autograd::impl::grad_accumulator(buckets_[b].params()[i]);
      TORCH_CHECK(accumulator, "zeroshard: parameter '", buckets_[b].layout().params()[i].name,
                  "' has no gradient accumulator (is it a leaf that requires grad?)");
      auto key = accumulator->add_post_hook(std::make_unique<GradReadyHook>(this, b, i));
      hooks_.push_back(std::make_unique<HookHandle>(HookHandle{std::move(accumulator), key}));
    }
  }
}

void GradReducer::removeHooks() {
  for (auto& h : hooks_) {
    h->accumulator->del_post_hook(h->key);
  }
  hooks_.clear();
}

bool GradReducer::reducesThisBackward() const {
  return plan_.gradsSharded() || boundary_;
}

void GradReducer::markShardsEmpty() {
  shardHasData_.assign(buckets_.size(), 0);
}

void GradReducer::beginBackward(bool boundary) {
  TORCH_CHECK(!inBackward_, "zeroshard: backward() started while the previous one is unfinished");
  inBackward_ = true;
  boundary_ = boundary;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    std::fill(ready_[b].begin(), ready_[b].end(), 0);
    readyCount_[b] = 0;
    launched_[b] = 0;
    if (!plan_.gradsSharded()) buckets_[b].attachGradViews();
  }
}

void GradReducer::onGradReady(size_t bucket, size_t param) {
  auto& b = buckets_[bucket];
  TORCH_CHECK(inBackward_, "zeroshard: a gradient for '", b.layout().params()[param].name,
              "' arrived outside engine.backward(); call engine.backward(loss) instead of loss.backward()");
  if (ready_[bucket][param]) {
    // A leaf's gradient is accumulated once per backward, unless a nested backward (reentrant
    // activation checkpointing) accumulates it again. Stages 0 and 1 add it to the flat
    // gradients in place, which is fine until the bucket's reduction starts reading them.
    TORCH_CHECK(!plan_.gradsSharded() && !launched_[bucket], "zeroshard: parameter '", b.layout().params()[param].name,
                "' received a second gradient in one backward, after ",
                !plan_.gradsSharded() ? "its bucket's reduction had started" : "it was reduced (stages 2 and 3 reduce each "
                "gradient as soon as it is final)",
                ". A nested backward does this: use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)");
    return;
  }
  ready_[bucket][param] = 1;
  ++readyCount_[bucket];
  if (plan_.gradsSharded()) {
    // Copy the final gradient into the bucket's staging buffer and free it right away.
    if (!b.staging().defined()) {
      // Uninitialized: every parameter's region is written by its gradient, and launch()
      // zeroes the regions of parameters that got none, and the padding.
      b.staging() = at::empty({b.layout().paddedNumel()}, b.flatParams().options());
      countStaging(static_cast<int64_t>(b.staging().nbytes()));
    }
    b.copyGradsInto(b.staging(), param);
    b.params()[param].mutable_grad() = at::Tensor();
  }
  if (readyCount_[bucket] == b.size() && reducesThisBackward()) {
    launch(bucket);
  }
}

// Note [staging lifetime]: a reduction's completion holds its staging buffer (a full-size
// gradient copy at stages 2 and 3). Before a bucket launches, the reductions that have finished
// are retired (oldest first), and then, while maxInFlight are still running, the oldest is
// waited for. Polling alone is not enough: Gloo reports an async reduce_scatter_tensor as not
// completed until wait() is called, so nothing would be freed before backward ends and the
// transient would be a whole gradient copy. With the cap, at most maxInFlight staging buffers
// are in flight plus the one being filled: staging_peak <= (maxInFlight + 1) x the largest
// bucket's, on every backend. On a GPU the wait only orders the compute stream after the
// collective, so the cap costs the host nothing.
void GradReducer::retireCompleted() {
  size_t done = 0;
  while (done < inFlight_.size() && inFlight_[done].handle.completed()) {
    retire(inFlight_[done]);
    ++done;
  }
  inFlight_.erase(inFlight_.begin(), inFlight_.begin() + static_cast<std::ptrdiff_t>(done));
}

void GradReducer::retireOldest() {
  retire(inFlight_.front());
  inFlight_.erase(inFlight_.begin());
}

void GradReducer::retire(InFlight& f) {
  f.handle.wait();
  if (f.then) f.then();
  f.then = nullptr;  // drops the buffers the completion captured
  countStaging(-f.stagingBytes);
  f.stagingBytes = 0;
}

// In launch order; each completion releases its staging buffer.
void GradReducer::retireAll() {
  auto inFlight = std::move(inFlight_);
  inFlight_.clear();
  for (auto& f : inFlight) retire(f);
}

void GradReducer::countStaging(int64_t bytes) {
  liveStagingBytes_ += bytes;
  peakStagingBytes_ = std::max(peakStagingBytes_, liveStagingBytes_);
}

void GradReducer::launch(size_t bucket) {
  retireCompleted();
  while (static_cast<int64_t>(inFlight_.size()) >= options_.maxInFlight) retireOldest();
  auto& b = buckets_[bucket];
  launched_[bucket] = 1;
  double mean = 1.0 / comm_.worldSize();
  if (options_.preDivide && !plan_.gradsSharded()) {
    b.flatGrads().mul_(mean);
    mean = 1.0;
  }
  const bool widen = options_.reduceInFloat && b.flatParams().scalar_type() != at::kFloat;
  if (!plan_.gradsSharded() && widen) {
    // Sum in fp32. Stage 0 rounds the result into its 16-bit gradients once; stage 1
    // reduce-scatters into the fp32 gradient shard the optimizer reads, unrounded, as stages 2
    // and 3 do (so stages 1-3 give bitwise the same weights).
    auto wide = b.flatGrads().to(at::kFloat);
    const auto wideBytes = static_cast<int64_t>(wide.nbytes());
    countStaging(wideBytes);
    if (!plan_.optimizerSharded()) {
      const at::Tensor& target = b.flatGrads();
      inFlight_.push_back({comm_.allReduce(wide, mean), [target, wide]() mutable { target.copy_(wide); }, wideBytes});
    } else {
      TORCH_CHECK(b.gradShard().defined() && b.gradShard().scalar_type() == at::kFloat,
                  "zeroshard: stage 1 with fp32 reduction needs the bucket's fp32 gradient shard");
      inFlight_.push_back({comm_.reduceScatter(wide, b.gradShard(), mean), [wide]() {}, wideBytes});
    }
  } else if (!plan_.optimizerSharded()) {
    inFlight_.push_back({comm_.allReduce(b.flatGrads(), mean), {}});
  } else if (!plan_.gradsSharded()) {
    inFlight_.push_back({comm_.reduceScatter(b.flatGrads(), b.flatGradShard(), mean), {}});
  } else {
    if (!b.staging().defined()) {
      b.staging() = at::zeros({b.layout().paddedNumel()}, b.flatParams().options());
      countStaging(static_cast<int64_t>(b.staging().nbytes()));
    } else {
      const auto& layout = b.layout();
      for (size_t i = 0; i < b.size(); ++i) {
        if (!ready_[bucket][i]) b.staging().narrow(0, layout.params()[i].offset, layout.params()[i].numel).zero_();
      }
      b.staging().narrow(0, layout.numel(), layout.paddedNumel() - layout.numel()).zero_();
    }
    at::Tensor staging = std::move(b.staging());
    b.staging() = at::Tensor();
    if (widen) {  // the fp32 shard then takes the sum directly
      const auto narrowBytes = static_cast<int64_t>(staging.nbytes());
      staging = staging.to(at::kFloat);
      countStaging(static_cast<int64_t>(staging.nbytes()));
      countStaging(-narrowBytes);
    }
    const auto stagingBytes = static_cast<int64_t>(staging.nbytes());
    if (options_.preDivide) {
      staging.mul_(mean);
      mean = 1.0;
    }
    const at::Tensor& shard = b.gradShard();
    if (!shardHasData_[bucket] && staging.scalar_type() == shard.scalar_type()) {
      // First micro-batch of the window: reduce straight into the shard.
      inFlight_.push_back({comm_.reduceScatter(staging, shard, mean), [staging]() {}, stagingBytes});
    } else {
      auto partial = at::empty({b.layout().shardNumel()}, staging.options());
      inFlight_.push_back({comm_.reduceScatter(staging, partial, mean),
                           [staging, partial, shard]() mutable { shard.add_(partial); }, stagingBytes});
    }
    shardHasData_[bucket] = 1;
    if (options_.onLaunched) options_.onLaunched(bucket);
  }
  if (!options_.overlap) retireAll();
}

void GradReducer::finishBackward() {
  TORCH_CHECK(inBackward_, "zeroshard: finishBackward without beginBackward");
  if (reducesThisBackward()) {
    // Buckets some of whose parameters got no gradient in this backward: same order on all ranks.
    for (size_t b = 0; b < buckets_.size(); ++b) {
      if (!launched_[b]) launch(b);
    }
  }
  inBackward_ = false;
  retireAll();
}

void GradReducer::abortBackward() {
  auto inFlight = std::move(inFlight_);
  inFlight_.clear();
  inBackward_ = false;
  for (auto& f : inFlight) {
    try {
      f.handle.wait();
    } catch (const std::exception&) {
      // The autograd error is the one to report.
    }
    countStaging(-f.stagingBytes);
  }
}

} // namespace zeroshard
