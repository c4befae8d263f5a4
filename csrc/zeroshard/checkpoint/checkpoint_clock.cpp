#include "zeroshard/checkpoint/checkpoint_clock.h"

#include <ATen/ops/full.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "zeroshard/comm/communicator.h"

#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

namespace zeroshard {
namespace {

// Whether the group can run a collective on CPU tensors (Gloo beside NCCL). torch 2.13 asks the
// group directly; 2.11 has no hasBackendForDeviceType, but its getDeviceTypes() lists the same
// set: setBackend records each device type in both, so the two answers agree.
bool hasCpuBackend(c10d::ProcessGroup& group) {
#if ZEROSHARD_TORCH_VERSION_MAJOR > 2 || ZEROSHARD_TORCH_VERSION_MINOR >= 13
  return group.hasBackendForDeviceType(c10::DeviceType::CPU);
#else
  const std::vector<c10::Device> types = group.getDeviceTypes();
  return std::any_of(types.begin(), types.end(), [](const c10::Device& d) { return d.is_cpu(); });
#endif
}

} // namespace

CheckpointClock::CheckpointClock(double everyMinutes) : everyMinutes_(everyMinutes) {}

double CheckpointClock::steadyMinutes() {
  using Minutes = std::chrono::duration<double, std::ratio<60>>;
  return std::chrono::duration_cast<Minutes>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void CheckpointClock::setClock(std::function<double()> minutesNow) {
  now_ = std::move(minutesNow);
  lastSaveMinutes_ = now_();
}

// The flag goes over the group's CPU backend when it has one (Gloo beside NCCL, as
// zeroshard's own process groups are): a host-side collective, no device synchronisation.
bool CheckpointClock::due(Communicator& world, at::Device device) const {
  if (everyMinutes_ <= 0) return false;
  const bool due = world.rank() == 0 && now_() - lastSaveMinutes_ >= everyMinutes_;
  const at::Device flagDevice = hasCpuBackend(*world.group()) ? at::Device(at::kCPU) : device;
  at::Tensor flag = at::full({1}, due ? 1.0f : 0.0f, at::TensorOptions().dtype(at::kFloat).device(flagDevice));
  {
    const UncountedCollectives uncounted(world);
    world.broadcast(flag, 0).wait();
  }
  return flag.item<float>() > 0;
}

} // namespace zeroshard
