// Stage 3's units without the Engine: assignUnits and buildStage3Units
// (csrc/zeroshard/stage3/unit_builder.*), which cut the parameters into units and give each its
// policy.
#include "error_text.h"
#include "unit_fixtures.h"
#include "zeroshard/layout/param_groups.h"
#include "zeroshard/stage3/unit_builder.h"

#include <ATen/ATen.h>

// c10's logging (pulled in by the ATen headers above) defines a glog-style CHECK that aborts;
// the tests' CHECK must be Catch2's, so it is dropped before catch.h defines it.
#undef CHECK
#include "catch.h"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

using zeroshard::ParamGroupSpec;
using zeroshard::Stage3Units;
using zeroshard::UnitIndex;
using zeroshard::UnitOptions;
using zeroshard::UnitSpec;
using zeroshard::testing::contains;
using zeroshard::testing::errorText;
using zeroshard::testing::leaf;
using zeroshard::testing::namesIn;

TEST_CASE("assignUnits puts a parameter of exactly one unit in it and shared or unowned ones in the root",
          "[unit_builder]") {
  auto embed = leaf(8, 1), w0 = leaf(8, 1), b0 = leaf(2, 1), tied = leaf(8, 1), w1 = leaf(8, 1), b1 = leaf(2, 1);
  auto frozen = leaf(4, 1, /*requiresGrad=*/false), head = leaf(8, 1);
  const std::vector<std::pair<std::string, at::Tensor>> model = {
      {"embed", embed}, {"blocks.0.w", w0}, {"blocks.0.b", b0}, {"tied", tied},
      {"blocks.1.w", w1}, {"blocks.1.b", b1}, {"blocks.1.frozen", frozen}, {"head", head}};
  // blocks.0 lists w0 twice (a submodule that shares it) and tied, which blocks.1 lists too.
  const auto specs = zeroshard::assignUnits(model, {"blocks.0", "blocks.1", "blocks.2"},
                                            {{w0, b0, w0, tied}, {tied, w1, b1, frozen}, {frozen}});
  REQUIRE(specs.size() == 4);
  CHECK(specs[0].name == "blocks.0");
  CHECK(specs[0].paramNames == std::vector<std::string>{"blocks.0.w", "blocks.0.b"});
  CHECK_FALSE(specs[0].root);
  CHECK(specs[1].name == "blocks.1");
  CHECK(specs[1].paramNames == std::vector<std::string>{"blocks.1.w", "blocks.1.b"});
  CHECK_FALSE(specs[1].root);
  // A unit whose parameters are all frozen is still there, empty.
  CHECK(specs[2].name == "blocks.2");
  CHECK(specs[2].paramNames.empty());
  // The root is last; it holds the shared and the unowned ones, in model order (frozen ones: in
  // frozenNames, test_frozen_units.cpp).
  CHECK(specs[3].name == "<root>");
  CHECK(specs[3].root);
  CHECK(specs[3].paramNames == std::vector<std::string>{"embed", "tied", "head"});

  const auto none = zeroshard::assignUnits(model, {}, {});
  REQUIRE(none.size() == 1);
  CHECK(none[0].name == "<root>");
  CHECK(none[0].paramNames ==
        std::vector<std::string>{"embed", "blocks.0.w", "blocks.0.b", "tied", "blocks.1.w", "blocks.1.b", "head"});

  CHECK(contains(errorText([&] { zeroshard::assignUnits(model, {"a", "b"}, {{w0}}); }),
                 "2 unit names but 1 parameter lists"));
}

// ---- buildStage3Units ------------------------------------------------------------------------

namespace {

// Two param groups (weights; biases and norms) cut into two blocks and the root.
struct Groups {
  std::vector<ParamGroupSpec> groups;
  std::vector<UnitSpec> specs;
};
Groups twoGroups() {
  Groups g;
  g.groups.resize(2);
  auto add = [&](int group, const std::string& name, int64_t numel) {
    g.groups[group].names.push_back(name);
    g.groups[group].params.push_back(leaf(numel, 1));
  };
  add(0, "blocks.0.w", 40);
  add(0, "blocks.1.w", 64);
  add(0, "head.w", 48);
  add(1, "blocks.0.b", 4);
  add(1, "blocks.1.b", 8);
  add(1, "norm", 6);
  g.specs = {{"blocks.0", {"blocks.0.w", "blocks.0.b"}, false},
             {"blocks.1", {"blocks.1.b", "blocks.1.w"}, false},
             {"<root>", {"head.w", "norm"}, true}};
  return g;
}

} // namespace

