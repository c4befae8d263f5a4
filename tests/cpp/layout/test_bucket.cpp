// Bucket (csrc/zeroshard/layout/bucket.*), its parameter side: the parameters become views of
// one padded flat buffer at the offsets of its FlatLayout and keep their identity; this rank's
// shard; and stage 3's detach / release / materialize of the flat storage (Note [freeing
// parameter storage]). World sizes 1, 2, 3, 4 and 8, every rank.
#include "error_text.h"
#include "zeroshard/layout/bucket.h"
#include "zeroshard/layout/flat_layout.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

// c10's logging (pulled in by the ATen op headers above) defines a glog-style CHECK
// that aborts; the tests' CHECK must be Catch2's, so it is dropped before catch.h defines it.
#undef CHECK
#include "catch.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

using zeroshard::Bucket;
using zeroshard::FlatLayout;
using zeroshard::ParamPlacement;
using zeroshard::testing::contains;
using zeroshard::testing::errorText;

namespace {

constexpr int kWorldSizes[] = {1, 2, 3, 4, 8};

struct Spec {
  std::string name;
  std::vector<int64_t> shape;
};

// Awkward on purpose: a parameter larger than several shards, a 1-element bias, an empty one in
// the middle, a 0-d scalar last.
const std::vector<Spec> kSpecs = {{"fc1.weight", {7, 9}}, {"fc1.bias", {1}}, {"unused", {0, 4}},
                                  {"fc2.weight", {53}},   {"fc2.bias", {3, 1}}, {"scale", {}}};

// Leaf parameters with values that are never 0 (so a zero in the flat buffer is padding).
std::vector<at::Tensor> makeParams(const std::vector<Spec>& specs, at::TensorOptions options = {}) {
  std::vector<at::Tensor> params;
  for (const auto& s : specs) {
    auto values = at::randn(s.shape, options.dtype(at::kFloat)).abs_().add_(0.5);
    params.push_back(values.to(options.dtype().toScalarType()).set_requires_grad(true));
  }
  return params;
}

std::vector<std::string> namesOf(const std::vector<Spec>& specs) {
  std::vector<std::string> names;
  for (const auto& s : specs) names.push_back(s.name);
  return names;
}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone());
  return out;
}

// The layout the bucket should use, built here on its own.
FlatLayout expectedLayout(const std::vector<Spec>& specs, int worldSize) {
  std::vector<ParamPlacement> placements;
  for (const auto& s : specs) placements.push_back({s.name, s.shape, 0, 0});
  return FlatLayout(std::move(placements), worldSize);
}

// Whether `t` is a view of `flat`'s storage starting `offset` elements in.
bool viewAt(const at::Tensor& t, const at::Tensor& flat, int64_t offset) {
  return t.storage().is_alias_of(flat.storage()) && t.storage_offset() == offset;
}

std::string where(int world, int rank) {
  return "world size " + std::to_string(world) + ", rank " + std::to_string(rank);
}

} // namespace

