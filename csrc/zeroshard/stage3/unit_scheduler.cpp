#include "zeroshard/stage3/unit_scheduler.h"

#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include "zeroshard/comm/gather_values.h"
#include "zeroshard/layout/host_memory.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <sstream>

namespace zeroshard {

UnitScheduler::UnitScheduler(std::vector<Bucket>& units, std::vector<UnitPolicy> policies, Communicator& comm,
                           int64_t prefetchElements, int64_t maxLiveElements, bool shardsOnHost, bool pin,
                           Communicator* secondary, bool gatherStream)
    : units_(units),
      policies_(std::move(policies)),
      comm_(comm),
      prefetchElements_(prefetchElements),
      maxLiveElements_(maxLiveElements),
      secondary_(secondary),
      gatherStream_(gatherStream) {
  TORCH_CHECK(policies_.size() == units_.size(), "zeroshard: ", units_.size(), " units but ", policies_.size(),
              " policies");
  states_.assign(units_.size(), UnitState::kSharded);
  pending_.resize(units_.size());
  stagedShards_.resize(units_.size());
  secondaryShards_.resize(units_.size());
  allocStreams_.resize(units_.size());
  for (size_t u = 0; u < units_.size(); ++u) {
    auto& unit = units_[u];
    unit.detachShard();
    if (shardsOnHost) unit.moveShardToHost(pin);
    if (policies_[u].keepGathered) {
      unit.allocateZeroed();  // a meta model's bucket has none yet (Note [meta buckets])
      states_[u] = UnitState::kGathered;
    } else {
      unit.releaseFlatParams();
    }
  }
}

const std::string& UnitScheduler::nameOf(size_t unit) const {
  // A unit's name is its first parameter's module path, e.g. "blocks.3.attn.qkv.weight".
  return units_.at(unit).layout().params().front().name;
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
  auto& unit = units_[u];
  const auto device = unit.flatParams().device();
  std::optional<c10::StreamGuard> onGatherStream;
  if (ahead && gatherStream_ && !device.is_cpu() && passStart_) {
    if (!sideStream_) sideStream_ = c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device);
    passStart_->block(*sideStream_);
    onGatherStream.emplace(*sideStream_);
  }
  unit.materializeFlatParams();
  if (!device.is_cpu()) allocStreams_[u] = c10::impl::VirtualGuardImpl(device.type()).getStream(device);
  pending_[u] = startGather(u);
  states_[u] = UnitState::kGathering;
  liveElements_ += unit.layout().paddedNumel();
  liveBytes_ += static_cast<int64_t>(unit.flatParams().nbytes());
  peakBytes_ = std::max(peakBytes_, liveBytes_);
}

namespace {

// The unit's all-gather; its error names the unit (the Communicator's names the collective).
void waitForGather(CommHandle& handle, const std::vector<Bucket>& units, size_t u, const char* when) {
  try {
    handle.wait();
  } catch (...) {
    rethrowWithContext(std::string("gathering the parameters of stage-3 unit ") + std::to_string(u) + " of " +
                       std::to_string(units.size()) + " " + when + ": " + units[u].describe());
  }
}

}  // namespace

void UnitScheduler::unshard(size_t u) {
  startUnshard(u);
  if (states_[u] == UnitState::kGathering) {
    auto handle = std::move(*pending_[u]);
    pending_[u].reset();
    waitForGather(handle, units_, u, "for its forward or backward");
    finished(u);
    states_[u] = UnitState::kGathered;
  }
}

CommHandle UnitScheduler::startGather(size_t u) {
  auto& unit = units_[u];
  if (secondaryShards_[u].defined()) return secondary_->allGather(secondaryShards_[u], unit.flatParams());
  if (!unit.shardOnHost()) return comm_.allGather(unit.paramShard(), unit.flatParams());
  // Issued on the current stream before the collective, which c10d orders after it.
  auto& staged = stagedShards_[u];
  staged = at::empty({unit.layout().shardNumel()}, unit.flatParams().options());
  copyBetween(staged, unit.paramShard());
  return comm_.allGather(staged, unit.flatParams());
}

