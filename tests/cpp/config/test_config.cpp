// Properties of the config layer: DeepSpeed configs read unchanged, defaults match DeepSpeed's,
// every bad value is a ConfigError that names the key path, the value and what is allowed, and
// every ignored DeepSpeed key is a warning.

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "catch.h"
#include "config/config_checks.h"
#include "zeroshard/config/config.h"

#ifndef ZEROSHARD_SOURCE_DIR
#error "ZEROSHARD_SOURCE_DIR (the repository root, as a string literal) must be defined"
#endif

using zeroshard::Config;
using zeroshard::ConfigError;
using zeroshard::testing::errorOf;
using zeroshard::testing::hasWarningFor;
using zeroshard::testing::missing;

namespace {

std::string writeTempFile(const std::string& name, const std::string& text) {
  const auto path = std::filesystem::temp_directory_path() / name;
  std::ofstream(path) << text;
  return path.string();
}

}  // namespace

TEST_CASE("an empty object gives DeepSpeed's defaults and no warnings") {
  const Config c = Config::fromJsonString("{}");
  CHECK(c.source == "<string>");
  CHECK(c.warnings.empty());
  CHECK(!c.trainBatchSize.has_value());
  CHECK(!c.trainMicroBatchSizePerGpu.has_value());
  CHECK(!c.gradientAccumulationSteps.has_value());
  CHECK(c.gradientClipping == 0);
  CHECK(!c.fp16.enabled);
  CHECK(c.fp16.lossScale == 0);
  CHECK(c.fp16.initialScalePower == 16);
  CHECK(c.fp16.lossScaleWindow == 1000);
  CHECK(c.fp16.hysteresis == 2);
  CHECK(c.fp16.minLossScale == 1);
  CHECK(!c.bf16.enabled);
  CHECK(c.optimizer.type == "AdamW");
  CHECK(c.optimizer.lr == 1e-3);
  CHECK(c.optimizer.beta1 == 0.9);
  CHECK(c.optimizer.beta2 == 0.999);
  CHECK(c.optimizer.eps == 1e-8);
  CHECK(c.optimizer.weightDecay == 0.01);
  CHECK(c.zero.stage == 0);
  CHECK(c.zero.reduceBucketSize == 500000000);
  CHECK(c.zero.allgatherBucketSize == 500000000);
  CHECK(!c.zero.overlapComm.has_value());
  CHECK(c.zero.stage3PrefetchBucketSize == 50000000);
  CHECK(c.zero.stage3ParamPersistenceThreshold == 100000);
  CHECK(c.zero.stage3MaxLiveParameters == 1000000000);
  CHECK(c.extras.collectiveTimeoutSeconds == 600);
}

TEST_CASE("overlap_comm defaults to true at stage 3 and for GPU gradients, to false below stage 3 on CPUs") {
  for (int stage = 0; stage <= 3; ++stage) {
    const Config c = Config::fromJsonString(
        "{\"zero_optimization\": {\"stage\": " + std::to_string(stage) + "}}");
    CHECK(c.zero.overlapCommResolved(/*gradsOnGpu=*/false) == (stage == 3));
    CHECK(c.zero.overlapCommResolved(/*gradsOnGpu=*/true));
  }
  const Config off = Config::fromJsonString(
      R"({"zero_optimization": {"stage": 3, "overlap_comm": false}})");
  CHECK(!off.zero.overlapCommResolved(false));
  CHECK(!off.zero.overlapCommResolved(true));
  const Config on = Config::fromJsonString(R"({"zero_optimization": {"overlap_comm": true}})");
  CHECK(on.zero.overlapCommResolved(false));
}

TEST_CASE("every message starts with the source") {
  REQUIRE(errorOf(R"({"zero_optimization": {"stage": 9}})").rfind("zeroshard config (test.json): ", 0) == 0);
  REQUIRE(missing(errorOf("[1]"), "zeroshard config (test.json): ") == "");
  const Config c = Config::fromJsonString("{}", "my.json");
  try {
    c.batchSizes(1);
    REQUIRE(false);
  } catch (const ConfigError& e) {
    REQUIRE(std::string(e.what()).rfind("zeroshard config (my.json): ", 0) == 0);
  }
}