TEST_CASE("buildStage3Units makes one unit per spec in spec order with exact UnitInfo", "[unit_builder]") {
  auto g = twoGroups();
  const auto built = zeroshard::buildStage3Units(g.groups, g.specs, {0, true}, 1, 2, at::kFloat);
  REQUIRE(built.buckets.size() == 3);
  REQUIRE(built.policies.size() == 3);
  REQUIRE(built.unitOf.size() == 3);
  REQUIRE(built.infos.size() == 3);
  for (size_t u = 0; u < 3; ++u) {
    REQUIRE(built.unitOf[u].has_value());
    CHECK(built.unitOf[u]->value == u);
  }
  CHECK(namesIn(built.buckets[0]) == std::vector<std::string>{"blocks.0.w", "blocks.0.b"});
  CHECK(namesIn(built.buckets[1]) == std::vector<std::string>{"blocks.1.b", "blocks.1.w"});
  CHECK(namesIn(built.buckets[2]) == std::vector<std::string>{"head.w", "norm"});
  // A unit mixes param groups; every parameter keeps its own.
  CHECK(built.buckets[0].paramGroupOf(0) == 0);
  CHECK(built.buckets[0].paramGroupOf(1) == 1);
  CHECK(built.buckets[1].paramGroupOf(0) == 1);
  CHECK(built.buckets[1].paramGroupOf(1) == 0);
  // Laid out for the world size, this rank's slice: 44 elements pad to 64 at two ranks.
  CHECK(built.buckets[0].layout().worldSize() == 2);
  CHECK(built.buckets[0].layout().paddedNumel() == 64);
  CHECK(built.buckets[0].paramShard().numel() == 32);
  CHECK(at::equal(built.buckets[0].paramShard(), built.buckets[0].flatParams().narrow(0, 32, 32)));
  // Blocks release after forward; the root does not; nothing is kept gathered.
  CHECK(built.policies[0].reshardAfterForward);
  CHECK(built.policies[1].reshardAfterForward);
  CHECK_FALSE(built.policies[2].reshardAfterForward);
  for (const auto& policy : built.policies) CHECK_FALSE(policy.keepGathered);

  CHECK(built.infos[0].name == "blocks.0");
  CHECK(built.infos[0].numel == 44);
  CHECK(built.infos[0].params == std::vector<std::string>{"blocks.0.w", "blocks.0.b"});
  CHECK(built.infos[0].persistent.empty());
  CHECK(built.infos[0].persistentNumel == 0);
  CHECK_FALSE(built.infos[0].root);
  CHECK(built.infos[1].numel == 72);
  CHECK(built.infos[2].name == "<root>");
  CHECK(built.infos[2].numel == 54);
  CHECK(built.infos[2].root);

  // reshard_after_forward false: no unit releases after forward.
  auto h = twoGroups();
  const auto kept = zeroshard::buildStage3Units(h.groups, h.specs, {0, false}, 0, 1, at::kBFloat16);
  for (const auto& policy : kept.policies) CHECK_FALSE(policy.reshardAfterForward);
  // The compute dtype is the units' flat buffers'.
  for (const auto& unit : kept.buckets) CHECK(unit.flatParams().scalar_type() == at::kBFloat16);

  // No specs: one root unit of every parameter, in group order.
  auto r = twoGroups();
  const auto whole = zeroshard::buildStage3Units(r.groups, {}, {0, true}, 0, 1, at::kFloat);
  REQUIRE(whole.buckets.size() == 1);
  CHECK(namesIn(whole.buckets[0]) ==
        std::vector<std::string>{"blocks.0.w", "blocks.1.w", "head.w", "blocks.0.b", "blocks.1.b", "norm"});
  CHECK(whole.infos[0].name == "root");
  CHECK(whole.infos[0].root);
  CHECK(whole.infos[0].numel == 170);
  CHECK_FALSE(whole.policies[0].reshardAfterForward);
}