// A host shard's device copy is read by the gather on NCCL's stream. Issued from the gather
// stream, its block belongs to that stream's pool, which c10d does not order after the gather:
// the current stream has waited for the gather (CommHandle::wait), so the gather stream waits
// for the current one before the block can be handed out again (Note [gather stream]).
void UnitScheduler::finished(size_t u) {
  auto& staged = stagedShards_[u];
  if (staged.defined() && allocStreams_[u]) {
    const auto device = staged.device();
    const c10::Stream current = c10::impl::VirtualGuardImpl(device.type()).getStream(device);
    if (current != *allocStreams_[u]) {
      c10::Event gathered(device.type());
      gathered.record(current);
      gathered.block(*allocStreams_[u]);
    }
  }
  staged = at::Tensor();
}

void UnitScheduler::reshard(size_t u, bool keepSecondary) {
  if (!keepSecondary) dropSecondaryShard(u);
  if (policies_[u].keepGathered || states_[u] == UnitState::kSharded) return;
  if (states_[u] == UnitState::kGathering) unshard(u);  // never free memory a collective writes
  if (keepSecondary) keepSecondaryShard(u);
  orderAllocationAfterUse(u);
  units_[u].releaseFlatParams();
  states_[u] = UnitState::kSharded;
  liveElements_ -= units_[u].layout().paddedNumel();
  liveBytes_ -= static_cast<int64_t>(units_[u].flatParams().element_size()) * units_[u].layout().paddedNumel();
}

// Note [hpZ secondary shards]: the secondary group's members are consecutive ranks of the shard
// group, so this rank's place in it is its rank there, and the slices of all members, in order,
// are the whole unit: an all-gather of the secondary shards over the secondary group rebuilds
// exactly the buffer the forward's all-gather over the shard group made. The slice is copied
// on the current stream, after the gather's wait, before the buffer is released.
void UnitScheduler::keepSecondaryShard(size_t u) {
  if (secondary_ == nullptr || secondaryShards_[u].defined()) return;
  const auto& flat = units_[u].flatParams();
  const int64_t numel = units_[u].layout().paddedNumel() / secondary_->worldSize();
  secondaryShards_[u] = flat.narrow(0, numel * secondary_->rank(), numel).clone();
  secondaryBytes_ += static_cast<int64_t>(secondaryShards_[u].nbytes());
  peakSecondaryBytes_ = std::max(peakSecondaryBytes_, secondaryBytes_);
}

void UnitScheduler::dropSecondaryShard(size_t u) {
  auto& shard = secondaryShards_[u];
  if (!shard.defined()) return;
  secondaryBytes_ -= static_cast<int64_t>(shard.nbytes());
  shard = at::Tensor();
}

// The next unit is prefetched even when it is larger than stage3_prefetch_bucket_size, as
// DeepSpeed always fetches the first parameters of its prefetch queue: with its default of 5e7
// elements, a transformer block of a 1B model (about 5e7 elements) would otherwise never be
// prefetched. Only 0 turns prefetch off; stage3_max_live_parameters still bounds it.
void UnitScheduler::prefetch(size_t u) {
  if (states_[u] != UnitState::kSharded || prefetchElements_ <= 0) return;
  const int64_t numel = units_[u].layout().paddedNumel();
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
  const auto device = units_[u].flatParams().device();
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
    if (forwardPos_ == 0) markPassStart(units_[u].flatParams());
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
  if (recording_ && c10::GradMode::is_enabled()) postOrder_.push_back(u);
  if (c10::GradMode::is_enabled()) {
    for (const auto& out : outputs) {
      if (out.defined() && out.requires_grad()) {
        out.register_hook([this, u](const at::TensorBase&) { preBackward(UnitIndex{u}); });
      }
    }
  }
  if (policies_[u].reshardAfterForward || !c10::GradMode::is_enabled()) {
    reshard(u, /*keepSecondary=*/c10::GradMode::is_enabled());
  }
}

