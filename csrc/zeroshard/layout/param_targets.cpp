#include "zeroshard/layout/param_targets.h"

#include <ATen/ops/where.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <utility>

namespace zeroshard {
namespace {

ShardRange intersect(const ShardRange& a, const ShardRange& b) {
  const int64_t begin = std::max(a.begin, b.begin);
  return {begin, std::max(begin, std::min(a.end, b.end))};
}

// The elements of flat-buffer range `srcRange` that fall inside `dstRange`, as slices of a
// flat `dst` covering dstRange and a flat `src` covering srcRange (undefined when none do).
std::pair<at::Tensor, at::Tensor> overlap(const at::Tensor& dst, const ShardRange& dstRange, const at::Tensor& src,
                                          const ShardRange& srcRange) {
  const ShardRange both = intersect(dstRange, srcRange);
  if (both.numel() == 0) return {};
  return {dst.narrow(0, both.begin - dstRange.begin, both.numel()),
          src.narrow(0, both.begin - srcRange.begin, both.numel())};
}

void copyOverlap(const at::Tensor& dst, const ShardRange& dstRange, const at::Tensor& src, const ShardRange& srcRange) {
  const auto [to, from] = overlap(dst, dstRange, src, srcRange);
  if (to.defined()) to.copy_(from);
}

} // namespace

ParamTargets ParamTargets::of(const Bucket& bucket, at::Tensor master, bool optimizerSharded, bool paramsSharded,
                              int rank) {
  const FlatLayout& layout = bucket.layout();
  const ShardRange whole{0, layout.paddedNumel()};
  ParamTargets t;
  t.master = std::move(master);
  t.masterRange = optimizerSharded ? layout.shardRange(rank) : whole;
  if (paramsSharded) {
    t.shard = bucket.paramShard();
    t.shardRange = layout.shardRange(rank);
  }
  if (bucket.flatParams().storage().nbytes() > 0) t.flat = bucket.flatParams();
  return t;
}

ShardRange ParamTargets::needed(const ShardRange& range) const {
  ShardRange hull{range.end, range.begin};
  auto add = [&](const ShardRange& held) {
    const ShardRange part = intersect(range, held);
    if (part.numel() == 0) return;
    hull.begin = std::min(hull.begin, part.begin);
    hull.end = std::max(hull.end, part.end);
  };
  if (master.defined()) add(masterRange);
  if (shard.defined()) add(shardRange);
  if (flat.defined()) add({0, flat.numel()});
  return hull.numel() > 0 ? hull : ShardRange{range.begin, range.begin};
}

void ParamTargets::write(const at::Tensor& value, const ShardRange& range) const {
  // In fp32 training the master is the parameters' own storage, so this also writes them.
  const auto [m, onValueDevice] = overlap(master, masterRange, value, range);
  if (m.defined()) {
    // Offloaded masters are in host memory, whatever device the value is on.
    const at::Tensor v = onValueDevice.to(m.device());
    if (v.scalar_type() != at::kFloat) {
      // Note [write-back keeps the master]: a 16-bit value carries no more than its dtype's
      // precision. Where it equals the master's rounding (an element nobody changed, e.g. a
      // parameter only read inside GatheredParameters), the fp32 master is kept as it is
      // rather than rounded; elsewhere it becomes the value.
      m.copy_(at::where(m.to(v.scalar_type()).eq(v), m, v.to(at::kFloat)));
    } else {
      m.copy_(v);
    }
  }
  // Stage 3 keeps the compute-dtype shard in its own storage; it is what the next gather reads.
  if (shard.defined()) copyOverlap(shard, shardRange, value, range);
  if (flat.defined()) copyOverlap(flat, {0, flat.numel()}, value, range);
}

} // namespace zeroshard
