// DeepSpeed users' configs as they are: "auto" recorded and resolved in the Hugging Face
// integration's order, unknown top-level keys warned about unless they are typos, the scheduler
// section with DeepSpeed's types and defaults, tensor_parallel, offload device "none".

#include <string>
#include <vector>

#include "catch.h"
#include "config/config_checks.h"
#include "zeroshard/config/auto_values.h"
#include "zeroshard/config/config.h"

using zeroshard::AutoInputs;
using zeroshard::Config;
using zeroshard::ConfigError;
using zeroshard::resolveAuto;
using zeroshard::testing::errorOf;
using zeroshard::testing::missing;

namespace {

// An HF Trainer template (zero3.json of the Hugging Face docs), trimmed.
const char* kTemplate = R"({
  "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
  "bf16": {"enabled": "auto"},
  "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
  "zero_optimization": {"stage": 3, "overlap_comm": true, "reduce_bucket_size": "auto",
                        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                        "stage3_gather_16bit_weights_on_model_save": true},
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto"
})";

AutoInputs trainerValues(int64_t world) {
  AutoInputs in;
  in.given = {{"optimizer.params.lr", "2e-05"},          {"optimizer.params.betas", "[0.9, 0.95]"},
              {"optimizer.params.eps", "1e-08"},         {"optimizer.params.weight_decay", "0.1"},
              {"gradient_clipping", "1.0"},              {"train_micro_batch_size_per_gpu", "4"},
              {"gradient_accumulation_steps", "2"}};
  in.hiddenSize = 64;
  in.hiddenSizeSource = "model.config.hidden_size";
  in.worldSize = world;
  return in;
}

std::string resolveError(const Config& c, const AutoInputs& in) {
  try {
    resolveAuto(c, in);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "<no ConfigError>";
}

}  // namespace

TEST_CASE("an HF template resolves from given values then the hidden size then the batch rule then defaults", "[config]") {
  const Config c = Config::fromJsonString(kTemplate, "zero3.json");
  REQUIRE(c.autoKeys.size() == 13);
  const auto r = resolveAuto(c, trainerValues(2));
  CHECK(r.config.autoKeys.empty());
  CHECK(r.config.optimizer.lr == 2e-5);
  CHECK(r.config.optimizer.beta2 == 0.95);
  CHECK(r.config.optimizer.weightDecay == 0.1);
  CHECK(r.config.gradientClipping == 1.0);
  // h*h, int(0.9*h*h), 10*h with h = 64, as the Hugging Face integration fills them at stage 3.
  CHECK(r.config.zero.reduceBucketSize == 4096);
  CHECK(r.config.zero.stage3PrefetchBucketSize == 3686);
  CHECK(r.config.zero.stage3ParamPersistenceThreshold == 640);
  CHECK(!r.config.fp16.enabled);  // DeepSpeed's default once its config model drops "auto"
  CHECK(!r.config.bf16.enabled);
  CHECK(r.config.fp16.initialScalePower == 16);
  const auto sizes = r.config.batchSizes(2);
  CHECK(sizes.train == 16);  // the batch rule: 4 * 2 * 2
  CHECK(r.config.zero.gather16bitWeightsOnModelSave);
  REQUIRE(missing(r.summary, "zeroshard config (zero3.json): \"auto\" resolved: ") == "");
  REQUIRE(missing(r.summary, "optimizer.params.lr=2e-05 (given)") == "");
  REQUIRE(missing(r.summary, "zero_optimization.reduce_bucket_size=4096 (h*h)") == "");
  REQUIRE(missing(r.summary, "zero_optimization.stage3_prefetch_bucket_size=3686 (int(0.9*h*h))") == "");
  REQUIRE(missing(r.summary, "; h = 64, the hidden size from model.config.hidden_size") == "");
  REQUIRE(missing(r.summary, "fp16.enabled=false (DeepSpeed's default)") == "");
  REQUIRE(missing(r.summary, "train_batch_size=16 (batch rule)") == "");
}

