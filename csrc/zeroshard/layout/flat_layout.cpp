#include "zeroshard/layout/flat_layout.h"

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace zeroshard {

FlatLayout::FlatLayout(std::vector<ParamPlacement> params, int worldSize)
    : params_(std::move(params)), worldSize_(worldSize) {
  TORCH_CHECK(worldSize_ >= 1, "zeroshard::FlatLayout: world size must be >= 1, got ", worldSize_);
  for (auto& p : params_) {
    int64_t numel = 1;
    for (int64_t d : p.shape) {
      TORCH_CHECK(d >= 0, "zeroshard::FlatLayout: parameter '", p.name, "' has negative dimension ", d,
                  " in shape ", c10::IntArrayRef(p.shape));
      numel *= d;
    }
    p.numel = numel;
    p.offset = numel_;
    numel_ += numel;
  }
  const int64_t unit = kShardAlignment * worldSize_;
  const int64_t padded = std::max<int64_t>(unit, (numel_ + unit - 1) / unit * unit);
  shardNumel_ = padded / worldSize_;
}

ShardRange FlatLayout::shardRange(int rank) const {
  TORCH_CHECK(rank >= 0 && rank < worldSize_, "zeroshard::FlatLayout: rank ", rank, " outside world of ",
              worldSize_);
  return {rank * shardNumel_, (rank + 1) * shardNumel_};
}

std::vector<ShardPiece> FlatLayout::piecesInShard(int rank) const {
  return piecesIn(shardRange(rank));
}

std::vector<ShardSpan> FlatLayout::spansOf(int64_t begin, int64_t end, int64_t shardNumel) {
  TORCH_CHECK(shardNumel > 0 && 0 <= begin && begin <= end, "zeroshard::FlatLayout: bad range [", begin, ", ", end,
              ") of shards of ", shardNumel);
  std::vector<ShardSpan> spans;
  for (int64_t flat = begin; flat < end;) {
    const int rank = static_cast<int>(flat / shardNumel);
    const int64_t within = flat - static_cast<int64_t>(rank) * shardNumel;
    const int64_t count = std::min(end - flat, shardNumel - within);
    spans.push_back({rank, within, count});
    flat += count;
  }
  return spans;
}

std::vector<ShardPiece> FlatLayout::piecesIn(const ShardRange& shard) const {
  std::vector<ShardPiece> pieces;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    const int64_t begin = std::max(p.offset, shard.begin);
    const int64_t end = std::min(p.offset + p.numel, shard.end);
    if (begin < end) {
      pieces.push_back({i, begin - p.offset, end - p.offset, begin - shard.begin});
    }
  }
  return pieces;
}

std::vector<int> FlatLayout::ranksHolding(size_t param) const {
  TORCH_CHECK(param < params_.size(), "zeroshard::FlatLayout: parameter index ", param, " out of range");
  const auto& p = params_[param];
  std::vector<int> ranks;
  if (p.numel == 0) {
    return ranks;
  }
  const int first = static_cast<int>(p.offset / shardNumel_);
  const int last = static_cast<int>((p.offset + p.numel - 1) / shardNumel_);
  for (int r = first; r <= last; ++r) ranks.push_back(r);
  return ranks;
}

} // namespace zeroshard
