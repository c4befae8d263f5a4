// A plain C++ training program on zeroshard: no Python anywhere.
//
//   torchrun --nproc-per-node 2 --no-python build/examples/cpp/zeroshard_train_example \
//       --config configs/zero2.json [--steps 50] [--device cuda]
//
// --device cuda trains on GPU LOCAL_RANK over NCCL (initProcessGroupFromEnv picks both when every
// local rank has a GPU); the default is the CPU, over Gloo.
// Without RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT it runs as a single rank. The model is a
// small MLP regressing y = sin(x A) for a fixed random matrix A; every rank draws its own
// micro-batches, the engine averages the gradients and shards the optimizer (and at stage 2 the
// gradients). Rank 0 logs the loss averaged over ranks, and ends with
//   final loss X (first loss Y)
// where both are that average, at the last and the first step. At stage 3 it also lists the
// units: the elements each gathers and releases around its use, and those it keeps gathered
// (parameters of at most stage3_param_persistence_threshold elements).
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "zeroshard/config.h"
#include "zeroshard/engine.h"
#include "zeroshard/process_group.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kIn = 16;
constexpr int64_t kHidden = 64;
constexpr int64_t kOut = 4;

struct Options {
  std::string config = "configs/zero2.json";
  int steps = 50;
  std::string device = "cpu";
};

Options parseArgs(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--config") {
      options.config = value();
    } else if (arg == "--device") {
      options.device = value();
      if (options.device != "cpu" && options.device != "cuda") {
        throw std::invalid_argument("--device must be cpu or cuda, got " + options.device);
      }
    } else if (arg == "--steps") {
      options.steps = std::stoi(value());
      if (options.steps < 1) throw std::invalid_argument("--steps must be >= 1");
    } else {
      throw std::invalid_argument("unknown argument " + arg + " (use --config PATH, --steps N, --device cpu|cuda)");
    }
  }
  return options;
}

// A port the kernel just handed out, for a single-rank run's rendezvous store.
int freePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    throw std::runtime_error("cannot find a free port for a single-rank run");
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

// Not launched by torchrun and nothing set by hand: one rank on this machine. If only some of
// the variables are set, leave them: initProcessGroupFromEnv names the missing one.
void defaultToSingleRank() {
  for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) {
    if (std::getenv(name) != nullptr) return;
  }
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "1", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(freePort()).c_str(), 1);
}

struct RegressionTask {
  torch::Tensor map;  // [kIn, kOut], the same on every rank, on the training device

  // A fresh micro-batch, different on every rank and every call.
  std::pair<torch::Tensor, torch::Tensor> sample(int64_t rows) const {
    auto x = torch::randn({rows, kIn}, map.options());
    return {x, torch::sin(x.matmul(map))};
  }
};

// The GPU initProcessGroupFromEnv made current for this rank, when it chose NCCL.
torch::Device trainingDevice(const std::string& name, const c10d::ProcessGroup& group) {
  if (name == "cpu") return torch::kCPU;
  if (!torch::cuda::is_available()) {
    throw std::invalid_argument("--device cuda: this build of torch sees no CUDA device");
  }
  if (group.getBackendName() != "nccl") {
    throw std::invalid_argument("--device cuda: the process group uses " + group.getBackendName() +
                                ", not NCCL (more ranks on this machine than GPUs, or zeroshard built without NCCL)");
  }
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice();
}