TEST_CASE("construction makes every parameter a view of flatParams at its layout offset", "[bucket]") {
  for (int world : kWorldSizes) {
    auto params = makeParams(kSpecs);
    const auto before = clones(params);
    std::vector<const c10::TensorImpl*> impls;
    for (const auto& p : params) impls.push_back(p.unsafeGetTensorImpl());

    Bucket bucket(params, namesOf(kSpecs), {0, 1, 0, 0, 1, 0}, world - 1, world);
    INFO(where(world, world - 1));
    const FlatLayout expected = expectedLayout(kSpecs, world);
    const at::Tensor& flat = bucket.flatParams();
    REQUIRE(bucket.size() == kSpecs.size());
    CHECK(bucket.layout().paddedNumel() == expected.paddedNumel());
    CHECK(bucket.layout().shardNumel() == expected.shardNumel());
    CHECK(flat.dim() == 1);
    CHECK(flat.numel() == expected.paddedNumel());
    CHECK(flat.scalar_type() == at::kFloat);
    CHECK_FALSE(flat.requires_grad());
    CHECK(bucket.paramGroup() == 0);
    CHECK(bucket.paramGroupOf(1) == 1);
    CHECK(bucket.paramGroupOf(4) == 1);
    for (size_t i = 0; i < kSpecs.size(); ++i) {
      const auto& place = bucket.layout().params()[i];
      INFO("parameter " << kSpecs[i].name);
      CHECK(place.name == kSpecs[i].name);
      CHECK(place.offset == expected.params()[i].offset);
      CHECK(place.numel == expected.params()[i].numel);
      // The caller's handle, the bucket's handle: one TensorImpl, still a leaf that wants grads.
      CHECK(params[i].unsafeGetTensorImpl() == impls[i]);
      CHECK(bucket.params()[i].unsafeGetTensorImpl() == impls[i]);
      CHECK(params[i].requires_grad());
      CHECK(params[i].is_leaf());
      CHECK(params[i].sizes().vec() == kSpecs[i].shape);
      CHECK(viewAt(params[i], flat, place.offset));
      CHECK(at::equal(params[i].detach(), before[i]));
      CHECK(at::equal(flat.narrow(0, place.offset, place.numel), before[i].reshape({-1})));
    }
    // Writes through the flat buffer are the parameters' values (and the other way round).
    flat.copy_(at::arange(flat.numel(), flat.options()));
    params[0].detach().fill_(-1);
    for (size_t i = 0; i < kSpecs.size(); ++i) {
      const auto& place = bucket.layout().params()[i];
      INFO("parameter " << kSpecs[i].name);
      auto expectedValues = at::arange(place.offset, place.offset + place.numel, flat.options()).view(kSpecs[i].shape);
      if (i == 0) expectedValues.fill_(-1);
      CHECK(at::equal(params[i].detach(), expectedValues));
    }
  }
}

TEST_CASE("the padding of flatParams is zero", "[bucket]") {
  for (int world : kWorldSizes) {
    Bucket bucket(makeParams(kSpecs), namesOf(kSpecs), std::vector<int>(kSpecs.size(), 0), 0, world);
    INFO(where(world, 0));
    auto covered = at::zeros({bucket.layout().paddedNumel()}, at::kBool);
    for (const auto& place : bucket.layout().params()) covered.narrow(0, place.offset, place.numel).fill_(true);
    const auto padding = bucket.flatParams().masked_select(covered.logical_not());
    CHECK(padding.numel() == bucket.layout().paddedNumel() - bucket.layout().numel());
    CHECK(padding.numel() > 0);
    CHECK(at::equal(padding, at::zeros_like(padding)));
    // Every parameter element is non-zero (makeParams), so none of them was mistaken for padding.
    CHECK(bucket.flatParams().masked_select(covered).ne(0).all().item<bool>());
  }
}

TEST_CASE("paramShard is this rank's slice of flatParams per FlatLayout shardRange", "[bucket]") {
  for (int world : kWorldSizes) {
    for (int rank = 0; rank < world; ++rank) {
      Bucket bucket(makeParams(kSpecs), namesOf(kSpecs), std::vector<int>(kSpecs.size(), 0), rank, world);
      INFO(where(world, rank));
      const auto range = expectedLayout(kSpecs, world).shardRange(rank);
      const auto shard = bucket.paramShard();
      CHECK(shard.dim() == 1);
      CHECK(shard.numel() == range.numel());
      CHECK(shard.numel() == bucket.layout().shardNumel());
      CHECK(viewAt(shard, bucket.flatParams(), range.begin));
      CHECK(at::equal(shard, bucket.flatParams().narrow(0, range.begin, range.numel())));
    }
  }
}

