#include "zeroshard/layout/host_memory.h"

#include <ATen/ops/empty.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace zeroshard {

at::Tensor emptyOnHost(int64_t numel, at::ScalarType dtype, bool pin, const c10::Device& computeDevice) {
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU).pinned_memory(pin && !computeDevice.is_cpu());
  return at::empty({numel}, options);
}

at::Tensor copyToHost(const at::Tensor& src, bool pin, const c10::Device& computeDevice) {
  at::Tensor out = emptyOnHost(src.numel(), src.scalar_type(), pin, computeDevice);
  out.copy_(src.reshape({-1}));  // blocking: it is read on the host right after
  return out;
}

void copyBetween(const at::Tensor& dst, const at::Tensor& src) {
  if (dst.device() == src.device()) {  // a CPU-only process: host and device are one memory
    dst.copy_(src);
    return;
  }
  const at::Tensor& host = dst.is_cpu() ? dst : src;
  const bool pinned = host.is_pinned();
  if (dst.scalar_type() == src.scalar_type()) {
    dst.copy_(src, /*non_blocking=*/pinned);
    return;
  }
  // Cast on the device side, so that the host side moves as it is stored (torch would stage a
  // cross-device cast through a pageable host temporary, which is synchronous).
  if (dst.is_cpu()) {
    dst.copy_(src.to(dst.scalar_type()), /*non_blocking=*/pinned);
  } else {
    at::Tensor staged = at::empty(src.sizes(), dst.options().dtype(src.scalar_type()));
    staged.copy_(src, /*non_blocking=*/pinned);
    dst.copy_(staged);
  }
}

void synchronizeDevice(const c10::Device& device) {
  if (device.is_cpu()) return;
  c10::impl::getDeviceGuardImpl(device.type())->synchronizeDevice(device.index());
}

}  // namespace zeroshard
