// Small helpers of the stage-3 tests (test_unit_builder.cpp, test_unit_scheduler.cpp).
#pragma once

#include <ATen/ATen.h>

#include "zeroshard/layout/bucket.h"

#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard::testing {

// A leaf of `numel` small distinct-ish values times `scale`.
inline at::Tensor leaf(int64_t numel, double scale, bool requiresGrad = true) {
  return at::arange(numel, at::kFloat).remainder(7).add(1).mul(scale).set_requires_grad(requiresGrad);
}

// The names of a bucket's parameters, in its layout's order.
inline std::vector<std::string> namesIn(const Bucket& bucket) {
  std::vector<std::string> names;
  for (const auto& place : bucket.layout().params()) names.push_back(place.name);
  return names;
}

}  // namespace zeroshard::testing
