#include "zeroshard/comm/communicator.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <sstream>
#include <utility>
#include <vector>

namespace zeroshard {

const char* collectiveName(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather:
      return "all_gather";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kAllReduce:
      return "all_reduce";
    case CollectiveKind::kBroadcast:
      return "broadcast";
  }
  return "unknown";
}

void CommStats::record(CollectiveKind kind, int64_t bytes) {
  auto& count = counts_[static_cast<int>(kind)];
  count.calls += 1;
  count.bytes += bytes;
}

const CollectiveCount& CommStats::operator[](CollectiveKind kind) const {
  return counts_[static_cast<int>(kind)];
}

int64_t CommStats::trafficBytes() const {
  // Note [traffic] in communicator.h.
  return (*this)[CollectiveKind::kAllGather].bytes + (*this)[CollectiveKind::kReduceScatter].bytes +
      2 * (*this)[CollectiveKind::kAllReduce].bytes + (*this)[CollectiveKind::kBroadcast].bytes;
}

void CommStats::add(const CommStats& other) {
  for (int k = 0; k < kNumCollectiveKinds; ++k) {
    counts_[k].calls += other.counts_[k].calls;
    counts_[k].bytes += other.counts_[k].bytes;
  }
}

void CommStats::reset() {
  counts_ = {};
}

CommHandle::CommHandle() = default;
CommHandle::CommHandle(
    c10::intrusive_ptr<c10d::Work> work,
    std::function<void()> onComplete,
    std::string description,
    std::chrono::milliseconds timeout,
    WaitNanos waitNanos)
    : work_(std::move(work)),
      onComplete_(std::move(onComplete)),
      description_(std::move(description)),
      timeout_(timeout),
      waitNanos_(std::move(waitNanos)) {}
CommHandle::CommHandle(CommHandle&&) noexcept = default;
CommHandle& CommHandle::operator=(CommHandle&&) noexcept = default;
CommHandle::~CommHandle() = default;

bool CommHandle::pending() const {
  return static_cast<bool>(work_);
}

bool CommHandle::completed() const {
  return !work_ || work_->isCompleted();
}

void rethrowWithContext(const std::string& context) {
  try {
    throw;
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, e.what_without_backtrace(), " [", context, "]");
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what(), " [", context, "]");
  }
}

void CommHandle::wait() {
  if (!work_) {
    return;
  }
  auto work = std::move(work_);
  const auto start = std::chrono::steady_clock::now();
  try {
    // Note [stream-ordered wait]: on a GPU, c10d's Work::wait() with no timeout only makes the
    // current stream wait for the collective's stream, and the host goes on queueing compute;
    // any timeout would make it block the host until the collective ends, serialising compute
    // behind communication. The process group's own timeout (set from the same config value)
    // and NCCL's watchdog still turn a hung collective into an error. CPU collectives (Gloo)
    // complete on the host, so there the wait is a host wait bounded by the timeout.
    if (timeout_.count() > 0) {
      work->wait(timeout_);
    } else {
      work->wait();
    }
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "zeroshard: ", description_, " failed: ", e.what_without_backtrace(),
                " (A peer rank may have exited or stalled; its own log holds the first error.)");
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "zeroshard: ", description_, " failed: ", e.what(),
                " (A peer rank may have exited or stalled; its own log holds the first error.)");
  }
  if (waitNanos_) {
    const auto waited = std::chrono::steady_clock::now() - start;
    waitNanos_->fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count(),
                          std::memory_order_relaxed);
  }
  if (onComplete_) {
    auto onComplete = std::move(onComplete_);
    onComplete();
  }
}

Communicator::Communicator(c10::intrusive_ptr<c10d::ProcessGroup> group, std::chrono::milliseconds timeout)
    : group_(std::move(group)), timeout_(timeout) {
  TORCH_CHECK(group_, "zeroshard::Communicator: the process group is null");
  TORCH_CHECK(timeout_.count() > 0, "zeroshard::Communicator: the collective timeout must be positive, got ",
              timeout_.count(), " ms");
  rank_ = group_->getRank();
  worldSize_ = group_->getSize();
}

Communicator Communicator::fromGroupName(const std::string& groupName, std::chrono::milliseconds timeout) {
  return Communicator(c10d::resolve_process_group(groupName), timeout);
}

Communicator::~Communicator() = default;
Communicator::Communicator(Communicator&&) noexcept = default;
Communicator& Communicator::operator=(Communicator&&) noexcept = default;

std::string Communicator::backendName() const {
  return group_->getBackendName();
}

