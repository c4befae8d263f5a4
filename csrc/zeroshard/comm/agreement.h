// Agreement across ranks on whether a phase of work succeeded everywhere.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <functional>
#include <string>

namespace zeroshard {

class Communicator;

// What agreeAcrossRanks throws when every rank answered and one or more had failed: every rank
// has finished its `work` by then, so a caller may undo it (a failed save removes what it
// staged). A rank that stopped answering is a plain c10::Error: it may still be at work.
class AgreedFailure : public c10::Error {
 public:
  using c10::Error::Error;
};

// Note [agreement]: runs `work` on this rank, then every rank learns whether every other rank
// succeeded (one all-reduce of per-rank failure flags on `device`). A rank's error then fails
// the call on all ranks, instead of one rank raising while the others carry on to a collective
// that never completes; a dead rank surfaces as this all-reduce's error. The error reads
// "zeroshard <what> failed on rank(s) ...: rank R: <its error>; <outcome>", `outcome` saying
// what a failure leaves behind ("nothing was published"): after a failure the ranks all-gather
// their errors, so every rank names the cause (the file, a full disk), not only the rank; a
// failed rank's own error is its message. Blocking; every rank of the group calls it.
void agreeAcrossRanks(Communicator& comm, c10::Device device, const std::string& what, const std::string& outcome,
                      const std::function<void()>& work);

}  // namespace zeroshard