TEST_CASE("one error lists every auto still open with the auto key that sets it", "[config]") {
  const Config c = Config::fromJsonString(kTemplate, "zero3.json");
  AutoInputs in;
  in.worldSize = 2;
  in.given = {{"train_micro_batch_size_per_gpu", "4"}};
  const std::string m = resolveError(c, in);
  REQUIRE(missing(m, "zeroshard config (zero3.json): \"auto\" has no value for \"gradient_clipping\", \"optimizer.params.lr\", "
                     "\"optimizer.params.betas\", \"optimizer.params.eps\", \"optimizer.params.weight_decay\"") == "");
  REQUIRE(missing(m, "auto={\"gradient_clipping\": ..., \"optimizer.params.lr\": ..., ") == "");
  // Without a hidden size the bucket sizes take DeepSpeed's defaults instead of failing.
  CHECK(m.find("reduce_bucket_size") == std::string::npos);
  // Nothing sets the batch: it is open too, named by its keys.
  const std::string batch = resolveError(Config::fromJsonString(R"({"train_batch_size": "auto"})"), AutoInputs{});
  REQUIRE(missing(batch, "\"auto\" has no value for \"train_batch_size\"") == "");
}

TEST_CASE("auto values are checked like written ones and must name an auto key", "[config]") {
  const Config c = Config::fromJsonString(R"({"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": 1.0})", "a.json");
  AutoInputs in;
  in.given = {{"train_micro_batch_size_per_gpu", "0"}};
  REQUIRE(missing(resolveError(c, in), "train_micro_batch_size_per_gpu: must be >= 1, got 0") == "");
  in.given = {{"gradient_clipping", "2.0"}};
  REQUIRE(missing(resolveError(c, in), "auto={\"gradient_clipping\": 2.0} is given, but the config does not write "
                                       "\"gradient_clipping\" as \"auto\"; its \"auto\" keys are "
                                       "\"train_micro_batch_size_per_gpu\"") == "");
  in.given = {{"train_micro_batch_size_per_gpu", "not json"}};
  REQUIRE(missing(resolveError(c, in), "auto[\"train_micro_batch_size_per_gpu\"]: the value must be JSON") == "");
}

TEST_CASE("the stage-3 bucket keys come from the hidden size at stage 3 only", "[config]") {
  const Config c = Config::fromJsonString(
      R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}})");
  AutoInputs in;
  in.hiddenSize = 10;
  in.hiddenSizeSource = "the weights";
  const auto r = resolveAuto(c, in);
  CHECK(r.config.zero.reduceBucketSize == 100);
  CHECK(r.config.zero.stage3PrefetchBucketSize == 50000000);
  CHECK(r.config.zero.stage3ParamPersistenceThreshold == 100000);
}

TEST_CASE("the hidden size from the weights is the most common second dimension", "[config]") {
  using zeroshard::hiddenSizeFromShapes;
  // A GPT block: embedding [V, h], qkv [3h, h], proj [h, h], fc1 [4h, h], fc2 [h, 4h], norms [h].
  CHECK(hiddenSizeFromShapes({{50, 8}, {24, 8}, {8, 8}, {32, 8}, {8, 32}, {8}}) == 8);
  CHECK(hiddenSizeFromShapes({{3, 4}, {4, 6}}) == 6);  // a tie takes the larger
  CHECK(!hiddenSizeFromShapes({{4}, {2, 3, 4}}).has_value());
}

TEST_CASE("unknown top-level keys warn as DeepSpeed ignores them but near misses are errors", "[config]") {
  const Config c = Config::fromJsonString(R"({"_comment": "from a repo", "my_extra": {"a": 1}, "comms_config": {}})");
  REQUIRE(c.warnings.size() == 3);
  CHECK(c.warnings[0] == "unknown top-level key \"_comment\" is ignored, as DeepSpeed ignores it");
  REQUIRE(missing(errorOf(R"({"zero_optimisation": {"stage": 2}})"), "did you mean \"zero_optimization\"?") == "");
  REQUIRE(missing(errorOf(R"({"gradient_clip": 1})"), "did you mean \"gradient_clipping\"?") == "");
  // Inside a known section an unknown key stays an error, as in DeepSpeed's config models.
  REQUIRE(missing(errorOf(R"({"zero_optimization": {"my_extra": 1}})"), "unknown key \"zero_optimization.my_extra\"") == "");
}

