// Stage 3: cutting the model's parameters into units (one flat buffer each) and choosing each
// unit's policy: what is released after forward, what stays gathered.
#pragma once

#include <ATen/core/Tensor.h>

#include "zeroshard/layout/bucket.h"
#include "zeroshard/layout/param_groups.h"
#include "zeroshard/stage3/unit_scheduler.h"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard {

// Stage 3: one unit of the model (e.g. one transformer block): the names of its parameters.
// Parameters of at most stage3_param_persistence_threshold elements leave their unit for one
// unit that stays gathered. The root unit (what no other unit holds) is not released after
// forward, since backward starts with it.
struct UnitSpec {
  std::string name;
  std::vector<std::string> paramNames;
  bool root = false;
  // Its frozen parameters (requires_grad=False), by the same rule (Note [frozen parameters]).
  std::vector<std::string> frozenNames;
};

// Stage 3: a unit as the engine built it. `numel` counts the elements it gathers and releases
// (its parameters but the persistent ones); `persistent` are its parameters of at most
// stage3_param_persistence_threshold elements, which stay gathered for the whole run in one
// shared unit (each costs a full copy on every rank plus its optimizer shard).
struct UnitInfo {
  std::string name;
  int64_t numel = 0;
  std::vector<std::string> params;
  std::vector<std::string> persistent;
  int64_t persistentNumel = 0;
  bool root = false;
  // Its frozen parameters sharded with it (one flat buffer per dtype), and their elements.
  std::vector<std::string> frozen;
  int64_t frozenNumel = 0;
};

// Which parameters each unit holds, the one rule for Python and C++ models: a trainable
// parameter of exactly one of the unit modules belongs to that unit; the rest (those of no unit,
// and those several units share, e.g. tied weights) belong to the root unit, last, "<root>".
// `namedParams`: the model's parameters in order, each once, under its first name;
// `unitParams[u]`: the parameters of unit module `unitNames[u]`. Frozen parameters follow the
// same rule into UnitSpec::frozenNames.
std::vector<UnitSpec> assignUnits(const std::vector<std::pair<std::string, at::Tensor>>& namedParams,
                                  const std::vector<std::string>& unitNames,
                                  const std::vector<std::vector<at::Tensor>>& unitParams);

struct UnitOptions {
  // Parameters of at most this many elements stay gathered (zero_optimization.stage3_param_persistence_threshold).
  int64_t persistenceThreshold = 0;
  // Units but the root release their parameters after forward (zeroshard.reshard_after_forward).
  bool reshardAfterForward = true;
};

// The units built from the specs (empty specs: one root unit of every parameter). unitOf[i] is
// the unit of spec i, none when spec i has no parameter of its own; infos[i] describes spec i.
// The persistent parameters, if any, form one more unit after the others, kept gathered.
// `buckets` are the trained parameters' flat buffers (what the optimizer and the gradient
// reducer index), `frozenBuckets` the frozen ones', and `buffers[u]` names unit u's in both.
// Frozen parameters at or under the persistence threshold stay whole: `frozenWhole`.
struct Stage3Units {
  std::vector<Bucket> buckets;
  std::vector<Bucket> frozenBuckets;
  std::vector<UnitBuffers> buffers;
  std::vector<UnitPolicy> policies;
  std::vector<std::optional<UnitIndex>> unitOf;
  std::vector<UnitInfo> infos;
  std::vector<std::pair<std::string, at::Tensor>> frozenWhole;
};

// `frozen`: the model's frozen parameters (requires_grad=False), each once under its first
// name; the ones no spec lists join the root unit (with no specs, the one root unit). Errors
// name the unit and parameter: a listed parameter that is not trainable (or not frozen), one
// listed by two units, a trainable one in none, a frozen one that is not floating-point.
Stage3Units buildStage3Units(const std::vector<ParamGroupSpec>& groups, std::vector<UnitSpec> specs,
                             const UnitOptions& options, int rank, int worldSize, at::ScalarType computeDtype,
                             std::optional<at::Device> metaDevice = std::nullopt,
                             const std::vector<std::pair<std::string, at::Tensor>>& frozen = {});

}  // namespace zeroshard
