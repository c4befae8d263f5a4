// Engine's module state: buffers, frozen parameters kept whole and second names of tied
// parameters (checkpoint/engine_checkpoint.h, ModuleState), which checkpoints, exports and
// pretrained loads carry beside the sharded state, and rank 0's copy of it given to every rank.
#include "zeroshard/engine/engine.h"

#include <torch/csrc/autograd/grad_mode.h>

#include <utility>
#include <vector>

namespace zeroshard {

void Engine::setModuleState(ModuleState state) {
  checkModuleState(state, buckets_);
  moduleState_ = std::move(state);
}

void Engine::setModuleStateFrom(const std::vector<std::pair<std::string, at::Tensor>>& stateDict) {
  setModuleState(moduleStateOf(stateDict, buckets_, frozenBuckets_, frozenWhole_));
}

void Engine::broadcastModuleState() {
  const UncountedCollectives uncounted(world());
  at::NoGradGuard noGrad;
  std::vector<std::pair<at::Tensor, at::Tensor>> sent;  // (the module's tensor, what is broadcast)
  std::vector<CommHandle> handles;
  for (const auto& [name, t] : moduleState_.tensors) {
    if (t.is_meta() || t.numel() == 0) continue;
    at::Tensor data = t.detach();
    at::Tensor buffer = data.is_contiguous() ? data : data.contiguous();
    handles.push_back(world().broadcast(buffer, 0));
    sent.emplace_back(data, buffer);
  }
  for (auto& h : handles) h.wait();
  for (auto& [data, buffer] : sent) {
    if (!buffer.is_same(data)) data.copy_(buffer);
  }
}

} // namespace zeroshard
