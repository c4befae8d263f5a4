// One rank of a multi-process engine test: `zeroshard_engine_worker SCENARIO`, started by
// spawnRanks() with the variables torchrun sets. Exit 0 when the scenario's checks hold;
// otherwise print what differed and exit 1.
//
// The reference is computed inside the same process: a second copy of the model (same seed)
// trained by torch::optim::AdamW on the whole global batch, of which this rank's engine sees
// only rows [rank*micro, (rank+1)*micro).
#include <torch/torch.h>
// Complete type for the intrusive_ptr that initProcessGroupFromEnv() returns.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "zeroshard/config/config.h"
#include "zeroshard/engine.h"
#include "zeroshard/comm/process_group.h"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <string>

namespace {

constexpr int64_t kMicro = 4;
constexpr int kSteps = 3;
constexpr double kLr = 1e-2;
constexpr double kWeightDecay = 0.01;  // the config's default, spelled out for the reference

// Stage 2, fp32, one micro-batch per step. reduce_bucket_size 64 splits the 195 parameters
// (filled in reverse: 3 + 48 + 16 | 128) into two buckets. `clipping` > 0 makes the engine
// measure the global gradient norm (and costs one all-reduce per step).
std::string stage2Config(double clipping = 0) {
  return R"({
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": )" + std::to_string(clipping) + R"(,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 64},
    "zeroshard": {"collective_timeout_seconds": 30}
  })";
}

double gradNorm(torch::nn::Module& model) {
  double squares = 0;
  for (const auto& p : model.parameters()) squares += p.grad().to(torch::kDouble).square().sum().item<double>();
  return std::sqrt(squares);
}

torch::nn::Sequential makeModel(uint64_t seed = 0) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Functional(torch::tanh),
                               torch::nn::Linear(16, 3));
}

struct Batch {
  torch::Tensor x, y;
};

// The global batch of step `step`, identical on every rank and in the reference.
Batch globalBatch(int step, int world) {
  torch::manual_seed(1000 + step);
  return {torch::randn({kMicro * world, 8}), torch::randn({kMicro * world, 3})};
}

// Note [leaving together]: a rank that exits while another is still connecting Gloo's full
// mesh makes that one fail in connectFullMesh ("Connection closed by peer"), which a scenario
// ending in an expected error before any collective would do. So every rank first completes
// one all-reduce (each rank's group is then formed), says so through the store and waits for
// the others; rank 0, whose process hosts the store, leaves only once the others have read it.
void leaveTogether(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  std::vector<torch::Tensor> flag{torch::ones({1})};
  group->allreduce(flag)->wait();
  const auto store = group->getStore();
  const int rank = group->getRank();
  const int world = group->getSize();
  auto keys = [&](const std::string& what) {
    std::vector<std::string> out;
    for (int r = 0; r < world; ++r) out.push_back("leave/" + what + "/" + std::to_string(r));
    return out;
  };
  store->set(keys("done")[rank], "1");
  store->wait(keys("done"));
  if (rank != 0) {
    store->set(keys("bye")[rank], "1");
    return;
  }
  auto others = keys("bye");
  others.erase(others.begin());
  store->wait(others);
}

zeroshard::Engine makeEngine(torch::nn::Module& model, const std::string& configText) {
  return zeroshard::Engine(model, zeroshard::initProcessGroupFromEnv(std::chrono::seconds(60)),
                           zeroshard::Config::fromJsonString(configText));
}

double maxAbsDiff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

