#include "catch.h"


#include "error_text.h"
#include "temp_dir.h"
#include "zeroshard/checkpoint_dir.h"
#include "zeroshard/checkpoint_manifest.h"

#include <filesystem>
#include <fstream>
#include <string>

using namespace zeroshard;
using zeroshard::testing::TempDir;
using zeroshard::testing::contains;
using zeroshard::testing::errorText;

namespace {

CheckpointManifest sampleManifest(const std::string& tag, int64_t created) {
  CheckpointManifest m;
  m.tag = tag;
  m.worldSize = 2;
  m.stage = 3;
  m.computeDtype = at::kBFloat16;
  m.globalSteps = 7;
  m.boundaries = 8;
  m.skippedSteps = 1;
  m.lossScaler = LossScaler::State{1024.0, 2, 8, 5};
  m.configJson = R"({"zero_optimization": {"stage": 3}})";
  m.groups = {AdamWHyper{1e-3, 0.9, 0.95, 1e-8, 0.1}};
  m.buffers = {SavedBuffer{10, 16}};
  m.params = {SavedParam{"w", {2, 3}, 0, 0, 0}, SavedParam{"b", {4}, 0, 0, 6}};
  m.aliases = {{"head.w", "w"}};
  m.moduleState = {SavedTensor{"buf", {2}, at::kLong}};
  m.stateDictKeys = {"w", "b", "head.w", "buf"};
  m.files = {FileDigest{"rank_00000.safetensors", 100, 64, {1u, 0xffffffffu}}};
  m.createdUnixNs = created;
  return m;
}

// A published checkpoint directory holding only a manifest, as prune and latest see it.
void stageAndPublish(const std::string& dir, const std::string& tag, int64_t created) {
  prepareStaging(dir, tag);
  std::ofstream(std::filesystem::path(stagingPath(dir, tag)) / kManifestFile) << sampleManifest(tag, created).toJsonText();
  publishCheckpoint(dir, tag);
}

std::string readFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

} // namespace

TEST_CASE("a manifest round-trips through its JSON text, and a changed digit fails its checksum", "[checkpoint]") {
  const auto m = sampleManifest("global_step8", 42);
  const std::string text = m.toJsonText();
  const auto back = CheckpointManifest::fromJsonText(text, "manifest.json");
  CHECK(back.toJsonText() == text);
  CHECK(back.params[1].offset == 6);
  CHECK(back.lossScaler->scale == 1024.0);
  CHECK(back.computeDtype == at::kBFloat16);
  CHECK(back.files[0].chunkCrcs[1] == 0xffffffffu);

  std::string damaged = text;
  damaged[damaged.find("\"global_steps\": 7") + 16] = '9';
  CHECK(contains(errorText([&] { CheckpointManifest::fromJsonText(damaged, "x/manifest.json"); }),
                 "'x/manifest.json': checksum mismatch"));
  CHECK(contains(errorText([&] { CheckpointManifest::fromJsonText(text.substr(0, text.size() / 2), "x/manifest.json"); }),
                 "'x/manifest.json' is not valid JSON"));
}

TEST_CASE("publishing moves latest last; pruning keeps the newest and never the one being kept",
          "[checkpoint]") {
  TempDir dir;
  const std::string root = dir.path().string();
  CHECK(contains(errorText([&] { readLatestTag(root); }), "no checkpoint in"));
  stageAndPublish(root, "a", 1);
  stageAndPublish(root, "b", 2);
  stageAndPublish(root, "c", 3);
  CHECK(readLatestTag(root) == "c");
  CHECK(readFile(dir / "latest") == "c");
  CHECK(pruneCheckpoints(root, 2, "c") == std::vector<std::string>{"a"});
  CHECK(!std::filesystem::exists(dir / "a"));
  CHECK(pruneCheckpoints(root, 0, "c").empty());  // 0 keeps everything
  // Republishing a tag replaces it.
  stageAndPublish(root, "b", 4);
  CHECK(readLatestTag(root) == "b");
  CHECK(pruneCheckpoints(root, 1, "b") == std::vector<std::string>{"c"});

  // A staging directory is not a checkpoint; the next save removes it.
  std::filesystem::create_directories(stagingPath(root, "dead"));
  CHECK(pruneCheckpoints(root, 1, "b").empty());
  prepareStaging(root, "next");
  CHECK(!std::filesystem::exists(stagingPath(root, "dead")));
}

TEST_CASE("tags that cannot name a checkpoint directory are refused", "[checkpoint]") {
  for (const std::string tag : {"", "a/b", ".hidden", "latest"}) {
    CHECK(contains(errorText([&] { checkTag(tag); }), "cannot name a checkpoint directory"));
  }
  checkTag("global_step100");
}
