// The model state's trained parameters by name: read (namedParameters, the gathered fp32 masters)
// and written. ModelState::setParameters: whole values written back into the sharded state, for
// GatheredParameters(modifier_rank=r) in zeroshard.deepspeed (the Python layer broadcasts the
// modified values from rank r first, so every rank writes the same thing and no collective is
// needed here).
#include "zeroshard/state/model_state.h"

#include "zeroshard/comm/communicator.h"
#include "zeroshard/layout/param_targets.h"
#include "zeroshard/stage3/unit_scheduler.h"

#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <unordered_map>
#include <unordered_set>

namespace zeroshard {
namespace {

struct ParamWrite {
  size_t bucket;
  size_t param;
  at::Tensor value;  // flat, as given (fp32 or the compute dtype), on the bucket's device
};

} // namespace

void ModelState::setParameters(const std::vector<std::pair<std::string, at::Tensor>>& values) {
  if (units_) units_->dropSecondaryShards();  // hpZ: they would hold the old values
  std::unordered_map<std::string, std::pair<size_t, size_t>> where;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const auto& params = buckets_[b].layout().params();
    for (size_t i = 0; i < params.size(); ++i) where.emplace(params[i].name, std::make_pair(b, i));
  }
  std::unordered_map<std::string, std::pair<size_t, size_t>> frozenAt;  // stage 3's sharded ones
  for (size_t b = 0; b < frozenBuckets_.size(); ++b) {
    const auto& params = frozenBuckets_[b].layout().params();
    for (size_t i = 0; i < params.size(); ++i) frozenAt.emplace(params[i].name, std::make_pair(b, i));
  }
  std::unordered_map<std::string, at::Tensor> frozenWhole(frozenWhole_.begin(), frozenWhole_.end());
  // Everything is checked before anything is written: a bad entry changes nothing.
  std::vector<ParamWrite> writes;
  std::vector<ParamWrite> frozenWrites;  // bucket: a frozen bucket
  std::vector<std::pair<at::Tensor, at::Tensor>> wholeWrites;
  std::unordered_set<std::string> seen;
  for (const auto& [name, value] : values) {
    TORCH_CHECK(seen.insert(name).second, "zeroshard: set_parameters: '", name, "' is given twice");
    if (const auto f = frozenAt.find(name); f != frozenAt.end()) {
      const auto [b, i] = f->second;
      const auto& place = frozenBuckets_[b].layout().params()[i];
      TORCH_CHECK(value.defined() && value.sizes().vec() == place.shape, "zeroshard: set_parameters: frozen '", name,
                  "' has shape ", c10::IntArrayRef(place.shape), " but the value given has shape ",
                  value.defined() ? value.sizes() : c10::IntArrayRef{});
      frozenWrites.push_back({b, i, value.detach()});
      continue;
    }
    if (const auto w = frozenWhole.find(name); w != frozenWhole.end()) {
      TORCH_CHECK(value.defined() && value.sizes() == w->second.sizes(), "zeroshard: set_parameters: frozen '", name,
                  "' has shape ", w->second.sizes(), " but the value given has shape ",
                  value.defined() ? value.sizes() : c10::IntArrayRef{});
      wholeWrites.emplace_back(w->second, value.detach());
      continue;
    }
    const auto it = where.find(name);
    TORCH_CHECK(it != where.end(), "zeroshard: set_parameters: '", name,
                "' is not a parameter of this engine (buffers are not sharded: write them in the module directly)");
    const auto [b, i] = it->second;
    const auto& place = buckets_[b].layout().params()[i];
    TORCH_CHECK(value.defined() && value.sizes().vec() == place.shape, "zeroshard: set_parameters: '", name,
                "' has shape ", c10::IntArrayRef(place.shape), " but the value given has shape ",
                value.defined() ? value.sizes() : c10::IntArrayRef{});
    TORCH_CHECK(at::isFloatingType(value.scalar_type()), "zeroshard: set_parameters: '", name,
                "' needs a floating-point value, got ", value.scalar_type());
    const at::Device device = buckets_[b].flatParams().device();
    const auto dtype = value.scalar_type() == computeDtype_ ? computeDtype_ : at::kFloat;
    writes.push_back({b, i, value.detach().to(device, dtype).reshape({-1})});
  }

  {
    at::NoGradGuard noGrad;
    for (const auto& w : frozenWrites) frozenBuckets_[w.bucket].writeShardOf(w.param, w.value);
    for (const auto& [target, value] : wholeWrites) {
      if (!target.is_same(value)) target.detach().copy_(value);
    }
  }
  for (const auto& w : writes) {
    const Bucket& bucket = buckets_[w.bucket];
    const auto& place = bucket.layout().params()[w.param];
    ParamTargets::of(bucket, masters_->of(bucket, w.bucket), plan_.optimizerSharded(), plan_.paramsSharded(),
                     shardRank_)
        .write(w.value, {place.offset, place.offset + place.numel});
  }
}

std::vector<std::pair<std::string, at::Tensor>> ModelState::namedParameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& b : buckets_) {
    for (size_t i = 0; i < b.size(); ++i) out.emplace_back(b.layout().params()[i].name, b.params()[i]);
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> ModelState::masterWeights(Communicator& shardComm) {
  UncountedCollectives uncountedShards(shardComm);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const auto& b = buckets_[i];
    // Offloaded masters are host tensors: gathered on the compute device, as a backend for
    // device tensors (NCCL) takes no host ones.
    const at::Tensor master = masters_->of(b, i).to(b.flatParams().device());
    at::Tensor full = master;
    if (plan_.optimizerSharded()) {
      full = at::empty({b.layout().paddedNumel()}, master.options());
      shardComm.allGather(master, full).wait();
    }
    for (const auto& place : b.layout().params()) {
      const at::Tensor view = full.narrow(0, place.offset, place.numel).view(place.shape);
      out.emplace_back(place.name, view.to(at::TensorOptions().device(at::kCPU), /*non_blocking=*/false, /*copy=*/true));
    }
  }
  return out;
}

} // namespace zeroshard
