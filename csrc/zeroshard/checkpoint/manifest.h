// The manifest of a checkpoint (manifest.json): everything needed to map the saved shards back
// onto parameters at any world size and stage, and to check the files.
//
// A checkpoint directory holds:
//   manifest.json               this record, with a CRC-32 of its own body
//   rank_00000.safetensors ...  one per saving rank: for flat buffer k, the rank's slice of
//                               "buffers.k.master", "buffers.k.exp_avg", "buffers.k.exp_avg_sq"
//                               (fp32, the saved layout's shard length each)
//   module_state.safetensors    module state the engine does not shard (buffers, frozen
//                               parameters), whole, by state-dict name (when there is any)
//   client_state.pt             the caller's client_state bytes (when given)
#pragma once

#include <ATen/core/Tensor.h>

#include "zeroshard/checkpoint/checked_file.h"
#include "zeroshard/optim/loss_scaler.h"
#include "zeroshard/optim/optimizer.h"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard {

constexpr int kCheckpointFormatVersion = 1;
constexpr const char* kManifestFile = "manifest.json";
constexpr const char* kModuleStateFile = "module_state.safetensors";
constexpr const char* kClientStateFile = "client_state.pt";

// The three fp32 tensors kept per flat buffer.
constexpr const char* kStateKinds[] = {"master", "exp_avg", "exp_avg_sq"};

// One flat buffer (a stage 0-2 bucket or a stage-3 unit) as laid out when saved.
struct SavedBuffer {
  int64_t numel = 0;
  int64_t shardNumel = 0;  // elements per rank file
};

// A trained parameter: where its fp32 values sit in the saved flat buffers.
struct SavedParam {
  std::string name;
  std::vector<int64_t> shape;
  int group = 0;
  int buffer = 0;
  int64_t offset = 0;
  int64_t numel() const;
};

// A tensor saved whole in module_state.safetensors.
struct SavedTensor {
  std::string name;
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
};

// The learning-rate schedule's state (DeepSpeed's state_dict: last_batch_iteration), with its
// type for people and for a warning when a run resumes under another type.
struct SavedSchedule {
  std::string type;
  int64_t lastBatchIteration = -1;
};

// The batch the run trained with (the batch guard compares it on resume); absent in older
// checkpoints. worldSize is the data-parallel world, every rank (a hybrid checkpoint is written
// by one shard group, CheckpointManifest::worldSize).
struct SavedBatch {
  int64_t train = 0;
  int64_t microPerRank = 0;
  int64_t accumulationSteps = 0;
  int worldSize = 0;
};

struct CheckpointManifest {
  int formatVersion = kCheckpointFormatVersion;
  std::string tag;
  int worldSize = 1;
  int stage = 0;
  at::ScalarType computeDtype = at::kFloat;
  int64_t globalSteps = 0;  // optimizer steps taken (AdamW's step count)
  int64_t boundaries = 0;   // accumulation boundaries passed (steps taken + fp16 steps skipped)
  int64_t skippedSteps = 0;
  std::optional<LossScaler::State> lossScaler;
  std::optional<SavedSchedule> lrSchedule;  // "lr_scheduler"; absent in older checkpoints
  std::optional<SavedBatch> batch;          // "batch"; absent in older checkpoints
  std::string configJson;  // the config the run used, for people and tools
  std::vector<AdamWHyper> groups;
  std::vector<SavedBuffer> buffers;
  std::vector<SavedParam> params;
  // State-dict names that refer to a trained parameter under another name (tied weights).
  std::vector<std::pair<std::string, std::string>> aliases;
  std::vector<SavedTensor> moduleState;
  // The model's state-dict order (parameters, aliases and module state); empty when the
  // engine was not given a module's state.
  std::vector<std::string> stateDictKeys;
  // Saved with exclude_frozen_parameters: the frozen parameters are in neither moduleState nor
  // stateDictKeys, and a load keeps the engine's ("frozen_excluded"; absent: false).
  bool frozenExcluded = false;
  std::vector<FileDigest> files;  // every other file of the checkpoint
  int64_t createdUnixNs = 0;

  static std::string rankFileName(int rank);
  static std::string stateTensorName(int buffer, const std::string& kind);
  // Throws naming `name` and the checkpoint when the manifest does not list it.
  const FileDigest& file(const std::string& name) const;
  bool hasFile(const std::string& name) const;

  // manifest.json's text, and back; `where` names the file in errors.
  std::string toJsonText() const;
  static CheckpointManifest fromJsonText(const std::string& text, const std::string& where);
};


// manifest.json's text for a manifest body edited outside zeroshard (by a tool, by hand, by the
// fuzz tests): the body as given, with the checksum of its text (Note [manifest checksum]).
// Nothing in the body is checked; fromJsonText checks it.
std::string manifestTextForBody(const std::string& bodyJson);

// File digests as the manifest writes them (the ranks send theirs to rank 0 this way).
std::string digestsToJson(const std::vector<FileDigest>& digests);
std::vector<FileDigest> digestsFromJson(const std::string& text);

} // namespace zeroshard
