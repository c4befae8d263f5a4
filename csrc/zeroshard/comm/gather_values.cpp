#include "zeroshard/comm/gather_values.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include "zeroshard/comm/communicator.h"

#include <algorithm>
#include <cstring>

namespace zeroshard {
namespace {

// `mine` is a 1-D CPU tensor; returns every rank's, as CPU tensors.
std::vector<at::Tensor> allGatherVariable(Communicator& comm, const at::Tensor& mine, c10::Device device) {
  const int world = comm.worldSize();
  const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
  auto lengths = at::empty({world}, longs);
  comm.allGather(at::full({1}, mine.numel(), longs), lengths).wait();
  const auto sizes = lengths.to(at::kCPU);
  int64_t longest = 0;
  for (int r = 0; r < world; ++r) longest = std::max(longest, sizes[r].item<int64_t>());
  std::vector<at::Tensor> out;
  if (longest == 0) {
    for (int r = 0; r < world; ++r) out.push_back(at::empty({0}, mine.options()));
    return out;
  }
  auto padded = at::zeros({longest}, mine.options());
  padded.narrow(0, 0, mine.numel()).copy_(mine);
  auto all = at::empty({longest * world}, mine.options().device(device));
  comm.allGather(padded.to(device), all).wait();
  const auto cpu = all.to(at::kCPU);
  for (int r = 0; r < world; ++r) out.push_back(cpu.narrow(0, r * longest, sizes[r].item<int64_t>()));
  return out;
}

}  // namespace

std::vector<std::vector<int64_t>> allGatherValues(Communicator& comm, const std::vector<int64_t>& mine,
                                                  c10::Device device) {
  auto cpu = at::empty({static_cast<int64_t>(mine.size())}, at::TensorOptions().dtype(at::kLong));
  std::copy(mine.begin(), mine.end(), cpu.data_ptr<int64_t>());
  std::vector<std::vector<int64_t>> out;
  for (const auto& t : allGatherVariable(comm, cpu, device)) {
    const auto contiguous = t.contiguous();
    out.emplace_back(contiguous.data_ptr<int64_t>(), contiguous.data_ptr<int64_t>() + contiguous.numel());
  }
  return out;
}

std::vector<std::string> allGatherText(Communicator& comm, const std::string& mine, c10::Device device) {
  auto cpu = at::empty({static_cast<int64_t>(mine.size())}, at::TensorOptions().dtype(at::kByte));
  if (!mine.empty()) std::memcpy(cpu.data_ptr<uint8_t>(), mine.data(), mine.size());
  std::vector<std::string> out;
  for (const auto& t : allGatherVariable(comm, cpu, device)) {
    const auto contiguous = t.contiguous();
    const auto* begin = contiguous.data_ptr<uint8_t>();
    out.emplace_back(begin, begin + contiguous.numel());
  }
  return out;
}

}  // namespace zeroshard
