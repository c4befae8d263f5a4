// Engine checkpoints: every rank writes its own shards of the fp32 master weights and AdamW
// state; rank 0 adds the manifest and publishes (checkpoint_dir.h). Loading maps each of this
// rank's flat ranges back to parameters by name, so the saving world size and stage do not
// matter (checkpoint_reader.h).
#include "zeroshard/engine.h"

#include <ATen/ops/zeros.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "zeroshard/checkpoint/directory.h"
#include "zeroshard/checkpoint/manifest.h"
#include "zeroshard/checkpoint/reader.h"
#include "zeroshard/comm/gather_values.h"
#include "zeroshard/checkpoint/safetensors.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <unordered_map>
#include <unordered_set>

namespace zeroshard {
namespace {

namespace fs = std::filesystem;

constexpr size_t kNumKinds = std::size(kStateKinds);

at::Tensor kindOf(const ShardedAdamW::ShardState& state, size_t kind) {
  return kind == 0 ? state.master : kind == 1 ? state.expAvg : state.expAvgSq;
}


} // namespace

void Engine::setModuleState(ModuleState state) {
  std::unordered_set<std::string> trained;
  for (const auto& b : buckets_) {
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
  moduleState_ = std::move(state);
}

ShardRange Engine::heldRange(size_t bucket) const {
  const auto& layout = buckets_[bucket].layout();
  return plan_.optimizerSharded() ? layout.shardRange(rank()) : ShardRange{0, layout.paddedNumel()};
}

// This rank's shard of one state tensor of a bucket, on CPU (zeros where no parameter lies).
// Stage 0 holds everything and saves its shard only, so that ranks write in parallel.
at::Tensor Engine::savedShard(size_t bucket, size_t kind) const {
  const ShardRange shard = buckets_[bucket].layout().shardRange(rank());
  const ShardRange held = heldRange(bucket);
  at::Tensor out = at::zeros({shard.numel()}, at::TensorOptions().dtype(at::kFloat));
  for (const auto& slot : slots_[bucket]) {
    const int64_t begin = std::max(held.begin + slot.offset, shard.begin);
    const int64_t end = std::min(held.begin + slot.offset + slot.numel, shard.end);
    if (begin >= end) continue;
    const at::Tensor state = kindOf(optimizer_.shardState(slot.group, slot.index), kind);
    out.narrow(0, begin - shard.begin, end - begin)
        .copy_(state.narrow(0, begin - held.begin - slot.offset, end - begin));
  }
  return out;
}

FileDigest Engine::writeRankFile(const std::string& dir) const {
  const std::string name = CheckpointManifest::rankFileName(rank());
  std::vector<TensorEntry> entries;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    for (const char* kind : kStateKinds) {
      entries.push_back({CheckpointManifest::stateTensorName(static_cast<int>(b), kind), at::kFloat,
                         {buckets_[b].layout().shardNumel()}});
    }
  }
  SafetensorsWriter writer((fs::path(dir) / name).string(), std::move(entries),
                           {{"format", "pt"}, {"zeroshard_rank", std::to_string(rank())}});
  for (size_t b = 0; b < buckets_.size(); ++b) {
    for (size_t kind = 0; kind < kNumKinds; ++kind) writer.write(savedShard(b, kind));
  }
  return writer.finish(name);
}

// Note [checkpoint agreement]: each phase of a save or load ends with every rank learning
// whether every other rank succeeded (one all-reduce of per-rank failure flags). A rank's
// error then fails the call on all ranks, instead of one rank raising while the others carry
// on to a collective that never completes; a dead rank surfaces as this all-reduce's error.
// `outcome` says what a failure leaves behind ("nothing was published").
void Engine::agreeAcrossRanks(const std::string& what, const std::string& outcome,
                              const std::function<void()>& work) {
  std::string error;
  try {
    work();
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
    if (error.empty()) error = "unknown error";
  } catch (const std::exception& e) {
    error = e.what();
    if (error.empty()) error = "unknown error";
  }
  const auto device = buckets_.front().flatParams().device();
  auto failed = at::zeros({worldSize()}, at::TensorOptions().dtype(at::kFloat).device(device));
  if (!error.empty()) failed[rank()].fill_(1);
  try {
    comm_.allReduce(failed).wait();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "zeroshard checkpoint: ", what, " failed: another rank stopped answering (",
                e.what_without_backtrace(), ")", error.empty() ? "" : "; this rank's own error: " + error, "; ",
                outcome);
  }
  const auto flags = failed.to(at::kCPU);
  std::vector<int> ranks;
  for (int r = 0; r < worldSize(); ++r) {
    if (flags[r].item<float>() > 0) ranks.push_back(r);
  }
  if (ranks.empty()) return;
  TORCH_CHECK(error.empty(), "zeroshard checkpoint: ", what, " failed on rank ", rank(), ": ", error, "; ", outcome);
  std::string list;
  for (int r : ranks) list += (list.empty() ? "" : ", ") + std::to_string(r);
  TORCH_CHECK(false, "zeroshard checkpoint: ", what, " failed on rank(s) ", list, " (their errors say why); ",
              outcome);
}

