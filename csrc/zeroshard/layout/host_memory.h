// Host memory for offloaded state (ZeRO-Offload): buffers that live in the host's RAM whatever
// the compute device is, page-locked when asked and when the compute device is a GPU (pinning
// needs one; a CPU-only process keeps them pageable), and the copies between them and the device.
//
// On a CPU-only machine "host" and "compute device" are the same memory, yet offloaded state
// still gets buffers of its own and every copy happens, so the offloaded path is what runs
// (and is tested) there too.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>

namespace zeroshard {

// An uninitialised 1-D host tensor of `numel` elements; pinned when `pin` and `computeDevice`
// is not the CPU.
at::Tensor emptyOnHost(int64_t numel, at::ScalarType dtype, bool pin, const c10::Device& computeDevice);
// A host copy of `src` (any device), pinned as emptyOnHost decides; blocking.
at::Tensor copyToHost(const at::Tensor& src, bool pin, const c10::Device& computeDevice);
// dst.copy_(src), non-blocking when one side is pinned host memory and the other a device
// (the copy is then ordered on the current stream, like a kernel: the host side must not be
// read or written before that stream has run it). A dtype change is done on the device side.
void copyBetween(const at::Tensor& dst, const at::Tensor& src);
// Waits for everything queued on `device` (nothing to wait for on a CPU): before the host writes
// buffers that asynchronous copies may still read (Note [host writes after device reads] in
// optim/optimizer_step.cpp), and for wall_clock_breakdown's timers.
void synchronizeDevice(const c10::Device& device);

}  // namespace zeroshard