TEST_CASE("tensor_parallel of size 0 or 1 is accepted and larger is an error", "[config]") {
  CHECK(Config::fromJsonString(R"({"tensor_parallel": {"autotp_size": 1, "tp_overlap_comm": true}})").warnings.empty());
  CHECK(Config::fromJsonString(R"({"tensor_parallel": {"tp": {"tp_size": 1}}})").warnings.empty());
  REQUIRE(missing(errorOf(R"({"tensor_parallel": {"autotp_size": 4}})"),
                  "tensor_parallel.autotp_size: zeroshard does not implement tensor parallelism") == "");
  REQUIRE(missing(errorOf(R"({"tensor_parallel": {"tp": {"tp_size": 2}}})"), "tensor_parallel.tp.tp_size:") == "");
  REQUIRE(missing(errorOf(R"({"tensor_parallel": {"autotp_size": "auto2"}})"),
                  "tensor_parallel.autotp_size: must be a whole number, got string \"auto2\"") == "");
}

TEST_CASE("offload: none is off, cpu takes effect at the stages that have it, nvme is refused", "[config]") {
  const Config none = Config::fromJsonString(
      R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none", "pin_memory": true,
          "buffer_count": 4}, "offload_param": {"device": "none", "pin_memory": true}}})");
  CHECK(none.warnings.empty());
  CHECK(!none.zero.offloadOptimizer.toHost);
  CHECK(!none.zero.offloadParam.toHost);

  // The NVMe knobs are inert with "cpu" too, as in DeepSpeed.
  const Config cpu = Config::fromJsonString(
      R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": false,
          "ratio": 0.25, "buffer_count": 4, "fast_init": true}, "offload_param": {"device": "cpu", "max_in_cpu": 1e9}}})");
  CHECK(cpu.warnings.empty());
  CHECK(cpu.zero.offloadOptimizer.toHost);
  CHECK(!cpu.zero.offloadOptimizer.pinMemory);
  CHECK(cpu.zero.offloadOptimizer.ratio == 0.25);
  CHECK(cpu.zero.offloadParam.toHost);
  CHECK(cpu.zero.offloadParam.pinMemory);  // DeepSpeed's default
  // The parsed config writes them back.
  const Config again = Config::fromJsonString(cpu.toJsonString());
  CHECK(again.zero.offloadOptimizer.ratio == 0.25);
  CHECK(again.zero.offloadParam.toHost);

  // Where the stage has nothing to offload: a warning naming the key, and nothing moves.
  const Config stage0 = Config::fromJsonString(R"({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})");
  REQUIRE(stage0.warnings.size() == 1);
  REQUIRE(missing(stage0.warnings[0], "\"zero_optimization.offload_optimizer.device\": \"cpu\" is ignored at "
                                      "zero_optimization.stage 0") == "");
  CHECK(!stage0.zero.offloadOptimizer.toHost);
  const Config stage2 = Config::fromJsonString(R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})");
  REQUIRE(stage2.warnings.size() == 1);
  REQUIRE(missing(stage2.warnings[0], "\"zero_optimization.offload_param.device\": \"cpu\" is ignored at "
                                      "zero_optimization.stage 2; the parameters go to host memory at stage 3 only") == "");

  REQUIRE(missing(errorOf(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})"),
                  "zero_optimization.offload_param.device: \"nvme\" (ZeRO-Infinity) is not supported by zeroshard; "
                  "use \"cpu\"") == "");
  REQUIRE(missing(errorOf(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}})"),
                  "zero_optimization.offload_optimizer.ratio: must be between 0 and 1, got") == "");
  REQUIRE(missing(errorOf(R"({"zero_optimization": {"offload_param": {"device": "gpu"}}})"),
                  "zero_optimization.offload_param.device: must be \"none\", \"cpu\" or \"nvme\", got string \"gpu\"") == "");
}

TEST_CASE("stage3_max_live_parameters 0 and the 16-bit save flag with its aliases are read", "[config]") {
  CHECK(Config::fromJsonString(R"({"zero_optimization": {"stage3_max_live_parameters": 0}})").zero.stage3MaxLiveParameters == 0);
  for (const char* key : {"stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                          "stage3_gather_fp16_weights_on_model_save"}) {
    const Config c = Config::fromJsonString(std::string(R"({"zero_optimization": {")") + key + R"(": true}})");
    CHECK(c.zero.gather16bitWeightsOnModelSave);
  }
  REQUIRE(missing(errorOf(R"({"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": true,
                                                    "gather_16bit_weights_on_model_save": false}})"),
                  "keep one of them") == "");
}

