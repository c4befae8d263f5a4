// Starts one process per rank with the variables torchrun sets, and waits for all of them
// within a deadline: a test that would hang fails instead, and every child is killed.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace zeroshard::testing {

struct RankOutcome {
  int exitCode = -1;     // -1 when killed
  bool killed = false;   // killed at the deadline, or as the lingering rank
  std::string output;    // stdout and stderr together
};

struct SpawnOptions {
  std::chrono::seconds deadline{120};
  // A rank that is expected to outlive the others (e.g. one that never joins a collective):
  // it is killed, without counting as a failure, once every other rank has exited.
  int lingeringRank = -1;
};

// Runs `program scenario` as ranks 0..worldSize-1 on 127.0.0.1 with a fresh port.
std::vector<RankOutcome> spawnRanks(
    const std::string& program,
    const std::string& scenario,
    int worldSize,
    const SpawnOptions& options = {});

// Runs `program args...` the same way (pass a named vector: a braced list of string literals
// would also fit the overload above, and the call is ambiguous).
std::vector<RankOutcome> spawnRanks(
    const std::string& program,
    const std::vector<std::string>& args,
    int worldSize,
    const SpawnOptions& options = {});

// "rank 1 exited 1:\n<its output>" for every rank that did not exit 0 (lingering rank aside).
std::string describeFailures(const std::vector<RankOutcome>& outcomes, int lingeringRank = -1);

} // namespace zeroshard::testing