TEST_CASE("integer keys take integral numbers, including 5e8, and nothing else") {
  SECTION("5e8 and 5.0e7 are integral floats and are accepted") {
    const Config c = Config::fromJsonString(
        R"({"zero_optimization": {"reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5.0e7}})");
    CHECK(c.zero.reduceBucketSize == 500000000);
    CHECK(c.zero.stage3PrefetchBucketSize == 50000000);
  }
  SECTION("5.5 is not a whole number") {
    const std::string m = errorOf(R"({"train_micro_batch_size_per_gpu": 5.5})");
    REQUIRE(missing(m, "train_micro_batch_size_per_gpu: must be a whole number, got 5.5") == "");
  }
  SECTION("a string is named as a string") {
    const std::string m = errorOf(R"({"zero_optimization": {"stage": "2"}})");
    REQUIRE(missing(m, "zero_optimization.stage: must be a whole number, got string \"2\"") == "");
  }
  SECTION("too large for 64 bits") {
    const std::string m = errorOf(R"({"zero_optimization": {"reduce_bucket_size": 1e30}})");
    REQUIRE(missing(m, "zero_optimization.reduce_bucket_size: must be at most") == "");
  }
}

TEST_CASE("\"auto\" is recorded by its path and leaves the default until resolved") {
  const Config c = Config::fromJsonString(
      R"({"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}}})");
  CHECK(c.autoKeys == std::vector<std::string>{"train_micro_batch_size_per_gpu", "bf16.enabled",
                                               "optimizer.params.lr", "optimizer.params.betas"});
  CHECK(!c.trainMicroBatchSizePerGpu.has_value());
  CHECK(!c.bf16.enabled);
  CHECK(c.optimizer.lr == 1e-3);
  CHECK(c.optimizer.beta1 == 0.9);
  // Where a value cannot be a placeholder, "auto" is a wrong value like any other.
  REQUIRE(missing(errorOf(R"({"optimizer": {"type": "auto"}})"), "optimizer.type: zeroshard implements AdamW only") == "");
  REQUIRE(missing(errorOf(R"({"zero_optimization": "auto"})"), "zero_optimization: must be a JSON object {...}, got string \"auto\"") == "");
}

TEST_CASE("bools must be JSON bools") {
  REQUIRE(missing(errorOf(R"({"fp16": {"enabled": 1}})"), "fp16.enabled: must be true or false, got 1") == "");
  REQUIRE(missing(errorOf(R"({"bf16": {"enabled": "true"}})"),
                  "bf16.enabled: must be true or false, got string \"true\"") == "");
  REQUIRE(missing(errorOf(R"({"zero_optimization": {"overlap_comm": 0}})"),
                  "zero_optimization.overlap_comm: must be true or false, got 0") == "");
}

