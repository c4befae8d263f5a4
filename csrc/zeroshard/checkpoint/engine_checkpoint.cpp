// saveCheckpoint (engine_checkpoint.h): every rank of the first shard group writes its shards of
// the fp32 master weights and AdamW state, rank 0 the module state, the client state and the
// manifest, and publishes (directory.h). The load side is in engine_checkpoint_load.cpp.
#include "zeroshard/checkpoint/engine_checkpoint.h"

#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include "zeroshard/checkpoint/checked_file.h"
#include "zeroshard/checkpoint/directory.h"
#include "zeroshard/checkpoint/held_state.h"
#include "zeroshard/checkpoint/manifest.h"
#include "zeroshard/checkpoint/progress.h"
#include "zeroshard/checkpoint/safetensors.h"
#include "zeroshard/comm/agreement.h"
#include "zeroshard/comm/communicator.h"
#include "zeroshard/comm/engine_groups.h"
#include "zeroshard/comm/gather_values.h"
#include "zeroshard/optim/optimizer_step.h"
#include "zeroshard/state/model_state.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace zeroshard {
namespace {

namespace fs = std::filesystem;

// This rank's shard of one state tensor of a bucket, on CPU (zeros where no parameter lies).
// Stage 0 holds everything and saves its shard only, so that ranks write in parallel.
at::Tensor savedShard(const CheckpointedState& s, size_t bucket, size_t kind) {
  const ShardRange shard = s.buckets[bucket].layout().shardRange(s.shardRank);
  const ShardRange held = heldRange(s, bucket);
  at::Tensor out = at::zeros({shard.numel()}, at::TensorOptions().dtype(at::kFloat));
  for (const auto& slot : s.slots[bucket]) {
    const int64_t begin = std::max(held.begin + slot.offset, shard.begin);
    const int64_t end = std::min(held.begin + slot.offset + slot.numel, shard.end);
    if (begin >= end) continue;
    const at::Tensor state = kindOf(s.optimizer.shardState(slot.group, slot.index), kind);
    out.narrow(0, begin - shard.begin, end - begin)
        .copy_(state.narrow(0, begin - held.begin - slot.offset, end - begin));
  }
  return out;
}

FileDigest writeRankFile(const CheckpointedState& s, const std::string& dir, Progress& progress) {
  const int rank = s.shardRank;
  const std::string name = CheckpointManifest::rankFileName(rank);
  std::vector<TensorEntry> entries;
  for (size_t b = 0; b < s.buckets.size(); ++b) {
    for (const char* kind : kStateKinds) {
      entries.push_back({CheckpointManifest::stateTensorName(static_cast<int>(b), kind), at::kFloat,
                         {s.buckets[b].layout().shardNumel()}});
    }
  }
  SafetensorsWriter writer((fs::path(dir) / name).string(), std::move(entries),
                           {{"format", "pt"}, {"zeroshard_rank", std::to_string(rank)}});
  for (size_t b = 0; b < s.buckets.size(); ++b) {
    for (size_t kind = 0; kind < kNumKinds; ++kind) {
      const at::Tensor shard = savedShard(s, b, kind);
      writer.write(shard);
      progress.advance(static_cast<int64_t>(shard.nbytes()));
    }
  }
  return writer.finish(name);
}

// The module-state tensors a save writes, in the file's order: the whole ones, then the frozen
// parameters sharded at stage 3, bucket by bucket (each bucket is gathered once to write them).
// exclude_frozen_parameters leaves every frozen parameter out.
struct SavedModuleState {
  std::vector<size_t> whole;    // indices into ModuleState::tensors
  std::vector<size_t> sharded;  // indices into ModuleState::sharded, by bucket
  std::vector<TensorEntry> entries;
};

SavedModuleState savedModuleState(const CheckpointedState& s, bool excludeFrozen) {
  SavedModuleState out;
  const ModuleState& state = s.moduleState;
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    const auto& [name, t] = state.tensors[i];
    if (excludeFrozen && state.isFrozen(name)) continue;
    out.whole.push_back(i);
    out.entries.push_back({name, t.scalar_type(), t.sizes().vec()});
  }
  if (!excludeFrozen) {
    for (size_t i = 0; i < state.sharded.size(); ++i) out.sharded.push_back(i);
    std::stable_sort(out.sharded.begin(), out.sharded.end(),
                     [&](size_t a, size_t b) { return state.sharded[a].bucket < state.sharded[b].bucket; });
    for (size_t i : out.sharded) {
      const auto& entry = state.sharded[i];
      const Bucket& bucket = s.frozenBuckets.at(entry.bucket);
      out.entries.push_back({entry.name, bucket.flatParams().scalar_type(), bucket.layout().params()[entry.param].shape});
    }
  }
  return out;
}

