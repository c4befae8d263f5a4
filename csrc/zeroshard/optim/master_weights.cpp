#include "zeroshard/optim/master_weights.h"

#include <ATen/ops/zeros.h>

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
  for (size_t i = 0; i < buckets.size(); ++i) {
    if (!separate_[i].defined()) continue;
    (sharded_ ? buckets[i].paramShard() : buckets[i].flatParams()).copy_(separate_[i]);
  }
}

int64_t MasterWeights::separateBytes() const {
  int64_t total = 0;
  for (const auto& m : separate_) {
    if (m.defined()) total += static_cast<int64_t>(m.nbytes());
  }
  return total;
}

}  // namespace zeroshard
