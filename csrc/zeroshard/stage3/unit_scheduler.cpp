#include "zeroshard/stage3/unit_scheduler.h"

#include <ATen/record_function.h>
#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include "zeroshard/layout/host_memory.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <sstream>

namespace zeroshard {

namespace {

std::vector<UnitBuffers> oneBucketEach(size_t n) {
  std::vector<UnitBuffers> units;
  for (size_t b = 0; b < n; ++b) units.push_back(UnitBuffers{b, {}});
  return units;
}

}  // namespace

UnitScheduler::UnitScheduler(std::vector<Bucket>& units, std::vector<UnitPolicy> policies, Communicator& comm,
                             int64_t prefetchElements, int64_t maxLiveElements, bool shardsOnHost, bool pin,
                             Communicator* secondary, bool gatherStream)
    : UnitScheduler(units, units, oneBucketEach(units.size()), std::move(policies), comm, prefetchElements,
                    maxLiveElements, shardsOnHost, pin, secondary, gatherStream) {}

UnitScheduler::UnitScheduler(std::vector<Bucket>& trained, std::vector<Bucket>& frozen, std::vector<UnitBuffers> units,
                             std::vector<UnitPolicy> policies, Communicator& comm, int64_t prefetchElements,
                             int64_t maxLiveElements, bool shardsOnHost, bool pin, Communicator* secondary,
                             bool gatherStream)
    : policies_(std::move(policies)),
      comm_(comm),
      prefetchElements_(prefetchElements),
      maxLiveElements_(maxLiveElements),
      secondary_(secondary),
      gatherStream_(gatherStream) {
  TORCH_CHECK(policies_.size() == units.size(), "zeroshard: ", units.size(), " units but ", policies_.size(),
              " policies");
  TORCH_CHECK(!units.empty(), "zeroshard stage 3: no units");
  unitOfBucket_.assign(trained.size(), 0);
  unitOfFrozen_.assign(&frozen == &trained ? 0 : frozen.size(), 0);
  for (size_t u = 0; u < units.size(); ++u) {
    auto& list = buffers_.emplace_back();
    const auto& spec = units[u];
    if (spec.trained) {
      TORCH_CHECK(*spec.trained < trained.size(), "zeroshard stage 3: unit ", u, " names trained bucket ",
                  *spec.trained, " of ", trained.size());
      list.push_back(&trained[*spec.trained]);
      unitOfBucket_[*spec.trained] = u;
    }
    for (size_t f : spec.frozen) {
      TORCH_CHECK(f < frozen.size(), "zeroshard stage 3: unit ", u, " names frozen bucket ", f, " of ", frozen.size());
      list.push_back(&frozen[f]);
      unitOfFrozen_.at(f) = u;
    }
    TORCH_CHECK(!list.empty(), "zeroshard stage 3: unit ", u, " has no parameters");
    TORCH_CHECK(!(policies_[u].keepGathered && !spec.frozen.empty()), "zeroshard stage 3: kept-gathered unit ", u,
                " holds frozen parameters (those under the persistence threshold stay whole instead)");
    trainedOf_.push_back(spec.trained);
    hasFrozen_.push_back(!spec.frozen.empty());
  }
  const size_t n = buffers_.size();
  states_.assign(n, UnitState::kSharded);
  pending_.resize(n);
  stagedShards_.resize(n);
  secondaryShards_.resize(n);
  allocStreams_.resize(n);
  inputsWatched_.assign(n, false);
  unwatchable_.assign(n, false);
  inputGradsPending_.assign(n, 0);
  gradsReduced_.assign(n, false);
  for (size_t u = 0; u < n; ++u) {
    stagedShards_[u].resize(buffers_[u].size());
    secondaryShards_[u].resize(buffers_[u].size());
    for (Bucket* buffer : buffers_[u]) {
      buffer->detachShard();
      if (shardsOnHost) buffer->moveShardToHost(pin);
      if (policies_[u].keepGathered) {
        buffer->allocateZeroed();  // a meta model's bucket has none yet (Note [meta buckets])
      } else {
        buffer->releaseFlatParams();
      }
    }
    if (policies_[u].keepGathered) states_[u] = UnitState::kGathered;
  }
}

const std::string& UnitScheduler::nameOf(size_t unit) const {
  // A unit's name is its first parameter's module path, e.g. "blocks.3.attn.qkv.weight".
  return buffers_.at(unit).front()->layout().params().front().name;
}

// Note [gather stream]: with zeroshard.stage3_gather_stream on a GPU, a gather issued ahead of
// its unit's use (a prefetch) runs from a side stream, as FSDP2's all-gather stream does. Made
// current there, the side stream is what the buffer is allocated on, what an offloaded shard's
// host-to-device copy runs on, and all that c10d orders the collective after: the gather no
// longer waits for every kernel queued on the compute stream, so it can run more than the one
// unit ahead that compute-stream ordering allows. What it must still wait for:
//   - what it reads: the shards, last written before the pass (an optimizer step, a load) or,
//     for hpZ's secondary shards, during the forward. The side stream waits for the event
//     markPassStart() records on the compute stream at the start of each forward and each
//     backward: everything queued before the pass, no kernel of it.
//   - the memory it allocates: a block freed by a unit released on the compute stream is
//     handed out again on the side stream only after the side stream waited for that release
//     (orderAllocationAfterUse, Note [release after use]); an offloaded shard's device copy,
//     dropped once the gather is waited for, likewise (finished()).
// The compute stream waits for the gather itself in unshard(): CommHandle::wait() is called
// with the compute stream current, before the unit's kernels are queued. Gathers that are
// needed at once (unshard() of a unit that was not prefetched) stay on the compute stream:
// they would be waited for immediately anyway. On CPUs there are no streams; nothing changes.
void UnitScheduler::startUnshard(size_t u, bool ahead) {
  if (states_[u] != UnitState::kSharded) return;
  RECORD_USER_SCOPE("zeroshard::gather_unit");  // Note [profiler names]
  const auto device = buffers_[u].front()->flatParams().device();
  std::optional<c10::StreamGuard> onGatherStream;
  if (ahead && gatherStream_ && !device.is_cpu() && passStart_) {
    if (!sideStream_) sideStream_ = c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device);
    passStart_->block(*sideStream_);
    onGatherStream.emplace(*sideStream_);
  }
  if (!device.is_cpu()) allocStreams_[u] = c10::impl::VirtualGuardImpl(device.type()).getStream(device);
  for (size_t i = 0; i < buffers_[u].size(); ++i) {
    Bucket& buffer = *buffers_[u][i];
    buffer.materializeFlatParams();
    pending_[u].push_back(startGather(u, i));
    liveElements_ += buffer.layout().paddedNumel();
    liveBytes_ += static_cast<int64_t>(buffer.flatParams().nbytes());
  }
  states_[u] = UnitState::kGathering;
  peakBytes_ = std::max(peakBytes_, liveBytes_);
}

