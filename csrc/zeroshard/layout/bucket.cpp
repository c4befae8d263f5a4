#include "zeroshard/layout/bucket.h"

#include "zeroshard/layout/host_memory.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

namespace zeroshard {
namespace {

FlatLayout layoutOf(const std::vector<at::Tensor>& params, std::vector<std::string> names, int worldSize) {
  TORCH_CHECK(params.size() == names.size(), "zeroshard::Bucket: ", params.size(), " parameters but ",
              names.size(), " names");
  std::vector<ParamPlacement> placements;
  for (size_t i = 0; i < params.size(); ++i) {
    placements.push_back({std::move(names[i]), params[i].sizes().vec(), 0, 0});
  }
  return FlatLayout(std::move(placements), worldSize);
}

// Note [meta buckets]: a flat buffer of `numel` elements whose storage holds no bytes, the state
// releaseFlatParams() leaves a buffer in. Views of it (the parameters) have their shapes and
// can be pointed at; only reading or writing them needs storage, which materializeFlatParams()
// or allocateZeroed() give. So a model built on the meta device never has a full buffer
// allocated for it: stage 3 allocates only this rank's shard (detachShard()).
at::Tensor unallocated(int64_t numel, const at::TensorOptions& options) {
  at::Tensor flat = at::empty({0}, options.requires_grad(false));
  flat.unsafeGetTensorImpl()->set_sizes_contiguous({numel});
  return flat;
}

} // namespace

void setTensorData(const at::Tensor& t, const at::Tensor& data) {
  if (t.is_meta() == data.is_meta()) {
    t.set_data(data);
    return;
  }
  // set_data's own last step, without its check that both are dense tensors of a real device.
  // No gradient accumulator exists yet for a tensor coming from or going to the meta device
  // here (the engine builds its hooks after), so there is none to reset.
  t.unsafeGetTensorImpl()->shallow_copy_from(data.getIntrusivePtr());
}

Bucket::Bucket(std::vector<at::Tensor> params, std::vector<std::string> names, std::vector<int> paramGroups,
               int rank, int worldSize, at::ScalarType computeDtype, std::optional<at::Device> metaDevice)
    : layout_(layoutOf(params, std::move(names), worldSize)),
      paramGroups_(std::move(paramGroups)),
      rank_(rank),
      params_(std::move(params)) {
  TORCH_CHECK(!params_.empty(), "zeroshard::Bucket: no parameters");
  TORCH_CHECK(paramGroups_.size() == params_.size(), "zeroshard::Bucket: ", params_.size(), " parameters but ",
              paramGroups_.size(), " group ids");
  const auto options = params_.front().options();
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    TORCH_CHECK(p.options().dtype() == options.dtype() && p.device() == options.device(),
                "zeroshard: parameter '", layout_.params()[i].name, "' is ", p.scalar_type(), " on ", p.device(),
                " but '", layout_.params()[0].name, "' is ", options.dtype(), " on ", options.device(),
                "; all parameters of a param group must share dtype and device");
  }
  if (options.device().is_meta()) {
    TORCH_CHECK(metaDevice && !metaDevice->is_meta(), "zeroshard: parameter '", layout_.params()[0].name,
                "' is on the meta device, and no device was given to allocate this rank's shards on");
    flatParams_ = unallocated(layout_.paddedNumel(), options.dtype(computeDtype).device(*metaDevice));
  } else {
    auto flat = at::zeros({layout_.paddedNumel()}, options.requires_grad(false));
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto& place = layout_.params()[i];
      flat.narrow(0, place.offset, place.numel).view(place.shape).copy_(params_[i].detach());
    }
    if (computeDtype == flat.scalar_type()) {
      flatParams_ = flat;
    } else {
      flatParams_ = flat.to(computeDtype);
      floatValues_ = flat;
    }
  }
  // set_data keeps the Parameter object (and its autograd identity) while its storage
  // becomes part of the flat buffer (and its dtype the compute dtype).
  for (size_t i = 0; i < params_.size(); ++i) restoreParamView(i);
}

