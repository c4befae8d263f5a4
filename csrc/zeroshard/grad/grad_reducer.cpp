#include "zeroshard/grad/grad_reducer.h"

#include <ATen/record_function.h>
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

// Runs before AccumulateGrad: the storage may hand it another tensor to accumulate (Note [first
// gradient of a window], grad_storage.cpp).
class GradArrivingHook : public torch::autograd::FunctionPreHook {
 public:
  GradArrivingHook(GradReducer* reducer, size_t bucket, size_t param)
      : reducer_(reducer), bucket_(bucket), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (grads.size() != 1 || !grads[0].defined()) return grads;
    return {reducer_->onGradArriving(bucket_, param_, grads[0])};
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
  const torch::autograd::FunctionPreHook* preHook;  // nullptr: none registered
};

GradReducer::GradReducer(const std::vector<Bucket>& buckets, GradStorage& grads, Communicator& comm,
                         ReductionOptions options)
    : buckets_(buckets), grads_(grads), comm_(comm), options_(std::move(options)) {
  TORCH_CHECK(options_.maxInFlight >= 1, "zeroshard: zeroshard.max_inflight_reductions must be >= 1, got ",
              options_.maxInFlight);
  for (const auto& b : buckets_) {
    ready_.emplace_back(b.size(), 0);
  }
  readyCount_.assign(buckets_.size(), 0);
  launched_.assign(buckets_.size(), 0);
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
      const torch::autograd::FunctionPreHook* preHook = nullptr;
      if (grads_.accumulatesInPlace()) {
        auto hook = std::make_unique<GradArrivingHook>(this, b, i);
        preHook = hook.get();
        accumulator->add_pre_hook(std::move(hook));
      }
      hooks_.push_back(std::make_unique<HookHandle>(HookHandle{std::move(accumulator), key, preHook}));
    }
  }
}

void GradReducer::removeHooks() {
  for (auto& h : hooks_) {
    h->accumulator->del_post_hook(h->key);
    auto& preHooks = h->accumulator->pre_hooks();  // a Node has no del_pre_hook
    preHooks.erase(std::remove_if(preHooks.begin(), preHooks.end(),
                                  [&](const auto& hook) { return hook.get() == h->preHook; }),
                   preHooks.end());
  }
  hooks_.clear();
}

bool GradReducer::reducesThisBackward() const {
  return !grads_.accumulatesInPlace() || boundary_;
}

void GradReducer::beginBackward(bool boundary) {
  TORCH_CHECK(!inBackward_, "zeroshard: backward() started while the previous one is unfinished");
  inBackward_ = true;
  boundary_ = boundary;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    std::fill(ready_[b].begin(), ready_[b].end(), 0);
    readyCount_[b] = 0;
    launched_[b] = 0;
    grads_.beginBackward(buckets_[b], b, boundary);
  }
}

at::Tensor GradReducer::onGradArriving(size_t bucket, size_t param, const at::Tensor& grad) {
  if (!inBackward_) return grad;  // onGradReady reports it
  return grads_.gradArriving(buckets_[bucket], bucket, param, grad);
}

void GradReducer::onGradReady(size_t bucket, size_t param) {
  const auto& b = buckets_[bucket];
  TORCH_CHECK(inBackward_, "zeroshard: a gradient for '", b.layout().params()[param].name,
              "' arrived outside engine.backward(); call engine.backward(loss) instead of loss.backward()");
  if (ready_[bucket][param]) {
    // A leaf's gradient is accumulated once per backward, unless a nested backward (reentrant
    // activation checkpointing) accumulates it again. Full gradients (stages 0 and 1) take it
    // in place, which is fine until the bucket's reduction starts reading them.
    const bool inPlace = grads_.accumulatesInPlace();
    TORCH_CHECK(inPlace && !launched_[bucket], "zeroshard: parameter '", b.layout().params()[param].name,
                "' received a second gradient in one backward, after ",
                inPlace ? "its bucket's reduction had started" : "it was reduced (stages 2 and 3 reduce each "
                "gradient as soon as it is final)",
                ". A nested backward does this: use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)");
    return;
  }
  ready_[bucket][param] = 1;
  ++readyCount_[bucket];
  grads_.gradReady(b, bucket, param, transient_);
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

void GradReducer::retire(StartedReduction& f) {
  try {
    f.handle.wait();
  } catch (...) {
    rethrowWithContext("reducing the gradients of bucket " + std::to_string(f.bucket) + " of " +
                       std::to_string(buckets_.size()) + ": " + buckets_[f.bucket].describe());
  }
  if (f.then) f.then();
  f.then = nullptr;  // drops the buffers the completion captured
  transient_.add(-f.transientBytes);
  f.transientBytes = 0;
}

// In launch order; each completion releases its staging buffer.
void GradReducer::retireAll() {
  auto inFlight = std::move(inFlight_);
  inFlight_.clear();
  for (auto& f : inFlight) retire(f);
}

void GradReducer::launch(size_t bucket) {
  RECORD_USER_SCOPE("zeroshard::reduce_bucket");  // Note [profiler names]
  retireCompleted();
  while (static_cast<int64_t>(inFlight_.size()) >= options_.maxInFlight) retireOldest();
  launched_[bucket] = 1;
  inFlight_.push_back(grads_.reduce(buckets_[bucket], bucket, ready_[bucket], comm_, options_, transient_));
  inFlight_.back().bucket = bucket;
  if (options_.onLaunched) options_.onLaunched(bucket);
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
    transient_.add(-f.transientBytes);
  }
}

} // namespace zeroshard
