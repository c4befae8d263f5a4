// The copies of a bucket's values this rank holds, and how new values reach all of them: the
// one rule for writing trained parameters from outside a step (Engine::setParameters, whole
// values; Engine::loadPretrained, the element ranges this rank holds).
#pragma once

#include <ATen/core/Tensor.h>

#include "zeroshard/layout/bucket.h"
#include "zeroshard/layout/flat_layout.h"

namespace zeroshard {

struct ParamTargets {
  at::Tensor master;       // the fp32 master weights: the whole flat buffer, or this rank's slice
  ShardRange masterRange;  // the flat range `master` covers
  at::Tensor shard;        // stage 3: the compute-dtype shard in its own storage (else undefined)
  ShardRange shardRange;
  at::Tensor flat;         // the whole compute-dtype buffer where its storage exists now (else undefined):
                           // always below stage 3; at stage 3 while gathered or kept gathered
                           // (persistent parameters)

  // `master`: the bucket's master weights (MasterWeights::of), which cover this rank's shard
  // once the optimizer state is sharded. In fp32 training they are the parameters' own storage.
  static ParamTargets of(const Bucket& bucket, at::Tensor master, bool optimizerSharded, bool paramsSharded,
                         int rank);

  // The flat elements of `range` that any copy holds, as one run (empty when none does). It
  // is exactly what they hold: the whole buffer (stages 0-2 hold every parameter whole), or
  // at stage 3 this rank's shard, which the master and the compute-dtype shard share, plus
  // the whole of what is kept gathered.
  ShardRange needed(const ShardRange& range) const;

  // Writes `value` (flat elements [range.begin, range.end), on the bucket's device) into every
  // copy's part of that range: the master as fp32, the others cast to the compute dtype, as an
  // optimizer step leaves them. A `value` in a 16-bit dtype keeps the fp32 master of each
  // element where it equals the master's rounding (Note [write-back keeps the master]).
  void write(const at::Tensor& value, const ShardRange& range) const;
};

} // namespace zeroshard
