#include "zeroshard/checkpoint/engine_checkpoint.h"

#include <ATen/ops/zeros.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "zeroshard/checkpoint/directory.h"
#include "zeroshard/checkpoint/manifest.h"
#include "zeroshard/checkpoint/reader.h"
#include "zeroshard/checkpoint/safetensors.h"
#include "zeroshard/comm/agreement.h"
#include "zeroshard/comm/gather_values.h"
#include "zeroshard/checkpoint/progress.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <memory>
#include <map>
#include <optional>
#include <unordered_map>
#include <unordered_set>

namespace zeroshard {
namespace {

namespace fs = std::filesystem;

constexpr size_t kNumKinds = std::size(kStateKinds);

at::Tensor kindOf(const ShardedAdamW::ShardState& state, size_t kind) {
  return kind == 0 ? state.master : kind == 1 ? state.expAvg : state.expAvgSq;
}

c10::Device deviceOf(const CheckpointedState& s) {
  return s.buckets.front().flatParams().device();
}

// The range of a bucket's flat buffer this rank holds master weights and AdamW state for.
ShardRange heldRange(const CheckpointedState& s, size_t bucket) {
  const auto& layout = s.buckets[bucket].layout();
  return s.plan.optimizerSharded() ? layout.shardRange(s.shardRank) : ShardRange{0, layout.paddedNumel()};
}

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


void checkCheckpointMatches(const CheckpointedState& s, const CheckpointManifest& m, bool sameGroups) {
  const std::string where = "checkpoint '" + m.tag + "'";
  std::unordered_map<std::string, const SavedParam*> saved;
  for (const auto& p : m.params) saved[p.name] = &p;
  size_t matched = 0;
  for (const auto& b : s.buckets) {
    for (size_t i = 0; i < b.layout().params().size(); ++i) {
      const auto& p = b.layout().params()[i];
      auto it = saved.find(p.name);
      TORCH_CHECK(it != saved.end(), "zeroshard: parameter '", p.name, "' of this model is not in ", where,
                  " (it holds ", m.params.size(), " parameters); the checkpoint is from another model");
      TORCH_CHECK(it->second->shape == p.shape, "zeroshard: parameter '", p.name, "' has shape ",
                  c10::IntArrayRef(p.shape), " here but ", c10::IntArrayRef(it->second->shape), " in ", where);
      TORCH_CHECK(!sameGroups || it->second->group == b.paramGroupOf(i), "zeroshard: parameter '", p.name,
                  "' is in param group ",
                  b.paramGroupOf(i), " here but in group ", it->second->group, " in ", where,
                  "; build the param groups as the saving run did");
      ++matched;
    }
  }
  if (matched != m.params.size()) {
    std::unordered_set<std::string> here;
    for (const auto& b : s.buckets) {
      for (const auto& p : b.layout().params()) here.insert(p.name);
    }
    for (const auto& p : m.params) {
      TORCH_CHECK(here.count(p.name), "zeroshard: ", where, " holds parameter '", p.name,
                  "', which this model does not train; the checkpoint is from another model");
    }
  }
  TORCH_CHECK(!sameGroups || static_cast<int>(m.groups.size()) == s.optimizer.numGroups(), "zeroshard: ", where,
              " has ", m.groups.size(), " param groups, this engine ", s.optimizer.numGroups(),
              " (to take only the weights, load without optimizer states)");
  std::unordered_map<std::string, const SavedTensor*> savedState;
  for (const auto& t : m.moduleState) savedState[t.name] = &t;
  const auto check = [&](const std::string& name, const std::vector<int64_t>& shape, at::ScalarType dtype) {
    if (m.frozenExcluded && s.moduleState.isFrozen(name)) return;  // kept as this engine has it
    auto it = savedState.find(name);
    TORCH_CHECK(it != savedState.end(), "zeroshard: module state '", name, "' (a buffer or frozen parameter) is not in ",
                where);
    TORCH_CHECK(it->second->shape == shape && it->second->dtype == dtype, "zeroshard: module state '", name, "' is ",
                dtypeName(dtype), " ", c10::IntArrayRef(shape), " here but ", dtypeName(it->second->dtype), " ",
                c10::IntArrayRef(it->second->shape), " in ", where);
  };
  for (const auto& [name, t] : s.moduleState.tensors) check(name, t.sizes().vec(), t.scalar_type());
  for (const auto& entry : s.moduleState.sharded) {
    const Bucket& bucket = s.frozenBuckets.at(entry.bucket);
    check(entry.name, bucket.layout().params()[entry.param].shape, bucket.flatParams().scalar_type());
  }
}

// This rank's shard of frozen bucket b from a checkpoint's module state, on CPU: each of its
// parameters' element ranges read from the whole tensor saved under one of its names.
at::Tensor readFrozenShard(const CheckpointedState& s, CheckpointReader& reader, size_t b) {
  const Bucket& bucket = s.frozenBuckets[b];
  const auto& layout = bucket.layout();
  at::Tensor shard = at::zeros({layout.shardNumel()}, at::TensorOptions().dtype(bucket.flatParams().scalar_type()));
  std::vector<const std::string*> nameOf(bucket.size(), nullptr);
  for (const auto& entry : s.moduleState.sharded) {
    if (entry.bucket == b && !nameOf[entry.param]) nameOf[entry.param] = &entry.name;
  }
  auto* out = static_cast<char*>(shard.data_ptr());
  for (const auto& piece : layout.piecesIn(layout.shardRange(s.shardRank))) {
    TORCH_CHECK(nameOf[piece.param], "zeroshard: frozen parameter '", layout.params()[piece.param].name,
                "' has no state-dict name");
    reader.readModuleStateElements(*nameOf[piece.param], piece.paramBegin, piece.paramEnd - piece.paramBegin,
                                   out + piece.shardOffset * shard.element_size());
  }
  return shard;
}

} // namespace

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

LoadedCheckpoint loadCheckpoint(CheckpointedState s, const std::string& dir, const std::string& tag,
                                const LoadOptions& options) {
  const UncountedCollectives uncounted(s.comm);
  std::unique_ptr<CheckpointReader> reader;
  // Everything is read (and checked) into CPU tensors before anything changes: an error leaves
  // this engine exactly as it was, on every rank (Note [agreement]).
  std::vector<std::vector<at::Tensor>> staged(s.buckets.size());
  std::vector<at::Tensor> moduleTensors;  // undefined: kept (a frozen parameter the checkpoint excluded)
  std::vector<at::Tensor> frozenShards(s.frozenBuckets.size());
  std::string clientState;
  const size_t kinds = options.optimizerStates ? kNumKinds : 1;
  Progress progress("load '" + (tag.empty() ? dir : (fs::path(dir) / tag).string()) + "'",
                    static_cast<int64_t>(kinds * s.buckets.size() + s.moduleState.tensors.size()), "tensors",
                    terminalProgress(s.comm.rank()));
  agreeAcrossRanks(s.comm, deviceOf(s), "checkpoint: loading from '" + dir + "'", "no rank changed anything", [&] {
    TORCH_CHECK(options.rankError.empty(), options.rankError);
    reader = std::make_unique<CheckpointReader>(dir, tag.empty() ? std::nullopt : std::optional<std::string>(tag));
    checkCheckpointMatches(s, reader->manifest(), options.optimizerStates);
    if (options.optimizerStates && s.config.extras.batchGuard == "error") {
      const auto change = batchChange(reader->manifest(), s.batch, s.comm.worldSize());
      TORCH_CHECK(!change, *change, " (zeroshard.batch_guard is \"error\")");
    }
    for (size_t b = 0; b < s.buckets.size(); ++b) {
      const ShardRange held = heldRange(s, b);
      for (size_t kind = 0; kind < (options.optimizerStates ? kNumKinds : 1); ++kind) {
        at::Tensor values = at::zeros({held.numel()}, at::TensorOptions().dtype(at::kFloat));
        const auto& layout = s.buckets[b].layout();
        for (const auto& piece : layout.piecesIn(held)) {
          reader->readParam(*reader->findParam(layout.params()[piece.param].name), kStateKinds[kind], piece.paramBegin,
                            piece.paramEnd, values.data_ptr<float>() + piece.shardOffset);
        }
        staged[b].push_back(values);
        progress.advance(static_cast<int64_t>(values.nbytes()));
      }
    }
    const bool frozenExcluded = reader->manifest().frozenExcluded;
    for (const auto& [name, t] : s.moduleState.tensors) {
      if (frozenExcluded && s.moduleState.isFrozen(name)) {
        moduleTensors.emplace_back();
        continue;
      }
      moduleTensors.push_back(reader->readModuleState(name));
      progress.advance(static_cast<int64_t>(moduleTensors.back().nbytes()));
    }
    for (size_t b = 0; b < frozenShards.size() && !frozenExcluded; ++b) {
      frozenShards[b] = readFrozenShard(s, *reader, b);
    }
    clientState = reader->readClientState();
    if (options.checkClientState) {
      const std::string error = options.checkClientState(clientState);
      TORCH_CHECK(error.empty(), error);
    }
  });

  const CheckpointManifest& m = reader->manifest();
  {
    at::NoGradGuard noGrad;
    for (size_t b = 0; b < s.buckets.size(); ++b) {
      for (const auto& slot : s.slots[b]) {
        const auto state = s.optimizer.shardState(slot.group, slot.index);
        for (size_t kind = 0; kind < staged[b].size(); ++kind) {
          kindOf(state, kind).copy_(staged[b][kind].narrow(0, slot.offset, slot.numel));
        }
      }
    }
    for (size_t i = 0; i < moduleTensors.size(); ++i) {
      if (moduleTensors[i].defined()) s.moduleState.tensors[i].second.detach().copy_(moduleTensors[i]);
    }
    for (size_t b = 0; b < frozenShards.size(); ++b) {
      if (frozenShards[b].defined()) s.frozenBuckets[b].paramShard().copy_(frozenShards[b]);
    }
  }
  if (options.optimizerStates) {
    s.optimizer.setStepCount(m.globalSteps);
    // As torch's optimizer.load_state_dict: the saved hyper-parameters (a scheduler's lr
    // included) win over the config's (docs/checkpoints.md).
    for (int g = 0; g < s.optimizer.numGroups(); ++g) s.optimizer.hyper(g) = m.groups[g];
    if (s.scaler && m.lossScaler) s.scaler->restore(*m.lossScaler);
    s.skippedSteps = m.skippedSteps;
    s.window.restore(m.boundaries);
  }
  if (options.optimizerStates && s.comm.rank() == 0) {
    if (const auto change = batchChange(m, s.batch, s.comm.worldSize())) TORCH_WARN(*change);
  }
  LoadedCheckpoint loaded{reader->path(), m.tag, clientState};
  if (s.schedule && options.loadSchedulerState && m.lrSchedule) {
    // As DeepSpeed's schedulers, whose state_dict is the iteration alone: it is taken whatever
    // the saved type, which only a person can judge.
    if (m.lrSchedule->type != s.schedule->type() && s.comm.rank() == 0) {  // the same on every rank
      TORCH_WARN("zeroshard checkpoint '", m.tag, "': saved with scheduler ", m.lrSchedule->type,
                 ", resumed with ", s.schedule->type(), "; its last_batch_iteration (",
                 m.lrSchedule->lastBatchIteration, ") is taken as it is");
    }
    s.schedule->restore(m.lrSchedule->lastBatchIteration);
    loaded.schedulerStateLoaded = true;
  }
  progress.finish();
  return loaded;
}

} // namespace zeroshard
