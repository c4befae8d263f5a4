// The manifest's lr_scheduler record (csrc/zeroshard/checkpoint/manifest.*): it round-trips,
// and a manifest written before it existed still reads, with no schedule state.
#include "catch.h"

#include "error_text.h"
#include "zeroshard/checkpoint/crc32.h"
#include "zeroshard/checkpoint/manifest.h"

#include <string>

using namespace zeroshard;
using zeroshard::testing::contains;
using zeroshard::testing::errorText;

namespace {

CheckpointManifest smallManifest() {
  CheckpointManifest m;
  m.tag = "global_step4";
  m.configJson = "{}";
  m.groups = {AdamWHyper{}};
  m.buffers = {SavedBuffer{6, 6}};
  m.params = {SavedParam{"w", {2, 3}, 0, 0, 0}};
  return m;
}

// The manifest text with `body` as its body, checksummed as toJsonText does.
std::string withBody(const std::string& body) {
  return "{\"body_crc32\": \"" + crc32Hex(crc32Update(0, body.data(), body.size())) + "\",\n\"manifest\": " + body +
         "}\n";
}

std::string bodyOf(const std::string& text) {
  const std::string start = "\"manifest\": ";
  const size_t begin = text.find(start) + start.size();
  return text.substr(begin, text.rfind('}') - begin);
}

} // namespace

TEST_CASE("the lr schedule's state round-trips through the manifest", "[checkpoint]") {
  auto m = smallManifest();
  m.lrSchedule = SavedSchedule{"WarmupCosineLR", 41};
  const std::string text = m.toJsonText();
  CHECK(contains(text, "\"lr_scheduler\": {\n  \"type\": \"WarmupCosineLR\",\n  \"last_batch_iteration\": 41\n }"));
  const auto back = CheckpointManifest::fromJsonText(text, "manifest.json");
  REQUIRE(back.lrSchedule.has_value());
  CHECK(back.lrSchedule->type == "WarmupCosineLR");
  CHECK(back.lrSchedule->lastBatchIteration == 41);
  CHECK(back.toJsonText() == text);

  const auto none = CheckpointManifest::fromJsonText(smallManifest().toJsonText(), "manifest.json");
  CHECK_FALSE(none.lrSchedule.has_value());
}

TEST_CASE("a manifest without lr_scheduler (an older checkpoint) reads with no schedule state", "[checkpoint]") {
  const std::string text = smallManifest().toJsonText();
  std::string body = bodyOf(text);
  const std::string line = " \"lr_scheduler\": null,\n";
  REQUIRE(body.find(line) != std::string::npos);
  body.erase(body.find(line), line.size());
  const auto old = CheckpointManifest::fromJsonText(withBody(body), "manifest.json");
  CHECK_FALSE(old.lrSchedule.has_value());
  CHECK(old.params.at(0).name == "w");

  auto bad = smallManifest();
  bad.lrSchedule = SavedSchedule{"WarmupLR", -2};
  CHECK(contains(errorText([&] { CheckpointManifest::fromJsonText(bad.toJsonText(), "x/manifest.json"); }),
                 "lr_scheduler.last_batch_iteration is -2"));
}
