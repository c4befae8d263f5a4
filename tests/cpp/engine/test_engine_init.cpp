// A C++ model built with meta tensors (csrc/zeroshard/state/meta_init.cpp, Engine's ModuleInit
// constructor), over the one-rank Gloo group in this process: the values are the init's, the
// same at every stage, and construction allocates no more than what the engine then holds plus
// one module's parameters. 2 and 4 ranks, every stage and precision: tests/python/test_meta_init.py.
#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/nn/module.h>

#undef CHECK
#include "catch.h"

#include "error_text.h"
#include "single_rank_group.h"
#include "zeroshard/engine.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

using zeroshard::Config;
using zeroshard::Engine;
using zeroshard::testing::contains;
using zeroshard::testing::errorText;
using zeroshard::testing::singleRankGroup;

namespace {

// Counts the bytes live through the CPU allocator between start() and stop(), and their peak.
// One instance for the whole test binary, never destroyed: a storage keeps a pointer to the
// allocator that made it, and a tensor made while counting may be freed long after (Gloo keeps
// a finished collective's tensors until its next one), so each counting session has its own
// counts, kept alive by the allocations that report to them.
class CountingAllocator final : public c10::Allocator {
 public:
  struct Counts {
    std::atomic<int64_t> live{0};
    std::atomic<int64_t> peak{0};
  };

  static CountingAllocator& instance() {
    static auto* allocator = new CountingAllocator();
    return *allocator;
  }
  // c10 takes an allocator only at a priority at least the current one's, so each install and
  // each restore goes one higher.
  std::shared_ptr<Counts> start() {
    counts_ = std::make_shared<Counts>();
    c10::SetCPUAllocator(this, ++priority_);
    return counts_;
  }
  void stop() { c10::SetCPUAllocator(base_, ++priority_); }

  c10::DataPtr allocate(size_t bytes) override {
    auto* held = new Held{base_->allocate(bytes), bytes, counts_};
    const int64_t live = counts_->live += static_cast<int64_t>(bytes);
    int64_t peak = counts_->peak.load();
    while (live > peak && !counts_->peak.compare_exchange_weak(peak, live)) {
    }
    return {held->inner.get(), held, &Held::release, held->inner.device()};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

 private:
  CountingAllocator() : base_(c10::GetCPUAllocator()), counts_(std::make_shared<Counts>()) {}

  struct Held {
    c10::DataPtr inner;
    size_t bytes;
    std::shared_ptr<Counts> counts;
    static void release(void* p) {
      auto* held = static_cast<Held*>(p);
      held->counts->live -= static_cast<int64_t>(held->bytes);
      delete held;
    }
  };
  uint8_t priority_ = 100;
  c10::Allocator* base_;
  std::shared_ptr<Counts> counts_;
};

// Four blocks of two [64, 64] weights and a [64] bias each, on the meta device.
struct Block : torch::nn::Module {
  Block() {
    for (const char* name : {"a", "b"}) register_parameter(name, at::empty({64, 64}, at::kMeta));
    register_parameter("bias", at::empty({64}, at::kMeta));
  }
};
struct Net : torch::nn::Module {
  std::vector<std::string> units;
  Net() {
    for (int i = 0; i < 4; ++i) {
      register_module("blocks" + std::to_string(i), std::make_shared<Block>());
      units.push_back("blocks" + std::to_string(i));
    }
    register_buffer("scale", at::empty({3}, at::kMeta));
  }
};

// Each module's own parameters and buffers from a value of its name: deterministic, and
// different per module.
double baseOf(const std::string& module) {
  return static_cast<double>(std::hash<std::string>{}(module) % 97);
}
at::Tensor expectedOf(const std::string& module, c10::IntArrayRef shape) {
  return at::arange(c10::multiply_integers(shape), at::kFloat).mul(0.001).add(baseOf(module)).view(shape);
}
void fill(const std::string& name, torch::nn::Module& module) {
  at::NoGradGuard noGrad;
  for (auto& p : module.named_parameters(/*recurse=*/false)) p.value().copy_(expectedOf(name, p.value().sizes()));
  for (auto& b : module.named_buffers(/*recurse=*/false)) b.value().fill_(baseOf(name));
}

Config configOf(int stage, bool bf16) {
  Config config = Config::fromJsonString(
      R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": )" + std::to_string(stage) +
      R"(, "stage3_param_persistence_threshold": 0}, "zeroshard": {"collective_timeout_seconds": 30}})");
  config.bf16.enabled = bf16;
  return config;
}

} // namespace

TEST_CASE("a meta model is initialised by its module init at every stage", "[engine_init]") {
  for (const bool bf16 : {false, true}) {
    for (int stage = 0; stage <= 3; ++stage) {
      CAPTURE(stage, bf16);
      Net net;
      std::vector<std::string> seen;
      std::shared_ptr<CountingAllocator::Counts> counts;
      int64_t liveInSteps = 0;  // the most bytes live while a step ran, its scratch included
      auto init = [&](const std::string& name, torch::nn::Module& module) {
        seen.push_back(name);
        liveInSteps = std::max(liveInSteps, counts->live.load());
        fill(name, module);
      };
      std::unique_ptr<Engine> engine;
      auto& counting = CountingAllocator::instance();
      counts = counting.start();
      engine = std::make_unique<Engine>(net, singleRankGroup(), configOf(stage, bf16),
                                        stage == 3 ? net.units : std::vector<std::string>{}, init, at::kCPU);
      counting.stop();
      const int64_t peak = counts->peak.load();
      REQUIRE(seen == std::vector<std::string>{"", "blocks0", "blocks1", "blocks2", "blocks3"});
      // The masters are the init's values; the buffer got storage and its value.
      for (const auto& [name, value] : engine->masterWeights()) {
        CAPTURE(name);
        REQUIRE(at::equal(value, expectedOf(name.substr(0, name.rfind('.')), value.sizes())));
      }
      REQUIRE(net.named_buffers()["scale"].device().is_cpu());
      REQUIRE(at::equal(net.named_buffers()["scale"], at::full({3}, baseOf(""))));
      // While the steps run, what exists is this rank's parameter storage, its fp32 masters
      // (16-bit: a separate copy, whole at one rank) and one module's parameters in fp32, never
      // a whole bucket's buffer beside the shards; construction's peak is what the engine then
      // holds (the AdamW state comes after the steps). The rest: the generator state and other
      // small buffers (generator states: about 5 KB each, two copies).
      const int64_t module = (2 * 64 * 64 + 64) * 4;
      const auto stats = engine->memoryStats();
      const int64_t masters = bf16 ? 2 * stats.paramBytes : 0;
      INFO("live in steps " << liveInSteps << ", peak " << peak << ", held " << stats.totalBytes());
      REQUIRE(liveInSteps <= stats.paramBytes + masters + module + 16 * 1024);
      REQUIRE(liveInSteps >= stats.paramBytes + masters);
      REQUIRE(peak <= stats.totalBytes() + module + 16 * 1024);
    }
  }
}

TEST_CASE("a model partly on the meta device is refused naming both parameters", "[engine_init]") {
  Net net;
  zeroshard::setTensorData(net.named_parameters()["blocks1.a"], at::zeros({64, 64}));
  const std::string error =
      errorText([&] { Engine(net, singleRankGroup(), configOf(2, false), {}, fill, at::kCPU); });
  REQUIRE(contains(error, "'blocks0.a' is on the meta device but 'blocks1.a' is on cpu"));
}