TEST_CASE("out-of-range values name the key, the value and what is allowed") {
  const struct {
    const char* json;
    const char* expected;
  } cases[] = {
      {R"({"zero_optimization": {"stage": 4}})", "zero_optimization.stage: must be 0, 1, 2 or 3, got 4"},
      {R"({"zero_optimization": {"stage": -1}})", "zero_optimization.stage: must be 0, 1, 2 or 3, got -1"},
      {R"({"optimizer": {"params": {"lr": -0.1}}})", "optimizer.params.lr: must be >= 0, got -0.1"},
      {R"({"optimizer": {"params": {"eps": 0}}})", "optimizer.params.eps: must be > 0, got 0"},
      {R"({"optimizer": {"params": {"weight_decay": -0.01}}})", "optimizer.params.weight_decay: must be >= 0, got -0.01"},
      {R"({"optimizer": {"params": {"betas": [0.9, 1.0]}}})", "optimizer.params.betas[1]: must be in [0, 1), got 1.0"},
      {R"({"optimizer": {"params": {"betas": [-0.1, 0.9]}}})", "optimizer.params.betas[0]: must be in [0, 1), got -0.1"},
      {R"({"optimizer": {"params": {"betas": [0.9]}}})", "optimizer.params.betas: must be an array of two numbers in [0, 1)"},
      {R"({"optimizer": {"params": {"betas": 0.9}}})", "optimizer.params.betas: must be an array of two numbers in [0, 1), e.g. [0.9, 0.999], got 0.9"},
      {R"({"zero_optimization": {"reduce_bucket_size": 0}})", "zero_optimization.reduce_bucket_size: must be >= 1, got 0"},
      {R"({"zero_optimization": {"allgather_bucket_size": -5}})", "zero_optimization.allgather_bucket_size: must be >= 1, got -5"},
      {R"({"zero_optimization": {"stage3_prefetch_bucket_size": -1}})", "zero_optimization.stage3_prefetch_bucket_size: must be >= 0, got -1"},
      {R"({"train_batch_size": 0})", "train_batch_size: must be >= 1, got 0"},
      {R"({"train_micro_batch_size_per_gpu": -4})", "train_micro_batch_size_per_gpu: must be >= 1, got -4"},
      {R"({"gradient_accumulation_steps": 0})", "gradient_accumulation_steps: must be >= 1, got 0"},
      {R"({"gradient_clipping": -1.0})", "gradient_clipping: must be >= 0, got -1.0"},
      {R"({"fp16": {"loss_scale": -1}})", "fp16.loss_scale: must be >= 0, got -1"},
      {R"({"fp16": {"hysteresis": 0}})", "fp16.hysteresis: must be >= 1, got 0"},
      {R"({"fp16": {"loss_scale_window": 0}})", "fp16.loss_scale_window: must be >= 1, got 0"},
      {R"({"fp16": {"initial_scale_power": 64}})", "fp16.initial_scale_power: must be in 0..63, got 64"},
      {R"({"fp16": {"min_loss_scale": 0}})", "fp16.min_loss_scale: must be > 0, got 0"},
      {R"({"zeroshard": {"collective_timeout_seconds": 0}})", "zeroshard.collective_timeout_seconds: must be > 0, got 0"},
      {R"({"zeroshard": {"stage3_unit_classes": "Block"}})", "zeroshard.stage3_unit_classes: must be a list of module class names"},
      {R"({"zeroshard": {"stage3_unit_classes": [3]}})", "zeroshard.stage3_unit_classes: every entry must be a non-empty class name string"},
      {R"({"zeroshard": {"reduce_dtype": "fp64"}})", "zeroshard.reduce_dtype: must be \"compute\" or \"fp32\", got string \"fp64\""},
  };
  for (const auto& c : cases) {
    REQUIRE(missing(errorOf(c.json), c.expected) == "");
  }
}

TEST_CASE("unknown keys are errors that suggest the closest known key") {
  SECTION("top level") {
    const std::string m = errorOf(R"({"zero_optimisation": {"stage": 2}})");
    REQUIRE(missing(m, "unknown key \"zero_optimisation\"; did you mean \"zero_optimization\"?") == "");
  }
  SECTION("nested, with the full path in both names") {
    const std::string m = errorOf(R"({"zero_optimization": {"stag": 2}})");
    REQUIRE(missing(m, "unknown key \"zero_optimization.stag\"; did you mean \"zero_optimization.stage\"?") == "");
  }
  SECTION("two levels down, and transpositions count as one edit") {
    const std::string m = errorOf(R"({"optimizer": {"type": "AdamW", "params": {"weight_dacey": 0.1}}})");
    REQUIRE(missing(m, "unknown key \"optimizer.params.weight_dacey\"; did you mean \"optimizer.params.weight_decay\"?") == "");
  }
  SECTION("ignored DeepSpeed keys are suggested too") {
    const std::string m = errorOf(R"({"steps_per_prnt": 10})");
    REQUIRE(missing(m, "did you mean \"steps_per_print\"?") == "");
  }
  SECTION("a key at the wrong level points to where it belongs") {
    const Config top = Config::fromJsonString(R"({"stage": 3})");
    REQUIRE(top.warnings.size() == 1);
    CHECK(top.warnings[0].find("\"stage\" is a key of \"zero_optimization\"; did you mean \"zero_optimization.stage\"?") != std::string::npos);
    const std::string lr = errorOf(R"({"optimizer": {"type": "AdamW", "lr": 0.001}})");
    REQUIRE(missing(lr, "unknown key \"optimizer.lr\"; did you mean \"optimizer.params.lr\"?") == "");
  }
  SECTION("no suggestion for a key unlike any known one") {
    const Config top = Config::fromJsonString(R"({"foo": 1})");
    REQUIRE(top.warnings == std::vector<std::string>{"unknown top-level key \"foo\" is ignored, as DeepSpeed ignores it"});
    const std::string nested = errorOf(R"({"fp16": {"xyzzy": 1}})");
    REQUIRE(missing(nested, "unknown key \"fp16.xyzzy\": \"fp16\" takes enabled, loss_scale") == "");
  }
  SECTION("the zeroshard section and the bfloat16 alias are checked as written") {
    REQUIRE(missing(errorOf(R"({"zeroshard": {"collective_timeout": 5}})"),
                    "did you mean \"zeroshard.collective_timeout_seconds\"?") == "");
    REQUIRE(missing(errorOf(R"({"bfloat16": {"enable": true}})"),
                    "unknown key \"bfloat16.enable\"; did you mean \"bfloat16.enabled\"?") == "");
  }
}

