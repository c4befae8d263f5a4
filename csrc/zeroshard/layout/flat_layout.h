// Where each parameter lives in one padded flat buffer, and which rank owns which slice.
//
// Parameters are laid out back to back in the order given. The total is padded so that it
// splits into worldSize equal shards of a multiple of kShardAlignment elements; rank r owns
// [r*S, (r+1)*S). A parameter may straddle shard boundaries. Nothing else in zeroshard
// computes offsets: every "where is it" question is answered here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard {

struct ParamPlacement {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // first element in the flat buffer
  int64_t numel = 0;
};

struct ShardRange {
  int64_t begin = 0;  // in flat-buffer elements, end exclusive
  int64_t end = 0;
  int64_t numel() const { return end - begin; }
};

// The part of one parameter that falls inside one rank's shard.
struct ShardPiece {
  size_t param = 0;           // index into FlatLayout::params()
  int64_t paramBegin = 0;     // element range within the parameter, end exclusive
  int64_t paramEnd = 0;
  int64_t shardOffset = 0;    // where paramBegin sits inside the shard
};

// A run of flat-buffer elements inside one rank's shard.
struct ShardSpan {
  int rank = 0;
  int64_t offset = 0;  // within the rank's shard
  int64_t numel = 0;
};

class FlatLayout {
 public:
  // Each shard's length is a multiple of this many elements, so shards start aligned.
  static constexpr int64_t kShardAlignment = 16;

  FlatLayout(std::vector<ParamPlacement> params, int worldSize);

  int worldSize() const { return worldSize_; }
  const std::vector<ParamPlacement>& params() const { return params_; }
  int64_t numel() const { return numel_; }              // parameters only
  int64_t paddedNumel() const { return shardNumel_ * worldSize_; }
  int64_t shardNumel() const { return shardNumel_; }
  ShardRange shardRange(int rank) const;
  // The pieces of parameters inside `rank`'s shard, in flat order (padding has none).
  std::vector<ShardPiece> piecesInShard(int rank) const;
  // The same for any range of the flat buffer (shardOffset is then within `range`).
  std::vector<ShardPiece> piecesIn(const ShardRange& range) const;
  // Flat elements [begin, end) of a buffer cut into shards of `shardNumel` elements (e.g. a
  // saved checkpoint's), at the shard boundaries, in order.
  static std::vector<ShardSpan> spansOf(int64_t begin, int64_t end, int64_t shardNumel);
  // The ranks whose shards hold some of parameter `param`.
  std::vector<int> ranksHolding(size_t param) const;

 private:
  std::vector<ParamPlacement> params_;
  int worldSize_;
  int64_t numel_ = 0;
  int64_t shardNumel_ = 0;
};

} // namespace zeroshard