// Trains as the options say. Every rank returns once its last collective is done; the engine
// (and whatever it issued through the group) is gone by then.
void train(const Options& options, const c10::intrusive_ptr<c10d::ProcessGroup>& processGroup) {
  const int rank = processGroup->getRank();
  const int world = processGroup->getSize();
  const torch::Device device = trainingDevice(options.device, *processGroup);

  // The same initial model and task on every rank (the engine also broadcasts rank 0's
  // parameters); different data per rank from here on.
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(kIn, kHidden), torch::nn::Functional(torch::tanh),
                              torch::nn::Linear(kHidden, kHidden), torch::nn::Functional(torch::tanh),
                              torch::nn::Linear(kHidden, kOut));
  model->to(device);
  const RegressionTask task{(torch::randn({kIn, kOut}) / std::sqrt(static_cast<double>(kIn))).to(device)};
  torch::manual_seed(1 + rank);

  // At stage 3 each Linear layer is a unit: gathered just for its forward and its backward.
  const std::vector<std::string> units{"0", "2", "4"};
  zeroshard::Engine engine(*model, processGroup, zeroshard::Config::fromFile(options.config), units);
  const size_t root = units.size();
  auto forward = [&](at::Tensor x) {
    return engine.runUnit(root, [&] {
      for (size_t i = 0; i < model->size(); ++i) {
        auto& layer = model->begin()[static_cast<std::ptrdiff_t>(i)];
        const auto unit = std::find(units.begin(), units.end(), std::to_string(i));
        x = unit == units.end() ? layer.forward(x)
                                : engine.runUnit(unit - units.begin(), [&] { return layer.forward(x); });
      }
      return x;
    });
  };
  const auto& batch = engine.batchSizes();
  if (rank == 0) {
    std::cout << "zeroshard example: " << world << " rank(s), stage " << engine.stage() << ", global batch "
              << batch.train << " = " << batch.microPerRank << " per rank x " << batch.accumulationSteps
              << " accumulation step(s) x " << world << " rank(s), config " << options.config << ", device "
              << device << "\n";
    for (const auto& warning : engine.config().warnings) std::cout << "config warning: " << warning << "\n";
    std::cout << "plan:\n" << engine.plan().describe() << "\n";
    if (!engine.stage3Units().empty()) {
      std::cout << "stage 3 units:";
      for (const auto& unit : engine.stage3Units()) {
        std::cout << " " << unit.name << " (" << unit.numel << " gathered, " << unit.persistentNumel << " kept)";
      }
      std::cout << "\n";
    }
  }

  double firstLoss = 0, lastLoss = 0;
  for (int step = 1; step <= options.steps; ++step) {
    auto stepLoss = torch::zeros({1}, task.map.options());
    for (int64_t micro = 0; micro < batch.accumulationSteps; ++micro) {
      auto [x, y] = task.sample(batch.microPerRank);
      // With bf16/fp16 configs the parameters are 16-bit: inputs go in at that dtype, and the
      // loss is taken in fp32.
      auto loss = torch::mse_loss(forward(x.to(engine.computeDtype())).to(torch::kFloat), y);
      engine.backward(loss);
      engine.step();
      stepLoss += loss.detach() / static_cast<double>(batch.accumulationSteps);
    }
    // Logging only: the mean over ranks of this step's loss, through the same process group.
    std::vector<at::Tensor> reduced{stepLoss};
    processGroup->allreduce(reduced)->wait();
    lastLoss = stepLoss.item<double>() / world;
    if (step == 1) firstLoss = lastLoss;
    if (rank == 0 && (step == 1 || step % 10 == 0 || step == options.steps)) {
      std::printf("step %4d  loss %.6f", step, lastLoss);
      // The engine measures the global norm only when it clips.
      if (engine.config().gradientClipping > 0) std::printf("  grad norm %.4f", engine.lastGradNorm());
      std::printf("\n");
    }
  }

  if (rank == 0) {
    const auto memory = engine.memoryStats();
    const auto& comm = engine.commStats();
    std::cout << "model state on rank 0: params " << memory.paramBytes << " B, grads " << memory.gradBytes
              << " B, optimizer " << memory.optimizerBytes << " B, total " << memory.totalBytes() << " B\n"
              << "last step moved " << comm.trafficBytes() << " B";
    for (auto kind : {zeroshard::CollectiveKind::kReduceScatter, zeroshard::CollectiveKind::kAllGather,
                      zeroshard::CollectiveKind::kAllReduce}) {
      std::cout << ", " << zeroshard::collectiveName(kind) << " " << comm[kind].bytes << " B";
    }
    // Hybrid sharding and hpZ: the bytes inside a node and across nodes.
    if (engine.plan().twoLevels()) {
      std::cout << " (inside a node " << engine.intraStats().trafficBytes() << " B, across nodes "
                << engine.interStats().trafficBytes() << " B)";
    }
    std::printf("\nfinal loss %.6f (first loss %.6f)\n", lastLoss, firstLoss);
  }
}

} // namespace

int main(int argc, char** argv) {
  c10::intrusive_ptr<c10d::ProcessGroup> processGroup;
  try {
    const Options options = parseArgs(argc, argv);
    defaultToSingleRank();
    processGroup = zeroshard::initProcessGroupFromEnv();
    train(options, processGroup);
    // NCCL's communicators must be destroyed before exit, with their work finished: a group
    // destructed without it warns, and may hang in the destructor. (ProcessGroup::shutdown is
    // in torch 2.11 and 2.13 alike; Python's destroy_process_group() calls it too.)
    processGroup->shutdown();
  } catch (const std::exception& e) {
    // zeroshard's messages say what to change; the C++ backtrace behind them rarely helps a user.
    const auto* torchError = dynamic_cast<const c10::Error*>(&e);
    const char* rank = std::getenv("RANK");
    std::cerr << "rank " << (rank ? rank : "?") << ": " << (torchError ? torchError->what_without_backtrace() : e.what())
              << "\n";
    // Abort, not shutdown: another rank may still wait in a collective this one never joins, and
    // abort does not wait for it.
    if (processGroup) processGroup->abort();
    return 1;
  }
  return 0;
}
