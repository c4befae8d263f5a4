// A checkpoint as one ordinary state dict: full tensors under the model's own names, in its
// state-dict order, streamed one tensor at a time (memory bounded by the largest tensor).
#pragma once

#include <c10/core/ScalarType.h>

#include "zeroshard/checkpoint/reader.h"
#include "zeroshard/checkpoint/progress.h"

#include <optional>
#include <string>

namespace zeroshard {

// Writes `out` as a .safetensors file (through a staging name, renamed when complete; removed on
// failure). Trained parameters are written in `dtype` (default float32, the master weights);
// buffers and frozen parameters keep their own dtype. Returns the number of tensors written.
// `progress`: where its line goes (python -m zeroshard.convert: terminalProgress); none by default.
size_t writeConsolidatedSafetensors(CheckpointReader& reader, const std::string& out,
                                    std::optional<at::ScalarType> dtype = std::nullopt, ProgressOutput progress = {});

} // namespace zeroshard
