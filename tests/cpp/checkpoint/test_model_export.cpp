// The model export's pieces without an engine (csrc/zeroshard/checkpoint/model_export.*,
// torch_file.*): what a file holds and in which order, the torch file read back by torch's own
// C++ readers, the safetensors file's byte ranges. The engine's use of them: test_engine_export.cpp.
#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/pickle.h>

#undef CHECK
#include "catch.h"

#include "error_text.h"
#include "temp_dir.h"
#include "zeroshard/checkpoint/crc32.h"
#include "zeroshard/checkpoint/model_export.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

using zeroshard::Bucket;
using zeroshard::FileDigest;
using zeroshard::ModelExportPlan;
using zeroshard::ModelFileFormat;
using zeroshard::ModelFileWriter;
using zeroshard::ModuleState;
using zeroshard::TensorEntry;
using zeroshard::TorchFileWriter;
using zeroshard::testing::TempDir;
using zeroshard::testing::contains;
using zeroshard::testing::errorText;

namespace {

at::Tensor values(int64_t numel, double scale) {
  return at::arange(numel, at::kFloat).mul(scale).add(0.5);
}

// Two buckets (two stage-3 units): "a" holds a.w [2, 3] and a.b [3], "b" holds b.w [4].
struct Model {
  std::vector<Bucket> buckets;
  ModuleState state;
};

Model makeModel(at::ScalarType computeDtype = at::kFloat) {
  Model m;
  m.buckets.emplace_back(std::vector<at::Tensor>{values(6, 1).view({2, 3}).clone(), values(3, 10)},
                         std::vector<std::string>{"a.w", "a.b"}, std::vector<int>{0, 0}, 0, 1, computeDtype);
  m.buckets.emplace_back(std::vector<at::Tensor>{values(4, 100)}, std::vector<std::string>{"b.w"},
                         std::vector<int>{0}, 0, 1, computeDtype);
  const at::Tensor frozen = values(5, -1);
  // The model's state dict: a buffer, a second name of a.w (tied), and a frozen parameter under
  // two names (a tied frozen weight: one tensor).
  m.state.keys = {"a.w", "a.b", "count", "tied", "b.w", "frozen", "frozen_again"};
  m.state.tensors = {{"count", at::arange(3, at::kLong)}, {"frozen", frozen}, {"frozen_again", frozen}};
  m.state.aliases = {{"tied", "a.w"}};
  return m;
}

std::vector<std::string> namesOf(const std::vector<TensorEntry>& tensors) {
  std::vector<std::string> names;
  for (const auto& t : tensors) names.push_back(t.name);
  return names;
}

std::vector<std::pair<std::string, size_t>> dict(std::vector<std::pair<std::string, size_t>> entries) {
  return entries;
}

// What a checkpoint's manifest would record for a file: its size and chunk CRCs.
FileDigest digestOf(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  FileDigest d;
  d.bytes = static_cast<int64_t>(bytes.size());
  d.chunkBytes = zeroshard::kChecksumChunkBytes;
  for (size_t at = 0; at < bytes.size(); at += static_cast<size_t>(d.chunkBytes)) {
    const size_t n = std::min(bytes.size() - at, static_cast<size_t>(d.chunkBytes));
    d.chunkCrcs.push_back(zeroshard::crc32Update(0, bytes.data() + at, n));
  }
  return d;
}

at::Tensor paramOf(const Bucket& b, size_t i) {
  const auto& place = b.layout().params()[i];
  return b.flatParams().narrow(0, place.offset, place.numel).view(place.shape);
}

// The plan's tensors, from the model, in the plan's order (what the engine streams).
std::vector<at::Tensor> tensorsOf(const Model& m, const ModelExportPlan& plan) {
  std::vector<at::Tensor> out;
  for (const auto& s : plan.sources) {
    out.push_back(s.bucket ? paramOf(m.buckets[*s.bucket], s.param) : m.state.tensors[s.moduleTensor].second);
  }
  return out;
}

} // namespace

