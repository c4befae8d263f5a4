// Optimizer param groups as the engine receives them, their checks, and how stages 0-2 cut them
// into buckets.
#pragma once

#include <ATen/core/Tensor.h>

#include "zeroshard/layout/bucket.h"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard {

// One optimizer param group: its parameters (leaf tensors that require grad) with their names,
// and hyper-parameters that override the config's optimizer.params.
struct ParamGroupSpec {
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::optional<double> lr, weightDecay, beta1, beta2, eps;
};

// Names each group's parameters after the model's: `modelParams` are the model's parameters in
// order, each once, under its first name. No groups given (nullopt): every trainable parameter
// of the model in one group. A tensor that is not a parameter of the model, or a trainable
// parameter in no group, is an error (ValueError in Python) naming it.
std::vector<ParamGroupSpec> nameParamGroups(std::optional<std::vector<ParamGroupSpec>> groups,
                                            const std::vector<std::pair<std::string, at::Tensor>>& modelParams);

// The one home of the param-group rules (the Python layer only turns torch's param-group dicts
// into specs): every parameter defined, a float32 leaf that requires grad, in one group under
// one name; at least one in all. Errors name the parameter.
void checkParamGroups(const std::vector<ParamGroupSpec>& groups);

// Where the model's states live: the device of its parameters ("cpu" when there are none).
std::string deviceOfParamGroups(const std::vector<ParamGroupSpec>& groups);
// Whether the parameters are on the meta device: all of them (the engine then allocates on
// MetaInit::device), or none; a mix is an error naming one of each.
bool paramsOnMeta(const std::vector<ParamGroupSpec>& groups);

// Stages 0-2: each group's parameters in buckets of at least `capacity` elements (the last of a
// group may be smaller), filled in reverse parameter order, the order backward usually
// produces gradients. Parameters on the meta device: see Bucket (`metaDevice`).
std::vector<Bucket> bucketParamGroups(const std::vector<ParamGroupSpec>& groups, int64_t capacity, int rank,
                                      int worldSize, at::ScalarType computeDtype,
                                      std::optional<at::Device> metaDevice = std::nullopt);

}  // namespace zeroshard
