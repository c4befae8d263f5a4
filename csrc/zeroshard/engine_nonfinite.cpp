// zeroshard.nonfinite: fp32 and bf16 gradients with an inf or NaN (fp16's loss scaler handles
// its own). The check reads the squared global norm the step computes for clipping anyway (one
// host read a step; without clipping one more pass over the gradient shards): it is finite
// exactly when every gradient is. Only then, on the rare bad step, a second pass finds the
// first parameter whose gradient is not finite, over every rank's shards, in the order of the
// flat buffers (the model's at stages 0-2; at stage 3 the units', the root unit's last).
#include "zeroshard/engine.h"

#include <ATen/ops/isfinite.h>
#include <c10/util/Exception.h>

#include "zeroshard/comm/gather_values.h"
#include "zeroshard/grad/grad_storage.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace zeroshard {

bool Engine::gradsFinite() {
  if (std::isfinite(globalGradSquares().item<double>())) return true;
  // This rank's first parameter (by index over all buckets, in buffer order) holding a non-finite
  // gradient element in the range it steps; every rank's, then the smallest.
  int64_t first = -1;
  int64_t before = 0;
  for (size_t b = 0; b < buckets_.size() && first < 0; ++b) {
    const auto& layout = buckets_[b].layout();
    const ShardRange held =
        plan_.optimizerSharded() ? layout.shardRange(shardComm().rank()) : ShardRange{0, layout.paddedNumel()};
    const at::Tensor& grad = grads_->optimizerGrad(b);
    for (const auto& piece : layout.piecesIn(held)) {
      const auto values = grad.narrow(0, piece.shardOffset, piece.paramEnd - piece.paramBegin);
      if (!at::isfinite(values).all().item<bool>()) {
        first = before + static_cast<int64_t>(piece.param);
        break;
      }
    }
    before += static_cast<int64_t>(layout.params().size());
  }
  if (plan_.optimizerSharded()) {
    int64_t smallest = -1;
    for (const auto& theirs : allGatherValues(shardComm(), {first}, buckets_.front().flatParams().device())) {
      if (theirs.at(0) >= 0 && (smallest < 0 || theirs[0] < smallest)) smallest = theirs[0];
    }
    first = smallest;
  }
  std::string name = "(none found)";
  for (size_t b = 0, offset = 0; b < buckets_.size() && first >= 0; ++b) {
    const auto& params = buckets_[b].layout().params();
    if (first < static_cast<int64_t>(offset + params.size())) {
      name = "'" + params[static_cast<size_t>(first) - offset].name + "'";
      break;
    }
    offset += params.size();
  }
  const int64_t step = microSteps_ / batchSizes_.accumulationSteps;
  const std::string what = "zeroshard: the gradients of step " + std::to_string(step) +
                           " hold an inf or NaN (a non-finite loss, or an overflow in backward); the first "
                           "parameter with a non-finite gradient is " + name;
  if (config_.extras.nonfinite == "skip") {
    if (comm_.rank() == 0) TORCH_WARN(what, "; the step is skipped on every rank (zeroshard.nonfinite \"skip\")");
    return false;
  }
  optimizer_.discardPrepared();
  zeroGrads();
  stepSquares_ = at::Tensor();
  TORCH_CHECK(false, what, ". Nothing was updated. zeroshard.nonfinite \"skip\" skips such steps instead, as "
                           "fp16's loss scaling does; lower the learning rate or clip (gradient_clipping) if it "
                           "recurs");
  return false;
}

} // namespace zeroshard
