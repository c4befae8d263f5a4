// A run of parameters that share one FlatLayout: the unit the gradient reducer reduces and the
// engine all-gathers, one collective per bucket (at stage 3, one unit).
//
// On construction the parameters' data moves into one padded flat buffer and every parameter
// becomes a view of it: the Parameter objects the model holds keep their identity.
#pragma once

#include <ATen/core/Tensor.h>

#include "zeroshard/layout/flat_layout.h"

#include <string>
#include <vector>

namespace zeroshard {

class Bucket {
 public:
  // paramGroups[i]: the optimizer param group of params[i] (one group per bucket at stages
  // 0-2; a stage-3 unit may mix groups).
  // The parameters must be float32: they seed the fp32 master weights. With a 16-bit
  // `computeDtype` the parameters become views of a flat buffer of that dtype, and the fp32
  // values are kept apart until takeFloatValues() (never rounded through the 16-bit copy).
  Bucket(std::vector<at::Tensor> params, std::vector<std::string> names, std::vector<int> paramGroups,
         int rank, int worldSize, at::ScalarType computeDtype = at::kFloat);

  const FlatLayout& layout() const { return layout_; }
  int paramGroup() const { return paramGroups_.front(); }
  int paramGroupOf(size_t param) const { return paramGroups_.at(param); }
  const std::vector<at::Tensor>& params() const { return params_; }
  size_t size() const { return params_.size(); }

  // The full flat parameters (padded), and this rank's slice of them: a view of the full
  // buffer, or its own storage after detachShard().
  const at::Tensor& flatParams() const { return flatParams_; }
  at::Tensor paramShard() const;

  // Stage 3. detachShard() copies this rank's slice into its own storage, so that the full
  // buffer can be released (the parameters keep their identity and shapes, their storage
  // becomes empty) and materialized again (contents undefined until an all-gather fills it).
  void detachShard();
  void releaseFlatParams();
  void materializeFlatParams();

  // With 16-bit parameters, the model's original fp32 values (the first time; undefined after,
  // and when the parameters are fp32): they seed the master weights (optim/master_weights.h).
  at::Tensor takeFloatValues();

 private:
  FlatLayout layout_;
  std::vector<int> paramGroups_;
  int rank_;
  std::vector<at::Tensor> params_;
  at::Tensor flatParams_;
  at::Tensor shard_;
  at::Tensor floatValues_;  // fp32, only when the parameters are 16-bit, until taken
};

} // namespace zeroshard