TEST_CASE("known DeepSpeed keys zeroshard ignores are warnings naming their path") {
  const Config c = Config::fromJsonString(R"({
    "flops_profiler": {"enabled": false},
    "fp16": {"enabled": true, "auto_cast": false},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": true}},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": true},
                          "sub_group_size": 1e9}
  })");
  REQUIRE(c.warnings.size() == 4);
  CHECK(c.warnings[0] == "\"flops_profiler\" is a DeepSpeed key zeroshard does not implement yet; it is ignored");
  CHECK(hasWarningFor(c, "fp16.auto_cast"));
  CHECK(hasWarningFor(c, "optimizer.params.torch_adam"));
  CHECK(hasWarningFor(c, "zero_optimization.sub_group_size"));
  CHECK(c.zero.offloadParam.toHost);
  CHECK(c.zero.stage == 3);
  const Config bf16 = Config::fromJsonString(R"({"bf16": {"enabled": true, "immediate_grad_update": true}})");
  CHECK(hasWarningFor(bf16, "bf16.immediate_grad_update"));
}

TEST_CASE("contiguous_gradients true is what zeroshard does and false is a warning") {
  CHECK(Config::fromJsonString(R"({"zero_optimization": {"contiguous_gradients": true}})").warnings.empty());
  const Config c = Config::fromJsonString(R"({"zero_optimization": {"contiguous_gradients": false}})");
  REQUIRE(c.warnings.size() == 1);
  REQUIRE(missing(c.warnings[0], "\"zero_optimization.contiguous_gradients\": false is ignored") == "");
  REQUIRE(missing(errorOf(R"({"zero_optimization": {"contiguous_gradients": 0}})"),
                  "zero_optimization.contiguous_gradients") == "");
}

TEST_CASE("zeroshard.max_inflight_reductions is a positive count that defaults to 2") {
  CHECK(Config::fromJsonString("{}").extras.maxInflightReductions == 2);
  CHECK(Config::fromJsonString(R"({"zeroshard": {"max_inflight_reductions": 1}})").extras.maxInflightReductions == 1);
  REQUIRE(missing(errorOf(R"({"zeroshard": {"max_inflight_reductions": 0}})"),
                  "zeroshard.max_inflight_reductions") == "");
}

TEST_CASE("objects must be objects, and the type found is named") {
  REQUIRE(missing(errorOf("[1, 2]"), "the top level must be a JSON object {...}, got array [1,2]") == "");
  REQUIRE(missing(errorOf("3"), "the top level must be a JSON object {...}, got 3") == "");
  REQUIRE(missing(errorOf(R"({"zero_optimization": true})"),
                  "zero_optimization: must be a JSON object {...}, got boolean true") == "");
  REQUIRE(missing(errorOf(R"({"optimizer": {"params": [0.001]}})"),
                  "optimizer.params: must be a JSON object {...}, got array [0.001]") == "");
  REQUIRE(missing(errorOf(R"({"fp16": "on"})"), "fp16: must be a JSON object {...}, got string \"on\"") == "");
}

