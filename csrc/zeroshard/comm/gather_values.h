// Small values of any length from every rank (a checkpoint's file digests, stage 3's unit
// order): all-gathered in two collectives, the lengths and then the values padded to the longest.
// Blocking; every rank of the communicator's group calls it with its own values. Used for
// agreement and checks, not for training data.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard {

class Communicator;

// Every rank's `mine`, by rank. The collectives run on `device` (the group's device: CUDA for
// NCCL). When every rank's list is empty only the lengths are exchanged.
std::vector<std::vector<int64_t>> allGatherValues(Communicator& comm, const std::vector<int64_t>& mine,
                                                  c10::Device device);
std::vector<std::string> allGatherText(Communicator& comm, const std::string& mine, c10::Device device);

}  // namespace zeroshard