namespace {

// The unit's all-gather; its error names the unit (the Communicator's names the collective).
void waitForGather(CommHandle& handle, const Bucket& buffer, size_t u, size_t units, const char* when) {
  try {
    handle.wait();
  } catch (...) {
    rethrowWithContext(std::string("gathering the parameters of stage-3 unit ") + std::to_string(u) + " of " +
                       std::to_string(units) + " " + when + ": " + buffer.describe());
  }
}

}  // namespace

void UnitScheduler::unshard(size_t u) {
  startUnshard(u);
  if (states_[u] == UnitState::kGathering) {
    RECORD_USER_SCOPE("zeroshard::wait_unit");
    auto handles = std::move(pending_[u]);
    pending_[u].clear();
    for (size_t i = 0; i < handles.size(); ++i) {
      waitForGather(handles[i], *buffers_[u][i], u, buffers_.size(), "for its forward or backward");
    }
    finished(u);
    states_[u] = UnitState::kGathered;
  }
}

CommHandle UnitScheduler::startGather(size_t u, size_t i) {
  const Bucket& unit = *buffers_[u][i];
  if (secondaryShards_[u][i].defined()) return secondary_->allGather(secondaryShards_[u][i], unit.flatParams());
  if (!unit.shardOnHost()) return comm_.allGather(unit.paramShard(), unit.flatParams());
  // Issued on the current stream before the collective, which c10d orders after it.
  auto& staged = stagedShards_[u][i];
  staged = at::empty({unit.layout().shardNumel()}, unit.flatParams().options());
  copyBetween(staged, unit.paramShard());
  return comm_.allGather(staged, unit.flatParams());
}

// A host shard's device copy is read by the gather on NCCL's stream. Issued from the gather
// stream, its block belongs to that stream's pool, which c10d does not order after the gather:
// the current stream has waited for the gather (CommHandle::wait), so the gather stream waits
// for the current one before the block can be handed out again (Note [gather stream]).
void UnitScheduler::finished(size_t u) {
  bool ordered = false;
  for (auto& staged : stagedShards_[u]) {
    if (staged.defined() && allocStreams_[u] && !ordered) {
      const auto device = staged.device();
      const c10::Stream current = c10::impl::VirtualGuardImpl(device.type()).getStream(device);
      if (current != *allocStreams_[u]) {
        c10::Event gathered(device.type());
        gathered.record(current);
        gathered.block(*allocStreams_[u]);
      }
      ordered = true;
    }
    staged = at::Tensor();
  }
}

