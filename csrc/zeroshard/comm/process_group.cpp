#include "zeroshard/comm/process_group.h"

#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
// Note [gloo headers]: the torch wheel ships ProcessGroupGloo.hpp but not the gloo headers it
// includes; the build takes those declarations from Debian's libgloo-dev. Only out-of-line
// members of ProcessGroupGloo are called here (Options::create_default, the constructor),
// so the code that runs is the Gloo inside libtorch_cpu, never libgloo.
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef ZEROSHARD_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <cstdlib>
#include <string>

namespace zeroshard {
namespace {

constexpr const char* kLaunchHint =
    " (launch with `torchrun --nproc-per-node N --no-python ./program`, or set RANK, WORLD_SIZE, "
    "MASTER_ADDR and MASTER_PORT yourself)";

std::string requireVar(const char* name) {
  const char* value = std::getenv(name);
  TORCH_CHECK(value != nullptr && *value != '\0', "zeroshard: environment variable ", name, " is not set",
              kLaunchHint);
  return value;
}

int parseInt(const char* name, const std::string& text, int low, int high) {
  size_t used = 0;
  long value = 0;
  try {
    value = std::stol(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(used == text.size() && !text.empty(), "zeroshard: environment variable ", name, "=\"", text,
              "\" is not an integer", kLaunchHint);
  TORCH_CHECK(value >= low && value <= high, "zeroshard: environment variable ", name, "=", value,
              " is out of range [", low, ", ", high, "]");
  return static_cast<int>(value);
}

const char* optionalVar(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

} // namespace

LaunchEnv readLaunchEnv() {
  LaunchEnv env;
  env.worldSize = parseInt("WORLD_SIZE", requireVar("WORLD_SIZE"), 1, 1 << 20);
  env.rank = parseInt("RANK", requireVar("RANK"), 0, env.worldSize - 1);
  env.localWorldSize = localWorldSizeFromEnv(env.worldSize);
  const int localWorld = env.localWorldSize;
  const char* local = optionalVar("LOCAL_RANK");
  env.localRank = local ? parseInt("LOCAL_RANK", local, 0, localWorld - 1) : env.rank % localWorld;
  const char* group = optionalVar("GROUP_RANK");
  env.groupRank = group ? parseInt("GROUP_RANK", group, 0, env.worldSize - 1) : env.rank / localWorld;
  const char* groups = optionalVar("GROUP_WORLD_SIZE");
  env.groupWorldSize = groups ? parseInt("GROUP_WORLD_SIZE", groups, 1, env.worldSize)
                              : (env.worldSize + localWorld - 1) / localWorld;
  TORCH_CHECK(env.groupRank < env.groupWorldSize, "zeroshard: environment variable GROUP_RANK=", env.groupRank,
              " is out of range [0, ", env.groupWorldSize - 1, "] (GROUP_WORLD_SIZE=", env.groupWorldSize, ")");
  TORCH_CHECK(env.groupWorldSize * localWorld == env.worldSize, "zeroshard: WORLD_SIZE=", env.worldSize, " is not ",
              env.groupWorldSize, " nodes (GROUP_WORLD_SIZE) x LOCAL_WORLD_SIZE=", localWorld,
              "; start the same number of ranks on every node (torchrun --nproc-per-node)");
  TORCH_CHECK(env.rank == env.groupRank * localWorld + env.localRank, "zeroshard: RANK=", env.rank,
              " is not GROUP_RANK=", env.groupRank, " x LOCAL_WORLD_SIZE=", localWorld, " + LOCAL_RANK=",
              env.localRank, ": zeroshard takes a node's ranks to be consecutive, as torchrun numbers them");
  env.masterAddr = requireVar("MASTER_ADDR");
  env.masterPort = parseInt("MASTER_PORT", requireVar("MASTER_PORT"), 1, 65535);
  return env;
}

int localWorldSizeFromEnv(int worldSize) {
  const char* localWorld = std::getenv("LOCAL_WORLD_SIZE");
  return localWorld && *localWorld ? parseInt("LOCAL_WORLD_SIZE", localWorld, 1, worldSize) : worldSize;
}

DeviceChoice chooseDevice(int localRank, int localWorldSize, int visibleGpus) {
  if (visibleGpus <= 0) return {};
  if (localWorldSize <= visibleGpus) return {true, localRank, ""};
  return {false, -1,
          "zeroshard: " + std::to_string(localWorldSize) + " ranks on this machine but " + std::to_string(visibleGpus) +
              " visible GPU(s): every rank uses Gloo and CPU tensors. Start at most one rank per GPU "
              "(torchrun --nproc-per-node), or set LOCAL_RANK and LOCAL_WORLD_SIZE."};
}

c10::intrusive_ptr<c10d::ProcessGroup> initProcessGroupFromEnv(std::chrono::milliseconds timeout) {
  const LaunchEnv env = readLaunchEnv();

  c10d::TCPStoreOptions storeOptions;
  storeOptions.port = static_cast<uint16_t>(env.masterPort);
  // Under torchrun the agent already serves the store on MASTER_PORT; the ranks are all clients.
  const char* agentStore = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  storeOptions.isServer = env.rank == 0 && !(agentStore && std::string(agentStore) == "True");
  storeOptions.numWorkers = env.worldSize;
  storeOptions.waitWorkers = false;
  storeOptions.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(env.masterAddr, storeOptions);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "zeroshard: rank ", env.rank, " could not reach the rendezvous store at ", env.masterAddr,
                ":", env.masterPort, ": ", e.what());
  }

  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, env.rank, env.worldSize);

