// ZeRO-Offload's gradients: the storage the plan picks (full or sharded, grad_storage.h), plus
// for each bucket whose optimizer state is in host memory an fp32 copy of its gradient shard
// there, which that bucket's host AdamW step reads.
//
// The copy is made as the reduction that ends the accumulation window finishes (its completion
// runs it, so it overlaps the rest of backward): on a GPU on a copy stream of its own, ordered
// after the reduction by an event, into pinned memory when the plan pins; finishCopies() waits
// for it before the step. The device gradients are kept as without offload (they accumulate
// the window), so the values the host step reads are exactly those the device step would.
#pragma once

#include "zeroshard/grad/grad_storage.h"

#include <memory>
#include <vector>

namespace zeroshard {

// `onHost[i]`: bucket i's optimizer state is in host memory. `inner` is the plan's storage.
std::unique_ptr<GradStorage> withHostGradShards(std::unique_ptr<GradStorage> inner, const std::vector<Bucket>& buckets,
                                                const std::vector<char>& onHost, bool pin);

}  // namespace zeroshard
