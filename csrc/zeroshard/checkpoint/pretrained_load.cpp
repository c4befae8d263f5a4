// loadPretrained: a Hugging Face-style safetensors checkpoint read into the sharded model state
// (pretrained.h finds the files and matches the names; Engine::loadPretrained).
//
// Note [pretrained reads]: each rank reads, for each trained parameter, only the elements some
// copy of it on this rank holds (ParamTargets::needed): at stage 3 the elements in its shard
// (plus persistent parameters whole), below stage 3 every parameter whole, as those ranks
// keep them. The range is read with pread straight from the file and converted to fp32 on
// the way (SafetensorsFile::readFloat), so one parameter's range in fp32 is the most this adds
// to memory; then it is written as setParameters writes an fp32 value. Everything is checked
// first (headers, byte ranges, names, shapes) and agreed across ranks (Note [agreement]), so a
// file that does not fit changes nothing on any rank; only an I/O error after the check (a file
// changed while being read) can leave a partial load, and it is reported on every rank.
#include "zeroshard/checkpoint/pretrained.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "zeroshard/comm/agreement.h"
#include "zeroshard/comm/communicator.h"
#include "zeroshard/layout/param_targets.h"
#include "zeroshard/checkpoint/progress.h"
#include "zeroshard/state/model_state.h"

#include <algorithm>
#include <memory>

namespace zeroshard {

PretrainedLoad loadPretrained(ModelState& model, Communicator& world, Communicator& shardComm, const std::string& path,
                              bool strict, const TensorRenames& renames) {
  const UncountedCollectives uncounted(world);
  const UncountedCollectives uncountedShards(shardComm);
  const c10::Device device = model.device();
  const std::vector<Bucket>& buckets = model.buckets();
  const std::vector<Bucket>& frozenBuckets = model.frozenBuckets();
  ModuleState& moduleState = model.moduleState();
  const ShardingPlan& plan = model.plan();
  std::unique_ptr<PretrainedFiles> files;
  PretrainedMatch match;
  agreeAcrossRanks(world, device, "load_pretrained: reading '" + path + "'", "nothing was loaded on any rank", [&] {
    files = std::make_unique<PretrainedFiles>(path);
    match = matchPretrained(*files, buckets, moduleState, renames, frozenBuckets);
    TORCH_CHECK(!strict || match.fits(), describeMismatch(path, match, renames));
  });

  PretrainedLoad result;
  int64_t sources = 0;  // the tensors read from the files
  auto found = [](const auto* source) { return source != nullptr; };
  for (const auto& bucket : match.params) sources += std::count_if(bucket.begin(), bucket.end(), found);
  sources += std::count_if(match.moduleState.begin(), match.moduleState.end(), found);
  for (const auto& bucket : match.frozen) sources += std::count_if(bucket.begin(), bucket.end(), found);
  // Rank 0's share (Note [progress where a person watches]): the bytes are those it reads.
  Progress progress("load_pretrained '" + path + "'", sources, "tensors", terminalProgress(world.rank()));
  agreeAcrossRanks(
      world, device, "load_pretrained: loading '" + path + "'",
      "the weights may be partly loaded (the files were checked first, so one changed or failed while being "
      "read): load them again",
      [&] {
        at::NoGradGuard noGrad;
        for (size_t b = 0; b < buckets.size(); ++b) {
          const Bucket& bucket = buckets[b];
          const auto targets = ParamTargets::of(bucket, model.masters().of(bucket, b), plan.optimizerSharded(),
                                                plan.paramsSharded(), shardComm.rank());
          const auto& params = bucket.layout().params();
          for (size_t i = 0; i < params.size(); ++i) {
            const auto* source = match.params[b][i];
            if (source == nullptr) continue;
            const ShardRange range = targets.needed({params[i].offset, params[i].offset + params[i].numel});
            if (range.numel() == 0) {
              progress.advance(0);
              continue;
            }
            SafetensorsFile& file = files->file(source->file);
            const int64_t before = file.dataBytesRead();
            at::Tensor value = at::empty({range.numel()}, at::TensorOptions().dtype(at::kFloat));
            file.readFloat(*source->entry, range.begin - params[i].offset, range.numel(), value.data_ptr<float>());
            result.paramBytesRead += file.dataBytesRead() - before;
            targets.write(value.to(device), range);
            progress.advance(file.dataBytesRead() - before);
          }
        }
        // Stage 3's frozen parameters: the elements of this rank's shard of each, in its dtype.
        for (size_t b = 0; b < frozenBuckets.size(); ++b) {
          const Bucket& bucket = frozenBuckets[b];
          const at::Tensor shard = bucket.paramShard();
          for (const auto& piece : bucket.layout().piecesIn(bucket.layout().shardRange(shardComm.rank()))) {
            const auto* source = match.frozen[b][piece.param];
            if (source == nullptr) continue;
            SafetensorsFile& file = files->file(source->file);
            const int64_t before = file.dataBytesRead();
            const int64_t n = piece.paramEnd - piece.paramBegin;
            at::Tensor value = at::empty({n}, at::TensorOptions().dtype(at::kFloat));
            file.readFloat(*source->entry, piece.paramBegin, n, value.data_ptr<float>());
            shard.narrow(0, piece.shardOffset, n).copy_(value);
            result.moduleStateBytesRead += file.dataBytesRead() - before;
            progress.advance(file.dataBytesRead() - before);
          }
        }
        for (size_t i = 0; i < moduleState.tensors.size(); ++i) {
          const auto* source = match.moduleState[i];
          if (source == nullptr) continue;
          SafetensorsFile& file = files->file(source->file);
          const int64_t before = file.dataBytesRead();
          // Converted to the tensor's own dtype (an integer buffer is copied as it is).
          moduleState.tensors[i].second.detach().copy_(file.read(*source->entry));
          result.moduleStateBytesRead += file.dataBytesRead() - before;
          progress.advance(file.dataBytesRead() - before);
        }
      });
  progress.finish();
  for (size_t f = 0; f < files->numFiles(); ++f) {
    result.files.push_back(files->file(f).path());
    result.headerBytesRead += files->file(f).headerBytesRead();
  }
  result.bytesRead = result.paramBytesRead + result.moduleStateBytesRead + result.headerBytesRead;
  result.missing = std::move(match.missing);
  result.unexpected = std::move(match.unexpected);
  result.mismatched = std::move(match.mismatched);
  return result;
}

} // namespace zeroshard
