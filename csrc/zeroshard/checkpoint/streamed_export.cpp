// exportModelFile: the model for inference as one file (model_export.h), and exportStateDict: the
// same tensors as a state dict of CPU tensors on rank 0 (Engine::save16bitModel and
// Engine::consolidatedStateDict).
//
// Note [streamed export]: both feed each tensor, as soon as it is whole, to a sink on rank 0
// (streamExport): the file writer, which wrote the file's header first (everything about it is
// known from the layouts), or a copy to CPU. Below stage 3 every parameter is whole on every
// rank, so nothing is communicated. At stage 3 the units are gathered one at a time (every rank
// takes part in each all-gather); rank 0 hands the unit's tensors to the sink and the unit is
// released before the next is gathered: the export adds one unit's parameters to each rank's
// memory, never the model. A sink's error on rank 0 (a failed write, no memory for a copy) does
// not stop it taking part in the remaining gathers (the other ranks would wait in them); it is
// reported on every rank at the end. save16bitModel writes under a hidden name, removed on
// error; the file appears under its own name (one rename, after fsync) only when complete.
#include "zeroshard/checkpoint/streamed_export.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "zeroshard/checkpoint/checked_file.h"
#include "zeroshard/comm/agreement.h"
#include "zeroshard/checkpoint/progress.h"
#include "zeroshard/comm/communicator.h"
#include "zeroshard/stage3/unit_scheduler.h"
#include "zeroshard/state/model_state.h"

#include <algorithm>
#include <filesystem>
#include <memory>
#include <optional>