std::string Communicator::describe(CollectiveKind kind, const at::Tensor& tensor) const {
  std::ostringstream out;
  out << collectiveName(kind) << " of " << tensor.nbytes() << " bytes (" << tensor.numel() << " x "
      << tensor.scalar_type() << ") on rank " << rank_ << " of " << worldSize_ << " (" << backendName() << ")";
  return out.str();
}

namespace {

void checkBuffer(const char* op, const char* role, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), "zeroshard: ", op, ": the ", role, " tensor is undefined");
  TORCH_CHECK(t.is_contiguous(), "zeroshard: ", op, ": the ", role,
              " tensor must be contiguous (collectives read and write flat buffers in place)");
}

void checkShardPair(const char* op, const at::Tensor& shard, const at::Tensor& flat, int worldSize) {
  checkBuffer(op, "shard", shard);
  checkBuffer(op, "flat", flat);
  TORCH_CHECK(flat.numel() == shard.numel() * worldSize, "zeroshard: ", op, ": the flat buffer has ",
              flat.numel(), " elements but the shard has ", shard.numel(), " and the world size is ", worldSize,
              " (flat must be shard x world size = ", shard.numel() * worldSize, ")");
  TORCH_CHECK(flat.scalar_type() == shard.scalar_type(), "zeroshard: ", op, ": dtypes differ (flat ",
              flat.scalar_type(), ", shard ", shard.scalar_type(), ")");
  TORCH_CHECK(flat.device() == shard.device(), "zeroshard: ", op, ": devices differ (flat ", flat.device(),
              ", shard ", shard.device(), ")");
}

std::function<void()> scaleAfter(const at::Tensor& t, double scale) {
  if (scale == 1.0) {
    return {};
  }
  return [t, scale]() mutable { t.mul_(scale); };
}

// Note [a group of one]: with one rank there is nothing to exchange. Every collective's result is
// its input (a sum of one value, a gather or scatter of one shard), so it is done here, in place
// or by one copy on the current stream, without the backend: counted as the collective it
// stands for, with nothing to wait for, and bitwise what the backend would return. A 1-rank
// engine's step then costs its arithmetic only (an all-gather of a bucket onto itself was a copy
// of the whole bucket), and a hybrid or hpZ group of one rank costs nothing. On a device it
// applies only where nothing is to be done (the result in place already, no scaling): a copy
// queued here would be ordered on the launching stream, where a collective's wait orders the
// waiting one (stage 3 launches prefetched gathers from a side stream), so those calls go to the
// backend.
bool doneLocally(const at::Tensor& out, const at::Tensor& in, double scale) {
  return out.device().is_cpu() || (out.data_ptr() == in.data_ptr() && scale == 1.0);
}

CommHandle localResult(const at::Tensor& out, const at::Tensor& in, double scale) {
  if (out.data_ptr() != in.data_ptr()) out.copy_(in);
  if (scale != 1.0) out.mul_(scale);
  return CommHandle();
}

} // namespace

std::chrono::milliseconds Communicator::hostWaitTimeout(const at::Tensor& tensor) const {
  return tensor.device().is_cpu() ? timeout_ : std::chrono::milliseconds(0);  // Note [stream-ordered wait]
}

// torch 2.13 asks the group directly; 2.11 has no hasBackendForDeviceType, but its
// getDeviceTypes() lists the same set: setBackend records each device type in both, so the two
// answers agree.
bool Communicator::hasCpuBackend() const {
#if ZEROSHARD_TORCH_VERSION_MAJOR > 2 || ZEROSHARD_TORCH_VERSION_MINOR >= 13
  return group_->hasBackendForDeviceType(c10::DeviceType::CPU);
#else
  const std::vector<c10::Device> types = group_->getDeviceTypes();
  return std::any_of(types.begin(), types.end(), [](const c10::Device& d) { return d.is_cpu(); });
#endif
}

CommHandle Communicator::allGather(const at::Tensor& shard, const at::Tensor& flat) {
  checkShardPair("all_gather", shard, flat, worldSize_);
  stats_.record(CollectiveKind::kAllGather, static_cast<int64_t>(flat.nbytes()));
  if (worldSize_ == 1 && doneLocally(flat, shard, 1.0)) return localResult(flat, shard, 1.0);
  at::Tensor in = shard;
  at::Tensor out = flat;
  c10d::AllgatherOptions opts;
  opts.timeout = timeout_;
#if ZEROSHARD_TORCH_VERSION_MAJOR > 2 || ZEROSHARD_TORCH_VERSION_MINOR >= 13
  auto work = group_->all_gather_single(out, in, opts);
#else
  auto work = group_->_allgather_base(out, in, opts);
#endif
  return CommHandle(std::move(work), {}, describe(CollectiveKind::kAllGather, flat), hostWaitTimeout(flat),
                    waitNanos_);
}