TEST_CASE("the export plan holds every state-dict name and each tensor once under its first name",
          "[model_export]") {
  const Model m = makeModel(at::kBFloat16);
  const auto plan = zeroshard::planModelExport(m.buckets, m.state, at::kBFloat16, /*byUnit=*/false, {});
  // Below stage 3: the model's order; a tied name adds no tensor.
  CHECK(namesOf(plan.tensors) == std::vector<std::string>{"a.w", "a.b", "count", "b.w", "frozen"});
  CHECK(plan.stateDict == dict({{"a.w", 0}, {"a.b", 1}, {"count", 2}, {"tied", 0}, {"b.w", 3}, {"frozen", 4},
                                {"frozen_again", 4}}));
  // Trained parameters in the compute dtype, module state in its own.
  CHECK(plan.tensors[0].dtype == at::kBFloat16);
  CHECK(plan.tensors[0].shape == std::vector<int64_t>{2, 3});
  CHECK(plan.tensors[2].dtype == at::kLong);
  CHECK(plan.tensors[4].dtype == at::kFloat);

  // Stage 3: module state (always whole) first, then unit by unit, the dict still in the model's order.
  const auto byUnit = zeroshard::planModelExport(m.buckets, m.state, at::kBFloat16, /*byUnit=*/true, {});
  CHECK(namesOf(byUnit.tensors) == std::vector<std::string>{"count", "frozen", "a.w", "a.b", "b.w"});
  CHECK(byUnit.stateDict == dict({{"a.w", 2}, {"a.b", 3}, {"count", 0}, {"tied", 2}, {"b.w", 4}, {"frozen", 1},
                                  {"frozen_again", 1}}));
  CHECK(byUnit.sources[2].bucket == std::optional<size_t>(0));
  CHECK(byUnit.sources[4].bucket == std::optional<size_t>(1));
}

TEST_CASE("the export plan leaves out excluded names and refuses unknown ones", "[model_export]") {
  const Model m = makeModel();
  const auto plan = zeroshard::planModelExport(m.buckets, m.state, at::kFloat, false, {{"frozen", "frozen_again"}});
  CHECK(namesOf(plan.tensors) == std::vector<std::string>{"a.w", "a.b", "count", "b.w"});
  CHECK(contains(errorText([&] { zeroshard::planModelExport(m.buckets, m.state, at::kFloat, false, {{"nope"}}); }),
                 "cannot exclude 'nope': the model's state dict has no such entry"));
  // No module state (a C++ engine built from param groups): the trained parameters.
  const auto bare = zeroshard::planModelExport(m.buckets, ModuleState{}, at::kFloat, false, {});
  CHECK(namesOf(bare.tensors) == std::vector<std::string>{"a.w", "a.b", "b.w"});
}

TEST_CASE("a .safetensors name is safetensors and any other a torch file and a path is refused",
          "[model_export]") {
  CHECK(zeroshard::modelFileFormatOf("model.safetensors") == ModelFileFormat::kSafetensors);
  CHECK(zeroshard::modelFileFormatOf("pytorch_model.bin") == ModelFileFormat::kTorch);
  CHECK(zeroshard::modelFileFormatOf("model.pt") == ModelFileFormat::kTorch);
  for (const char* bad : {"", "sub/model.safetensors", ".."}) {
    CHECK(contains(errorText([&] { zeroshard::modelFileFormatOf(bad); }), "must be a file name without '/'"));
  }
}