void UnitScheduler::reshard(size_t u, bool keepSecondary) {
  if (!keepSecondary) dropSecondaryShard(u);
  if (policies_[u].keepGathered || states_[u] == UnitState::kSharded) return;
  if (states_[u] == UnitState::kGathering) unshard(u);  // never free memory a collective writes
  RECORD_USER_SCOPE("zeroshard::release_unit");
  if (keepSecondary) keepSecondaryShard(u);
  orderAllocationAfterUse(u);
  for (Bucket* buffer : buffers_[u]) {
    buffer->releaseFlatParams();
    liveElements_ -= buffer->layout().paddedNumel();
    liveBytes_ -= static_cast<int64_t>(buffer->flatParams().element_size()) * buffer->layout().paddedNumel();
  }
  states_[u] = UnitState::kSharded;
}

// Note [hpZ secondary shards]: the secondary group's members are consecutive ranks of the shard
// group, so this rank's place in it is its rank there, and the slices of all members, in order,
// are the whole unit: an all-gather of the secondary shards over the secondary group rebuilds
// exactly the buffer the forward's all-gather over the shard group made. The slice is copied
// on the current stream, after the gather's wait, before the buffer is released.
void UnitScheduler::keepSecondaryShard(size_t u) {
  if (secondary_ == nullptr) return;
  for (size_t i = 0; i < buffers_[u].size(); ++i) {
    auto& shard = secondaryShards_[u][i];
    if (shard.defined()) continue;
    const auto& flat = buffers_[u][i]->flatParams();
    const int64_t numel = buffers_[u][i]->layout().paddedNumel() / secondary_->worldSize();
    shard = flat.narrow(0, numel * secondary_->rank(), numel).clone();
    secondaryBytes_ += static_cast<int64_t>(shard.nbytes());
  }
  peakSecondaryBytes_ = std::max(peakSecondaryBytes_, secondaryBytes_);
}

void UnitScheduler::dropSecondaryShard(size_t u) {
  for (auto& shard : secondaryShards_[u]) {
    if (!shard.defined()) continue;
    secondaryBytes_ -= static_cast<int64_t>(shard.nbytes());
    shard = at::Tensor();
  }
}

// The next unit is prefetched even when it is larger than stage3_prefetch_bucket_size, as
// DeepSpeed always fetches the first parameters of its prefetch queue: with its default of 5e7
// elements, a transformer block of a 1B model (about 5e7 elements) would otherwise never be
// prefetched. Only 0 turns prefetch off; stage3_max_live_parameters still bounds it.
void UnitScheduler::prefetch(size_t u) {
  if (states_[u] != UnitState::kSharded || prefetchElements_ <= 0) return;
  int64_t numel = 0;
  for (const Bucket* buffer : buffers_[u]) numel += buffer->layout().paddedNumel();
  if (liveElements_ + numel > maxLiveElements_) return;
  startUnshard(u, /*ahead=*/true);
}

void UnitScheduler::markPassStart(const at::Tensor& like) {
  const auto device = like.device();
  if (!gatherStream_ || device.is_cpu()) return;
  if (!passStart_) passStart_.emplace(device.type());
  passStart_->record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
}

// Note [release after use]: the caching allocator hands a freed block out again in the order of
// the stream it was allocated on. A unit is released on the current stream, after the wait that
// orders it behind the all-gather and after the kernels that read the parameters; when the
// block came from another stream (a unit gathered on one thread's stream and released from
// another's), an event makes that stream wait for this one first, so the block is not reused
// while the all-gather or a kernel may still touch it. On one stream (the usual case) and on
// CPUs there is nothing to order.
void UnitScheduler::orderAllocationAfterUse(size_t u) {
  auto& allocStream = allocStreams_[u];
  if (!allocStream) return;
  const auto device = buffers_[u].front()->flatParams().device();
  const c10::Stream current = c10::impl::VirtualGuardImpl(device.type()).getStream(device);
  if (current != *allocStream) {
    c10::Event used(device.type());
    used.record(current);
    used.block(*allocStream);
  }
  allocStream.reset();
}