// Note [backward prefetch order]: backward runs the units in the reverse of the order their
// forwards finished, not started. The two differ when a unit's forward encloses others: the
// root unit (embeddings, head), whose module is the whole model, starts first and finishes
// last, and its gradient arrives first. Walking the start order backwards from the root finds
// nothing before it, so no block would ever be prefetched; walking the finish order backwards
// goes root, last block, ..., first block, as FSDP2's post-forward order does.
void UnitScheduler::preBackward(UnitIndex unit) {
  const size_t u = unit.value;
  if (!recording_ && backwardPos_ == postOrder_.size()) markPassStart(units_[u].flatParams());
  unshard(u);
  if (recording_) return;
  // The unit before this one in the finish order runs its backward next.
  size_t pos = std::min(backwardPos_, postOrder_.size());
  while (pos > 0 && postOrder_[pos - 1] != u) --pos;
  if (pos > 0) {
    backwardPos_ = pos - 1;
    if (backwardPos_ > 0) prefetch(postOrder_[backwardPos_ - 1]);
  }
}

void UnitScheduler::afterGradReduce(UnitIndex unit) {
  reshard(unit.value);
}

void UnitScheduler::finishBackward() {
  for (size_t u = 0; u < units_.size(); ++u) reshard(u);
  if (recording_) {
    checkOrderAcrossRanks();
    recording_ = false;
  }
  forwardPos_ = 0;
  backwardPos_ = postOrder_.size();
}

void UnitScheduler::checkOrderAcrossRanks() {
  const std::vector<int64_t> mine(order_.begin(), order_.end());
  const auto orders = allGatherValues(comm_, mine, units_.front().flatParams().device());
  const auto n = static_cast<int64_t>(mine.size());
  for (int r = 0; r < comm_.worldSize(); ++r) {
    const auto& theirs = orders[static_cast<size_t>(r)];
    TORCH_CHECK(static_cast<int64_t>(theirs.size()) == n, "zeroshard stage 3: rank ", comm_.rank(), " ran ", n,
                " unit forwards in its first step but rank ", r, " ran ", theirs.size(),
                "; every rank must run the same units in the same order");
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(theirs[i] == mine[i], "zeroshard stage 3: at position ", i, " of the first step rank ", comm_.rank(),
                  " ran unit '", nameOf(mine[i]), "' but rank ", r, " ran unit '", nameOf(theirs[i]),
                  "'; every rank must run the units in the same order");
    }
  }
}

int64_t UnitScheduler::hostBytes() const {
  int64_t total = 0;
  for (const auto& unit : units_) {
    if (unit.shardOnHost()) total += static_cast<int64_t>(unit.paramShard().nbytes());
  }
  return total;
}

int64_t UnitScheduler::bytes() const {
  int64_t total = 0;
  for (size_t u = 0; u < units_.size(); ++u) {
    total += static_cast<int64_t>(units_[u].paramShard().nbytes());
    if (policies_[u].keepGathered) total += static_cast<int64_t>(units_[u].flatParams().nbytes());
  }
  return total;
}

void UnitScheduler::refreshKeptUnits() {
  for (size_t u = 0; u < units_.size(); ++u) afterStepOf(u);
  finishAfterStep();
}

void UnitScheduler::afterStepOf(size_t u) {
  dropSecondaryShard(u);  // the step changed the unit's shards
  if (policies_.at(u).keepGathered) refreshing_.emplace_back(u, startGather(u));
}

void UnitScheduler::finishAfterStep() {
  auto refreshing = std::move(refreshing_);
  refreshing_.clear();
  for (auto& [u, handle] : refreshing) {
    waitForGather(handle, units_, u, "after the optimizer step");
    finished(u);
  }
}

void UnitScheduler::gatherAll() {
  for (size_t u = 0; u < units_.size(); ++u) startUnshard(u);
  for (size_t u = 0; u < units_.size(); ++u) unshard(u);
}

bool UnitScheduler::gatherUnit(UnitIndex unit) {
  const size_t u = unit.value;
  TORCH_CHECK(u < units_.size(), "zeroshard stage 3: unit ", u, " does not exist (", units_.size(), " units)");
  const bool wasSharded = states_[u] == UnitState::kSharded;
  unshard(u);
  return wasSharded;
}

void UnitScheduler::reshardAll() {
  for (size_t u = 0; u < units_.size(); ++u) reshard(u);
}

} // namespace zeroshard
