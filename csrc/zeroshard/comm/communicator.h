// Collectives over one c10d::ProcessGroup, straight into and out of flat buffers.
//
// Every call returns a CommHandle. Blocking use is `comm.allGather(shard, flat).wait()`;
// async use keeps the handle and waits later. On CPU (Gloo) wait() blocks the calling
// thread; on CUDA (NCCL) it makes the current stream wait for the collective's stream and
// returns without a host sync. Every call adds its bytes to stats() (see CommStats).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
class Work;
} // namespace c10d

namespace zeroshard {

enum class CollectiveKind { kAllGather = 0, kReduceScatter, kAllReduce, kBroadcast };
constexpr int kNumCollectiveKinds = 4;

// "all_gather", "reduce_scatter", "all_reduce", "broadcast".
const char* collectiveName(CollectiveKind kind);

struct CollectiveCount {
  int64_t calls = 0;
  int64_t bytes = 0;
};

// Byte counts use the size of the full (unsharded) buffer a collective works on: the
// output of an all-gather, the input of a reduce-scatter, the tensor of an all-reduce or
// broadcast. Note [traffic]: a ring all-reduce is a reduce-scatter plus an all-gather, so
// trafficBytes() counts it twice; that makes one step of stages 0, 1 and 2 move 2Ψ and
// stage 3 move 3Ψ (DESIGN.md), whichever collectives carry it.
class CommStats {
 public:
  void record(CollectiveKind kind, int64_t bytes);
  const CollectiveCount& operator[](CollectiveKind kind) const;
  int64_t trafficBytes() const;
  void reset();
  // Adds another communicator's counts (hybrid sharding's groups, into one step's stats).
  void add(const CommStats& other);

 private:
  std::array<CollectiveCount, kNumCollectiveKinds> counts_{};
};

// Nanoseconds the host spent blocked in CommHandle::wait(), summed over every handle of one
// Communicator. Shared with the handles, so a handle may outlive (a move of) its Communicator.
using WaitNanos = std::shared_ptr<std::atomic<int64_t>>;

// Inside a catch block: rethrows the c10::Error (or other exception) being handled as a
// c10::Error with `context` after its message, e.g. which bucket or unit the failed
// collective was for (what the Communicator that ran it cannot know).
[[noreturn]] void rethrowWithContext(const std::string& context);

// One collective in flight. wait() may be called once; later calls return at once.
class CommHandle {
 public:
  CommHandle();
  // `timeout` bounds a host wait; 0 makes wait() stream-ordered (Note [stream-ordered wait]).
  // `waitNanos`, when given, gets the host time wait() blocks.
  CommHandle(
      c10::intrusive_ptr<c10d::Work> work,
      std::function<void()> onComplete,
      std::string description,
      std::chrono::milliseconds timeout,
      WaitNanos waitNanos = nullptr);
  CommHandle(CommHandle&&) noexcept;
  CommHandle& operator=(CommHandle&&) noexcept;
  ~CommHandle();

  // Blocks until the collective is done (CPU), or orders the current stream after it
  // (CUDA), then runs the post-processing (e.g. the scaling that replaces AVG). Throws an
  // error naming the collective, its size and the rank when it fails or times out.
  void wait();
  bool pending() const;
  // Whether the collective has finished (never blocks); wait() is then immediate.
  bool completed() const;

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void()> onComplete_;
  std::string description_;
  std::chrono::milliseconds timeout_{0};
  WaitNanos waitNanos_;
};

class Communicator {
 public:
  // `timeout` bounds every collective: a dead or stuck peer gives an error, never a hang.
  Communicator(c10::intrusive_ptr<c10d::ProcessGroup> group, std::chrono::milliseconds timeout);
  // The group registered under `groupName` (torch.distributed's ProcessGroup.group_name).
  static Communicator fromGroupName(const std::string& groupName, std::chrono::milliseconds timeout);
  ~Communicator();
  Communicator(Communicator&&) noexcept;
  Communicator& operator=(Communicator&&) noexcept;

  int rank() const { return rank_; }
  int worldSize() const { return worldSize_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& group() const { return group_; }
  std::string backendName() const;
  // Whether the group can run a collective on CPU tensors (Gloo, or Gloo beside NCCL).
  bool hasCpuBackend() const;

  // flat[r*S, (r+1)*S) = shard of rank r, S = shard.numel(). Non-blocking.
  CommHandle allGather(const at::Tensor& shard, const at::Tensor& flat);
  // pieces[r] = rank r's `piece` (every piece the same size; they may be separate views into one
  // buffer, e.g. the same chunk of every rank's slice). Non-blocking. The backend stages the
  // result in a buffer of pieces.size() x piece.numel() elements and copies it out.
  CommHandle allGatherPieces(const at::Tensor& piece, const std::vector<at::Tensor>& pieces);
  // shard = scale * (sum over ranks of flat[rank*S, (rank+1)*S)). Gloo has no AVG, so the
  // mean is SUM with scale = 1/worldSize. Non-blocking; the scaling runs in wait().
  CommHandle reduceScatter(const at::Tensor& flat, const at::Tensor& shard, double scale = 1.0);
  // tensor = scale * (sum over ranks of tensor), in place. Non-blocking.
  CommHandle allReduce(const at::Tensor& tensor, double scale = 1.0);
  // tensor = root's tensor, in place. Non-blocking.
  CommHandle broadcast(const at::Tensor& tensor, int root);

  const CommStats& stats() const { return stats_; }
  void resetStats() { stats_.reset(); }
  // Puts back counts taken earlier (work that is not to be counted, e.g. checkpoints).
  void restoreStats(const CommStats& stats) { stats_ = stats; }
  // Host time blocked in the waits of this communicator's collectives since it was made, in
  // nanoseconds (wall_clock_breakdown's "communication"). With CUDA tensors a wait only orders
  // the stream (Note [stream-ordered wait]), so it counts the host-blocking waits alone.
  int64_t waitNanos() const { return waitNanos_ ? waitNanos_->load(std::memory_order_relaxed) : 0; }
  void setWaitNanos(int64_t nanos) {
    if (waitNanos_) waitNanos_->store(nanos, std::memory_order_relaxed);
  }

 private:
  std::string describe(CollectiveKind kind, const at::Tensor& tensor) const;
  // What CommHandle::wait() bounds a host wait by: the timeout for CPU tensors; 0 (a
  // stream-ordered wait, bounded by the process group's own timeout) for device tensors.
  std::chrono::milliseconds hostWaitTimeout(const at::Tensor& tensor) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int rank_ = 0;
  int worldSize_ = 1;
  std::chrono::milliseconds timeout_;
  CommStats stats_;
  WaitNanos waitNanos_ = std::make_shared<std::atomic<int64_t>>(0);
};

// While alive, the collectives of `comm` are not counted, nor their waits timed: they are not
// training traffic (a checkpoint, a full state dict), and commStats() goes on describing steps.
class UncountedCollectives {
 public:
  explicit UncountedCollectives(Communicator& comm)
      : comm_(comm), saved_(comm.stats()), savedWaitNanos_(comm.waitNanos()) {}
  ~UncountedCollectives() {
    comm_.restoreStats(saved_);
    comm_.setWaitNanos(savedWaitNanos_);
  }
  UncountedCollectives(const UncountedCollectives&) = delete;
  UncountedCollectives& operator=(const UncountedCollectives&) = delete;

 private:
  Communicator& comm_;
  CommStats saved_;
  int64_t savedWaitNanos_;
};

} // namespace zeroshard
