#pragma once

// Resolving "auto": the Hugging Face Trainer's placeholder, which a DeepSpeed config may hold for
// any value the Trainer fills in before DeepSpeed reads it. Config records each one
// (Config::autoKeys); resolveAuto fills them in the order the Trainer and DeepSpeed would:
//
//   1. values the caller gives (initialize(..., auto={"optimizer.params.lr": 2e-5}));
//   2. the model-derived bucket sizes, from the model's hidden size h, as the Hugging Face
//      integration computes them: zero_optimization.reduce_bucket_size = h*h, and at stage 3
//      stage3_prefetch_bucket_size = int(0.9*h*h) and stage3_param_persistence_threshold = 10*h;
//   3. the batch rule: an "auto" batch size the others determine (Config::batchSizes);
//   4. DeepSpeed's default, for keys of the sections DeepSpeed reads through its config models
//      (fp16, bf16, zero_optimization and its offload sections; zeroshard's own section too),
//      which drop "auto" so that the default applies.
//
// What is still open after that (a learning rate, a schedule's step count, gradient_clipping:
// values only the script knows) is one ConfigError listing every such key with the auto= key
// that would set it. Torch-free, like the rest of the config layer.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "zeroshard/config/config.h"

namespace zeroshard {

struct AutoInputs {
  // Dotted key path (as written in the config, e.g. "train_micro_batch_size_per_gpu",
  // "scheduler.params.total_num_steps") -> the value as JSON text ("4", "2e-05", "true").
  std::map<std::string, std::string> given;
  // The model's hidden size, and where it came from (said in the summary), when known.
  std::optional<int64_t> hiddenSize;
  std::string hiddenSizeSource;
  int64_t worldSize = 1;
};

struct AutoResolution {
  Config config;        // no "auto" left
  std::string summary;  // one line: what each "auto" became and why; empty when there was none
};

// Throws ConfigError: a given key that is not one of config.autoKeys (listing those), a given
// value the config rejects (named as the config would name it), or "auto" left open.
AutoResolution resolveAuto(const Config& config, const AutoInputs& inputs);

// The hidden size read from the weights when the model has no config saying it: the most
// common second dimension of the 2-D parameters (a Linear's in_features, an Embedding's width),
// the larger on a tie. None without 2-D parameters.
std::optional<int64_t> hiddenSizeFromShapes(const std::vector<std::vector<int64_t>>& shapes);

}  // namespace zeroshard