TEST_CASE("the optimizer is AdamW, written as AdamW or Adam in any case") {
  for (const char* type : {"AdamW", "adamw", "Adam", "ADAM"}) {
    const Config c = Config::fromJsonString(std::string(R"({"optimizer": {"type": ")") + type + "\"}}");
    CHECK(c.optimizer.type == "AdamW");
  }
  const std::string lamb = errorOf(R"({"optimizer": {"type": "Lamb"}})");
  REQUIRE(missing(lamb, "optimizer.type: zeroshard implements AdamW only") == "");
  REQUIRE(missing(lamb, "got string \"Lamb\"") == "");
  REQUIRE(missing(errorOf(R"({"optimizer": {"type": 1}})"), "optimizer.type: must be a string, got 1") == "");
  REQUIRE(missing(errorOf(R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}})"),
                  "optimizer.params.adam_w_mode: zeroshard implements AdamW (decoupled weight decay) only, so it must be true or left out, got false") == "");
  REQUIRE(missing(errorOf(R"({"optimizer": {"params": {"amsgrad": true}}})"),
                  "optimizer.params.amsgrad: zeroshard implements AdamW without AMSGrad") == "");
  const Config ok = Config::fromJsonString(
      R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": true, "amsgrad": false, "bias_correction": true}}})");
  CHECK(ok.warnings.empty());
}

TEST_CASE("fp16 and bf16 exclude each other; bfloat16 is an alias of bf16") {
  REQUIRE(missing(errorOf(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})"),
                  "fp16.enabled and bf16.enabled are both true; enable one of them") == "");
  REQUIRE(missing(errorOf(R"({"fp16": {"enabled": true}, "bfloat16": {"enabled": true}})"),
                  "fp16.enabled and bfloat16.enabled are both true") == "");
  CHECK(Config::fromJsonString(R"({"bfloat16": {"enabled": true}})").bf16.enabled);
  REQUIRE(missing(errorOf(R"({"bf16": {"enabled": true}, "bfloat16": {"enabled": true}})"),
                  "both \"bf16\" and its alias \"bfloat16\" are set") == "");
  // Both blocks present with one disabled is a normal DeepSpeed config.
  const Config c = Config::fromJsonString(R"({"fp16": {"enabled": false}, "bf16": {"enabled": true}})");
  CHECK(c.bf16.enabled);
  CHECK(!c.fp16.enabled);
}

TEST_CASE("DeepSpeed's short aliases of the stage3_ keys are read") {
  const Config c = Config::fromJsonString(
      R"({"zero_optimization": {"prefetch_bucket_size": 0, "param_persistence_threshold": 10, "max_live_parameters": 3e8}})");
  CHECK(c.zero.stage3PrefetchBucketSize == 0);
  CHECK(c.zero.stage3ParamPersistenceThreshold == 10);
  CHECK(c.zero.stage3MaxLiveParameters == 300000000);
  REQUIRE(missing(errorOf(R"({"zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 1}})"),
                  "zero_optimization: both \"stage3_prefetch_bucket_size\" and its alias \"prefetch_bucket_size\" are set") == "");
}

TEST_CASE("invalid JSON, empty text and duplicate keys are reported with their place") {
  const std::string syntax = errorOf("{\n  \"train_batch_size\": 8,\n}\n");
  REQUIRE(missing(syntax, "zeroshard config (test.json): invalid JSON at line 3, column 1: syntax error") == "");
  REQUIRE(missing(errorOf("  \n"), "the config is empty") == "");
  REQUIRE(missing(errorOf(R"({"gradient_clipping": 1e999})"), "invalid JSON: number overflow parsing '1e999'") == "");
  REQUIRE(missing(errorOf(R"({"zero_optimization": {"stage": 1, "stage": 2}})"),
                  "duplicate key \"zero_optimization.stage\"") == "");
  REQUIRE(missing(errorOf(R"({"fp16": {}, "fp16": {}})"), "duplicate key \"fp16\"") == "");
  // The same key in sibling objects is not a duplicate.
  CHECK(Config::fromJsonString(R"({"fp16": {"enabled": false}, "bf16": {"enabled": false}})").warnings.empty());
}

