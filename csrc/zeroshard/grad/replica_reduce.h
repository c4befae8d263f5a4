// Hybrid sharding's second level of gradient reduction: the plan's storage reduce-scatters
// each bucket over the shard group (full or sharded, grad_storage.h); at the boundary of the
// accumulation window, once that completes, each rank's shard is all-reduced over its replicate
// group (the ranks holding the same shard in the other shard groups), so every copy of a shard
// ends with the mean over the whole world. One collective per bucket on each level per step;
// across groups only the shard moves, and only once per window (the micro-batches before it
// accumulate inside the group).
#pragma once

#include "zeroshard/grad/grad_storage.h"

#include <memory>

namespace zeroshard {

std::unique_ptr<GradStorage> withReplicaAllReduce(std::unique_ptr<GradStorage> inner, Communicator& replicate);

}  // namespace zeroshard
