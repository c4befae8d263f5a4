// Untrusted JSON input (config/json_input.h): the nesting bound and the text quoted in messages.

#include <string>

#include <nlohmann/json.hpp>

#include "catch.h"
#include "zeroshard/config/json_input.h"

using zeroshard::JsonTooDeep;
using zeroshard::kMaxJsonNesting;
using zeroshard::parseNestingBounded;
using zeroshard::shortText;
using zeroshard::validUtf8;

namespace {

std::string nested(int levels) {
  return std::string(static_cast<size_t>(levels), '[') + std::string(static_cast<size_t>(levels), ']');
}

}  // namespace

TEST_CASE("JSON is parsed up to kMaxJsonNesting levels and refused past them", "[json_input]") {
  const auto ok = parseNestingBounded<nlohmann::ordered_json>(nested(kMaxJsonNesting));
  CHECK(ok.is_array());
  CHECK_THROWS_AS(parseNestingBounded<nlohmann::ordered_json>(nested(kMaxJsonNesting + 1)), JsonTooDeep);
  CHECK_THROWS_AS(parseNestingBounded<nlohmann::json>("{\"a\": " + nested(200000) + "}"), JsonTooDeep);
  CHECK_THROWS_AS(parseNestingBounded<nlohmann::json>("[1,"), nlohmann::json::parse_error);
}

TEST_CASE("validUtf8 keeps well-formed UTF-8 and replaces every other byte", "[json_input]") {
  const std::string good = "ascii \xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80";  // e-acute, euro, emoji
  CHECK(validUtf8(good) == good);
  CHECK(validUtf8("a\xff" "b") == "a?b");
  CHECK(validUtf8("\xc3") == "?");                   // cut short
  CHECK(validUtf8("\xc0\xaf") == "??");              // overlong '/'
  CHECK(validUtf8("\xed\xa0\x80") == "???");         // a surrogate, U+D800
  CHECK(validUtf8("\xf4\x90\x80\x80") == "????");    // past U+10FFFF
  CHECK(validUtf8("\xe2\x82") == "??");
}

TEST_CASE("shortText cuts at a character boundary", "[json_input]") {
  std::string accents;
  for (int i = 0; i < 40; ++i) accents += "\xc3\xa9";
  for (int pad = 0; pad < 4; ++pad) {
    const std::string cut = shortText(std::string(static_cast<size_t>(pad), 'x') + accents, 60);
    CHECK(cut.size() <= 60);
    CHECK(cut.substr(cut.size() - 3) == "...");
    CHECK(validUtf8(cut) == cut);
  }
  CHECK(shortText("short", 60) == "short");
}
