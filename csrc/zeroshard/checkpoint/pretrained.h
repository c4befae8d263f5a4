// Pretrained weights from outside zeroshard (a Hugging Face checkpoint: one .safetensors file,
// or model.safetensors.index.json and its shards): which files, where each tensor is, and
// which of them the model takes under its state-dict names. Engine::loadPretrained
// (pretrained_load.cpp) reads the ranges each rank holds; docs/checkpoints.md, "Loading
// pretrained weights".
#pragma once

#include "zeroshard/checkpoint/engine_checkpoint.h"
#include "zeroshard/checkpoint/safetensors_file.h"
#include "zeroshard/layout/bucket.h"

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace zeroshard {

struct ShapeMismatch {
  std::string name;  // the model's state-dict name
  std::vector<int64_t> fileShape;
  std::vector<int64_t> modelShape;
  std::string fileName;  // the tensor's name in the file, when renamed (otherwise empty)
};

// What Engine::loadPretrained found and read on this rank.
struct PretrainedLoad {
  // State-dict names the model has and the files do not (a tied weight under its first name,
  // only when none of its names is there), in state-dict order.
  std::vector<std::string> missing;
  // Tensors in the files that are no state-dict name of the model, in file order.
  std::vector<std::string> unexpected;
  // Names in both whose shapes differ (not loaded), in state-dict order.
  std::vector<ShapeMismatch> mismatched;
  std::vector<std::string> files;  // the safetensors files opened
  // Bytes this rank read: tensor data of trained parameters (only the ranges it holds, in the
  // file's dtype), of module state (buffers and frozen parameters, whole), and the files'
  // headers; bytesRead is their sum.
  int64_t paramBytesRead = 0;
  int64_t moduleStateBytesRead = 0;
  int64_t headerBytesRead = 0;
  int64_t bytesRead = 0;
};

// The safetensors files of `path`: a .safetensors file; a directory holding model.safetensors
// (taken first, as from_pretrained does) or model.safetensors.index.json; or that index file
// itself. Every file's header is read and checked on construction (blocking); errors name the
// path: nothing there, a header that is not safetensors, an index that is not JSON or names a
// shard file that is missing or does not hold the tensor it maps there, a tensor in two shards.
class PretrainedFiles {
 public:
  explicit PretrainedFiles(std::string path);

  struct Located {
    size_t file = 0;
    const TensorEntry* entry = nullptr;
  };

  const std::string& path() const { return path_; }
  size_t numFiles() const { return files_.size(); }
  SafetensorsFile& file(size_t index) const { return *files_.at(index); }
  // nullptr when no file holds `name`.
  const Located* find(const std::string& name) const;
  // Every tensor name, file by file in header order.
  const std::vector<std::string>& names() const { return names_; }

 private:
  void openIndex(const std::string& indexPath);
  void add(const std::string& filePath);

  std::string path_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<std::string> names_;
  std::unordered_map<std::string, Located> where_;
};

// File tensor name -> the model's state-dict name it is loaded as (transformers renames some
// keys on load, e.g. GPT-NeoX's embed_out.weight is lm_head.weight); names not in it are taken
// as they are, entries for names no file holds are ignored. Exact names: the Python layer turns
// regex key mappings into this map.
using TensorRenames = std::unordered_map<std::string, std::string>;

// Which tensor of the files each piece of the model takes (nullptr: none, it stays as it is),
// and the three lists of what does not fit. Tied weights are read once: a trained parameter
// takes its first name present in the files (its own, then its aliases in state-dict order),
// and so do module-state tensors that are one tensor under several names.
struct PretrainedMatch {
  std::vector<std::vector<const PretrainedFiles::Located*>> params;  // [bucket][param]
  std::vector<const PretrainedFiles::Located*> moduleState;          // [ModuleState::tensors index]
  std::vector<std::vector<const PretrainedFiles::Located*>> frozen;  // [frozen bucket][param] (stage 3)
  std::vector<std::string> missing;
  std::vector<std::string> unexpected;
  std::vector<ShapeMismatch> mismatched;
  bool fits() const { return missing.empty() && unexpected.empty() && mismatched.empty(); }
};

// Files' names are matched after `renames`; two file tensors that become one name: the first
// (file order) is taken, the other is unexpected, as is a tensor renamed to no name of the
// model. `unexpected` holds file names. Throws naming the tensor and file when a trained
// parameter would take a tensor that is not floating-point.
// `frozenBuckets`: stage 3's frozen parameters (ModuleState::sharded), matched by their names.
PretrainedMatch matchPretrained(const PretrainedFiles& files, const std::vector<Bucket>& buckets,
                                const ModuleState& state, const TensorRenames& renames = {},
                                const std::vector<Bucket>& frozenBuckets = {});

// The strict error: what did not fit, each list capped at kListedNames names ("and N more"); a
// renamed tensor shows both names ("embed_out.weight (as lm_head.weight)").
std::string describeMismatch(const std::string& path, const PretrainedMatch& match,
                             const TensorRenames& renames = {});
constexpr size_t kListedNames = 20;

class Communicator;
class ModelState;

// Engine::loadPretrained (pretrained_load.cpp, Note [pretrained reads]): `path`'s tensors by
// state-dict name into `model` (trained parameters as setParameters writes them, stage 3's
// frozen shards, module state), each rank reading only what it holds. Collective and blocking
// over `world` (the agreements) and `shardComm` (uncounted).
PretrainedLoad loadPretrained(ModelState& model, Communicator& world, Communicator& shardComm, const std::string& path,
                              bool strict, const TensorRenames& renames);

} // namespace zeroshard
