// loadCheckpoint (engine_checkpoint.h): the manifest is checked against this engine and each of
// this rank's held ranges read by parameter name (reader.h), whatever world size and stage saved
// it, all into CPU tensors before anything changes. The save side is in engine_checkpoint.cpp.
#include "zeroshard/checkpoint/engine_checkpoint.h"

#include <ATen/ops/zeros.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "zeroshard/checkpoint/held_state.h"
#include "zeroshard/checkpoint/manifest.h"
#include "zeroshard/checkpoint/progress.h"
#include "zeroshard/checkpoint/reader.h"
#include "zeroshard/checkpoint/safetensors.h"
#include "zeroshard/comm/agreement.h"
#include "zeroshard/comm/communicator.h"

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace zeroshard {
namespace {

namespace fs = std::filesystem;

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