CommHandle Communicator::allGatherPieces(const at::Tensor& piece, const std::vector<at::Tensor>& pieces) {
  checkBuffer("all_gather", "input", piece);
  TORCH_CHECK(static_cast<int>(pieces.size()) == worldSize_, "zeroshard: all_gather: ", pieces.size(),
              " output pieces for a world of ", worldSize_, " ranks (one per rank)");
  for (const auto& out : pieces) {
    checkBuffer("all_gather", "output", out);
    TORCH_CHECK(out.numel() == piece.numel() && out.scalar_type() == piece.scalar_type() &&
                    out.device() == piece.device(),
                "zeroshard: all_gather: an output piece of ", out.numel(), " x ", out.scalar_type(), " on ",
                out.device(), " for an input of ", piece.numel(), " x ", piece.scalar_type(), " on ", piece.device());
  }
  const auto bytes = static_cast<int64_t>(piece.nbytes()) * worldSize_;
  stats_.record(CollectiveKind::kAllGather, bytes);
  if (worldSize_ == 1 && doneLocally(pieces.front(), piece, 1.0)) {
    return localResult(pieces.front(), piece, 1.0);
  }
  std::vector<std::vector<at::Tensor>> outputs{pieces};
  std::vector<at::Tensor> inputs{piece};
  c10d::AllgatherOptions opts;
  opts.timeout = timeout_;
  auto work = group_->allgather(outputs, inputs, opts);
  std::ostringstream what;
  what << "all_gather of " << bytes << " bytes in " << worldSize_ << " pieces of " << piece.numel() << " x "
       << piece.scalar_type() << " on rank " << rank_ << " of " << worldSize_ << " (" << backendName() << ")";
  return CommHandle(std::move(work), {}, what.str(), hostWaitTimeout(piece), waitNanos_);
}

CommHandle Communicator::reduceScatter(const at::Tensor& flat, const at::Tensor& shard, double scale) {
  checkShardPair("reduce_scatter", shard, flat, worldSize_);
  stats_.record(CollectiveKind::kReduceScatter, static_cast<int64_t>(flat.nbytes()));
  if (worldSize_ == 1 && doneLocally(shard, flat, scale)) return localResult(shard, flat, scale);
  at::Tensor in = flat;
  at::Tensor out = shard;
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  opts.timeout = timeout_;
#if ZEROSHARD_TORCH_VERSION_MAJOR > 2 || ZEROSHARD_TORCH_VERSION_MINOR >= 13
  auto work = group_->reduce_scatter_single(out, in, opts);
#else
  auto work = group_->_reduce_scatter_base(out, in, opts);
#endif
  return CommHandle(std::move(work), scaleAfter(shard, scale), describe(CollectiveKind::kReduceScatter, flat),
                    hostWaitTimeout(flat), waitNanos_);
}

CommHandle Communicator::allReduce(const at::Tensor& tensor, double scale) {
  checkBuffer("all_reduce", "input", tensor);
  stats_.record(CollectiveKind::kAllReduce, static_cast<int64_t>(tensor.nbytes()));
  if (worldSize_ == 1 && doneLocally(tensor, tensor, scale)) return localResult(tensor, tensor, scale);
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  opts.timeout = timeout_;
  auto work = group_->allreduce(tensors, opts);
  return CommHandle(std::move(work), scaleAfter(tensor, scale), describe(CollectiveKind::kAllReduce, tensor),
                    hostWaitTimeout(tensor), waitNanos_);
}

CommHandle Communicator::broadcast(const at::Tensor& tensor, int root) {
  checkBuffer("broadcast", "input", tensor);
  TORCH_CHECK(root >= 0 && root < worldSize_, "zeroshard: broadcast: root rank ", root,
              " is outside the group of ", worldSize_, " ranks");
  stats_.record(CollectiveKind::kBroadcast, static_cast<int64_t>(tensor.nbytes()));
  if (worldSize_ == 1 && doneLocally(tensor, tensor, 1.0)) return localResult(tensor, tensor, 1.0);
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.timeout = timeout_;
  auto work = group_->broadcast(tensors, opts);
  return CommHandle(std::move(work), {}, describe(CollectiveKind::kBroadcast, tensor), hostWaitTimeout(tensor),
                    waitNanos_);
}

} // namespace zeroshard