TEST_CASE("fromFile names the path for missing files, directories and bad JSON") {
  SECTION("missing") {
    try {
      Config::fromFile("/nonexistent/ds_config.json");
      REQUIRE(false);
    } catch (const ConfigError& e) {
      REQUIRE(missing(e.what(), "zeroshard config (/nonexistent/ds_config.json): no such file") == "");
    }
  }
  SECTION("a directory") {
    REQUIRE_THROWS_AS(Config::fromFile(std::filesystem::temp_directory_path().string()), ConfigError);
  }
  SECTION("invalid JSON, with line and column") {
    const std::string path = writeTempFile("zeroshard_test_bad.json", "{\n  \"fp16\": {\"enabled\": tru}\n}\n");
    try {
      Config::fromFile(path);
      REQUIRE(false);
    } catch (const ConfigError& e) {
      REQUIRE(missing(e.what(), "zeroshard config (" + path + "): invalid JSON at line 2, column") == "");
    }
    std::remove(path.c_str());
  }
  SECTION("a good file keeps its path as the source") {
    const std::string path = writeTempFile("zeroshard_test_good.json", R"({"steps_per_print": 5, "tensorboard": {}})");
    const Config c = Config::fromFile(path);
    CHECK(c.source == path);
    CHECK(c.stepsPerPrint == 5);
    CHECK(c.warnings.size() == 1);
    std::remove(path.c_str());
  }
}

TEST_CASE("a realistic DeepSpeed config parses with its values and warnings") {
  const Config c = Config::fromJsonString(R"({
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 2000,
    "wall_clock_breakdown": false,
    "fp16": {
      "enabled": true,
      "loss_scale": 0,
      "loss_scale_window": 500,
      "initial_scale_power": 12,
      "hysteresis": 2,
      "min_loss_scale": 1
    },
    "optimizer": {
      "type": "Adam",
      "params": {"lr": 3e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    },
    "zero_optimization": {
      "stage": 2,
      "offload_optimizer": {"device": "cpu", "pin_memory": true},
      "allgather_partitions": true,
      "allgather_bucket_size": 2e8,
      "overlap_comm": true,
      "reduce_scatter": true,
      "reduce_bucket_size": 2e8,
      "contiguous_gradients": true
    }
  })");
  CHECK(*c.trainMicroBatchSizePerGpu == 8);
  CHECK(*c.gradientAccumulationSteps == 4);
  CHECK(!c.trainBatchSize.has_value());
  CHECK(c.gradientClipping == 1.0);
  CHECK(c.fp16.enabled);
  CHECK(c.fp16.lossScale == 0);
  CHECK(c.fp16.lossScaleWindow == 500);
  CHECK(c.fp16.initialScalePower == 12);
  CHECK(c.optimizer.type == "AdamW");
  CHECK(c.optimizer.lr == 3e-5);
  CHECK(c.optimizer.beta2 == 0.95);
  CHECK(c.optimizer.weightDecay == 0.1);
  CHECK(c.zero.stage == 2);
  CHECK(c.zero.allgatherBucketSize == 200000000);
  CHECK(c.zero.reduceBucketSize == 200000000);
  CHECK(c.zero.overlapComm == std::optional<bool>(true));
  CHECK(c.stepsPerPrint == 2000);
  CHECK(!c.wallClockBreakdown);
  // allgather_partitions and reduce_scatter true are what zeroshard does, and so is offload.
  CHECK(c.warnings.empty());
  CHECK(c.zero.offloadOptimizer.toHost);
  CHECK(c.zero.offloadOptimizer.pinMemory);
  const auto sizes = c.batchSizes(2);
  CHECK(sizes.train == 64);
}

TEST_CASE("every shipped config in configs/ parses and means what its name says") {
  const std::string dir = std::string(ZEROSHARD_SOURCE_DIR) + "/configs/";
  const struct {
    const char* file;
    int64_t stage;
    bool fp16;
    bool bf16;
  } shipped[] = {
      {"zero0.json", 0, false, false}, {"zero1.json", 1, false, false},
      {"zero2.json", 2, false, false}, {"zero3.json", 3, false, false},
      {"bf16.json", 3, false, true},   {"fp16.json", 2, true, false},
  };
  for (const auto& s : shipped) {
    const Config c = Config::fromFile(dir + s.file);
    CHECK(c.source == dir + s.file);
    CHECK(c.warnings.empty());
    CHECK(c.zero.stage == s.stage);
    CHECK(c.fp16.enabled == s.fp16);
    CHECK(c.bf16.enabled == s.bf16);
    CHECK(c.optimizer.type == "AdamW");
    CHECK(c.gradientClipping == 1.0);
    CHECK(!c.trainBatchSize.has_value());
    // Shipped configs fix the per-GPU batch, so they work at any world size.
    for (int64_t world : {1, 2, 3, 4, 8}) {
      const auto sizes = c.batchSizes(world);
      CHECK(sizes.train == sizes.microPerRank * sizes.accumulationSteps * world);
    }
  }
  CHECK(Config::fromFile(dir + "fp16.json").fp16.lossScale == 0);
}

