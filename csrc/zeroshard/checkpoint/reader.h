// Reads a checkpoint in slices: any range of a saved flat buffer or parameter, whatever world
// size it was saved at, opening only the rank files that hold it. Every byte read is checked
// against the manifest's checksums (Note [chunk checksums]). Needs no process group: loading
// and converting both use it.
#pragma once

#include <ATen/core/Tensor.h>

#include "zeroshard/checkpoint/manifest.h"
#include "zeroshard/checkpoint/safetensors.h"

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>

namespace zeroshard {

class CheckpointReader {
 public:
  // `tag` empty: the one `dir`/latest names. Reads and checks the manifest.
  CheckpointReader(const std::string& dir, const std::optional<std::string>& tag = std::nullopt);

  const CheckpointManifest& manifest() const { return manifest_; }
  const std::string& path() const { return path_; }
  // The trained parameter `name`, or nullptr.
  const SavedParam* findParam(const std::string& name) const;
  // The trained parameter behind a state-dict name (itself, or the target of an alias), or
  // nullptr for module state.
  const SavedParam* paramOfStateDictEntry(const std::string& name) const;

  // Elements [begin, end) of parameter `param`'s `kind` (one of kStateKinds), flattened, into
  // `out` (end - begin floats).
  void readParam(const SavedParam& param, const std::string& kind, int64_t begin, int64_t end, float* out);
  // The whole parameter's fp32 master weights, shaped, on CPU.
  at::Tensor readParam(const std::string& name);
  // A tensor of module_state.safetensors, on CPU; or elements [first, first + count) of it
  // (flattened) into `out`, in its dtype.
  at::Tensor readModuleState(const std::string& name);
  void readModuleStateElements(const std::string& name, int64_t first, int64_t count, void* out);
  // The client_state bytes; empty when none was saved.
  std::string readClientState();

  // The state-dict names in order: each trained parameter, alias and module-state tensor.
  std::vector<std::string> stateDictNames() const;
  // Full tensor for a state-dict name (an alias reads its parameter).
  at::Tensor readStateDictEntry(const std::string& name);

 private:
  SafetensorsReader& rankFile(int rank);
  SafetensorsReader& moduleStateFile();
  void checkClaimsAgainstFiles() const;
  // The manifest's digest of file `name`; throws naming the checkpoint when it lists none.
  const FileDigest& digest(const std::string& name) const;

  std::string path_;
  CheckpointManifest manifest_;
  std::unordered_map<std::string, size_t> paramIndex_;
  // Open rank files, most recently used last; at most kOpenRankFiles stay open, so reading a
  // checkpoint of many ranks holds a bounded number of descriptors and chunk caches.
  static constexpr size_t kOpenRankFiles = 8;
  std::vector<std::pair<int, std::unique_ptr<SafetensorsReader>>> rankFiles_;
  std::unique_ptr<SafetensorsReader> moduleState_;
};

} // namespace zeroshard