std::string Engine::saveCheckpoint(const std::string& dir, const std::string& tagIn, const std::string& clientState,
                                   const std::string& rankError) {
  const int64_t accumulation = batchSizes_.accumulationSteps;
  TORCH_CHECK(!backwardSinceStep_ && microSteps_ % accumulation == 0,
              "zeroshard: save_checkpoint() must be called between optimizer steps (after engine.step() ended an "
              "accumulation window); gradients of a partial window are not saved");
  const UncountedCollectives uncounted(comm_);
  const int64_t boundaries = microSteps_ / accumulation;
  const std::string tag = tagIn.empty() ? defaultTag(boundaries) : tagIn;
  checkTag(tag);
  const std::string staging = stagingPath(dir, tag);
  const std::string what = "saving '" + checkpointPath(dir, tag) + "'";
  const std::string outcome = "nothing was published; the previous checkpoints and 'latest' are as they were";

  agreeAcrossRanks(what, outcome, [&] {
    TORCH_CHECK(rankError.empty(), rankError);
    if (rank() == 0) prepareStaging(dir, tag);
  });
  std::vector<FileDigest> digests;
  agreeAcrossRanks(what, outcome, [&] {
    digests.push_back(writeRankFile(staging));
    if (rank() != 0) return;
    if (!moduleState_.tensors.empty()) {
      std::vector<TensorEntry> entries;
      for (const auto& [name, t] : moduleState_.tensors) entries.push_back({name, t.scalar_type(), t.sizes().vec()});
      SafetensorsWriter writer((fs::path(staging) / kModuleStateFile).string(), std::move(entries), {{"format", "pt"}});
      for (const auto& [name, t] : moduleState_.tensors) writer.write(t.detach());
      digests.push_back(writer.finish(kModuleStateFile));
    }
    if (!clientState.empty()) {
      digests.push_back(writeCheckedFile((fs::path(staging) / kClientStateFile).string(), kClientStateFile, clientState));
    }
  });
  const auto texts = allGatherText(comm_, digestsToJson(digests), buckets_.front().flatParams().device());
  agreeAcrossRanks(what, outcome, [&] {
    if (rank() != 0) return;
    CheckpointManifest m;
    m.tag = tag;
    m.worldSize = worldSize();
    m.stage = static_cast<int>(plan_.stage());
    m.computeDtype = computeDtype_;
    m.globalSteps = optimizer_.stepCount();
    m.boundaries = boundaries;
    m.skippedSteps = skippedSteps_;
    if (scaler_) m.lossScaler = scaler_->state();
    m.configJson = config_.toJsonString();
    for (int g = 0; g < optimizer_.numGroups(); ++g) m.groups.push_back(optimizer_.hyper(g));
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const auto& layout = buckets_[b].layout();
      m.buffers.push_back(SavedBuffer{layout.numel(), layout.shardNumel()});
      for (size_t i = 0; i < layout.params().size(); ++i) {
        const auto& p = layout.params()[i];
        m.params.push_back(SavedParam{p.name, p.shape, buckets_[b].paramGroupOf(i), static_cast<int>(b), p.offset});
      }
    }
    m.aliases = moduleState_.aliases;
    for (const auto& [name, t] : moduleState_.tensors) m.moduleState.push_back({name, t.sizes().vec(), t.scalar_type()});
    m.stateDictKeys = moduleState_.keys;
    for (const auto& text : texts) {
      for (auto& d : digestsFromJson(text)) m.files.push_back(std::move(d));
    }
    m.createdUnixNs = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
    writeCheckedFile((fs::path(staging) / kManifestFile).string(), kManifestFile, m.toJsonText());
    publishCheckpoint(dir, tag);
    try {
      pruneCheckpoints(dir, config_.extras.checkpointKeepLast, tag);
    } catch (const std::exception& e) {
      // The new checkpoint is complete and `latest` names it: a stale one left over is no failure.
      TORCH_WARN("zeroshard checkpoint: saved '", checkpointPath(dir, tag), "' but removing older checkpoints (",
                 "zeroshard.checkpoint.keep_last = ", config_.extras.checkpointKeepLast, ") failed: ", e.what());
    }
  });
  return checkpointPath(dir, tag);
}