namespace zeroshard {
namespace {

namespace fs = std::filesystem;

std::string describeError(const std::exception& e) {
  if (const auto* c10Error = dynamic_cast<const c10::Error*>(&e)) return c10Error->what_without_backtrace();
  return e.what();
}

// Stage 3: the unit that must be gathered for a tensor (-1: module state, always whole).
int64_t exportUnitOf(const ModelState& model, const ExportSource& source) {
  const UnitScheduler* units = model.units();
  if (!units) return -1;
  if (source.bucket) return static_cast<int64_t>(units->unitOfBucket(*source.bucket).value);
  if (source.frozenBucket) return static_cast<int64_t>(units->unitOfFrozen(*source.frozenBucket).value);
  return -1;
}

ModelExportPlan planExport(ModelState& model, const ModelExportOptions& options) {
  return planModelExport(model.buckets(), model.moduleState(), model.computeDtype(),
                         model.plan().paramsSharded(), options, model.frozenBuckets(),
                         [&model](const ExportSource& source) { return exportUnitOf(model, source); });
}

// Every tensor of `exported`, whole, to `sink` on rank 0 (all ranks take part); returns rank
// 0's first error from the sink ("" on the other ranks).
using ExportSink = std::function<void(size_t tensor, const at::Tensor& value)>;
std::string streamExport(ModelState& model, Communicator& world, Communicator& shardComm,
                         const ModelExportPlan& exported, const ExportSink& sink, Progress& progress,
                         ModelExportStats& stats) {
  UnitScheduler* units = model.units();
  const std::vector<Bucket>& buckets = model.buckets();
  const UncountedCollectives uncounted(world);
  const UncountedCollectives uncountedShards(shardComm);
  const bool feeds = world.rank() == 0;
  stats.tensors = static_cast<int64_t>(exported.tensors.size());
  std::string sinkError;  // rank 0's first error (Note [streamed export])
  size_t i = 0;
  while (i < exported.tensors.size()) {
    // The run of tensors whole together: one unit's at stage 3, everything below it.
    const int64_t unit = exportUnitOf(model, exported.sources[i]);
    size_t end = i + 1;
    if (units) {
      while (end < exported.tensors.size() && exportUnitOf(model, exported.sources[end]) == unit) ++end;
    } else {
      end = exported.tensors.size();
    }
    // A run of trained parameters only (an adapter export) of a unit that also holds frozen
    // ones gathers the trained bucket alone, into a buffer of its own: the frozen base is not
    // moved to write the adapters.
    const bool needsFrozen = std::any_of(exported.sources.begin() + static_cast<std::ptrdiff_t>(i),
                                         exported.sources.begin() + static_cast<std::ptrdiff_t>(end),
                                         [](const ExportSource& s) { return s.frozenBucket.has_value(); });
    const bool alone = unit >= 0 && !needsFrozen && units->hasFrozen(UnitIndex{static_cast<size_t>(unit)}) &&
                       !units->isUnsharded(UnitIndex{static_cast<size_t>(unit)});
    at::Tensor aloneFlat;
    if (alone) {
      const Bucket& b = buckets[*exported.sources[i].bucket];
      aloneFlat = at::empty({b.layout().paddedNumel()}, b.flatParams().options());
      const at::Tensor shard = b.paramShard().to(aloneFlat.device());
      shardComm.allGather(shard, aloneFlat).wait();
      stats.gatheredPeakBytes = std::max(stats.gatheredPeakBytes, static_cast<int64_t>(aloneFlat.nbytes()));
    }
    const bool gathered = unit >= 0 && !alone && units->gatherUnit(UnitIndex{static_cast<size_t>(unit)});
    if (units) stats.gatheredPeakBytes = std::max(stats.gatheredPeakBytes, units->gatheredBytes());
    if (feeds && sinkError.empty()) {
      try {
        for (size_t t = i; t < end; ++t) {
          const ExportSource& source = exported.sources[t];
          at::Tensor value;
          if (source.bucket) {
            const Bucket& b = buckets[*source.bucket];
            const auto& place = b.layout().params()[source.param];
            const at::Tensor& flat = alone ? aloneFlat : b.flatParams();
            value = flat.narrow(0, place.offset, place.numel).view(place.shape);
          } else if (source.frozenBucket) {
            value = model.frozenBuckets()[*source.frozenBucket].params()[source.param].detach();
          } else {
            value = model.moduleState().tensors[source.moduleTensor].second.detach();
          }
          sink(t, value);
          progress.advance(static_cast<int64_t>(value.nbytes()));
        }
      } catch (const std::exception& e) {
        sinkError = describeError(e);
      }
    }
    if (gathered) units->releaseUnit(UnitIndex{static_cast<size_t>(unit)});
    i = end;
  }
  return sinkError;
}

} // namespace

bool exportModelFile(ModelState& model, Communicator& world, Communicator& shardComm, bool gatherOnSave,
                     const std::string& dir, const std::string& filename, const ModelExportOptions& options,
                     ModelExportStats* stats) {
  const fs::path target = fs::path(dir) / filename;
  if (model.plan().paramsSharded() && !gatherOnSave) {
    // As DeepSpeed: without the flag stage 3 saves nothing rather than a file of shards. Every
    // rank returns false; rank 0 says why (the same words on every rank).
    if (world.rank() == 0) {
      TORCH_WARN("zeroshard save_16bit_model: did not save '", target.string(),
                 "': at stage 3 the weights must be gathered to be saved, which "
                 "zero_optimization.stage3_gather_16bit_weights_on_model_save = true allows (one unit is gathered "
                 "at a time); or save a sharded checkpoint with save_checkpoint() and convert it "
                 "(python -m zeroshard.convert)");
    }
    return false;
  }
  const ModelFileFormat format = modelFileFormatOf(filename);
  const ModelExportPlan exported = planExport(model, options);
  const bool writes = world.rank() == 0;
  const fs::path staging = fs::path(dir) / ("." + filename + ".partial");
  const auto device = model.device();
  const std::string what = "save_16bit_model: writing '" + target.string() + "'";
  const std::string outcome = "no file was written ('" + target.string() + "' is as it was)";
  ModelExportStats result;
  result.path = target.string();
  Progress progress("save_16bit_model '" + target.string() + "'", static_cast<int64_t>(exported.tensors.size()),
                    "tensors", terminalProgress(world.rank()));  // rank 0 writes every tensor

  std::optional<ModelFileWriter> writer;
  const auto removeStaging = [&] {
    writer.reset();
    std::error_code ignored;
    fs::remove(staging, ignored);
  };
  try {
    agreeAcrossRanks(world, device, what, outcome, [&] {
      if (!writes) return;
      std::error_code ec;
      fs::create_directories(dir, ec);
      TORCH_CHECK(!ec, "cannot create directory '", dir, "': ", ec.message());
      writer.emplace(staging.string(), format, exported);
    });
    // The tensors arrive in the plan's order, the order the file lays them out in.
    const std::string writeError =
        streamExport(model, world, shardComm, exported,
                     [&](size_t, const at::Tensor& value) { writer->write(value); }, progress, result);
    agreeAcrossRanks(world, device, what, outcome, [&] {
      if (!writes) return;
      TORCH_CHECK(writeError.empty(), writeError);
      result.fileBytes = writer->finish();
      writer.reset();
      fs::rename(staging, target);
      syncDirectory(dir);
    });
    progress.finish();
  } catch (...) {
    if (writes) removeStaging();
    throw;
  }
  if (stats) *stats = result;
  return true;
}

std::optional<std::vector<std::pair<std::string, at::Tensor>>> exportStateDict(
    ModelState& model, Communicator& world, Communicator& shardComm, const ModelExportOptions& optionsIn,
    ModelExportStats* stats) {
  ModelExportOptions options = optionsIn;
  options.operation = "consolidated_state_dict";
  const ModelExportPlan exported = planExport(model, options);
  const bool collects = world.rank() == 0;
  ModelExportStats result;
  Progress progress("consolidated state dict", static_cast<int64_t>(exported.tensors.size()), "tensors",
                    terminalProgress(world.rank()));
  std::vector<at::Tensor> copies(exported.tensors.size());
  const std::string copyError = streamExport(
      model, world, shardComm, exported,
      [&](size_t tensor, const at::Tensor& value) {
        // A copy even of what is on the CPU already: the dict must not alias the engine's
        // buffers, which the next step overwrites (or, at stage 3, releases).
        copies[tensor] = value.to(at::TensorOptions().device(at::kCPU), /*non_blocking=*/false, /*copy=*/true);
      },
      progress, result);
  agreeAcrossRanks(world, model.device(), "consolidated 16-bit state dict: copying to CPU",
                   "nothing was returned", [&] { TORCH_CHECK(copyError.empty(), copyError); });
  progress.finish();
  if (stats) *stats = result;
  if (!collects) return std::nullopt;
  // Every name in the model's order; a tied weight's names share one tensor, as in the
  // module's own state_dict() (Note [one tensor, several names]).
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.reserve(exported.stateDict.size());
  for (const auto& [name, tensor] : exported.stateDict) out.emplace_back(name, copies[tensor]);
  return out;
}

} // namespace zeroshard