CheckpointManifest manifestOf(const CheckpointedState& s, const std::string& tag, int64_t boundaries,
                              const std::vector<std::string>& digestTexts, const SavedModuleState& saved,
                              bool excludeFrozen) {
  CheckpointManifest m;
  m.tag = tag;
  m.worldSize = s.shardCount;
  m.stage = static_cast<int>(s.plan.stage());
  m.computeDtype = s.computeDtype;
  m.globalSteps = s.optimizer.stepCount();
  m.boundaries = boundaries;
  m.skippedSteps = s.skippedSteps;
  if (s.scaler) m.lossScaler = s.scaler->state();
  if (s.schedule) m.lrSchedule = SavedSchedule{s.schedule->type(), s.schedule->lastBatchIteration()};
  m.batch = SavedBatch{s.batch.train, s.batch.microPerRank, s.batch.accumulationSteps, s.comm.worldSize()};
  m.configJson = s.config.toJsonString();
  for (int g = 0; g < s.optimizer.numGroups(); ++g) m.groups.push_back(s.optimizer.hyper(g));
  for (size_t b = 0; b < s.buckets.size(); ++b) {
    const auto& layout = s.buckets[b].layout();
    m.buffers.push_back(SavedBuffer{layout.numel(), layout.shardNumel()});
    for (size_t i = 0; i < layout.params().size(); ++i) {
      const auto& p = layout.params()[i];
      m.params.push_back(SavedParam{p.name, p.shape, s.buckets[b].paramGroupOf(i), static_cast<int>(b), p.offset});
    }
  }
  m.aliases = s.moduleState.aliases;
  for (const auto& e : saved.entries) m.moduleState.push_back({e.name, e.shape, e.dtype});
  for (const auto& key : s.moduleState.keys) {
    if (!(excludeFrozen && s.moduleState.isFrozen(key))) m.stateDictKeys.push_back(key);
  }
  m.frozenExcluded = excludeFrozen;
  for (const auto& text : digestTexts) {
    for (auto& d : digestsFromJson(text)) m.files.push_back(std::move(d));
  }
  m.createdUnixNs = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::system_clock::now().time_since_epoch())
                        .count();
  return m;
}

} // namespace

CheckpointedState checkpointedState(const Config& config, const BatchSizes& batch, EngineGroups& groups,
                                    ModelState& model, OptimizerStep& step, AccumulationWindow& window) {
  return {config,
          model.plan(),
          groups.world(),
          model.computeDtype(),
          model.buckets(),
          model.slots(),
          model.optimizer(),
          step.scaler(),
          model.moduleState(),
          model.frozenBuckets(),
          [&model](size_t frozenBucket, const std::function<void()>& use) { model.withFrozenWhole(frozenBucket, use); },
          window,
          step.skippedSteps(),
          step.schedule(),
          groups.shard().rank(),
          groups.shard().worldSize(),
          batch};
}

