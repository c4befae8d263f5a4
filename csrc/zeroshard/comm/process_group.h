// A c10d::ProcessGroup for a C++ program launched by torchrun (or anything that sets the
// same variables). Python programs pass their torch.distributed group instead.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
} // namespace c10d

namespace zeroshard {

struct LaunchEnv {
  int rank = 0;
  int worldSize = 1;
  int localRank = 0;
  int localWorldSize = 1;  // ranks on this machine: LOCAL_WORLD_SIZE, else the world size
  int groupRank = 0;       // this machine's index among the nodes: GROUP_RANK
  int groupWorldSize = 1;  // nodes: GROUP_WORLD_SIZE, else worldSize / localWorldSize
  std::string masterAddr;
  int masterPort = 0;
};

// Reads RANK, WORLD_SIZE, LOCAL_RANK (default: RANK modulo the local world size),
// LOCAL_WORLD_SIZE, GROUP_RANK (default: RANK / LOCAL_WORLD_SIZE), GROUP_WORLD_SIZE, MASTER_ADDR
// and MASTER_PORT, as torchrun sets them on every node (on several nodes MASTER_ADDR is the
// node that serves the rendezvous store). A missing or malformed variable is an error that names
// it and says how to launch instead; so is a layout other than torchrun's with the same
// --nproc-per-node on every node (RANK = GROUP_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK), which a
// shard group of "node" (consecutive ranks) relies on.
LaunchEnv readLaunchEnv();
// The ranks of one node: LOCAL_WORLD_SIZE when set (checked as readLaunchEnv checks it), else
// `worldSize` (one machine).
int localWorldSizeFromEnv(int worldSize);

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

// Hybrid sharding's two groups for this rank of `world` (issue 17): the world splits into shard
// groups of `shardGroupSize` consecutive ranks (a node when it is LOCAL_WORLD_SIZE); a rank's
// replicate group is the ranks at its own position in every shard group. E.g. 4 ranks in
// groups of 2: rank 3's shard group is {2, 3}, its replicate group {1, 3}.
struct HybridRanks {
  std::vector<int> shard;
  std::vector<int> replicate;
};
// Throws when shardGroupSize does not divide the world size, naming both.
HybridRanks hybridRanks(int rank, int worldSize, int shardGroupSize);

// A c10d subgroup of `world` over `ranks` (sorted, holding world's rank), with world's kind of
// backends (Gloo for CPU tensors; NCCL too when world's default is NCCL) and collectives bounded
// by `timeout`. Only the members call it; they rendezvous through world's store under `name`,
// which must be the same on every member and differ between the subgroups of one world.
c10::intrusive_ptr<c10d::ProcessGroup> makeSubgroup(const c10::intrusive_ptr<c10d::ProcessGroup>& world,
                                                    const std::vector<int>& ranks, const std::string& name,
                                                    std::chrono::milliseconds timeout);

} // namespace zeroshard