TEST_CASE("the scheduler takes DeepSpeed's five types with their parameters and defaults", "[config]") {
  const Config c = Config::fromJsonString(
      R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_max_lr": 3e-4, "warmup_type": "linear"}}})");
  CHECK(c.scheduler.type == "WarmupDecayLR");
  CHECK(c.scheduler.param("total_num_steps") == 100);
  CHECK(c.scheduler.param("warmup_max_lr") == 3e-4);
  CHECK(c.scheduler.param("warmup_min_lr") == 0.0);      // DeepSpeed's default
  CHECK(c.scheduler.param("warmup_num_steps") == 1000);  // DeepSpeed's default
  CHECK(c.scheduler.param("last_batch_iteration") == -1);
  CHECK(c.scheduler.warmupType == "linear");
  CHECK_THROWS_AS(c.scheduler.param("cycle_min_lr"), std::out_of_range);
  // WarmupLR's warmup_max_lr has no default (None: each group's own lr); WarmupDecayLR's is 0.001.
  CHECK_THROWS_AS(Config::fromJsonString(R"({"scheduler": {"type": "WarmupLR"}})").scheduler.param("warmup_max_lr"),
                  std::out_of_range);
  CHECK(Config::fromJsonString(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 5}}})")
            .scheduler.param("warmup_max_lr") == 0.001);

  const Config one = Config::fromJsonString(
      R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
          "cycle_second_step_size": null, "cycle_momentum": false}}})");
  CHECK(!one.scheduler.has("cycle_second_step_size"));
  CHECK(one.scheduler.param("cycle_momentum") == 0.0);
  CHECK(one.scheduler.param("cycle_first_step_size") == 2000);
  CHECK(one.scheduler.param("cycle_min_mom") == 0.8);
  // Round trip through toJsonString keeps every written value.
  const Config back = Config::fromJsonString(one.toJsonString());
  CHECK(back.scheduler.params == one.scheduler.params);
  CHECK(Config::fromJsonString(c.toJsonString()).scheduler.warmupType == "linear");
  CHECK(Config::fromJsonString("{}").scheduler.type.empty());
}

TEST_CASE("scheduler errors name the key, the value and the five types", "[config]") {
  REQUIRE(missing(errorOf(R"({"scheduler": {"type": "CosineAnnealing"}})"),
                  "scheduler.type: must be one of DeepSpeed's schedules LRRangeTest, OneCycle, WarmupLR, "
                  "WarmupDecayLR, WarmupCosineLR, got string \"CosineAnnealing\"") == "");
  REQUIRE(missing(errorOf(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 10}}})"),
                  "unknown key \"scheduler.params.warmup_steps\": WarmupLR takes warmup_min_lr, warmup_max_lr, "
                  "warmup_num_steps, warmup_type, last_batch_iteration") == "");
  REQUIRE(missing(errorOf(R"({"scheduler": {"type": "WarmupCosineLR", "params": {}}})"),
                  "scheduler.params.total_num_steps: WarmupCosineLR needs it") == "");
  REQUIRE(missing(errorOf(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2.5}}})"),
                  "scheduler.params.warmup_num_steps: must be a whole number, got 2.5") == "");
  REQUIRE(missing(errorOf(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}})"),
                  "scheduler.params.warmup_type: must be \"log\" or \"linear\", got string \"cosine\"") == "");
  REQUIRE(missing(errorOf(R"({"scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_staircase": 1}}})"),
                  "scheduler.params.lr_range_test_staircase: must be true or false, got 1") == "");
  // "auto" in the params is recorded, for initialize(auto=...) to fill.
  const Config a = Config::fromJsonString(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}})");
  CHECK(a.autoKeys == std::vector<std::string>{"scheduler.params.total_num_steps"});
}

TEST_CASE("steps_per_print and wall_clock_breakdown are read and round-trip", "[config]") {
  const Config c = Config::fromJsonString(R"({"steps_per_print": 7, "wall_clock_breakdown": true})");
  CHECK(c.stepsPerPrint == 7);
  CHECK(c.wallClockBreakdown);
  const Config back = Config::fromJsonString(c.toJsonString());
  CHECK(back.stepsPerPrint == 7);
  CHECK(back.wallClockBreakdown);
  CHECK(Config::fromJsonString("{}").stepsPerPrint == 10);
  REQUIRE(missing(errorOf(R"({"steps_per_print": 0})"), "steps_per_print: must be >= 1, got 0") == "");
}