std::string saveCheckpoint(CheckpointedState s, const std::string& dir, const std::string& tagIn,
                           const std::string& clientState, const std::string& rankError, bool excludeFrozen) {
  const UncountedCollectives uncounted(s.comm);
  const int rank = s.comm.rank();
  const int64_t boundaries = s.window.boundaries();
  const std::string tag = tagIn.empty() ? defaultTag(boundaries) : tagIn;
  checkTag(tag);
  const std::string staging = stagingPath(dir, tag);
  const std::string what = "checkpoint: saving '" + checkpointPath(dir, tag) + "'";
  const std::string outcome = "nothing was published; the previous checkpoints and 'latest' are as they were";
  const auto device = deviceOf(s);
  const SavedModuleState saved = savedModuleState(s, excludeFrozen);
  // Rank 0's share (Note [progress where a person watches]): its shard file, then the module state.
  Progress progress("save '" + tag + "'", static_cast<int64_t>(kNumKinds * s.buckets.size() + saved.entries.size()),
                    "tensors", terminalProgress(rank));
  std::optional<SafetensorsWriter> moduleWriter;
  std::string writeError;  // rank 0's, while the frozen buckets are gathered (Note [streamed export])

  try {
    agreeAcrossRanks(s.comm, device, what, outcome, [&] {
      TORCH_CHECK(rankError.empty(), rankError);
      if (rank == 0) prepareStaging(dir, tag);
    });
    std::vector<FileDigest> digests;
    agreeAcrossRanks(s.comm, device, what, outcome, [&] {
      // The first shard group's ranks hold every shard once (the other groups' are copies).
      if (rank < s.shardCount) digests.push_back(writeRankFile(s, staging, progress));
      if (rank != 0) return;
      if (!saved.entries.empty()) {
        moduleWriter.emplace((fs::path(staging) / kModuleStateFile).string(), saved.entries,
                             std::map<std::string, std::string>{{"format", "pt"}});
        for (size_t i : saved.whole) {
          const at::Tensor& t = s.moduleState.tensors[i].second;
          moduleWriter->write(t.detach());
          progress.advance(static_cast<int64_t>(t.nbytes()));
        }
      }
      if (!clientState.empty()) {
        digests.push_back(writeCheckedFile((fs::path(staging) / kClientStateFile).string(), kClientStateFile, clientState));
      }
    });
    // Stage 3's sharded frozen parameters: every rank takes part in each bucket's gather, rank 0
    // writes; a write error does not stop it taking part in the rest (the others would wait).
    for (size_t k = 0; k < saved.sharded.size();) {
      const size_t bucket = s.moduleState.sharded[saved.sharded[k]].bucket;
      size_t end = k;
      while (end < saved.sharded.size() && s.moduleState.sharded[saved.sharded[end]].bucket == bucket) ++end;
      s.withFrozenWhole(bucket, [&] {
        if (rank != 0 || !writeError.empty()) return;
        try {
          for (size_t i = k; i < end; ++i) {
            const auto& entry = s.moduleState.sharded[saved.sharded[i]];
            const at::Tensor t = s.frozenBuckets[bucket].params()[entry.param].detach();
            moduleWriter->write(t);
            progress.advance(static_cast<int64_t>(t.nbytes()));
          }
        } catch (const std::exception& e) {
          writeError = e.what();
        }
      });
      k = end;
    }
    agreeAcrossRanks(s.comm, device, what, outcome, [&] {
      if (rank != 0) return;
      TORCH_CHECK(writeError.empty(), writeError);
      if (moduleWriter) digests.push_back(moduleWriter->finish(kModuleStateFile));
      moduleWriter.reset();
    });
    const auto texts = allGatherText(s.comm, digestsToJson(digests), device);
    agreeAcrossRanks(s.comm, device, what, outcome, [&] {
      if (rank != 0) return;
      writeCheckedFile((fs::path(staging) / kManifestFile).string(), kManifestFile,
                       manifestOf(s, tag, boundaries, texts, saved, excludeFrozen).toJsonText());
      publishCheckpoint(dir, tag);
      const int64_t keep = s.config.extras.checkpointKeepLast;
      try {
        pruneCheckpoints(dir, keep, tag);
      } catch (const std::exception& e) {
        // The new checkpoint is complete and `latest` names it: a stale one left over is no failure.
        TORCH_WARN("zeroshard checkpoint: saved '", checkpointPath(dir, tag), "' but removing older checkpoints (",
                   "zeroshard.checkpoint.keep_last = ", keep, ") failed: ", e.what());
      }
    });
  } catch (const AgreedFailure&) {
    moduleWriter.reset();
    // Every rank answered, so every rank has stopped writing: a failed save, a full disk's above
    // all, gives its space back at once. Not so when a rank stopped answering (it may still
    // write): its staging directory is left to the next save (Note [crash-safe publish]).
    if (rank == 0) discardStaging(dir, tag);
    throw;
  }
  progress.finish();
  return checkpointPath(dir, tag);
}

} // namespace zeroshard