TEST_CASE("detachShard gives the shard its own storage with the same values", "[bucket]") {
  for (int world : kWorldSizes) {
    for (int rank = 0; rank < world; ++rank) {
      Bucket bucket(makeParams(kSpecs), namesOf(kSpecs), std::vector<int>(kSpecs.size(), 0), rank, world);
      INFO(where(world, rank));
      const auto range = bucket.layout().shardRange(rank);
      const auto values = bucket.flatParams().narrow(0, range.begin, range.numel()).clone();
      bucket.detachShard();
      const auto shard = bucket.paramShard();
      CHECK_FALSE(shard.storage().is_alias_of(bucket.flatParams().storage()));
      CHECK(shard.numel() == range.numel());
      CHECK(at::equal(shard, values));
      // Independent both ways; the same shard on every call.
      bucket.flatParams().fill_(7);
      CHECK(at::equal(bucket.paramShard(), values));
      bucket.paramShard().fill_(-3);
      CHECK(at::equal(bucket.flatParams(), at::full_like(bucket.flatParams(), 7)));
      CHECK(bucket.paramShard().data_ptr() == shard.data_ptr());
      // A second detach keeps the shard's own values, not a fresh copy of the flat buffer.
      bucket.detachShard();
      CHECK(bucket.paramShard().data_ptr() == shard.data_ptr());
      CHECK(at::equal(bucket.paramShard(), at::full_like(shard, -3)));
    }
  }
}

TEST_CASE("releaseFlatParams frees the storage and materializeFlatParams brings it back under the params",
          "[bucket]") {
  for (int world : kWorldSizes) {
    const int rank = world / 2;
    auto params = makeParams(kSpecs);
    Bucket bucket(params, namesOf(kSpecs), std::vector<int>(kSpecs.size(), 0), rank, world);
    INFO(where(world, rank));
    const FlatLayout& layout = bucket.layout();
    const int64_t bytes = layout.paddedNumel() * static_cast<int64_t>(sizeof(float));
    const auto* storage = bucket.flatParams().storage().unsafeGetStorageImpl();
    // A view taken before the release stands for what autograd saved for backward.
    const auto saved = params[3].detach().view({-1});

    bucket.detachShard();
    const auto shardValues = bucket.paramShard().clone();
    bucket.releaseFlatParams();
    CHECK(bucket.flatParams().storage().nbytes() == 0);
    CHECK(bucket.flatParams().storage().data_ptr().get() == nullptr);
    CHECK(bucket.flatParams().numel() == layout.paddedNumel());
    for (size_t i = 0; i < kSpecs.size(); ++i) {
      INFO("parameter " << kSpecs[i].name);
      CHECK(params[i].sizes().vec() == kSpecs[i].shape);
      CHECK(params[i].storage().nbytes() == 0);
      CHECK(bucket.params()[i].unsafeGetTensorImpl() == params[i].unsafeGetTensorImpl());
    }
    CHECK(at::equal(bucket.paramShard(), shardValues));

    bucket.materializeFlatParams();
    CHECK(bucket.flatParams().storage().nbytes() == static_cast<size_t>(bytes));
    CHECK(bucket.flatParams().storage().data_ptr().get() != nullptr);
    CHECK(bucket.flatParams().storage().unsafeGetStorageImpl() == storage);
    // What an all-gather writes into the flat buffer is what every parameter (and every view
    // saved before the release) reads.
    const auto gathered = at::arange(layout.paddedNumel(), at::kFloat).mul_(0.5);
    bucket.flatParams().copy_(gathered);
    for (size_t i = 0; i < kSpecs.size(); ++i) {
      const auto& place = layout.params()[i];
      INFO("parameter " << kSpecs[i].name);
      CHECK(viewAt(params[i], bucket.flatParams(), place.offset));
      CHECK(at::equal(params[i].detach(), gathered.narrow(0, place.offset, place.numel).view(kSpecs[i].shape)));
    }
    CHECK(at::equal(saved, gathered.narrow(0, layout.params()[3].offset, layout.params()[3].numel)));
    // The detached shard is untouched by either.
    CHECK(at::equal(bucket.paramShard(), shardValues));

    // Materializing storage that is there already keeps it and its contents.
    const void* data = bucket.flatParams().data_ptr();
    bucket.materializeFlatParams();
    CHECK(bucket.flatParams().data_ptr() == data);
    CHECK(at::equal(bucket.flatParams(), gathered));

    // And the cycle repeats.
    bucket.releaseFlatParams();
    CHECK(bucket.flatParams().storage().nbytes() == 0);
    bucket.materializeFlatParams();
    bucket.flatParams().fill_(2);
    CHECK(at::equal(params[0].detach(), at::full(kSpecs[0].shape, 2.0f)));
  }
}