TEST_CASE("a torch file written record by record is what torch's own readers read", "[model_export][torch_file]") {
  TempDir dir;
  const std::string path = dir / "model.bin";
  const at::Tensor w = values(6, 1).view({2, 3}).to(at::kBFloat16);
  const at::Tensor big = values(70000, 0.001);
  const at::Tensor count = at::arange(3, at::kLong);
  const at::Tensor scalar = at::full({}, 7.0, at::kFloat);
  const at::Tensor empty = at::empty({0, 4}, at::kHalf);
  const std::vector<TensorEntry> records = {{"w", at::kBFloat16, {2, 3}}, {"big", at::kFloat, {70000}},
                                            {"count", at::kLong, {3}}, {"scalar", at::kFloat, {}},
                                            {"empty", at::kHalf, {0, 4}}};
  // The dict in another order than the records, with a second name for record 0.
  const auto entries = dict({{"count", 2}, {"w", 0}, {"w_tied", 0}, {"big", 1}, {"scalar", 3}, {"empty", 4}});
  TorchFileWriter writer(path, records, entries);
  for (const auto& t : {w, big, count, scalar, empty}) writer.write(t);
  const int64_t bytes = writer.finish();
  CHECK(bytes == digestOf(path).bytes);

  // Each record byte-exact, and no storage-order promise (Note [no storage order record]).
  caffe2::serialize::PyTorchStreamReader zip(path);
  CHECK_FALSE(zip.hasRecord(".format_version"));
  const std::vector<at::Tensor> written = {w, big, count, scalar, empty};
  for (size_t i = 0; i < written.size(); ++i) {
    auto [data, size] = zip.getRecord("data/" + std::to_string(i));
    REQUIRE(size == written[i].nbytes());
    CHECK(std::memcmp(data.get(), written[i].data_ptr(), size) == 0);
  }
  auto [pickle, pickleSize] = zip.getRecord("data.pkl");
  const std::string expected = zeroshard::torchStateDictPickle(records, entries);
  CHECK(std::string(static_cast<const char*>(pickle.get()), pickleSize) == expected);

  // torch's C++ unpickler (torch::pickle_load reads torch.save's files) sees the dict in order.
  std::ifstream in(path, std::ios::binary);
  const std::vector<char> file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto loaded = torch::jit::pickle_load(file).toGenericDict();
  std::vector<std::string> keys;
  for (const auto& item : loaded) keys.push_back(item.key().toStringRef());
  CHECK(keys == std::vector<std::string>{"count", "w", "w_tied", "big", "scalar", "empty"});
  CHECK(at::equal(loaded.at("w").toTensor(), w));
  CHECK(at::equal(loaded.at("w_tied").toTensor(), w));
  CHECK(at::equal(loaded.at("big").toTensor(), big));
  CHECK(at::equal(loaded.at("count").toTensor(), count));
  CHECK(loaded.at("scalar").toTensor().dim() == 0);
  CHECK(at::equal(loaded.at("scalar").toTensor(), scalar));
  CHECK(loaded.at("empty").toTensor().sizes() == c10::IntArrayRef({0, 4}));
  CHECK(loaded.at("empty").toTensor().scalar_type() == at::kHalf);
}

TEST_CASE("a torch file refuses a tensor that does not match its record and a dtype it cannot name",
          "[model_export][torch_file]") {
  TempDir dir;
  TorchFileWriter writer(dir / "m.bin", {{"a", at::kFloat, {4}}}, dict({{"a", 0}}));
  CHECK(contains(errorText([&] { writer.write(values(5, 1)); }), "tensor 'a' is Float with 5 elements"));
  CHECK(contains(errorText([&] { TorchFileWriter(dir / "c.bin", {{"c", at::kComplexFloat, {1}}}, dict({{"c", 0}})); }),
                 "cannot be saved in a torch file"));
}

TEST_CASE("a planned safetensors file gives each tensor its byte range and reads back byte-exact",
          "[model_export][safetensors]") {
  TempDir dir;
  const std::string path = dir / "model.safetensors";
  const Model m = makeModel(at::kBFloat16);
  const auto plan = zeroshard::planModelExport(m.buckets, m.state, at::kBFloat16, /*byUnit=*/true, {});
  const auto tensors = tensorsOf(m, plan);
  ModelFileWriter writer(path, ModelFileFormat::kSafetensors, plan);
  for (const auto& t : tensors) writer.write(t);
  const int64_t bytes = writer.finish();

  zeroshard::SafetensorsReader reader(path, digestOf(path));
  CHECK(reader.metadata() == std::map<std::string, std::string>{{"format", "pt"}});
  CHECK_FALSE(reader.contains("tied"));  // Note [one tensor, several names]
  CHECK_FALSE(reader.contains("frozen_again"));
  int64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& e = reader.entry(plan.tensors[i].name);
    // Back to back in the order they were streamed.
    CHECK(e.begin == offset);
    CHECK(e.end - e.begin == static_cast<int64_t>(tensors[i].nbytes()));
    CHECK(e.dtype == tensors[i].scalar_type());
    CHECK(e.shape == tensors[i].sizes().vec());
    CHECK(at::equal(reader.read(plan.tensors[i].name), tensors[i].contiguous()));
    offset = e.end;
  }
  CHECK(bytes == digestOf(path).bytes);
}