// Stage 2 at `world` ranks gives the losses and final parameters of torch::optim::AdamW on the
// global batch. AdamW barely notices a gradient scaled by a constant (a sum over ranks instead
// of a mean, say), so the gradient's size is held separately: a clipping threshold far above
// the norm leaves the update alone but makes the engine report the global norm.
void stage2Parity() {
  auto model = makeModel();
  auto reference = makeModel();
  auto engine = makeEngine(*model, stage2Config(/*clipping=*/1e6));
  const int world = engine.worldSize();
  const int rank = engine.rank();
  torch::optim::AdamW optimizer(reference->parameters(), torch::optim::AdamWOptions(kLr).weight_decay(kWeightDecay));

  for (int step = 0; step < kSteps; ++step) {
    const Batch batch = globalBatch(step, world);
    {
      // Every rank holds the full parameters at stage 2, so the global loss needs no collective.
      torch::NoGradGuard noGrad;
      const double engineLoss = torch::mse_loss(model->forward(batch.x), batch.y).item<double>();
      const double referenceLoss = torch::mse_loss(reference->forward(batch.x), batch.y).item<double>();
      TORCH_CHECK(std::abs(engineLoss - referenceLoss) <= 1e-5 + 1e-4 * std::abs(referenceLoss), "step ", step,
                  ": global-batch loss ", engineLoss, " differs from the reference's ", referenceLoss);
    }
    const auto x = batch.x.narrow(0, rank * kMicro, kMicro);
    const auto y = batch.y.narrow(0, rank * kMicro, kMicro);
    engine.backward(torch::mse_loss(model->forward(x), y));
    TORCH_CHECK(engine.step(), "step ", step, ": engine.step() did not step at accumulation 1");

    optimizer.zero_grad();
    torch::mse_loss(reference->forward(batch.x), batch.y).backward();
    const double referenceNorm = gradNorm(*reference);
    TORCH_CHECK(std::abs(engine.lastGradNorm() - referenceNorm) <= 1e-4 * referenceNorm, "step ", step,
                ": global gradient norm ", engine.lastGradNorm(), " differs from the reference's ", referenceNorm);
    optimizer.step();
  }

  const auto expected = reference->named_parameters();
  double worst = 0;
  std::string worstName;
  for (const auto& item : model->named_parameters()) {
    const auto& want = expected[item.key()];
    const double diff = maxAbsDiff(item.value(), want);
    if (diff > worst) {
      worst = diff;
      worstName = item.key();
    }
    TORCH_CHECK(torch::allclose(item.value(), want, /*rtol=*/1e-4, /*atol=*/1e-5), "parameter '", item.key(),
                "' differs from torch::optim::AdamW after ", kSteps, " steps: max |difference| ", diff);
  }
  // The engine's own view of the parameters is the model's (same storage, same values).
  for (const auto& [name, tensor] : engine.namedParameters()) {
    TORCH_CHECK(torch::equal(tensor, model->named_parameters()[name]), "engine.namedParameters()['", name,
                "'] is not the model's parameter");
  }
  std::cout << "rank " << rank << ": parameters match torch::optim::AdamW, max |difference| " << worst << " ("
            << worstName << ")\n";
}

