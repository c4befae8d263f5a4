// Pretrained checkpoints without an engine (csrc/zeroshard/checkpoint/pretrained.*): finding
// the files of a path (one file, a directory, a sharded index) with errors that name it, and
// matching their tensors to a model's state-dict names (tied weights read once, the three
// lists of what does not fit). The engine's loading: tests/python/test_load_pretrained.py.
#include <ATen/ATen.h>

#undef CHECK
#include "catch.h"

#include "error_text.h"
#include "temp_dir.h"
#include "zeroshard/checkpoint/pretrained.h"

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

using zeroshard::Bucket;
using zeroshard::ModuleState;
using zeroshard::PretrainedFiles;
using zeroshard::PretrainedMatch;
using zeroshard::SafetensorsWriter;
using zeroshard::TensorEntry;
using zeroshard::testing::TempDir;
using zeroshard::testing::contains;
using zeroshard::testing::errorText;

namespace {

namespace fs = std::filesystem;

// A safetensors file of float tensors {name: shape}, each filled with its index + 1.
void writeFile(const std::string& path, const std::vector<TensorEntry>& entries) {
  SafetensorsWriter writer(path, entries);
  for (size_t i = 0; i < entries.size(); ++i) {
    writer.write(at::full(entries[i].shape, static_cast<double>(i + 1), at::TensorOptions().dtype(entries[i].dtype)));
  }
  writer.finish(path);
}

void writeText(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

std::string openError(const std::string& path) {
  return errorText([&] { PretrainedFiles files(path); });
}

std::vector<std::string> fileNames(const PretrainedFiles& files) {
  std::vector<std::string> out;
  for (size_t i = 0; i < files.numFiles(); ++i) out.push_back(fs::path(files.file(i).path()).filename().string());
  return out;
}

const std::string kIndex = R"({"metadata": {"total_size": 40}, "weight_map": {"a": "model-00001-of-00002.safetensors",
  "b": "model-00002-of-00002.safetensors", "c": "model-00001-of-00002.safetensors"}})";

void writeSharded(const TempDir& dir) {
  writeFile(dir / "model-00001-of-00002.safetensors", {{"a", at::kFloat, {2}}, {"c", at::kFloat, {3}}});
  writeFile(dir / "model-00002-of-00002.safetensors", {{"b", at::kFloat, {5}}});
  writeText(dir / "model.safetensors.index.json", kIndex);
}

} // namespace

TEST_CASE("pretrained files are found from a file a directory or a sharded index", "[pretrained]") {
  TempDir dir;
  SECTION("one file, by any name") {
    writeFile(dir / "weights.safetensors", {{"a", at::kFloat, {2}}});
    PretrainedFiles files(dir / "weights.safetensors");
    CHECK(fileNames(files) == std::vector<std::string>{"weights.safetensors"});
    CHECK(files.names() == std::vector<std::string>{"a"});
  }
  SECTION("a sharded checkpoint, from its directory or its index file") {
    writeSharded(dir);
    for (const auto& path : {dir.path().string(), dir / "model.safetensors.index.json"}) {
      PretrainedFiles files(path);
      CHECK(fileNames(files) == std::vector<std::string>{"model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"});
      CHECK(files.names() == std::vector<std::string>{"a", "c", "b"});
      CHECK(files.find("b")->file == 1);
      CHECK(files.find("b")->entry->shape == std::vector<int64_t>{5});
      CHECK(files.find("d") == nullptr);
    }
  }
  SECTION("model.safetensors is taken before an index, as from_pretrained does") {
    writeSharded(dir);
    writeFile(dir / "model.safetensors", {{"z", at::kFloat, {1}}});
    CHECK(PretrainedFiles(dir.path().string()).names() == std::vector<std::string>{"z"});
  }
}

TEST_CASE("a pretrained path that holds no usable checkpoint is an error naming it", "[pretrained]") {
  TempDir dir;
  SECTION("nothing there") {
    const auto text = openError(dir / "nothing");
    CHECK(contains(text, "'" + dir / "nothing" + "' does not exist; load_pretrained takes a .safetensors file"));
  }
  SECTION("a directory without either file, or with only torch's format") {
    CHECK(contains(openError(dir.path().string()),
                   "directory '" + dir.path().string() +
                       "' holds neither model.safetensors nor model.safetensors.index.json"));
    writeText(dir / "pytorch_model.bin", "x");
    CHECK(contains(openError(dir.path().string()), "pytorch_model.bin is torch.save's format, which is not read"));
  }
  SECTION("a file that is not safetensors") {
    writeText(dir / "model.safetensors", "not a safetensors file at all");
    CHECK(contains(openError(dir.path().string()), "model.safetensors' has a header length of"));
  }
  SECTION("an index that is not JSON, or has no weight_map") {
    writeText(dir / "model.safetensors.index.json", "{\"weight_map\": ");
    CHECK(contains(openError(dir.path().string()), "index '" + dir / "model.safetensors.index.json" +
                                                       "' is not valid JSON"));
    writeText(dir / "model.safetensors.index.json", R"({"metadata": {}})");
    CHECK(contains(openError(dir.path().string()), "has no \"weight_map\" object"));
  }
  SECTION("an index naming a missing shard file") {
    writeSharded(dir);
    fs::remove(dir / "model-00002-of-00002.safetensors");
    CHECK(contains(openError(dir.path().string()),
                   "index '" + dir / "model.safetensors.index.json" +
                       "' names shard file 'model-00002-of-00002.safetensors' (for 'b'), which is missing"));
  }
  SECTION("an index mapping a tensor to a shard that does not hold it") {
    writeSharded(dir);
    writeText(dir / "model.safetensors.index.json",
              R"({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                  "c": "model-00002-of-00002.safetensors"}})");
    CHECK(contains(openError(dir.path().string()),
                   "maps 'b' to 'model-00001-of-00002.safetensors', which does not hold it (it is in '"));
  }
  SECTION("a tensor in two shards") {
    writeSharded(dir);
    writeFile(dir / "model-00002-of-00002.safetensors", {{"b", at::kFloat, {5}}, {"a", at::kFloat, {2}}});
    CHECK(contains(openError(dir.path().string()), "tensor 'a' is in both '"));
  }
}

