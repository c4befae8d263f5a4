// The small model the gradient reducer's tests train (grad/test_grad_reducer.cpp and the
// two-rank scenarios in grad_worker.cpp): buckets of parameters whose gradients are small
// integers, so sums over micro-batches and means over ranks are exact, and what they must be.
#pragma once

#include <ATen/ATen.h>

#include "zeroshard/layout/bucket.h"

#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace zeroshard::testing {

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
};
using BucketSpec = std::vector<ParamSpec>;

// Three buckets of 32, 64 and 48 elements padded at one rank (32, 64, 64 at two), each with a
// parameter that is not a multiple of the alignment.
inline const std::vector<BucketSpec> kModel = {
    {{"head.bias", {3}}, {"head.weight", {3, 7}}},
    {{"fc.bias", {7}}, {"fc.weight", {7, 8}}},
    {{"embedding", {5, 8}}},
};

// Four buckets of 32 elements padded (one parameter of 30 each), for the staging peaks.
inline const std::vector<BucketSpec> kEqualBuckets = {
    {{"block0.weight", {30}}}, {{"block1.weight", {30}}}, {{"block2.weight", {30}}}, {{"block3.weight", {30}}}};

inline std::vector<Bucket> makeBuckets(const std::vector<BucketSpec>& specs, int rank, int world,
                                at::ScalarType computeDtype = at::kFloat) {
  std::vector<Bucket> buckets;
  buckets.reserve(specs.size());
  for (const auto& spec : specs) {
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
    for (const auto& p : spec) {
      params.push_back(at::ones(p.shape).set_requires_grad(true));
      names.push_back(p.name);
    }
    buckets.emplace_back(std::move(params), std::move(names), std::vector<int>(spec.size(), 0), rank, world,
                         computeDtype);
  }
  return buckets;
}

// The gradient rank `rank` gives the model's j-th parameter in micro-batch `micro`: small
// integers (at most 27), so sums over micro-batches and means over ranks are exact in float32
// and bfloat16.
inline at::Tensor gradOf(int64_t j, int64_t numel, int micro, int rank) {
  return at::arange(numel, at::kDouble).remainder(5).add(1 + j + 4 * micro + 8 * rank);
}

// sum_j (p_j * g_j).sum() over the parameters not in `skip`. Autograd runs the newest nodes
// first, so backward produces the gradients bucket by bucket from the last: bucket 2, then 1,
// then 0, never two buckets at once.
inline at::Tensor lossOf(const std::vector<Bucket>& buckets, int micro, int rank, const std::set<std::string>& skip = {}) {
  std::vector<at::Tensor> terms;
  int64_t j = 0;
  for (const auto& bucket : buckets) {
    for (size_t i = 0; i < bucket.size(); ++i, ++j) {
      const auto& p = bucket.params()[i];
      if (skip.count(bucket.layout().params()[i].name)) continue;
      terms.push_back((p * gradOf(j, p.numel(), micro, rank).view(p.sizes()).to(p.scalar_type())).sum());
    }
  }
  at::Tensor loss = terms.front().to(at::kFloat);
  for (size_t t = 1; t < terms.size(); ++t) loss = loss + terms[t].to(at::kFloat);
  return loss;
}

// Bucket b's padded flat gradients after micro-batches `micros` at `world` ranks: the sum over
// the micro-batches of the mean over ranks; zero in the padding and for the skipped parameters.
inline at::Tensor expectedFlat(const std::vector<Bucket>& buckets, size_t b, const std::vector<int>& micros, int world,
                        const std::set<std::string>& skip = {}) {
  int64_t j = 0;
  for (size_t k = 0; k < b; ++k) j += static_cast<int64_t>(buckets[k].size());
  const auto& layout = buckets[b].layout();
  auto flat = at::zeros({layout.paddedNumel()}, at::kDouble);
  for (size_t i = 0; i < buckets[b].size(); ++i, ++j) {
    const auto& place = layout.params()[i];
    if (skip.count(place.name)) continue;
    for (int micro : micros) {
      auto mean = at::zeros({place.numel}, at::kDouble);
      for (int r = 0; r < world; ++r) mean += gradOf(j, place.numel, micro, r);
      flat.narrow(0, place.offset, place.numel).add_(mean / world);
    }
  }
  return flat;
}

}  // namespace zeroshard::testing
