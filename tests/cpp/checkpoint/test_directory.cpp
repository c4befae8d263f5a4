#include "catch.h"


#include "error_text.h"
#include "temp_dir.h"
#include "zeroshard/checkpoint/directory.h"
#include "zeroshard/checkpoint/manifest.h"

#include <algorithm>
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

TEST_CASE("publishing moves latest last; pruning keeps the newest default tags and never a chosen one",
          "[checkpoint]") {
  TempDir dir;
  const std::string root = dir.path().string();
  CHECK(contains(errorText([&] { readLatestTag(root); }), "no checkpoint in"));
  std::ofstream(dir / "latest") << "\n";
  CHECK(contains(errorText([&] { readLatestTag(root); }), "is empty; pass the tag to load"));
  stageAndPublish(root, "best", 1);
  stageAndPublish(root, "global_step9", 2);
  stageAndPublish(root, "global_step10", 3);  // newer by step, though "9" sorts after "10" as text
  stageAndPublish(root, "global_step11", 4);
  CHECK(readLatestTag(root) == "global_step11");
  CHECK(readFile(dir / "latest") == "global_step11");
  CHECK(pruneCheckpoints(root, 2, "global_step11") == std::vector<std::string>{"global_step9"});
  CHECK(std::filesystem::exists(dir / "best"));
  CHECK(pruneCheckpoints(root, 0, "global_step11").empty());  // 0 keeps everything
  CHECK(pruneCheckpoints(root, 1, "global_step11") == std::vector<std::string>{"global_step10"});
  CHECK(std::filesystem::exists(dir / "best"));
  CHECK(defaultTagStep("global_step42") == 42);
  CHECK(!defaultTagStep("global_step4x").has_value());
  CHECK(!defaultTagStep("best").has_value());
}

TEST_CASE("re-publishing a tag swaps the new checkpoint in whole", "[checkpoint]") {
  TempDir dir;
  const std::string root = dir.path().string();
  stageAndPublish(root, "same", 1);
  stageAndPublish(root, "same", 2);
  const auto manifest = CheckpointManifest::fromJsonText(readFile(dir / "same/manifest.json"), "manifest.json");
  CHECK(manifest.createdUnixNs == 2);
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"latest", "same"});
}

TEST_CASE("the next save puts back a checkpoint that a dead publish had moved aside, and drops staging",
          "[checkpoint]") {
  TempDir dir;
  const std::string root = dir.path().string();
  stageAndPublish(root, "same", 1);
  // The state a publish without an atomic exchange leaves if it dies between its two renames.
  std::filesystem::rename(dir / "same", dir / ".trash-same");
  std::filesystem::create_directories(stagingPath(root, "same"));
  std::filesystem::create_directories(stagingPath(root, "dead"));
  prepareStaging(root, "next");
  CHECK(std::filesystem::exists(dir / "same/manifest.json"));
  CHECK(!std::filesystem::exists(dir / ".trash-same"));
  CHECK(!std::filesystem::exists(stagingPath(root, "dead")));
  CHECK(std::filesystem::exists(stagingPath(root, "next")));
  CHECK(readLatestTag(root) == "same");
}

TEST_CASE("tags that cannot name a checkpoint directory are refused", "[checkpoint]") {
  for (const std::string tag : {"", "a/b", ".hidden", "latest", "a b", "step\n", "x\ty"}) {
    CHECK(contains(errorText([&] { checkTag(tag); }), "cannot name a checkpoint directory"));
  }
  checkTag("global_step100");
  checkTag("run-2.best_v1");
}