namespace {

// Trained w [2, 3] (tied: also "head"), b [3]; module state: a long buffer "count" and a frozen
// weight under two names.
struct Model {
  std::vector<Bucket> buckets;
  ModuleState state;
};

Model makeModel() {
  Model m;
  m.buckets.emplace_back(std::vector<at::Tensor>{at::zeros({2, 3}), at::zeros({3})},
                         std::vector<std::string>{"w", "b"}, std::vector<int>{0, 0}, 0, 1);
  const at::Tensor frozen = at::zeros({4});
  m.state.keys = {"w", "b", "count", "head", "frozen", "frozen_again"};
  m.state.tensors = {{"count", at::zeros({2}, at::kLong)}, {"frozen", frozen}, {"frozen_again", frozen}};
  m.state.aliases = {{"head", "w"}};
  return m;
}

struct Matched {
  std::unique_ptr<PretrainedFiles> files;  // what the match points into
  PretrainedMatch match;
  const PretrainedFiles::Located* tensor(const std::string& name) const { return files->find(name); }
};

Matched matchFile(const TempDir& dir, const std::vector<TensorEntry>& entries, const Model& m) {
  writeFile(dir / "m.safetensors", entries);
  Matched out{std::make_unique<PretrainedFiles>(dir / "m.safetensors"), {}};
  out.match = zeroshard::matchPretrained(*out.files, m.buckets, m.state);
  return out;
}

} // namespace

TEST_CASE("pretrained tensors match the state-dict names with tied weights read once", "[pretrained]") {
  TempDir dir;
  const Model m = makeModel();
  SECTION("everything present, the tied copies dropped as save_pretrained drops them") {
    const auto r = matchFile(dir, {{"w", at::kBFloat16, {2, 3}}, {"b", at::kFloat, {3}},
                                   {"count", at::kLong, {2}}, {"frozen", at::kFloat, {4}}}, m);
    CHECK(r.match.fits());
    CHECK((r.match.params[0][0] == r.tensor("w") && r.match.params[0][1] == r.tensor("b")));
    // The frozen weight's second name is the same tensor: read once, through its first entry.
    CHECK((r.match.moduleState[0] == r.tensor("count") && r.match.moduleState[1] == r.tensor("frozen") &&
           r.match.moduleState[2] == nullptr));
  }
  SECTION("a tied weight under its second name only") {
    const auto r = matchFile(dir, {{"head", at::kFloat, {2, 3}}, {"b", at::kFloat, {3}},
                                   {"count", at::kLong, {2}}, {"frozen_again", at::kFloat, {4}}}, m);
    CHECK(r.match.fits());
    CHECK((r.match.params[0][0] == r.tensor("head") && r.match.moduleState[1] == r.tensor("frozen_again")));
  }
  SECTION("both names of a tied weight present: the first is read") {
    const auto r = matchFile(dir, {{"head", at::kFloat, {2, 3}}, {"w", at::kFloat, {2, 3}}}, m);
    CHECK(r.match.params[0][0] == r.tensor("w"));
    CHECK(r.match.missing == std::vector<std::string>{"b", "count", "frozen"});
  }
  SECTION("missing, unexpected and wrong-shaped tensors, in state-dict order") {
    const auto r = matchFile(dir, {{"extra.1", at::kFloat, {1}}, {"b", at::kFloat, {4}},
                                   {"extra.0", at::kFloat, {1}}, {"head", at::kFloat, {3, 2}}}, m);
    const PretrainedMatch& match = r.match;
    CHECK(match.missing == std::vector<std::string>{"count", "frozen"});
    CHECK(match.unexpected == std::vector<std::string>{"extra.1", "extra.0"});
    REQUIRE(match.mismatched.size() == 2);
    CHECK(match.mismatched[0].name == "b");
    CHECK(match.mismatched[0].fileShape == std::vector<int64_t>{4});
    CHECK(match.mismatched[0].modelShape == std::vector<int64_t>{3});
    CHECK(match.mismatched[1].name == "head");
    CHECK((!match.params[0][0] && !match.params[0][1]));  // wrong shapes are not loaded
  }
  SECTION("a trained parameter cannot take an integer tensor") {
    CHECK(contains(errorText([&] { matchFile(dir, {{"w", at::kLong, {2, 3}}}, m); }),
                   "tensor 'w' in '" + dir / "m.safetensors" + "' is Long, but the model trains 'w' and needs a "
                   "floating-point value"));
  }
}

TEST_CASE("the strict error lists all three kinds capped at twenty names each", "[pretrained]") {
  PretrainedMatch match;
  for (int i = 0; i < 23; ++i) match.unexpected.push_back("u" + std::to_string(i));
  match.missing = {"m"};
  match.mismatched = {{"s", {2}, {3, 1}}};
  const auto text = zeroshard::describeMismatch("/ckpt", match);
  CHECK(contains(text, "'/ckpt' does not fit the model (strict=True): 1 missing: m; 23 unexpected: u0, u1,"));
  CHECK(contains(text, "u19 and 3 more; 1 with another shape: s (file [2], model [3, 1]); load_pretrained(path, strict=False)"));
  CHECK(!contains(text, "u20"));
}
