#include "zeroshard/optim/master_weights.h"

#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include "zeroshard/layout/host_memory.h"

namespace zeroshard {

MasterWeights::MasterWeights(std::vector<Bucket>& buckets) {
  for (auto& b : buckets) separate_.push_back(b.takeFloatValues());
}

MasterWeights MasterWeights::allocated(const std::vector<Bucket>& buckets, bool sharded, int rank) {
  MasterWeights out;
  out.sharded_ = sharded;
  for (const auto& b : buckets) {
    const at::Tensor& flat = b.flatParams();
    if (flat.scalar_type() == at::kFloat) {
      out.separate_.emplace_back();
      continue;
    }
    const int64_t numel = sharded ? b.layout().shardRange(rank).numel() : b.layout().paddedNumel();
    out.separate_.push_back(at::zeros({numel}, flat.options().dtype(at::kFloat)));
  }
  return out;
}

at::Tensor MasterWeights::of(const Bucket& bucket, size_t index) const {
  if (separate_[index].defined()) return separate_[index];
  return sharded_ ? bucket.paramShard() : bucket.flatParams();
}

void MasterWeights::shard(const std::vector<Bucket>& buckets, int rank) {
  sharded_ = true;
  for (size_t i = 0; i < buckets.size(); ++i) {
    if (!separate_[i].defined()) continue;
    const auto range = buckets[i].layout().shardRange(rank);
    separate_[i] = separate_[i].narrow(0, range.begin, range.numel()).clone();
  }
}

void MasterWeights::pushToParams(const std::vector<Bucket>& buckets) const {
  for (size_t i = 0; i < buckets.size(); ++i) pushToParams(buckets[i], i);
}

void MasterWeights::pushToParams(const Bucket& bucket, size_t index) const {
  if (!separate_[index].defined()) return;
  copyBetween(sharded_ ? bucket.paramShard() : bucket.flatParams(), separate_[index]);
}

void MasterWeights::offload(const std::vector<Bucket>& buckets, const std::vector<char>& onHost, bool paramsOnHost,
                            bool pin) {
  TORCH_CHECK(sharded_ && onHost.size() == buckets.size(), "zeroshard: offload needs sharded master weights");
  onHost_ = onHost;
  for (size_t i = 0; i < buckets.size(); ++i) {
    const at::Tensor shard = buckets[i].paramShard();
    const c10::Device device = buckets[i].flatParams().device();
    at::Tensor& master = separate_[i];
    if (onHost[i]) {
      if (master.defined()) {
        master = copyToHost(master, pin, device);
      } else if (!paramsOnHost) {
        master = copyToHost(shard, pin, device);  // fp32: the optimizer's own copy in host memory
      }  // else the host shard is the master, as the device shard is without offload
    } else if (!master.defined() && paramsOnHost) {
      master = shard.to(device, /*non_blocking=*/false, /*copy=*/true);
    }
  }
}

int64_t MasterWeights::separateBytes() const {
  int64_t total = 0;
  for (const auto& m : separate_) {
    if (m.defined()) total += static_cast<int64_t>(m.nbytes());
  }
  return total;
}

int64_t MasterWeights::hostBytes() const {
  int64_t total = 0;
  for (size_t i = 0; i < separate_.size(); ++i) {
    if (separate_[i].defined() && i < onHost_.size() && onHost_[i]) total += static_cast<int64_t>(separate_[i].nbytes());
  }
  return total;
}

}  // namespace zeroshard