void Engine::checkCheckpointMatches(const CheckpointManifest& m, bool sameGroups) const {
  const std::string where = "checkpoint '" + m.tag + "'";
  std::unordered_map<std::string, const SavedParam*> saved;
  for (const auto& p : m.params) saved[p.name] = &p;
  size_t matched = 0;
  for (const auto& b : buckets_) {
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
    for (const auto& b : buckets_) {
      for (const auto& p : b.layout().params()) here.insert(p.name);
    }
    for (const auto& p : m.params) {
      TORCH_CHECK(here.count(p.name), "zeroshard: ", where, " holds parameter '", p.name,
                  "', which this model does not train; the checkpoint is from another model");
    }
  }
  TORCH_CHECK(!sameGroups || static_cast<int>(m.groups.size()) == optimizer_.numGroups(), "zeroshard: ", where,
              " has ", m.groups.size(), " param groups, this engine ", optimizer_.numGroups(),
              " (to take only the weights, load without optimizer states)");
  std::unordered_map<std::string, const SavedTensor*> savedState;
  for (const auto& t : m.moduleState) savedState[t.name] = &t;
  for (const auto& [name, t] : moduleState_.tensors) {
    auto it = savedState.find(name);
    TORCH_CHECK(it != savedState.end(), "zeroshard: module state '", name, "' (a buffer or frozen parameter) is not in ",
                where);
    TORCH_CHECK(it->second->shape == t.sizes().vec() && it->second->dtype == t.scalar_type(),
                "zeroshard: module state '", name, "' is ", dtypeName(t.scalar_type()), " ",
                t.sizes(), " here but ", dtypeName(it->second->dtype), " ",
                c10::IntArrayRef(it->second->shape), " in ", where);
  }
}

LoadedCheckpoint Engine::loadCheckpoint(const std::string& dir, const std::string& tag, const LoadOptions& options) {
  const int64_t accumulation = batchSizes_.accumulationSteps;
  TORCH_CHECK(!backwardSinceStep_ && microSteps_ % accumulation == 0,
              "zeroshard: load_checkpoint() must be called between optimizer steps, not inside an accumulation "
              "window");
  const UncountedCollectives uncounted(comm_);
  std::unique_ptr<CheckpointReader> reader;
  // Everything is read (and checked) into CPU tensors before anything changes: an error leaves
  // this engine exactly as it was, on every rank (Note [checkpoint agreement]).
  std::vector<std::vector<at::Tensor>> staged(buckets_.size());
  std::vector<at::Tensor> moduleTensors;
  std::string clientState;
  agreeAcrossRanks("loading from '" + dir + "'", "no rank changed anything", [&] {
    TORCH_CHECK(options.rankError.empty(), options.rankError);
    reader = std::make_unique<CheckpointReader>(dir, tag.empty() ? std::nullopt : std::optional<std::string>(tag));
    checkCheckpointMatches(reader->manifest(), options.optimizerStates);
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const ShardRange held = heldRange(b);
      for (size_t kind = 0; kind < (options.optimizerStates ? kNumKinds : 1); ++kind) {
        at::Tensor values = at::zeros({held.numel()}, at::TensorOptions().dtype(at::kFloat));
        for (const auto& p : buckets_[b].layout().params()) {
          const int64_t begin = std::max(p.offset, held.begin);
          const int64_t end = std::min(p.offset + p.numel, held.end);
          if (begin >= end) continue;
          reader->readParam(*reader->findParam(p.name), kStateKinds[kind], begin - p.offset, end - p.offset,
                            values.data_ptr<float>() + (begin - held.begin));
        }
        staged[b].push_back(values);
      }
    }
    for (const auto& [name, t] : moduleState_.tensors) moduleTensors.push_back(reader->readModuleState(name));
    clientState = reader->readClientState();
  });

  const CheckpointManifest& m = reader->manifest();
  {
    at::NoGradGuard noGrad;
    if (units_) units_->reshardAll();
    for (size_t b = 0; b < buckets_.size(); ++b) {
      for (const auto& slot : slots_[b]) {
        const auto state = optimizer_.shardState(slot.group, slot.index);
        for (size_t kind = 0; kind < staged[b].size(); ++kind) {
          kindOf(state, kind).copy_(staged[b][kind].narrow(0, slot.offset, slot.numel));
        }
      }
    }
    for (size_t i = 0; i < moduleTensors.size(); ++i) moduleState_.tensors[i].second.detach().copy_(moduleTensors[i]);
  }
  if (options.optimizerStates) {
    optimizer_.setStepCount(m.globalSteps);
    // As torch's optimizer.load_state_dict: the saved hyper-parameters (a scheduler's lr
    // included) win over the config's (docs/checkpoints.md).
    for (int g = 0; g < optimizer_.numGroups(); ++g) optimizer_.hyper(g) = m.groups[g];
    if (scaler_ && m.lossScaler) scaler_->restore(*m.lossScaler);
    skippedSteps_ = m.skippedSteps;
    microSteps_ = m.boundaries * accumulation;
  }
  for (auto& b : buckets_) b.pushMasterToParams();
  gatherParams();
  zeroGrads();
  return {reader->path(), m.tag, clientState};
}

} // namespace zeroshard
