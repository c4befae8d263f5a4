// Engine::setParameters: whole values written back into the sharded state, for
// GatheredParameters(modifier_rank=r) in zeroshard.deepspeed (the Python layer broadcasts the
// modified values from rank r first, so every rank writes the same thing and no collective is
// needed here).
#include "zeroshard/engine.h"

#include <ATen/ops/where.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

namespace zeroshard {
namespace {

// The elements of flat-buffer range `srcRange` that fall inside `dstRange`, as slices of a
// flat `dst` covering dstRange and a flat `src` covering srcRange (undefined when none do).
std::pair<at::Tensor, at::Tensor> overlap(const at::Tensor& dst, const ShardRange& dstRange, const at::Tensor& src,
                                          const ShardRange& srcRange) {
  const int64_t begin = std::max(dstRange.begin, srcRange.begin);
  const int64_t end = std::min(dstRange.end, srcRange.end);
  if (begin >= end) return {};
  return {dst.narrow(0, begin - dstRange.begin, end - begin), src.narrow(0, begin - srcRange.begin, end - begin)};
}

void copyOverlap(const at::Tensor& dst, const ShardRange& dstRange, const at::Tensor& src, const ShardRange& srcRange) {
  const auto [to, from] = overlap(dst, dstRange, src, srcRange);
  if (to.defined()) to.copy_(from);
}

struct ParamWrite {
  size_t bucket;
  size_t param;
  at::Tensor value;  // flat, as given (fp32 or the compute dtype), on the bucket's device
};

} // namespace

void Engine::setParameters(const std::vector<std::pair<std::string, at::Tensor>>& values) {
  std::unordered_map<std::string, std::pair<size_t, size_t>> where;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const auto& params = buckets_[b].layout().params();
    for (size_t i = 0; i < params.size(); ++i) where.emplace(params[i].name, std::make_pair(b, i));
  }
  // Everything is checked before anything is written: a bad entry changes nothing.
  std::vector<ParamWrite> writes;
  std::unordered_set<std::string> seen;
  for (const auto& [name, value] : values) {
    const auto it = where.find(name);
    TORCH_CHECK(it != where.end(), "zeroshard: set_parameters: '", name,
                "' is not a trained parameter of this engine (frozen parameters and buffers are not "
                "sharded: write them in the module directly)");
    TORCH_CHECK(seen.insert(name).second, "zeroshard: set_parameters: '", name, "' is given twice");
    const auto [b, i] = it->second;
    const auto& place = buckets_[b].layout().params()[i];
    TORCH_CHECK(value.defined() && value.sizes().vec() == place.shape, "zeroshard: set_parameters: '", name,
                "' has shape ", c10::IntArrayRef(place.shape), " but the value given has shape ",
                value.defined() ? value.sizes() : c10::IntArrayRef{});
    TORCH_CHECK(at::isFloatingType(value.scalar_type()), "zeroshard: set_parameters: '", name,
                "' needs a floating-point value, got ", value.scalar_type());
    const at::Device device = buckets_[b].flatParams().device();
    const auto dtype = value.scalar_type() == computeDtype_ ? computeDtype_ : at::kFloat;
    writes.push_back({b, i, value.detach().to(device, dtype).reshape({-1})});
  }

  const int r = comm_.rank();
  for (const auto& w : writes) {
    const Bucket& bucket = buckets_[w.bucket];
    const auto& place = bucket.layout().params()[w.param];
    const ShardRange param{place.offset, place.offset + place.numel};
    // The fp32 master weights: this rank's slice once the optimizer state is sharded. In fp32
    // training they are the parameters' own storage, so this also writes the parameters.
    const ShardRange masterRange =
        plan_.optimizerSharded() ? bucket.layout().shardRange(r) : ShardRange{0, bucket.layout().paddedNumel()};
    const auto [master, value] = overlap(masters_->of(bucket, w.bucket), masterRange, w.value, param);
    if (master.defined()) {
      if (value.scalar_type() != at::kFloat) {
        // Note [write-back keeps the master]: a 16-bit value carries no more than its dtype's
        // precision. Where it equals the master's rounding (an element nobody changed, e.g. a
        // parameter only read inside GatheredParameters), the fp32 master is kept as it is
        // rather than rounded; elsewhere it becomes the value.
        master.copy_(at::where(master.to(value.scalar_type()).eq(value), master, value.to(at::kFloat)));
      } else {
        master.copy_(value);
      }
    }
    // Stage 3 keeps the compute-dtype shard in its own storage; it is what the next gather reads.
    if (plan_.paramsSharded()) copyOverlap(bucket.paramShard(), bucket.layout().shardRange(r), w.value, param);
    // The whole compute-dtype buffer wherever it exists now: always below stage 3; at stage 3
    // while gathered (inside gathered_parameters) or kept gathered (persistent parameters).
    const at::Tensor& flat = bucket.flatParams();
    if (flat.storage().nbytes() > 0) copyOverlap(flat, {0, bucket.layout().paddedNumel()}, w.value, param);
  }
}

} // namespace zeroshard