TEST_CASE("the persistence threshold moves parameters of at most that many elements into one kept unit",
          "[unit_builder]") {
  auto g = twoGroups();
  // 40 elements and fewer: blocks.0.w (exactly 40), the biases and norm. blocks.0 has nothing left.
  const auto built = zeroshard::buildStage3Units(g.groups, g.specs, {40, true}, 0, 1, at::kFloat);
  REQUIRE(built.buckets.size() == 3);
  REQUIRE(built.unitOf.size() == 3);
  CHECK_FALSE(built.unitOf[0].has_value());
  REQUIRE(built.unitOf[1].has_value());
  CHECK(built.unitOf[1]->value == 0);
  REQUIRE(built.unitOf[2].has_value());
  CHECK(built.unitOf[2]->value == 1);
  CHECK(namesIn(built.buckets[0]) == std::vector<std::string>{"blocks.1.w"});
  CHECK(namesIn(built.buckets[1]) == std::vector<std::string>{"head.w"});
  // The kept unit comes last, its parameters in spec order, each in its own group.
  CHECK(namesIn(built.buckets[2]) == std::vector<std::string>{"blocks.0.w", "blocks.0.b", "blocks.1.b", "norm"});
  CHECK(built.buckets[2].paramGroupOf(0) == 0);
  CHECK(built.buckets[2].paramGroupOf(3) == 1);
  REQUIRE(built.policies.size() == 3);
  CHECK(built.policies[2].keepGathered);
  CHECK_FALSE(built.policies[2].reshardAfterForward);
  CHECK_FALSE(built.policies[0].keepGathered);
  CHECK_FALSE(built.policies[1].keepGathered);

  REQUIRE(built.infos.size() == 3);  // one per spec; the kept unit has none of its own
  CHECK(built.infos[0].name == "blocks.0");
  CHECK(built.infos[0].numel == 0);
  CHECK(built.infos[0].params.empty());
  CHECK(built.infos[0].persistent == std::vector<std::string>{"blocks.0.w", "blocks.0.b"});
  CHECK(built.infos[0].persistentNumel == 44);
  CHECK(built.infos[1].numel == 64);
  CHECK(built.infos[1].params == std::vector<std::string>{"blocks.1.w"});
  CHECK(built.infos[1].persistent == std::vector<std::string>{"blocks.1.b"});
  CHECK(built.infos[1].persistentNumel == 8);
  CHECK(built.infos[2].numel == 48);
  CHECK(built.infos[2].persistent == std::vector<std::string>{"norm"});
  CHECK(built.infos[2].persistentNumel == 6);

  // One element under blocks.0.w: it stays in its unit.
  auto h = twoGroups();
  const auto below = zeroshard::buildStage3Units(h.groups, h.specs, {39, true}, 0, 1, at::kFloat);
  REQUIRE(below.buckets.size() == 4);
  CHECK(namesIn(below.buckets[0]) == std::vector<std::string>{"blocks.0.w"});
  CHECK(namesIn(below.buckets[3]) == std::vector<std::string>{"blocks.0.b", "blocks.1.b", "norm"});
}

TEST_CASE("buildStage3Units names the unit and parameter of a bad spec", "[unit_builder]") {
  {
    auto g = twoGroups();
    g.specs[1].paramNames.push_back("blocks.9.w");
    CHECK(contains(errorText([&] { zeroshard::buildStage3Units(g.groups, g.specs, {}, 0, 1, at::kFloat); }),
                   "unit 'blocks.1' lists parameter 'blocks.9.w', which is not a trainable parameter of any "
                   "param group"));
  }
  {
    auto g = twoGroups();
    g.specs[2].paramNames.push_back("blocks.0.b");
    CHECK(contains(errorText([&] { zeroshard::buildStage3Units(g.groups, g.specs, {}, 0, 1, at::kFloat); }),
                   "parameter 'blocks.0.b' is listed by two units; a parameter shared between units belongs to "
                   "the root unit"));
  }
  {
    auto g = twoGroups();
    g.specs[2].paramNames = {"head.w"};
    CHECK(contains(errorText([&] { zeroshard::buildStage3Units(g.groups, g.specs, {}, 0, 1, at::kFloat); }),
                   "trainable parameter 'norm' is in no unit; pass it in the root unit"));
  }
}

// ---- UnitScheduler ---------------------------------------------------------------------------