void Bucket::restoreParamView(size_t i) {
  const auto& place = layout_.params().at(i);
  // A view is bounds-checked against its storage's size: a buffer without storage (Note [meta
  // buckets]) claims its size, with no memory behind it, while the view is made.
  auto* storage = flatParams_.storage().unsafeGetStorageImpl();
  const bool empty = storage->nbytes() == 0;
  if (empty) storage->set_nbytes(static_cast<size_t>(layout_.paddedNumel()) * flatParams_.element_size());
  setTensorData(params_[i], flatParams_.narrow(0, place.offset, place.numel).view(place.shape));
  if (empty) storage->set_nbytes(0);
}

at::Tensor Bucket::takeFloatValues() {
  return std::exchange(floatValues_, at::Tensor());
}

std::string Bucket::describe() const {
  const auto& params = layout_.params();
  if (params.empty()) return "no parameters";
  if (params.size() == 1) return "'" + params.front().name + "'";
  return "'" + params.front().name + "' .. '" + params.back().name + "' (" + std::to_string(params.size()) +
         " parameters)";
}

at::Tensor Bucket::paramShard() const {
  if (shard_.defined()) return shard_;
  const auto range = layout_.shardRange(rank_);
  return flatParams_.narrow(0, range.begin, range.numel());
}

void Bucket::writeShardOf(size_t param, const at::Tensor& whole) {
  const auto& place = layout_.params().at(param);
  TORCH_CHECK(whole.numel() == place.numel, "zeroshard: '", place.name, "' has ", place.numel, " elements, the value ",
              whole.numel());
  const auto range = layout_.shardRange(rank_);
  const int64_t begin = std::max(range.begin, place.offset);
  const int64_t end = std::min(range.end, place.offset + place.numel);
  if (begin >= end) return;
  paramShard().narrow(0, begin - range.begin, end - begin).copy_(whole.detach().reshape({-1}).narrow(0, begin - place.offset, end - begin));
}

void Bucket::detachShard() {
  if (shard_.defined()) return;
  if (allocated()) {
    shard_ = paramShard().clone();
  } else {  // a meta bucket: zeros until initialised
    const auto range = layout_.shardRange(rank_);
    shard_ = at::zeros({range.numel()}, flatParams_.options());
  }
}

void Bucket::moveShardToHost(bool pin) {
  detachShard();
  if (shardOnHost_) return;
  shard_ = copyToHost(shard_, pin, flatParams_.device());
  shardOnHost_ = true;
}

bool Bucket::allocated() const {
  return flatParams_.storage().nbytes() > 0 || layout_.paddedNumel() == 0;
}

void Bucket::allocateZeroed() {
  if (allocated()) return;
  materializeFlatParams();
  flatParams_.zero_();
}

// Note [freeing parameter storage]: the parameters are views of flatParams_'s storage. Swapping
// that storage's data pointer frees the memory while every view (and every tensor autograd
// saved) keeps referring to the same StorageImpl, so re-materializing makes them all valid
// again without touching a version counter. The allocator is the storage's own (the CUDA
// caching allocator on GPUs), so this is device-generic.
void Bucket::releaseFlatParams() {
  auto* storage = flatParams_.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, flatParams_.device()));
  storage->set_nbytes(0);
}

void Bucket::materializeFlatParams() {
  auto* storage = flatParams_.storage().unsafeGetStorageImpl();
  if (storage->nbytes() > 0) return;
  const size_t bytes = static_cast<size_t>(layout_.paddedNumel()) * flatParams_.element_size();
  // The CUDA caching allocator allocates on the calling thread's current device, which a user's
  // thread may have left on another GPU than this buffer's.
  const c10::DeviceGuard onBufferDevice(flatParams_.device());
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
}

} // namespace zeroshard