// memoryStats() is the stage-2 fp32 formula plus padding only, and one step moves exactly one
// reduce-scatter and one all-gather of the padded parameters.
void stage2Accounting() {
  auto model = makeModel();
  auto engine = makeEngine(*model, stage2Config());
  const int world = engine.worldSize();
  const int rank = engine.rank();
  int64_t numel = 0;
  for (const auto& p : model->parameters()) numel += p.numel();

  for (int step = 0; step < 2; ++step) {
    const Batch batch = globalBatch(step, world);
    engine.backward(torch::mse_loss(model->forward(batch.x.narrow(0, rank * kMicro, kMicro)),
                                    batch.y.narrow(0, rank * kMicro, kMicro)));
    engine.step();
  }

  const auto memory = engine.memoryStats();
  const auto& comm = engine.commStats();
  using zeroshard::CollectiveKind;
  const int64_t buckets = comm[CollectiveKind::kReduceScatter].calls;
  TORCH_CHECK(buckets >= 2, "expected reduce_bucket_size 64 to give 2 or more buckets, got ", buckets,
              " reduce-scatter calls");

  // Each bucket pads to a multiple of kShardAlignment * world elements.
  const int64_t unit = zeroshard::FlatLayout::kShardAlignment * world;
  const int64_t padded = memory.paramBytes / 4;
  TORCH_CHECK(memory.paramBytes % (4 * unit) == 0 && padded >= numel && padded < numel + buckets * unit,
              "paramBytes ", memory.paramBytes, " is not 4 bytes x (", numel,
              " parameters + padding below one alignment unit per bucket)");
  TORCH_CHECK(memory.gradBytes == memory.paramBytes / world, "gradBytes ", memory.gradBytes,
              " != paramBytes / world = ", memory.paramBytes / world, " (stage 2 keeps only the fp32 grad shard)");
  TORCH_CHECK(memory.optimizerBytes == 2 * memory.paramBytes / world, "optimizerBytes ", memory.optimizerBytes,
              " != 2 * paramBytes / world = ", 2 * memory.paramBytes / world, " (exp_avg + exp_avg_sq shards)");
  TORCH_CHECK(memory.totalBytes() == memory.paramBytes * (world + 3) / world, "totalBytes ", memory.totalBytes());

  auto expectBytes = [&](CollectiveKind kind, int64_t calls, int64_t bytes) {
    TORCH_CHECK(comm[kind].calls == calls && comm[kind].bytes == bytes, "last step's ",
                zeroshard::collectiveName(kind), ": ", comm[kind].calls, " calls, ", comm[kind].bytes,
                " bytes; expected ", calls, " calls, ", bytes, " bytes");
  };
  expectBytes(CollectiveKind::kReduceScatter, buckets, memory.paramBytes);
  expectBytes(CollectiveKind::kAllGather, buckets, memory.paramBytes);
  expectBytes(CollectiveKind::kAllReduce, 0, 0);
  expectBytes(CollectiveKind::kBroadcast, 0, 0);
  TORCH_CHECK(comm.trafficBytes() == 2 * memory.paramBytes, "trafficBytes ", comm.trafficBytes(),
              " != 2 * paramBytes");
  std::cout << "rank " << rank << ": " << buckets << " buckets, params " << memory.paramBytes << " B, grads "
            << memory.gradBytes << " B, optimizer " << memory.optimizerBytes << " B\n";
}

// engine.step() before any engine.backward() is a c10::Error that says to call backward.
void stepBeforeBackward() {
  auto model = makeModel();
  auto group = zeroshard::initProcessGroupFromEnv(std::chrono::seconds(60));
  zeroshard::Engine engine(*model, group, zeroshard::Config::fromJsonString(stage2Config()));
  try {
    engine.step();
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    TORCH_CHECK(what.find("backward") != std::string::npos, "the error does not mention backward: ", what);
    std::cout << "expected error: " << what << "\n";
    leaveTogether(group);
    return;
  }
  TORCH_CHECK(false, "engine.step() before any backward returned normally");
}

// A train_batch_size that the world size cannot produce is a ConfigError naming both numbers.
void batchSizeMismatch() {
  const int world = zeroshard::readLaunchEnv().worldSize;
  const int64_t wrong = kMicro * world + 4;
  const std::string text = R"({"train_batch_size": )" + std::to_string(wrong) +
                           R"(, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                               "zero_optimization": {"stage": 2}})";
  auto model = makeModel();
  auto group = zeroshard::initProcessGroupFromEnv(std::chrono::seconds(60));
  try {
    zeroshard::Engine engine(*model, group, zeroshard::Config::fromJsonString(text));
  } catch (const zeroshard::ConfigError& e) {
    const std::string what = e.what();
    TORCH_CHECK(what.find("train_batch_size (" + std::to_string(wrong) + ")") != std::string::npos &&
                    what.find("world size (" + std::to_string(world) + ")") != std::string::npos,
                "the error does not name train_batch_size ", wrong, " and world size ", world, ": ", what);
    std::cout << "expected error: " << what << "\n";
    leaveTogether(group);
    return;
  }
  TORCH_CHECK(false, "train_batch_size ", wrong, " at world size ", world, " was accepted");
}

