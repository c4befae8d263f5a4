// The batch guard of checkpoint loads (checkpoint/engine_checkpoint.h, batchChange): what a
// person should read when a run resumes with another global batch than it saved with.
#include "zeroshard/checkpoint/engine_checkpoint.h"

#include "zeroshard/checkpoint/manifest.h"

#include <optional>
#include <string>

namespace zeroshard {
namespace {

std::string describeBatch(int64_t train, int64_t micro, int64_t accumulation, int64_t world) {
  return std::to_string(train) + " (" + std::to_string(micro) + " per rank x " + std::to_string(accumulation) +
         " accumulation step" + (accumulation == 1 ? "" : "s") + " x " + std::to_string(world) + " rank" +
         (world == 1 ? "" : "s") + ")";
}

}  // namespace

std::optional<std::string> batchChange(const CheckpointManifest& m, const BatchSizes& batch, int worldSize) {
  if (!m.batch || m.batch->train == batch.train) return std::nullopt;
  const auto& saved = *m.batch;
  std::string text = "zeroshard checkpoint '" + m.tag + "': saved with a global batch of " +
                     describeBatch(saved.train, saved.microPerRank, saved.accumulationSteps, saved.worldSize) +
                     ", resumed with " +
                     describeBatch(batch.train, batch.microPerRank, batch.accumulationSteps, worldSize) +
                     ": the run goes on with another batch (and so another effective learning rate); ";
  const int64_t perStep = batch.microPerRank * worldSize;
  if (saved.train % perStep == 0) {
    text += "gradient_accumulation_steps " + std::to_string(saved.train / perStep) + " keeps the global batch of " +
            std::to_string(saved.train);
  } else {
    text += "no gradient_accumulation_steps keeps " + std::to_string(saved.train) + " at " +
            std::to_string(batch.microPerRank) + " per rank on " + std::to_string(worldSize) + " ranks (" +
            std::to_string(saved.train) + " is not a multiple of " + std::to_string(perStep) +
            "); change train_micro_batch_size_per_gpu too";
  }
  return text;
}

} // namespace zeroshard
