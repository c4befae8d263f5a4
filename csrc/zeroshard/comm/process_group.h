// A c10d::ProcessGroup for a C++ program launched by torchrun (or anything that sets the
// same variables). Python programs pass their torch.distributed group instead.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <string>

namespace c10d {
class ProcessGroup;
} // namespace c10d

namespace zeroshard {

struct LaunchEnv {
  int rank = 0;
  int worldSize = 1;
  int localRank = 0;
  int localWorldSize = 1;  // ranks on this machine: LOCAL_WORLD_SIZE, else the world size
  std::string masterAddr;
  int masterPort = 0;
};

// Reads RANK, WORLD_SIZE, LOCAL_RANK (default: RANK), MASTER_ADDR and MASTER_PORT. A missing
// or malformed variable is an error that names it and says how to launch instead.
LaunchEnv readLaunchEnv();

// The one-GPU-per-local-rank rule, for C++ programs (initProcessGroupFromEnv) and Python ones
// (zeroshard.init_distributed) alike: with at least as many visible GPUs as ranks on this
// machine, each rank uses GPU `localRank` and NCCL; otherwise every rank uses CPU tensors and
// Gloo (all ranks must choose alike), and `warning` says why when there are GPUs.
struct DeviceChoice {
  bool useGpu = false;
  int gpu = -1;
  std::string warning;
};
DeviceChoice chooseDevice(int localRank, int localWorldSize, int visibleGpus);

// Rendezvous through a TCPStore on MASTER_ADDR:MASTER_PORT (rank 0 serves it), then Gloo for
// CPU tensors and, when torch has CUDA and zeroshard was built with NCCL, NCCL for CUDA
// tensors on device LOCAL_RANK. Blocks until every rank has joined or `timeout` passes.
c10::intrusive_ptr<c10d::ProcessGroup> initProcessGroupFromEnv(
    std::chrono::milliseconds timeout = std::chrono::minutes(10));

} // namespace zeroshard
