// Agreement across ranks on whether a phase of work succeeded everywhere.
#pragma once

#include <c10/core/Device.h>

#include <functional>
#include <string>

namespace zeroshard {

class Communicator;

// Note [agreement]: runs `work` on this rank, then every rank learns whether every other rank
// succeeded (one all-reduce of per-rank failure flags on `device`). A rank's error then fails
// the call on all ranks, instead of one rank raising while the others carry on to a collective
// that never completes; a dead rank surfaces as this all-reduce's error. The error reads
// "zeroshard <what> failed on rank(s) ...; <outcome>", `outcome` saying what a failure leaves
// behind ("nothing was published"). Blocking; every rank of the group calls it.
void agreeAcrossRanks(Communicator& comm, c10::Device device, const std::string& what, const std::string& outcome,
                      const std::function<void()>& work);

}  // namespace zeroshard
