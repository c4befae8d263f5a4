// The model for inference, streamed out of the sharded state one tensor at a time (Note
// [streamed export] in streamed_export.cpp): as one file, or as a state dict on rank 0. Both are
// collective and blocking: every rank calls them outside forward and backward, with the same
// arguments; on any rank's error they fail on every rank. `world` is where rank 0 and the
// agreements are; `shardComm` the group stage 3 gathers units over.
#pragma once

#include <ATen/core/Tensor.h>

#include "zeroshard/checkpoint/model_export.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard {

class Communicator;
class ModelState;

// Engine::save16bitModel: dir/filename, safetensors for a ".safetensors" name, torch.save's
// format otherwise, written by rank 0 under a hidden name and renamed when complete. At stage
// 3 without `gatherOnSave` (stage3_gather_16bit_weights_on_model_save) nothing is written,
// rank 0 warns, and false is returned, as DeepSpeed does.
bool exportModelFile(ModelState& model, Communicator& world, Communicator& shardComm, bool gatherOnSave,
                     const std::string& dir, const std::string& filename, const ModelExportOptions& options,
                     ModelExportStats* stats);
// Engine::consolidatedStateDict: every state-dict name in the model's order on rank 0, each a
// whole new CPU tensor (a tied weight's names share one); nullopt on the other ranks.
std::optional<std::vector<std::pair<std::string, at::Tensor>>> exportStateDict(
    ModelState& model, Communicator& world, Communicator& shardComm, const ModelExportOptions& options,
    ModelExportStats* stats);

} // namespace zeroshard