// saveCheckpoint after two steps, then loadCheckpoint into a second engine over a differently
// initialized model (same process group): it holds the same parameters at once, gets the client
// state back, and the two train on in lockstep with identical losses and parameters.
void checkpointResume(const std::string& dir) {
  auto group = zeroshard::initProcessGroupFromEnv(std::chrono::seconds(60));
  const auto config = zeroshard::Config::fromJsonString(stage2Config());
  auto model = makeModel(0);
  zeroshard::Engine engine(*model, group, config);
  const int world = engine.worldSize();
  const int rank = engine.rank();
  auto trainStep = [&](torch::nn::Sequential& m, zeroshard::Engine& e, int step) {
    const Batch batch = globalBatch(step, world);
    auto loss = torch::mse_loss(m->forward(batch.x.narrow(0, rank * kMicro, kMicro)),
                                batch.y.narrow(0, rank * kMicro, kMicro));
    e.backward(loss);
    e.step();
    return loss.item<double>();
  };
  for (int step = 0; step < 2; ++step) trainStep(model, engine, step);
  const std::string path = engine.saveCheckpoint(dir, "", "resume at step 2");
  TORCH_CHECK(path == dir + "/global_step2", "saveCheckpoint returned '", path, "'");

  auto resumed = makeModel(7);
  zeroshard::Engine resumedEngine(*resumed, group, config);
  const auto loaded = resumedEngine.loadCheckpoint(dir);
  TORCH_CHECK(loaded.tag == "global_step2" && loaded.clientState == "resume at step 2", "loaded tag '", loaded.tag,
              "', client state '", loaded.clientState, "'");
  TORCH_CHECK(resumedEngine.globalSteps() == 2, "the loaded engine is at step ", resumedEngine.globalSteps());
  auto compare = [&](const std::string& when) {
    const auto want = model->named_parameters();
    for (const auto& item : resumed->named_parameters()) {
      TORCH_CHECK(torch::equal(item.value(), want[item.key()]), when, ": parameter '", item.key(),
                  "' differs between the uninterrupted engine and the loaded one");
    }
  };
  compare("right after loading");
  for (int step = 2; step < 4; ++step) {
    const double a = trainStep(model, engine, step);
    const double b = trainStep(resumed, resumedEngine, step);
    TORCH_CHECK(a == b, "step ", step, ": loss ", b, " after loading, ", a, " uninterrupted");
  }
  compare("two steps after loading");
  std::cout << "rank " << rank << ": resumed run matches the uninterrupted one\n";
}

// Stage 3 from C++: the units named at construction, then the root, each with what it gathers
// and the parameters at or below stage3_param_persistence_threshold that stay gathered instead.
void stage3Units() {
  auto model = makeModel();
  zeroshard::Engine engine(*model, zeroshard::initProcessGroupFromEnv(std::chrono::seconds(60)),
                           zeroshard::Config::fromJsonString(R"({
    "train_micro_batch_size_per_gpu": 4,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 16},
    "zeroshard": {"collective_timeout_seconds": 30}
  })"), {"0", "2"});
  TORCH_CHECK((engine.unitNames() == std::vector<std::string>{"0", "2", "<root>"}), "unit names: ",
              c10::Join(", ", engine.unitNames()));
  const auto& units = engine.stage3Units();
  TORCH_CHECK(units[0].params == std::vector<std::string>{"0.weight"} && units[0].numel == 128 &&
                  units[0].persistent == std::vector<std::string>{"0.bias"} && units[0].persistentNumel == 16,
              "unit 0: ", c10::Join(", ", units[0].params), " | ", c10::Join(", ", units[0].persistent));
  TORCH_CHECK(units[1].params == std::vector<std::string>{"2.weight"} && units[1].numel == 48 &&
                  units[1].persistent == std::vector<std::string>{"2.bias"} && units[1].persistentNumel == 3,
              "unit 2: ", c10::Join(", ", units[1].params), " | ", c10::Join(", ", units[1].persistent));
  TORCH_CHECK(units[2].root && units[2].params.empty() && units[2].numel == 0, "the root holds nothing here");
  std::cout << "rank " << engine.rank() << ": stage 3 units as built\n";
}