void UnitScheduler::preForward(UnitIndex unit) {
  const size_t u = unit.value;
  const bool training = c10::GradMode::is_enabled();
  if (recording_ && training) {
    order_.push_back(u);
  } else if (!recording_ && training) {
    if (forwardPos_ == order_.size()) forwardPos_ = 0;  // a forward that had no backward
    if (forwardPos_ == 0) {
      markPassStart(buffers_[u].front()->flatParams());
      // A forward whose graph was dropped without a backward left watches that never fire.
      // (Several forwards before one backward are one pass: the first step recorded them all.)
      if (!inBackward_) resetWatches();
    }
    TORCH_CHECK(forwardPos_ < order_.size() && order_[forwardPos_] == u, "zeroshard stage 3: unit '", nameOf(u),
                "' ran at position ", forwardPos_, " of this forward, but the first step ran ",
                forwardPos_ < order_.size() ? "'" + nameOf(order_[forwardPos_]) + "'" : std::string("no unit"),
                " there; every training forward must run the units in the same order on every rank");
  }
  unshard(u);
  if (!recording_ && training) {
    ++forwardPos_;
    if (forwardPos_ < order_.size()) prefetch(order_[forwardPos_]);
  }
}

void UnitScheduler::postForward(UnitIndex unit, const std::vector<at::Tensor>& outputs) {
  const size_t u = unit.value;
  bool hooked = false;
  if (c10::GradMode::is_enabled()) {
    for (const auto& out : outputs) {
      if (out.defined() && out.requires_grad()) {
        out.register_hook([this, u](const at::TensorBase&) { preBackward(UnitIndex{u}); });
        hooked = true;
      }
    }
  }
  // A unit whose outputs need no gradient (frozen, below every trained parameter) has no
  // backward: backward prefetch passes it by.
  if (recording_ && c10::GradMode::is_enabled() && hooked) postOrder_.push_back(u);
  if (policies_[u].reshardAfterForward || !c10::GradMode::is_enabled()) {
    reshard(u, /*keepSecondary=*/hooked);  // hpZ: only a unit with a backward gathers again
  }
}

int64_t UnitScheduler::hostBytes() const {
  int64_t total = 0;
  for (size_t u = 0; u < buffers_.size(); ++u) {
    const Bucket& first = *buffers_[u].front();
    if (trainedOf_[u] && first.shardOnHost()) total += static_cast<int64_t>(first.paramShard().nbytes());
  }
  return total;
}

int64_t UnitScheduler::bytes() const {
  int64_t total = 0;
  for (size_t u = 0; u < buffers_.size(); ++u) {
    if (!trainedOf_[u]) continue;
    const Bucket& trained = *buffers_[u].front();
    total += static_cast<int64_t>(trained.paramShard().nbytes());
    if (policies_[u].keepGathered) total += static_cast<int64_t>(trained.flatParams().nbytes());
  }
  return total;
}

int64_t UnitScheduler::frozenBytes() const {
  int64_t total = 0;
  for (size_t u = 0; u < buffers_.size(); ++u) {
    for (size_t i = trainedOf_[u] ? 1 : 0; i < buffers_[u].size(); ++i) {
      total += static_cast<int64_t>(buffers_[u][i]->paramShard().nbytes());
    }
  }
  return total;
}

int64_t UnitScheduler::frozenHostBytes() const {
  int64_t total = 0;
  for (size_t u = 0; u < buffers_.size(); ++u) {
    for (size_t i = trainedOf_[u] ? 1 : 0; i < buffers_[u].size(); ++i) {
      if (buffers_[u][i]->shardOnHost()) total += static_cast<int64_t>(buffers_[u][i]->paramShard().nbytes());
    }
  }
  return total;
}

void UnitScheduler::finishAfterStep() {
  auto refreshing = std::move(refreshing_);
  refreshing_.clear();
  for (auto& [u, handle] : refreshing) {
    waitForGather(handle, *buffers_[u].front(), u, buffers_.size(), "after the optimizer step");
    finished(u);
  }
}

void UnitScheduler::gatherAll() {
  for (size_t u = 0; u < buffers_.size(); ++u) startUnshard(u);
  for (size_t u = 0; u < buffers_.size(); ++u) unshard(u);
}

bool UnitScheduler::gatherUnit(UnitIndex unit) {
  const size_t u = unit.value;
  TORCH_CHECK(u < buffers_.size(), "zeroshard stage 3: unit ", u, " does not exist (", buffers_.size(), " units)");
  const bool wasSharded = states_[u] == UnitState::kSharded;
  unshard(u);
  return wasSharded;
}

void UnitScheduler::reshardAll() {
  for (size_t u = 0; u < buffers_.size(); ++u) reshard(u);
}

} // namespace zeroshard