TEST_CASE("a bf16 computeDtype makes the parameters bf16 views of a bf16 flatParams", "[bucket]") {
  for (int world : kWorldSizes) {
    auto params = makeParams(kSpecs);
    const auto before = clones(params);
    Bucket bucket(params, namesOf(kSpecs), std::vector<int>(kSpecs.size(), 0), 0, world, at::kBFloat16);
    INFO(where(world, 0));
    const at::Tensor& flat = bucket.flatParams();
    CHECK(flat.scalar_type() == at::kBFloat16);
    CHECK(flat.numel() == bucket.layout().paddedNumel());
    CHECK(bucket.paramShard().scalar_type() == at::kBFloat16);
    for (size_t i = 0; i < kSpecs.size(); ++i) {
      const auto& place = bucket.layout().params()[i];
      INFO("parameter " << kSpecs[i].name);
      CHECK(params[i].scalar_type() == at::kBFloat16);
      CHECK(params[i].sizes().vec() == kSpecs[i].shape);
      CHECK(viewAt(params[i], flat, place.offset));
      CHECK(at::equal(params[i].detach(), before[i].to(at::kBFloat16)));
    }
    const auto padding = flat.narrow(0, bucket.layout().numel(), flat.numel() - bucket.layout().numel());
    CHECK(at::equal(padding, at::zeros_like(padding)));
  }
}

TEST_CASE("parameters of another dtype or device or a wrong count of names or groups are rejected",
          "[bucket]") {
  const std::vector<Spec> specs = {{"encoder.weight", {4, 4}}, {"encoder.bias", {4}}, {"head.weight", {2, 4}}};
  const std::vector<std::string> names = namesOf(specs);
  const std::vector<int> groups = {0, 0, 0};

  SECTION("a parameter of another dtype is named") {
    auto params = makeParams(specs);
    params[2] = at::ones({2, 4}, at::kDouble).set_requires_grad(true);
    const auto text = errorText([&] { Bucket(params, names, groups, 0, 2); });
    INFO(text);
    CHECK(contains(text, "'head.weight'"));
    CHECK(contains(text, "Double"));
    CHECK(contains(text, "'encoder.weight'"));
    CHECK(contains(text, "share dtype and device"));
  }
  SECTION("a parameter on another device is named") {
    auto params = makeParams(specs);
    params[1] = at::ones({4}, at::TensorOptions().device(at::kMeta)).set_requires_grad(true);
    const auto text = errorText([&] { Bucket(params, names, groups, 0, 2); });
    INFO(text);
    CHECK(contains(text, "'encoder.bias'"));
    CHECK(contains(text, "meta"));
    CHECK(contains(text, "share dtype and device"));
  }
  SECTION("a name missing") {
    const auto text =
        errorText([&] { Bucket(makeParams(specs), {"encoder.weight", "encoder.bias"}, groups, 0, 2); });
    INFO(text);
    CHECK(contains(text, "3 parameters but 2 names"));
  }
  SECTION("a group id missing") {
    const auto text = errorText([&] { Bucket(makeParams(specs), names, {0, 1}, 0, 2); });
    INFO(text);
    CHECK(contains(text, "3 parameters but 2 group ids"));
  }
  SECTION("no parameters at all") {
    const auto text = errorText([&] { Bucket({}, {}, {}, 0, 2); });
    INFO(text);
    CHECK(contains(text, "no parameters"));
  }
}