// From C++, offload is a config key: two engines on one process group, the second with
// offload_optimizer "cpu", train the same model bitwise alike; the second holds its optimizer
// state and an fp32 gradient shard in host memory (fp32: a master copy of its own, 12 bytes per
// shard element), nothing of the optimizer on the device.
void stage2Offload() {
  const auto group = zeroshard::initProcessGroupFromEnv(std::chrono::seconds(60));
  std::string offloaded = stage2Config(/*clipping=*/0.1);
  const std::string key = R"("reduce_bucket_size": 64)";
  offloaded.replace(offloaded.find(key), key.size(), key + R"(, "offload_optimizer": {"device": "cpu"})");
  auto plainModel = makeModel();
  auto offloadModel = makeModel();
  zeroshard::Engine plain(*plainModel, group, zeroshard::Config::fromJsonString(stage2Config(0.1)));
  zeroshard::Engine offload(*offloadModel, group, zeroshard::Config::fromJsonString(offloaded));
  const int world = plain.worldSize();
  const int rank = plain.rank();
  for (int step = 0; step < kSteps; ++step) {
    const Batch batch = globalBatch(step, world);
    const auto x = batch.x.narrow(0, rank * kMicro, kMicro);
    const auto y = batch.y.narrow(0, rank * kMicro, kMicro);
    plain.backward(torch::mse_loss(plainModel->forward(x), y));
    plain.step();
    offload.backward(torch::mse_loss(offloadModel->forward(x), y));
    offload.step();
  }
  const auto a = plainModel->parameters();
  const auto b = offloadModel->parameters();
  for (size_t i = 0; i < a.size(); ++i) TORCH_CHECK(torch::equal(a[i], b[i]), "parameter ", i, " differs with offload");
  const auto p = plain.memoryStats();
  const auto o = offload.memoryStats();
  const int64_t shardElements = p.optimizerBytes / 8;  // exp_avg + exp_avg_sq, fp32
  TORCH_CHECK(p.hostTotalBytes() == 0, "without offload nothing is in host memory");
  TORCH_CHECK(o.hostOptimizerBytes == 12 * shardElements && o.deviceOptimizerBytes() == 0,
              "offloaded optimizer bytes: host ", o.hostOptimizerBytes, ", device ", o.deviceOptimizerBytes());
  TORCH_CHECK(o.hostGradBytes == 4 * shardElements && o.deviceGradBytes() == p.gradBytes,
              "offloaded gradient bytes: host ", o.hostGradBytes, ", device ", o.deviceGradBytes());
  TORCH_CHECK(o.hostParamBytes == 0 && o.paramBytes == p.paramBytes, "parameters stay on the device at stage 2");
  TORCH_CHECK(offload.plan().describe().find("optimizer state: sharded over ranks 0-") != std::string::npos &&
                  offload.plan().describe().find("in host memory") != std::string::npos,
              offload.plan().describe());
  std::cout << "rank " << rank << ": offloaded run is bitwise the plain one\n";
}

} // namespace

int main(int argc, char** argv) {
  const std::map<std::string, std::function<void()>> scenarios = {
      {"stage2_parity", stage2Parity},
      {"stage2_accounting", stage2Accounting},
      {"step_before_backward", stepBeforeBackward},
      {"batch_size_mismatch", batchSizeMismatch},
      {"checkpoint_resume", [&] { checkpointResume(argc > 2 ? argv[2] : ""); }},
      {"stage3_units", stage3Units},
      {"stage2_offload", stage2Offload},
  };
  if (argc < 2 || argc > 3 || !scenarios.count(argv[1])) {
    std::cerr << "usage: zeroshard_engine_worker stage2_parity|stage2_accounting|step_before_backward|"
                 "batch_size_mismatch|checkpoint_resume DIR|stage3_units|stage2_offload\n";
    return 2;
  }
  try {
    scenarios.at(argv[1])();
  } catch (const c10::Error& e) {
    std::cerr << "rank " << std::getenv("RANK") << " failed: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "rank " << std::getenv("RANK") << " failed: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
