// The fp32 weights the optimizer updates, one tensor per bucket: the whole flat buffer while the
// optimizer state is replicated (stage 0), this rank's slice once it is sharded (shard()).
//
// In fp32 training they are the parameters' own storage (the flat buffer, or the bucket's
// shard), so there is nothing to copy. With 16-bit parameters they are a separate fp32 copy,
// built from the model's original values (never rounded through the 16-bit copy), and
// pushToParams() casts them into the parameters after each step.
//
// Offload (offload()): a bucket whose optimizer state is in host memory keeps its masters there,
// as a copy of their own even in fp32 training, unless they can be the parameter shard itself
// (fp32 parameters whose stage-3 shards are in host memory too). A bucket stepped on the device
// while its fp32 shard is in host memory (offload_param alone) gets a device copy.
#pragma once

#include <ATen/core/Tensor.h>

#include "zeroshard/layout/bucket.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace zeroshard {

class MasterWeights {
 public:
  // Takes each bucket's fp32 values (Bucket::takeFloatValues()).
  explicit MasterWeights(std::vector<Bucket>& buckets);
  // For buckets of a meta-device model (nothing to take): zeroed fp32 copies where the
  // parameters are 16-bit, whole or, with `sharded`, only this rank's slice (never a whole
  // bucket then), filled by the engine's initialisation.
  static MasterWeights allocated(const std::vector<Bucket>& buckets, bool sharded, int rank);

  // Bucket `index`'s master weights, whole or this rank's slice.
  at::Tensor of(const Bucket& bucket, size_t index) const;
  // Keeps only this rank's slice of each (stages 1-3; after the initial broadcast).
  void shard(const std::vector<Bucket>& buckets, int rank);
  // With 16-bit parameters: casts the masters into the parameters (or their shard).
  void pushToParams(const std::vector<Bucket>& buckets) const;
  // With 16-bit parameters, or a copy in another place: bucket `index`'s cast into its parameters.
  void pushToParams(const Bucket& bucket, size_t index) const;
  // Offload, once the parameter storage holds its final shards (stages 1-3, after shard()):
  // onHost[i] puts bucket i's masters in host memory (pinned with `pin`); `paramsOnHost` says
  // the parameter shards are there (stage 3, offload_param).
  void offload(const std::vector<Bucket>& buckets, const std::vector<char>& onHost, bool paramsOnHost, bool pin);
  // Bytes of the separate fp32 copies (0 in fp32 training without offload), and of those in
  // host memory.
  int64_t separateBytes() const;
  int64_t hostBytes() const;

 private:
  MasterWeights() = default;

  std::vector<at::Tensor> separate_;  // per bucket; undefined where the parameters are fp32
  std::vector<char> onHost_;           // per bucket, after offload()
  bool sharded_ = false;
};

}  // namespace zeroshard