TEST_CASE("batch sizes follow DeepSpeed's rules") {
  auto config = [](const std::string& json) { return Config::fromJsonString(json, "b.json"); };
  auto errorAt = [](const Config& c, int64_t world) -> std::string {
    try {
      c.batchSizes(world);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "<no ConfigError>";
  };

  SECTION("all three must agree, and the error quotes all four numbers") {
    const Config c = config(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})");
    REQUIRE(missing(errorAt(c, 2), "zeroshard config (b.json): train_batch_size (32) != train_micro_batch_size_per_gpu (4) * gradient_accumulation_steps (2) * world size (2) = 16") == "");
    const auto sizes = c.batchSizes(4);
    CHECK(sizes.train == 32);
    CHECK(sizes.microPerRank == 4);
    CHECK(sizes.accumulationSteps == 2);
  }
  SECTION("train and micro derive accumulation, which must divide") {
    const Config c = config(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})");
    CHECK(c.batchSizes(2).accumulationSteps == 4);
    REQUIRE(missing(errorAt(c, 3), "train_batch_size (32) is not divisible by train_micro_batch_size_per_gpu (4) * world size (3) = 12, so gradient_accumulation_steps cannot be derived") == "");
    REQUIRE(missing(errorAt(c, 16), "world size (16) = 64") == "");
  }
  SECTION("train and accumulation derive micro, which must divide") {
    const Config c = config(R"({"train_batch_size": 24, "gradient_accumulation_steps": 3})");
    const auto sizes = c.batchSizes(2);
    CHECK(sizes.microPerRank == 4);
    CHECK(sizes.accumulationSteps == 3);
    REQUIRE(missing(errorAt(c, 5), "train_batch_size (24) is not divisible by gradient_accumulation_steps (3) * world size (5) = 15, so train_micro_batch_size_per_gpu cannot be derived") == "");
  }
  SECTION("micro and accumulation derive train") {
    const auto sizes = config(R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3})").batchSizes(8);
    CHECK(sizes.train == 96);
  }
  SECTION("only train: one accumulation step, micro = train / world") {
    const Config c = config(R"({"train_batch_size": 16})");
    const auto sizes = c.batchSizes(4);
    CHECK(sizes.microPerRank == 4);
    CHECK(sizes.accumulationSteps == 1);
    REQUIRE(missing(errorAt(c, 3), "train_batch_size (16) is not divisible by world size (3)") == "");
  }
  SECTION("only micro: one accumulation step, train = micro * world") {
    const auto sizes = config(R"({"train_micro_batch_size_per_gpu": 2})").batchSizes(8);
    CHECK(sizes.train == 16);
    CHECK(sizes.microPerRank == 2);
    CHECK(sizes.accumulationSteps == 1);
  }
  SECTION("only accumulation, or nothing, is not enough") {
    REQUIRE(missing(errorAt(config(R"({"gradient_accumulation_steps": 2})"), 1),
                    "train_batch_size or train_micro_batch_size_per_gpu is needed (only gradient_accumulation_steps is set)") == "");
    REQUIRE(missing(errorAt(config("{}"), 1), "train_batch_size or train_micro_batch_size_per_gpu is needed") == "");
  }
  SECTION("null reads as absent, as in DeepSpeed") {
    CHECK(config(R"({"train_batch_size": null, "train_micro_batch_size_per_gpu": 2})").batchSizes(2).train == 4);
  }
  SECTION("the world size must be positive") {
    REQUIRE(missing(errorAt(config(R"({"train_micro_batch_size_per_gpu": 2})"), 0), "the world size must be >= 1, got 0") == "");
  }
}

