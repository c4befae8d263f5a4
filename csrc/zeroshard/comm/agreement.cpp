#include "zeroshard/comm/agreement.h"

#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include "zeroshard/comm/communicator.h"

#include <vector>

namespace zeroshard {

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
  TORCH_CHECK(error.empty(), "zeroshard ", what, " failed on rank ", comm.rank(), ": ", error, "; ", outcome);
  std::string list;
  for (int r : ranks) list += (list.empty() ? "" : ", ") + std::to_string(r);
  TORCH_CHECK(false, "zeroshard ", what, " failed on rank(s) ", list, " (their errors say why); ", outcome);
}

}  // namespace zeroshard
