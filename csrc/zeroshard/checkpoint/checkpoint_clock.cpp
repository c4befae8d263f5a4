#include "zeroshard/checkpoint/checkpoint_clock.h"

#include <ATen/ops/full.h>

#include "zeroshard/comm/communicator.h"

#include <chrono>
#include <utility>

namespace zeroshard {

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
  const at::Device flagDevice = world.hasCpuBackend() ? at::Device(at::kCPU) : device;
  at::Tensor flag = at::full({1}, due ? 1.0f : 0.0f, at::TensorOptions().dtype(at::kFloat).device(flagDevice));
  {
    const UncountedCollectives uncounted(world);
    world.broadcast(flag, 0).wait();
  }
  return flag.item<float>() > 0;
}

} // namespace zeroshard
