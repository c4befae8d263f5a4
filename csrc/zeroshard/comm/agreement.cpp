#include "zeroshard/comm/agreement.h"

#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include "zeroshard/comm/communicator.h"
#include "zeroshard/comm/gather_values.h"

#include <vector>

namespace zeroshard {
namespace {

// A rank's error as the other ranks are told it: enough for any message, bounded for many ranks.
constexpr size_t kSharedErrorBytes = 2000;

}  // namespace

void agreeAcrossRanks(Communicator& comm, c10::Device device, const std::string& what, const std::string& outcome,
                      const std::function<void()>& work) {
  std::string error;
  try {
    work();
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
    if (error.empty()) error = "unknown error";
  } catch (const std::exception& e) {
    error = e.what();
    if (error.empty()) error = "unknown error";
  }
  const int world = comm.worldSize();
  auto failed = at::zeros({world}, at::TensorOptions().dtype(at::kFloat).device(device));
  if (!error.empty()) failed[comm.rank()].fill_(1);
  try {
    comm.allReduce(failed).wait();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "zeroshard ", what, " failed: another rank stopped answering (", e.what_without_backtrace(), ")",
                error.empty() ? "" : "; this rank's own error: " + error, "; ", outcome);
  }
  const auto flags = failed.to(at::kCPU);
  std::vector<int> ranks;
  for (int r = 0; r < world; ++r) {
    if (flags[r].item<float>() > 0) ranks.push_back(r);
  }
  if (ranks.empty()) return;
  // Every rank (all know that one failed) takes part, the failed ones too, before anyone throws.
  std::string first;
  try {
    first = allGatherText(comm, error.substr(0, kSharedErrorBytes), device)[static_cast<size_t>(ranks.front())];
  } catch (const c10::Error&) {
    // A rank gone since the flags: each rank's own log still holds its error.
  }
  const c10::SourceLocation here{__func__, __FILE__, static_cast<uint32_t>(__LINE__)};
  if (!error.empty()) {
    throw AgreedFailure(here, c10::str("zeroshard ", what, " failed on rank ", comm.rank(), ": ", error, "; ", outcome));
  }
  std::string list;
  for (int r : ranks) list += (list.empty() ? "" : ", ") + std::to_string(r);
  const std::string why = first.empty() ? " (their errors say why)"
                                        : ": rank " + std::to_string(ranks.front()) + ": " + first +
                                              (ranks.size() > 1 ? " (the other ranks' errors are in their logs)" : "");
  throw AgreedFailure(here, c10::str("zeroshard ", what, " failed on rank(s) ", list, why, "; ", outcome));
}

}  // namespace zeroshard
