// FlatLayout: padding, shard tiling, and that the per-rank pieces account for every parameter
// element exactly once, for awkward shapes and world sizes 1, 2, 3, 4 and 8.
#include "catch.h"

#include "zeroshard/layout/flat_layout.h"

#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

using zeroshard::FlatLayout;
using zeroshard::ParamPlacement;

namespace {

constexpr int kWorldSizes[] = {1, 2, 3, 4, 8};

std::vector<ParamPlacement> placements(const std::vector<std::pair<std::string, std::vector<int64_t>>>& shapes) {
  std::vector<ParamPlacement> out;
  for (const auto& [name, shape] : shapes) out.push_back({name, shape, 0, 0});
  return out;
}

// Parameter lists that stress the layout: odd sizes, a 1-element bias, a 0-d scalar, empty
// parameters (first, middle, last), one parameter larger than several shards, none at all.
std::vector<std::vector<ParamPlacement>> paramSets() {
  return {
      placements({{"fc1.weight", {53}}, {"fc1.bias", {1}}, {"unused", {0}}, {"fc2.weight", {7, 9}},
                  {"fc2.bias", {16, 3}}}),
      placements({{"empty_first", {0, 5}}, {"scale", {}}, {"big", {100, 3}}, {"empty_last", {0}}}),
      placements({{"exact", {32}}}),
      placements({{"a", {17}}, {"b", {15}}, {"c", {33}}, {"d", {1}}, {"e", {64, 2}}}),
      placements({}),
  };
}

int64_t product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string errorOf(const std::vector<ParamPlacement>& params, int worldSize) {
  try {
    FlatLayout layout(params, worldSize);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

std::string describe(const std::vector<ParamPlacement>& params, int worldSize) {
  std::string text = "world size " + std::to_string(worldSize) + ", params";
  for (const auto& p : params) text += " " + p.name + "(" + std::to_string(product(p.shape)) + ")";
  return text;
}

} // namespace

TEST_CASE("padded size divides by the world size, shards are aligned, and padding is minimal", "[flat_layout]") {
  for (const auto& params : paramSets()) {
    for (int world : kWorldSizes) {
      FlatLayout layout(params, world);
      INFO(describe(params, world));
      int64_t numel = 0;
      for (const auto& p : params) numel += product(p.shape);
      const int64_t unit = FlatLayout::kShardAlignment * world;
      CHECK(layout.worldSize() == world);
      CHECK(layout.numel() == numel);
      CHECK(layout.paddedNumel() == layout.shardNumel() * world);
      CHECK(layout.paddedNumel() % world == 0);
      CHECK(layout.shardNumel() % FlatLayout::kShardAlignment == 0);
      CHECK(layout.shardNumel() > 0);
      CHECK(layout.paddedNumel() >= numel);
      // Padding only: less than one alignment unit (kShardAlignment per rank) beyond the
      // parameters; an empty layout still gets one unit, so no rank's shard is empty.
      if (numel > 0) {
        CHECK(layout.paddedNumel() - numel < unit);
      } else {
        CHECK(layout.paddedNumel() == unit);
      }
    }
  }
}

TEST_CASE("parameters are laid out back to back in the given order", "[flat_layout]") {
  for (const auto& params : paramSets()) {
    for (int world : kWorldSizes) {
      FlatLayout layout(params, world);
      INFO(describe(params, world));
      REQUIRE(layout.params().size() == params.size());
      int64_t offset = 0;
      for (size_t i = 0; i < params.size(); ++i) {
        const auto& p = layout.params()[i];
        CHECK(p.name == params[i].name);
        CHECK(p.shape == params[i].shape);
        CHECK(p.numel == product(params[i].shape));
        CHECK(p.offset == offset);
        offset += p.numel;
      }
    }
  }
}

TEST_CASE("shard ranges tile [0, paddedNumel) exactly, in rank order", "[flat_layout]") {
  for (const auto& params : paramSets()) {
    for (int world : kWorldSizes) {
      FlatLayout layout(params, world);
      INFO(describe(params, world));
      int64_t next = 0;
      for (int r = 0; r < world; ++r) {
        const auto range = layout.shardRange(r);
        CHECK(range.begin == next);
        CHECK(range.numel() == layout.shardNumel());
        next = range.end;
      }
      CHECK(next == layout.paddedNumel());
    }
  }
}

TEST_CASE("pieces over all ranks cover every parameter element exactly once", "[flat_layout]") {
  for (const auto& params : paramSets()) {
    for (int world : kWorldSizes) {
      FlatLayout layout(params, world);
      INFO(describe(params, world));
      std::vector<std::vector<int>> covered;
      for (const auto& p : layout.params()) covered.emplace_back(p.numel, 0);

      for (int r = 0; r < world; ++r) {
        const auto shard = layout.shardRange(r);
        int64_t previousEnd = 0;  // pieces come in flat order and do not overlap
        for (const auto& piece : layout.piecesInShard(r)) {
          INFO("rank " << r << " param " << piece.param << " [" << piece.paramBegin << ", " << piece.paramEnd
                       << ") at shard offset " << piece.shardOffset);
          REQUIRE(piece.param < layout.params().size());
          const auto& p = layout.params()[piece.param];
          REQUIRE(0 <= piece.paramBegin);
          REQUIRE(piece.paramBegin < piece.paramEnd);  // no empty pieces
          REQUIRE(piece.paramEnd <= p.numel);
          CHECK(piece.shardOffset >= previousEnd);
          CHECK(piece.shardOffset + (piece.paramEnd - piece.paramBegin) <= shard.numel());
          // The piece sits where the parameter's elements sit in the flat buffer.
          CHECK(shard.begin + piece.shardOffset == p.offset + piece.paramBegin);
          previousEnd = piece.shardOffset + (piece.paramEnd - piece.paramBegin);
          for (int64_t e = piece.paramBegin; e < piece.paramEnd; ++e) ++covered[piece.param][e];
        }
      }
      for (size_t i = 0; i < covered.size(); ++i) {
        for (size_t e = 0; e < covered[i].size(); ++e) {
          if (covered[i][e] != 1) {
            FAIL("element " << e << " of '" << layout.params()[i].name << "' is covered " << covered[i][e]
                            << " times");
          }
        }
      }
    }
  }
}

TEST_CASE("ranksHolding names exactly the ranks whose pieces hold the parameter", "[flat_layout]") {
  for (const auto& params : paramSets()) {
    for (int world : kWorldSizes) {
      FlatLayout layout(params, world);
      INFO(describe(params, world));
      std::vector<std::vector<int>> expected(layout.params().size());
      for (int r = 0; r < world; ++r) {
        for (const auto& piece : layout.piecesInShard(r)) {
          if (expected[piece.param].empty() || expected[piece.param].back() != r) expected[piece.param].push_back(r);
        }
      }
      for (size_t i = 0; i < layout.params().size(); ++i) {
        INFO("parameter '" << layout.params()[i].name << "'");
        CHECK(layout.ranksHolding(i) == expected[i]);
        if (layout.params()[i].numel == 0) CHECK(layout.ranksHolding(i).empty());
      }
    }
  }
}

TEST_CASE("a parameter straddling a shard boundary is split between the two ranks", "[flat_layout]") {
  // 20 + 20 elements at 2 ranks: padded to 64, shards of 32; "second" spans [20, 40).
  FlatLayout layout(placements({{"first", {4, 5}}, {"second", {20}}}), 2);
  REQUIRE(layout.paddedNumel() == 64);
  REQUIRE(layout.shardNumel() == 32);
  CHECK(layout.ranksHolding(0) == std::vector<int>{0});
  CHECK(layout.ranksHolding(1) == std::vector<int>{0, 1});

  const auto rank0 = layout.piecesInShard(0);
  REQUIRE(rank0.size() == 2);
  CHECK(rank0[1].param == 1);
  CHECK(rank0[1].paramBegin == 0);
  CHECK(rank0[1].paramEnd == 12);
  CHECK(rank0[1].shardOffset == 20);

  const auto rank1 = layout.piecesInShard(1);
  REQUIRE(rank1.size() == 1);  // the rest of rank 1's shard is padding
  CHECK(rank1[0].param == 1);
  CHECK(rank1[0].paramBegin == 12);
  CHECK(rank1[0].paramEnd == 20);
  CHECK(rank1[0].shardOffset == 0);
}

TEST_CASE("a layout smaller than the world leaves the last ranks with padding only", "[flat_layout]") {
  // 53 + 1 elements at 8 ranks: shards of 16, so ranks 4..7 hold nothing.
  FlatLayout layout(placements({{"weight", {53}}, {"bias", {1}}}), 8);
  CHECK(layout.paddedNumel() == 128);
  CHECK(layout.ranksHolding(0) == std::vector<int>{0, 1, 2, 3});
  CHECK(layout.ranksHolding(1) == std::vector<int>{3});
  for (int r = 4; r < 8; ++r) CHECK(layout.piecesInShard(r).empty());
}

TEST_CASE("bad layouts are rejected with a message naming the problem", "[flat_layout]") {
  const auto params = placements({{"fc.weight", {3, 4}}});
  for (int world : {0, -2}) {
    const std::string message = errorOf(params, world);
    INFO(message);
    CHECK(message.find("world size") != std::string::npos);
    CHECK(message.find(std::to_string(world)) != std::string::npos);
  }

  const std::string negative = errorOf(placements({{"ok", {2}}, {"fc.weight", {3, -4}}}), 2);
  INFO(negative);
  CHECK(negative.find("fc.weight") != std::string::npos);
  CHECK(negative.find("negative") != std::string::npos);

  FlatLayout layout(params, 2);
  CHECK_THROWS_AS(layout.shardRange(2), c10::Error);
  CHECK_THROWS_AS(layout.shardRange(-1), c10::Error);
  CHECK_THROWS_AS(layout.piecesInShard(2), c10::Error);
  CHECK_THROWS_AS(layout.ranksHolding(1), c10::Error);
}

TEST_CASE("pieces of any flat range and spans of shards cover exactly what they are asked for", "[flat_layout]") {
  // 12 + 7 + 30 elements at 2 ranks: shards of 32; a range across both shards.
  FlatLayout layout(placements({{"a", {3, 4}}, {"b", {7}}, {"c", {30}}}), 2);
  const auto pieces = layout.piecesIn(zeroshard::ShardRange{10, 40});
  REQUIRE(pieces.size() == 3);
  CHECK((pieces[0].param == 0 && pieces[0].paramBegin == 10 && pieces[0].paramEnd == 12 && pieces[0].shardOffset == 0));
  CHECK((pieces[1].param == 1 && pieces[1].paramBegin == 0 && pieces[1].paramEnd == 7 && pieces[1].shardOffset == 2));
  CHECK((pieces[2].param == 2 && pieces[2].paramBegin == 0 && pieces[2].paramEnd == 21 && pieces[2].shardOffset == 9));
  // A rank's shard is the same question asked of its range.
  for (int r = 0; r < 2; ++r) {
    const auto a = layout.piecesInShard(r);
    const auto b = layout.piecesIn(layout.shardRange(r));
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      CHECK((a[i].param == b[i].param && a[i].paramBegin == b[i].paramBegin && a[i].paramEnd == b[i].paramEnd &&
             a[i].shardOffset == b[i].shardOffset));
    }
  }

  // Elements [5, 70) of shards of 32: the tail of shard 0, all of shard 1, the head of shard 2.
  const auto spans = FlatLayout::spansOf(5, 70, 32);
  REQUIRE(spans.size() == 3);
  CHECK((spans[0].rank == 0 && spans[0].offset == 5 && spans[0].numel == 27));
  CHECK((spans[1].rank == 1 && spans[1].offset == 0 && spans[1].numel == 32));
  CHECK((spans[2].rank == 2 && spans[2].offset == 0 && spans[2].numel == 6));
  CHECK(FlatLayout::spansOf(64, 64, 32).empty());
  CHECK_THROWS_AS(FlatLayout::spansOf(3, 2, 32), c10::Error);
  CHECK_THROWS_AS(FlatLayout::spansOf(0, 4, 0), c10::Error);
}
