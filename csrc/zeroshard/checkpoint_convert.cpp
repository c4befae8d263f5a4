#include "zeroshard/checkpoint_convert.h"

#include <c10/util/Exception.h>

#include "zeroshard/safetensors.h"

#include <filesystem>

namespace zeroshard {
namespace {

namespace fs = std::filesystem;

// The dtype and shape of a state-dict entry, from the manifest alone (the header comes first).
TensorEntry entryOf(const CheckpointReader& reader, const std::string& name, std::optional<at::ScalarType> dtype) {
  const auto& m = reader.manifest();
  std::string target = name;
  for (const auto& [alias, param] : m.aliases) {
    if (alias == name) target = param;
  }
  TensorEntry e;
  e.name = name;
  if (const SavedParam* p = reader.findParam(target)) {
    e.shape = p->shape;
    e.dtype = at::kFloat;
  } else {
    const SavedTensor* found = nullptr;
    for (const auto& t : m.moduleState) {
      if (t.name == name) found = &t;
    }
    TORCH_CHECK(found, "zeroshard convert: checkpoint '", reader.path(), "' lists state-dict name '", name,
                "' but holds no tensor for it");
    e.shape = found->shape;
    e.dtype = found->dtype;
  }
  if (dtype && at::isFloatingType(e.dtype)) e.dtype = *dtype;
  return e;
}

} // namespace

size_t writeConsolidatedSafetensors(CheckpointReader& reader, const std::string& out,
                                    std::optional<at::ScalarType> dtype) {
  const auto names = reader.stateDictNames();
  std::vector<TensorEntry> entries;
  for (const auto& name : names) entries.push_back(entryOf(reader, name, dtype));
  const fs::path target(out);
  std::string stagingName = ".";
  stagingName += target.filename().string();
  stagingName += ".partial";
  const fs::path staging = target.parent_path() / stagingName;
  {
    SafetensorsWriter writer(staging.string(), entries, {{"format", "pt"}});
    for (size_t i = 0; i < names.size(); ++i) writer.write(reader.readStateDictEntry(names[i]).to(entries[i].dtype));
    writer.finish(target.filename().string());
  }
  fs::rename(staging, target);
  return names.size();
}

} // namespace zeroshard
