// A run of parameters that share one FlatLayout: the unit the gradient reducer reduces and the
// engine all-gathers, one collective per bucket (at stage 3, one unit).
//
// On construction the parameters' data moves into one padded flat buffer and every parameter
// becomes a view of it: the Parameter objects the model holds keep their identity.
#pragma once

#include <ATen/core/Tensor.h>

#include "zeroshard/layout/flat_layout.h"

#include <optional>
#include <string>
#include <vector>

namespace zeroshard {

// Like t.set_data(data): `t` (a parameter or buffer, keeping its identity, autograd metadata and
// version counter) now has `data`'s storage, shape, dtype and device. Unlike set_data it also
// moves a tensor between the meta device and a real one, which set_data refuses as
// incompatible tensor types (Note [meta buckets]).
void setTensorData(const at::Tensor& t, const at::Tensor& data);

class Bucket {
 public:
  // paramGroups[i]: the optimizer param group of params[i] (one group per bucket at stages
  // 0-2; a stage-3 unit may mix groups).
  // The parameters must be float32: they seed the fp32 master weights. With a 16-bit
  // `computeDtype` the parameters become views of a flat buffer of that dtype, and the fp32
  // values are kept apart until takeFloatValues() (never rounded through the 16-bit copy).
  //
  // Parameters on the meta device (a model built under torch.device("meta")) have no values:
  // nothing is copied, and the flat buffer is made on `metaDevice` without storage, as after
  // releaseFlatParams(); allocateZeroed() gives it storage (Note [meta buckets]).
  Bucket(std::vector<at::Tensor> params, std::vector<std::string> names, std::vector<int> paramGroups,
         int rank, int worldSize, at::ScalarType computeDtype = at::kFloat,
         std::optional<at::Device> metaDevice = std::nullopt);

  const FlatLayout& layout() const { return layout_; }
  int paramGroup() const { return paramGroups_.front(); }
  int paramGroupOf(size_t param) const { return paramGroups_.at(param); }
  const std::vector<at::Tensor>& params() const { return params_; }
  size_t size() const { return params_.size(); }
  // Its parameters for an error message: "'a.weight'" or "'a.weight' .. 'b.bias' (4 parameters)".
  std::string describe() const;

  // The full flat parameters (padded), and this rank's slice of them: a view of the full
  // buffer, or its own storage after detachShard().
  const at::Tensor& flatParams() const { return flatParams_; }
  at::Tensor paramShard() const;

  // Stage 3. detachShard() copies this rank's slice into its own storage, so that the full
  // buffer can be released (the parameters keep their identity and shapes, their storage
  // becomes empty) and materialized again (contents undefined until an all-gather fills it).
  void detachShard();
  // Offload (stage 3, offload_param): the detached shard moves into host memory (pinned with
  // `pin` on a GPU); paramShard() is then that host tensor, which an all-gather reads through a
  // device copy (stage3/unit_scheduler.h).
  void moveShardToHost(bool pin);
  bool shardOnHost() const { return shardOnHost_; }
  void releaseFlatParams();
  void materializeFlatParams();
  // Whether the full buffer has storage now; allocateZeroed() gives it zeroed storage.
  bool allocated() const;
  void allocateZeroed();
  // Makes parameter i a view of the flat buffer again (after it was pointed elsewhere with
  // set_data, e.g. at a scratch tensor during meta initialisation).
  void restoreParamView(size_t i);

  // Writes this rank's part of parameter `param` from its whole value (any dtype, cast to the
  // buffer's) into its shard: the detached shard after detachShard(), else the full buffer's
  // slice. Frozen parameters at stage 3 are written so (meta initialisation).
  void writeShardOf(size_t param, const at::Tensor& whole);

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
  bool shardOnHost_ = false;
  at::Tensor floatValues_;  // fp32, only when the parameters are 16-bit, until taken
};

} // namespace zeroshard
