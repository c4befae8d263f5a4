#include "zeroshard/layout/bucket.h"

#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

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

} // namespace

Bucket::Bucket(std::vector<at::Tensor> params, std::vector<std::string> names, std::vector<int> paramGroups,
               int rank, int worldSize, at::ScalarType computeDtype)
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
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& place = layout_.params()[i];
    // set_data keeps the Parameter object (and its autograd identity) while its storage
    // becomes part of the flat buffer (and its dtype the compute dtype).
    params_[i].set_data(flatParams_.narrow(0, place.offset, place.numel).view(place.shape));
  }
}

at::Tensor Bucket::takeFloatValues() {
  return std::exchange(floatValues_, at::Tensor());
}

at::Tensor Bucket::paramShard() const {
  if (shard_.defined()) return shard_;
  const auto range = layout_.shardRange(rank_);
  return flatParams_.narrow(0, range.begin, range.numel());
}

void Bucket::detachShard() {
  if (!shard_.defined()) shard_ = paramShard().clone();
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
