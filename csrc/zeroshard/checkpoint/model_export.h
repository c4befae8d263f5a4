// The model for inference as one file (Engine::save16bitModel, DeepSpeed's save_16bit_model):
// every entry of the model's state dict under its own name, the trained parameters in the
// compute dtype, buffers and frozen parameters as the model holds them, in safetensors or
// torch.save's format. Everything about the file (names, dtypes, shapes, offsets) is known
// before any data, so the header goes first and each tensor's bytes follow as soon as the
// tensor is whole: at stage 3 one unit is gathered at a time (streamed_export.cpp).
//
// Note [one tensor, several names]: a tied weight is one tensor under several state-dict names.
// safetensors files hold no shared tensors, so it is written once, under its first name, as
// transformers' save_pretrained does (from_pretrained ties the others back); a torch file lists
// every name, all sharing one storage, as torch.save(model.state_dict()) does.
#pragma once

#include <ATen/core/Tensor.h>

#include "zeroshard/checkpoint/engine_checkpoint.h"
#include "zeroshard/checkpoint/safetensors.h"
#include "zeroshard/checkpoint/torch_file.h"
#include "zeroshard/layout/bucket.h"

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard {

enum class ModelFileFormat { kSafetensors, kTorch };

// A name ending in ".safetensors" is a safetensors file; any other (".bin", ".pt") a torch
// file, as DeepSpeed's torch.save writes whatever the name. Throws unless `filename` is a plain
// file name (no '/').
ModelFileFormat modelFileFormatOf(const std::string& filename);

struct ModelExportOptions {
  // State-dict names to leave out, e.g. the frozen parameters (DeepSpeed's
  // exclude_frozen_parameters); a name the model does not have is an error.
  std::vector<std::string> exclude;
  // The call that exports, as its errors name it.
  std::string operation = "save_16bit_model";
};

// What one save16bitModel call did.
struct ModelExportStats {
  std::string path;           // the file written (on every rank)
  int64_t tensors = 0;        // distinct tensors in it
  int64_t fileBytes = 0;      // its size (rank 0; 0 on the others)
  // Stage 3: the most bytes of gathered unit parameters alive at once during the call (what
  // the export adds on top of the shards: one unit). 0 below stage 3, where nothing is gathered.
  int64_t gatheredPeakBytes = 0;
};

// Where one exported tensor's bytes come from.
struct ExportSource {
  std::optional<size_t> bucket;        // a trained parameter: bucket and index in it
  size_t param = 0;
  size_t moduleTensor = 0;             // otherwise: index into ModuleState::tensors
  std::optional<size_t> frozenBucket;  // or a frozen parameter sharded at stage 3 (index `param` in it)
};

// The file's contents, worked out from the engine's buckets and module state alone (the same
// on every rank), before any data is read.
struct ModelExportPlan {
  // Each distinct tensor, in the order its bytes are written (its name: its first state-dict
  // name), and where it comes from.
  std::vector<TensorEntry> tensors;
  std::vector<ExportSource> sources;
  // Every exported state-dict name, in the model's order, and its tensor.
  std::vector<std::pair<std::string, size_t>> stateDict;
};

// `byUnit`: the parameters are whole only one unit at a time (stage 3), so the tensors are
// ordered unit by unit, module state first; otherwise in the state dict's order. A unit is
// `unitOf(source)` (default: the trained bucket; module state: -1). Trained parameters are
// `computeDtype`; the frozen parameters of `frozenBuckets` (ModuleState::sharded) keep theirs.
// With no module state (a C++ engine built from param groups alone) the state dict is the
// trained parameters.
ModelExportPlan planModelExport(const std::vector<Bucket>& buckets, const ModuleState& moduleState,
                                at::ScalarType computeDtype, bool byUnit, const ModelExportOptions& options,
                                const std::vector<Bucket>& frozenBuckets = {},
                                const std::function<int64_t(const ExportSource&)>& unitOf = {});

// Writes a planned file of either format: construction writes the header (safetensors) or
// opens the archive (torch); write() takes the plan's tensors in order; finish() completes and
// flushes the file (fsync) and returns its size. Blocking.
class ModelFileWriter {
 public:
  ModelFileWriter(const std::string& path, ModelFileFormat format, const ModelExportPlan& plan);
  void write(const at::Tensor& tensor);
  int64_t finish();

 private:
  std::string path_;
  std::optional<SafetensorsWriter> safetensors_;
  std::optional<TorchFileWriter> torch_;
};

} // namespace zeroshard
