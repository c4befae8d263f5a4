// Stages 1 and 2 after the optimizer step: every rank updated its slice of each bucket's
// parameters, and the all-gather makes every rank's flat buffers whole again.
#pragma once

#include "zeroshard/comm/communicator.h"
#include "zeroshard/layout/bucket.h"

#include <cstdint>
#include <vector>

namespace zeroshard {

// At most `limit` elements delivered per all-gather (zero_optimization.allgather_bucket_size).
// Blocking.
void allGatherBuckets(std::vector<Bucket>& buckets, Communicator& comm, int64_t limit);

}  // namespace zeroshard