TEST_CASE("toJsonString round-trips every field exactly") {
  const Config original = Config::fromJsonString(R"({
    "train_batch_size": 48, "train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0.3,
    "fp16": {"enabled": true, "loss_scale": 128.5, "initial_scale_power": 7, "loss_scale_window": 77,
             "hysteresis": 5, "min_loss_scale": 0.25},
    "optimizer": {"type": "adam", "params": {"lr": 0.1234567890123, "betas": [0.8, 0.98765], "eps": 1e-12, "weight_decay": 0}},
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 123, "allgather_bucket_size": 456,
                          "contiguous_gradients": true, "stage3_prefetch_bucket_size": 0,
                          "stage3_param_persistence_threshold": 9, "stage3_max_live_parameters": 10},
    "zeroshard": {"collective_timeout_seconds": 12.5, "reshard_after_forward": false, "reduce_dtype": "fp32",
                  "max_inflight_reductions": 5,
                  "stage3_unit_classes": ["Block", "DecoderLayer"]},
    "steps_per_print": 1
  })");
  const std::string text = original.toJsonString();
  const Config back = Config::fromJsonString(text);
  CHECK(back.warnings.empty());
  CHECK(back.toJsonString() == text);
  CHECK(back.trainBatchSize == original.trainBatchSize);
  CHECK(back.trainMicroBatchSizePerGpu == original.trainMicroBatchSizePerGpu);
  CHECK(!back.gradientAccumulationSteps.has_value());
  CHECK(back.gradientClipping == original.gradientClipping);
  CHECK(!back.extras.reshardAfterForward);
  CHECK(back.extras.reduceDtype == "fp32");
  CHECK(back.extras.unitClasses == std::vector<std::string>{"Block", "DecoderLayer"});
  CHECK(back.fp16.enabled == original.fp16.enabled);
  CHECK(back.fp16.lossScale == original.fp16.lossScale);
  CHECK(back.fp16.initialScalePower == original.fp16.initialScalePower);
  CHECK(back.fp16.lossScaleWindow == original.fp16.lossScaleWindow);
  CHECK(back.fp16.hysteresis == original.fp16.hysteresis);
  CHECK(back.fp16.minLossScale == original.fp16.minLossScale);
  CHECK(back.bf16.enabled == original.bf16.enabled);
  CHECK(back.optimizer.type == original.optimizer.type);
  CHECK(back.optimizer.lr == original.optimizer.lr);
  CHECK(back.optimizer.beta1 == original.optimizer.beta1);
  CHECK(back.optimizer.beta2 == original.optimizer.beta2);
  CHECK(back.optimizer.eps == original.optimizer.eps);
  CHECK(back.optimizer.weightDecay == original.optimizer.weightDecay);
  CHECK(back.zero.stage == original.zero.stage);
  CHECK(back.zero.reduceBucketSize == original.zero.reduceBucketSize);
  CHECK(back.zero.allgatherBucketSize == original.zero.allgatherBucketSize);
  CHECK(back.zero.overlapComm == original.zero.overlapComm);
  CHECK(back.extras.maxInflightReductions == original.extras.maxInflightReductions);
  CHECK(back.zero.stage3PrefetchBucketSize == original.zero.stage3PrefetchBucketSize);
  CHECK(back.zero.stage3ParamPersistenceThreshold == original.zero.stage3ParamPersistenceThreshold);
  CHECK(back.zero.stage3MaxLiveParameters == original.zero.stage3MaxLiveParameters);
  CHECK(back.extras.collectiveTimeoutSeconds == original.extras.collectiveTimeoutSeconds);
  // The defaults round-trip too; an unset overlap_comm below stage 3 stays unset (the device
  // decides), at stage 3 it is written resolved.
  const std::string defaults = Config::fromJsonString("{}").toJsonString();
  CHECK(Config::fromJsonString(defaults).toJsonString() == defaults);
  CHECK(defaults.find("overlap_comm") == std::string::npos);
  CHECK(!Config::fromJsonString(defaults).zero.overlapComm.has_value());
  const std::string stage3 = Config::fromJsonString(R"({"zero_optimization": {"stage": 3}})").toJsonString();
  REQUIRE(missing(stage3, "\"overlap_comm\": true") == "");
}