  auto glooOptions = c10d::ProcessGroupGloo::Options::create_default(timeout);
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
      c10::make_intrusive<c10d::PrefixStore>("gloo", store), env.rank, env.worldSize, glooOptions);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);

#ifdef ZEROSHARD_WITH_NCCL
  const DeviceChoice choice =
      chooseDevice(env.localRank, env.localWorldSize, at::hasCUDA() ? static_cast<int>(c10::cuda::device_count()) : 0);
  if (choice.useGpu) {
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(choice.gpu));
    auto ncclOptions = c10d::ProcessGroupNCCL::Options::create();
    ncclOptions->timeout = timeout;
    auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(
        c10::make_intrusive<c10d::PrefixStore>("nccl", store), env.rank, env.worldSize, ncclOptions);
    group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
  } else if (!choice.warning.empty() && env.rank == 0) {  // the same words on every rank: said once
    TORCH_WARN_ONCE(choice.warning);
  }
#else
  if (at::hasCUDA() && env.rank == 0) {
    TORCH_WARN_ONCE("zeroshard was built without NCCL; CUDA tensors cannot be communicated. "
                    "Rebuild against a CUDA build of torch.");
  }
#endif
  return group;
}

HybridRanks hybridRanks(int rank, int worldSize, int shardGroupSize) {
  TORCH_CHECK(shardGroupSize >= 1 && worldSize % shardGroupSize == 0, "zeroshard: a shard group of ",
              shardGroupSize, " ranks does not divide the world of ", worldSize,
              " ranks; use a size that divides it (the ranks of one node, LOCAL_WORLD_SIZE, usually)");
  TORCH_CHECK(rank >= 0 && rank < worldSize, "zeroshard: rank ", rank, " is not in a world of ", worldSize);
  HybridRanks out;
  const int first = rank / shardGroupSize * shardGroupSize;
  for (int r = first; r < first + shardGroupSize; ++r) out.shard.push_back(r);
  for (int r = rank % shardGroupSize; r < worldSize; r += shardGroupSize) out.replicate.push_back(r);
  return out;
}

c10::intrusive_ptr<c10d::ProcessGroup> makeSubgroup(const c10::intrusive_ptr<c10d::ProcessGroup>& world,
                                                    const std::vector<int>& ranks, const std::string& name,
                                                    std::chrono::milliseconds timeout) {
  const auto at = std::find(ranks.begin(), ranks.end(), world->getRank());
  TORCH_CHECK(at != ranks.end() && std::is_sorted(ranks.begin(), ranks.end()), "zeroshard: subgroup '", name,
              "' must list this rank (", world->getRank(), ") among sorted ranks");
  const auto store = world->getStore();
  TORCH_CHECK(store, "zeroshard: subgroup '", name, "': the world group has no store to meet through");
  const int rank = static_cast<int>(at - ranks.begin());
  const int size = static_cast<int>(ranks.size());
  auto groupStore = c10::make_intrusive<c10d::PrefixStore>("zeroshard/" + name, store);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(groupStore, rank, size);
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>("gloo", groupStore),
                                                          rank, size,
                                                          c10d::ProcessGroupGloo::Options::create_default(timeout));
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
#ifdef ZEROSHARD_WITH_NCCL
  if (world->getBackendType() == c10d::ProcessGroup::BackendType::NCCL) {
    auto ncclOptions = c10d::ProcessGroupNCCL::Options::create();
    ncclOptions->timeout = timeout;
    auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(
        c10::make_intrusive<c10d::PrefixStore>("nccl", groupStore), rank, size, ncclOptions);
    group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
  }
#endif
  group->setGroupName(name);
  return group;
}

} // namespace zeroshard
