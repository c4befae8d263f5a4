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
#include "zeroshard/progress.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <memory>
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

CheckpointManifest manifestOf(const CheckpointedState& s, const std::string& tag, int64_t boundaries,
                              const std::vector<std::string>& digestTexts) {
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
  for (const auto& [name, t] : s.moduleState.tensors) m.moduleState.push_back({name, t.sizes().vec(), t.scalar_type()});
  m.stateDictKeys = s.moduleState.keys;
  for (const auto& text : digestTexts) {
    for (auto& d : digestsFromJson(text)) m.files.push_back(std::move(d));
  }
  m.createdUnixNs = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::system_clock::now().time_since_epoch())
                        .count();
  return m;
}

std::string describeBatch(int64_t train, int64_t micro, int64_t accumulation, int64_t world) {
  return std::to_string(train) + " (" + std::to_string(micro) + " per rank x " + std::to_string(accumulation) +
         " accumulation step" + (accumulation == 1 ? "" : "s") + " x " + std::to_string(world) + " rank" +
         (world == 1 ? "" : "s") + ")";
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
  for (const auto& [name, t] : s.moduleState.tensors) {
    auto it = savedState.find(name);
    TORCH_CHECK(it != savedState.end(), "zeroshard: module state '", name, "' (a buffer or frozen parameter) is not in ",
                where);
    TORCH_CHECK(it->second->shape == t.sizes().vec() && it->second->dtype == t.scalar_type(),
                "zeroshard: module state '", name, "' is ", dtypeName(t.scalar_type()), " ",
                t.sizes(), " here but ", dtypeName(it->second->dtype), " ",
                c10::IntArrayRef(it->second->shape), " in ", where);
  }
}

} // namespace

ModuleState moduleStateOf(const std::vector<std::pair<std::string, at::Tensor>>& stateDict,
                          const std::vector<Bucket>& buckets) {
  std::unordered_map<const void*, const std::string*> trained;
  for (const auto& b : buckets) {
    for (size_t i = 0; i < b.size(); ++i) trained.emplace(b.params()[i].unsafeGetTensorImpl(), &b.layout().params()[i].name);
  }
  ModuleState state;
  for (const auto& [key, tensor] : stateDict) {
    state.keys.push_back(key);
    auto it = tensor.defined() ? trained.find(tensor.unsafeGetTensorImpl()) : trained.end();
    if (it == trained.end()) {
      state.tensors.emplace_back(key, tensor);
    } else if (*it->second != key) {
      state.aliases.emplace_back(key, *it->second);
    }
  }
  return state;
}

void checkModuleState(const ModuleState& state, const std::vector<Bucket>& buckets) {
  std::unordered_set<std::string> trained;
  for (const auto& b : buckets) {
    for (const auto& p : b.layout().params()) trained.insert(p.name);
  }
  std::unordered_set<std::string> known(trained);
  for (const auto& [name, tensor] : state.tensors) {
    TORCH_CHECK(tensor.defined(), "zeroshard: module state '", name, "' is undefined");
    TORCH_CHECK(known.insert(name).second, "zeroshard: module state '", name,
                "' is also a trained parameter or appears twice");
  }
  for (const auto& [alias, target] : state.aliases) {
    TORCH_CHECK(trained.count(target), "zeroshard: state-dict name '", alias, "' refers to '", target,
                "', which is not a trained parameter");
    TORCH_CHECK(known.insert(alias).second, "zeroshard: state-dict name '", alias, "' appears twice");
  }
  for (const auto& key : state.keys) {
    TORCH_CHECK(known.count(key), "zeroshard: state-dict name '", key,
                "' is neither a trained parameter, an alias nor a module-state tensor");
  }
}

std::string saveCheckpoint(CheckpointedState s, const std::string& dir, const std::string& tagIn,
                           const std::string& clientState, const std::string& rankError) {
  const UncountedCollectives uncounted(s.comm);
  const int rank = s.comm.rank();
  const int64_t boundaries = s.microSteps / s.accumulationSteps;
  const std::string tag = tagIn.empty() ? defaultTag(boundaries) : tagIn;
  checkTag(tag);
  const std::string staging = stagingPath(dir, tag);
  const std::string what = "checkpoint: saving '" + checkpointPath(dir, tag) + "'";
  const std::string outcome = "nothing was published; the previous checkpoints and 'latest' are as they were";
  const auto device = deviceOf(s);
  // Rank 0's share (Note [progress where a person watches]): its shard file, then the module state.
  Progress progress("save '" + tag + "'",
                    static_cast<int64_t>(kNumKinds * s.buckets.size() + s.moduleState.tensors.size()), "tensors",
                    terminalProgress(rank));

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
      const auto& tensors = s.moduleState.tensors;
      if (!tensors.empty()) {
        std::vector<TensorEntry> entries;
        for (const auto& [name, t] : tensors) entries.push_back({name, t.scalar_type(), t.sizes().vec()});
        SafetensorsWriter writer((fs::path(staging) / kModuleStateFile).string(), std::move(entries), {{"format", "pt"}});
        for (const auto& [name, t] : tensors) {
          writer.write(t.detach());
          progress.advance(static_cast<int64_t>(t.nbytes()));
        }
        digests.push_back(writer.finish(kModuleStateFile));
      }
      if (!clientState.empty()) {
        digests.push_back(writeCheckedFile((fs::path(staging) / kClientStateFile).string(), kClientStateFile, clientState));
      }
    });
    const auto texts = allGatherText(s.comm, digestsToJson(digests), device);
    agreeAcrossRanks(s.comm, device, what, outcome, [&] {
      if (rank != 0) return;
      writeCheckedFile((fs::path(staging) / kManifestFile).string(), kManifestFile,
                       manifestOf(s, tag, boundaries, texts).toJsonText());
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
  std::vector<at::Tensor> moduleTensors;
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
    for (const auto& [name, t] : s.moduleState.tensors) {
      moduleTensors.push_back(reader->readModuleState(name));
      progress.advance(static_cast<int64_t>(moduleTensors.back().nbytes()));
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
    for (size_t i = 0; i < moduleTensors.size(); ++i) s.moduleState.tensors[i].second.detach().copy_(moduleTensors[i]);
  }
  if (options.optimizerStates) {
    s.optimizer.setStepCount(m.globalSteps);
    // As torch's optimizer.load_state_dict: the saved hyper-parameters (a scheduler's lr
    // included) win over the config's (docs/checkpoints.md).
    for (int g = 0; g < s.optimizer.numGroups(); ++g) s.optimizer.hyper(g) = m.groups[g];
    if (s.scaler && m.lossScaler) s.scaler->restore(*m.lossScaler);
    s.skippedSteps = m.skippedSteps;
    s.microSteps = m.boundaries * s.accumulationSteps;
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
