#include "zeroshard/checkpoint/convert.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "zeroshard/checkpoint/safetensors.h"

#include <algorithm>
#include <filesystem>
#include <utility>

namespace zeroshard {
namespace {

namespace fs = std::filesystem;

// The dtype and shape of a state-dict entry, from the manifest alone (the header comes first).
TensorEntry entryOf(const CheckpointReader& reader, const std::string& name, std::optional<at::ScalarType> dtype) {
  const auto& m = reader.manifest();
  TensorEntry e;
  e.name = name;
  if (const SavedParam* p = reader.paramOfStateDictEntry(name)) {
    e.shape = p->shape;
    e.dtype = dtype.value_or(at::kFloat);  // trained parameters: the fp32 master weights, cast
    return e;
  }
  // Buffers and frozen parameters keep the dtype the model holds them in, as in its state dict.
  const SavedTensor* found = nullptr;
  for (const auto& t : m.moduleState) {
    if (t.name == name) found = &t;
  }
  TORCH_CHECK(found, "zeroshard convert: checkpoint '", reader.path(), "' lists state-dict name '", name,
              "' but holds no tensor for it");
  e.shape = found->shape;
  e.dtype = found->dtype;
  return e;
}

} // namespace

size_t writeConsolidatedSafetensors(CheckpointReader& reader, const std::string& out,
                                    std::optional<at::ScalarType> dtype, ProgressOutput progressOutput) {
  const auto names = reader.stateDictNames();
  std::vector<TensorEntry> entries;
  for (const auto& name : names) entries.push_back(entryOf(reader, name, dtype));
  const fs::path target(out);
  std::string stagingName = ".";
  stagingName += target.filename().string();
  stagingName += ".partial";
  const fs::path staging = target.parent_path() / stagingName;
  // Note [bounded conversion]: parameters are read into one reused fp32 buffer (and cast into
  // one reused buffer of the output dtype), so memory stays at the largest parameter whatever
  // the model's size; a fresh allocation per tensor leaves the heap holding many of them.
  int64_t largest = 0;
  for (const auto& e : entries) largest = std::max(largest, e.numel());
  const at::Tensor values = at::empty({largest}, at::TensorOptions().dtype(at::kFloat));
  at::Tensor cast;
  if (dtype && *dtype != at::kFloat) cast = at::empty({largest}, at::TensorOptions().dtype(*dtype));
  Progress progress("convert '" + reader.path() + "'", static_cast<int64_t>(names.size()), "tensors",
                    std::move(progressOutput));
  try {
    SafetensorsWriter writer(staging.string(), entries, {{"format", "pt"}});
    for (size_t i = 0; i < names.size(); ++i) {
      const SavedParam* param = reader.paramOfStateDictEntry(names[i]);
      if (!param) {
        const at::Tensor t = reader.readModuleState(names[i]);  // buffers: small, kept as saved
        TORCH_CHECK(t.scalar_type() == entries[i].dtype && t.sizes() == c10::IntArrayRef(entries[i].shape),
                    "zeroshard convert: checkpoint '", reader.path(), "': '", names[i], "' in ", kModuleStateFile,
                    " is ", t.scalar_type(), " ", t.sizes(), ", the manifest says ", entries[i].dtype, " ",
                    c10::IntArrayRef(entries[i].shape), "; the checkpoint is damaged");
        writer.write(t);
        progress.advance(static_cast<int64_t>(t.nbytes()));
        continue;
      }
      const at::Tensor v = values.narrow(0, 0, param->numel());
      reader.readParam(*param, "master", 0, param->numel(), v.data_ptr<float>());
      if (entries[i].dtype == at::kFloat) {
        writer.write(v);
      } else {
        const at::Tensor c = cast.narrow(0, 0, param->numel());
        c.copy_(v);
        writer.write(c);
      }
      progress.advance(param->numel() * static_cast<int64_t>(c10::elementSize(entries[i].dtype)));
    }
    writer.finish(target.filename().string());
    fs::rename(staging, target);
    progress.finish();
  } catch (...) {
    std::error_code ignored;
    fs::remove(staging, ignored);  // never leave a partial file behind
    throw;
  }
  return names.size();
}

} // namespace zeroshard
