#include "zeroshard/layout/host_memory.h"

#include <ATen/ops/empty.h>

namespace zeroshard {

at::Tensor emptyOnHost(int64_t numel, at::ScalarType dtype, bool pin, const c10::Device& computeDevice) {
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU).pinned_memory(pin && !computeDevice.is_cpu());
  return at::empty({numel}, options);
}

at::Tensor copyToHost(const at::Tensor& src, bool pin, const c10::Device& computeDevice) {
  at::Tensor out = emptyOnHost(src.numel(), src.scalar_type(), pin, computeDevice);
  copyBetween(out, src.reshape({-1}));
  return out;
}

void copyBetween(const at::Tensor& dst, const at::Tensor& src) {
  if (dst.device() == src.device()) {  // a CPU-only process: host and device are one memory
    dst.copy_(src);
    return;
  }
  const at::Tensor& host = dst.is_cpu() ? dst : src;
  dst.copy_(src, /*non_blocking=*/host.is_pinned());
}

}  // namespace zeroshard
