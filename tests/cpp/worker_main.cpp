// One rank of a multi-process test: `zeroshard_test_worker SCENARIO`, started by
// spawnRanks() with the variables torchrun sets. Exit 0 when the scenario's checks hold;
// otherwise print what differed and exit 1.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "zeroshard/comm/gather_values.h"
#include "zeroshard/comm/communicator.h"
#include "zeroshard/comm/process_group.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <vector>

using zeroshard::CollectiveKind;
using zeroshard::Communicator;

namespace {

void expectEqual(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  TORCH_CHECK(at::equal(actual, expected), what, ": got ", actual, " expected ", expected);
}

void expectCount(const Communicator& comm, CollectiveKind kind, int64_t calls, int64_t bytes) {
  const auto& count = comm.stats()[kind];
  TORCH_CHECK(count.calls == calls && count.bytes == bytes, zeroshard::collectiveName(kind), ": counted ",
              count.calls, " calls and ", count.bytes, " bytes, expected ", calls, " and ", bytes);
}

// Values and byte counts of every collective, blocking and overlapped.
void collectives(Communicator& comm) {
  const int r = comm.rank();
  const int w = comm.worldSize();
  const auto f32 = at::TensorOptions().dtype(at::kFloat);

  // all-gather of a 3-element float shard and of a 1-element double shard, both in flight.
  auto flat = at::empty({3 * w}, f32);
  auto flat64 = at::empty({w}, at::kDouble);
  auto first = comm.allGather(at::full({3}, r + 1.0, f32), flat);
  auto second = comm.allGather(at::full({1}, r * 0.5, at::kDouble), flat64);
  second.wait();
  first.wait();
  expectEqual(flat, at::arange(1, w + 1, f32).repeat_interleave(3), "all_gather float32");
  expectEqual(flat64, at::arange(w, at::kDouble) * 0.5, "all_gather float64");
  expectCount(comm, CollectiveKind::kAllGather, 2, 3 * w * 4 + w * 8);

  // reduce-scatter: sum, then mean through explicit scaling.
  auto input = at::arange(4 * w, f32) + r;
  auto shard = at::empty({4}, f32);
  comm.reduceScatter(input, shard).wait();
  auto expectedSum = at::arange(4 * r, 4 * r + 4, f32) * w + w * (w - 1) / 2.0;
  expectEqual(shard, expectedSum, "reduce_scatter sum");
  comm.reduceScatter(input, shard, 1.0 / w).wait();
  TORCH_CHECK(at::allclose(shard, expectedSum / w), "reduce_scatter mean: got ", shard);
  expectCount(comm, CollectiveKind::kReduceScatter, 2, 2 * 4 * w * 4);

  // all-reduce and broadcast, in place.
  auto t = at::full({5}, static_cast<double>(r), f32);
  comm.allReduce(t).wait();
  expectEqual(t, at::full({5}, w * (w - 1) / 2.0, f32), "all_reduce");
  auto b = at::full({6}, static_cast<double>(r), f32);
  comm.broadcast(b, w - 1).wait();
  expectEqual(b, at::full({6}, w - 1.0, f32), "broadcast");
  expectCount(comm, CollectiveKind::kAllReduce, 1, 20);
  expectCount(comm, CollectiveKind::kBroadcast, 1, 24);
  const int64_t traffic = (3 * w * 4 + w * 8) + 2 * 4 * w * 4 + 2 * 20 + 24;
  TORCH_CHECK(comm.stats().trafficBytes() == traffic, "traffic ", comm.stats().trafficBytes(), " != ", traffic);
  comm.resetStats();
  TORCH_CHECK(comm.stats().trafficBytes() == 0, "resetStats left bytes behind");

  // A shape error is caught before anything is sent, on every rank alike.
  bool threw = false;
  try {
    comm.allGather(at::zeros({2}, f32), at::empty({2 * w + 1}, f32));
  } catch (const c10::Error& e) {
    threw = std::string(e.what()).find("flat buffer has") != std::string::npos;
  }
  TORCH_CHECK(threw, "a mis-sized all_gather was not rejected");
  TORCH_CHECK(comm.stats().trafficBytes() == 0, "a rejected collective was counted");
}

// The last rank dies; the others' all-reduce must fail with an error that names it.
//
// Note [dead peer after the mesh]: the peer must die only once the group is formed on every
// rank. Returning from the Gloo constructor on the dying rank does not prove that: its side
// of the full mesh can be connected while a survivor is still inside connectFullMesh, which
// then fails ("Connection closed by peer") instead of the collective under test. So every
// rank first completes one all-reduce, and each survivor then says so through the rendezvous
// store; the dying rank exits only once it has read every survivor's key. The store's
// timeout bounds that wait, and no sleep orders anything.
void deadPeer(Communicator& comm) {
  const int dying = comm.worldSize() - 1;
  auto joined = at::ones({1});
  comm.allReduce(joined).wait();
  TORCH_CHECK(joined.item<float>() == comm.worldSize(), "the all-reduce before the peer dies gave ",
              joined.item<float>(), ", expected ", comm.worldSize());
  const auto store = comm.group()->getStore();
  auto readyKey = [](int rank) { return "dead_peer/ready/" + std::to_string(rank); };
  if (comm.rank() == dying) {
    std::vector<std::string> survivors;
    for (int rank = 0; rank < dying; ++rank) survivors.push_back(readyKey(rank));
    store->wait(survivors);
    std::_Exit(0);
  }
  store->set(readyKey(comm.rank()), "1");
  try {
    comm.allReduce(at::ones({1024})).wait();
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    TORCH_CHECK(what.find("all_reduce") != std::string::npos && what.find("rank") != std::string::npos,
                "the error does not name the collective: ", what);
    std::cout << "expected error: " << e.what_without_backtrace() << "\n";
    return;
  }
  TORCH_CHECK(false, "all_reduce with a dead peer returned normally");
}

// The last rank stays alive but never joins: the others must time out, not hang.
void stalledPeer(Communicator& comm) {
  if (comm.rank() == comm.worldSize() - 1) {
    ::pause();  // killed by the test once the others have exited
  }
  try {
    comm.allReduce(at::ones({16})).wait();
  } catch (const c10::Error& e) {
    TORCH_CHECK(std::string(e.what()).find("all_reduce") != std::string::npos,
                "the error does not name the collective: ", e.what());
    std::cout << "expected error: " << e.what_without_backtrace() << "\n";
    return;
  }
  TORCH_CHECK(false, "all_reduce with a stalled peer returned normally");
}

// Values of different lengths from every rank come back by rank, whole; all-empty lists too.
void gatherValues(Communicator& comm) {
  const int rank = comm.rank();
  std::vector<int64_t> mine;
  for (int i = 0; i <= rank; ++i) mine.push_back(100 * rank + i);
  const auto values = allGatherValues(comm, mine, at::kCPU);
  const auto texts = allGatherText(comm, rank == 0 ? "" : "rank " + std::to_string(rank) + std::string(rank, '!'),
                                   at::kCPU);
  const auto empties = allGatherValues(comm, {}, at::kCPU);
  TORCH_CHECK(static_cast<int>(values.size()) == comm.worldSize() && static_cast<int>(texts.size()) == comm.worldSize());
  for (int r = 0; r < comm.worldSize(); ++r) {
    std::vector<int64_t> expected;
    for (int i = 0; i <= r; ++i) expected.push_back(100 * r + i);
    TORCH_CHECK(values[r] == expected, "rank ", r, "'s values arrived as ", c10::Join(", ", values[r]));
    const std::string text = r == 0 ? "" : "rank " + std::to_string(r) + std::string(r, '!');
    TORCH_CHECK(texts[r] == text, "rank ", r, "'s text arrived as '", texts[r], "'");
    TORCH_CHECK(empties[r].empty(), "rank ", r, " sent nothing but ", empties[r].size(), " values arrived");
  }
}

// Hybrid sharding's groups (4 ranks as 2 shard groups of 2): an all-reduce in the shard group
// sums its two consecutive ranks only, one in the replicate group the ranks at the same position
// of each shard group, and an all-gather in each delivers the members in group-rank order.
void subgroups(Communicator& world) {
  const int rank = world.rank();
  const auto ranks = zeroshard::hybridRanks(rank, world.worldSize(), 2);
  Communicator shard(zeroshard::makeSubgroup(world.group(), ranks.shard, "test/shard/" + std::to_string(ranks.shard[0]),
                                             world.timeout()),
                     world.timeout());
  Communicator replicate(zeroshard::makeSubgroup(world.group(), ranks.replicate,
                                                 "test/replicate/" + std::to_string(ranks.replicate[0]), world.timeout()),
                         world.timeout());
  TORCH_CHECK(shard.worldSize() == 2 && shard.rank() == rank % 2, "shard group: rank ", shard.rank(), " of ",
              shard.worldSize());
  TORCH_CHECK(replicate.worldSize() == world.worldSize() / 2 && replicate.rank() == rank / 2, "replicate group: rank ",
              replicate.rank(), " of ", replicate.worldSize());
  auto sum = at::full({3}, static_cast<double>(rank));
  shard.allReduce(sum).wait();
  expectEqual(sum, at::full({3}, static_cast<double>(ranks.shard[0] + ranks.shard[1])), "shard-group all_reduce");
  auto across = at::full({2}, static_cast<double>(rank));
  replicate.allReduce(across).wait();
  double expected = 0;
  for (int r : ranks.replicate) expected += r;
  expectEqual(across, at::full({2}, expected), "replicate-group all_reduce");
  auto gathered = at::empty({static_cast<int64_t>(ranks.replicate.size())});
  replicate.allGather(at::full({1}, static_cast<double>(rank)), gathered).wait();
  std::vector<float> members(ranks.replicate.begin(), ranks.replicate.end());
  expectEqual(gathered, at::tensor(members), "replicate-group all_gather");
  // The world group still spans every rank.
  auto everyone = at::ones({1});
  world.allReduce(everyone).wait();
  expectEqual(everyone, at::full({1}, static_cast<double>(world.worldSize())), "world all_reduce");
}

} // namespace

int main(int argc, char** argv) {
  const std::map<std::string, std::pair<std::function<void(Communicator&)>, int>> scenarios = {
      {"collectives", {collectives, 60000}},
      {"dead_peer", {deadPeer, 60000}},
      {"gather_values", {gatherValues, 60000}},
      {"stalled_peer", {stalledPeer, 2000}},
      {"subgroups", {subgroups, 60000}},
  };
  if (argc != 2 || !scenarios.count(argv[1])) {
    std::cerr << "usage: zeroshard_test_worker collectives|dead_peer|gather_values|stalled_peer|subgroups\n";
    return 2;
  }
  try {
    const auto& [run, timeoutMs] = scenarios.at(argv[1]);
    // Joining the group is bounded by a longer timeout than the scenario's collectives.
    Communicator comm(zeroshard::initProcessGroupFromEnv(std::chrono::seconds(60)),
                      std::chrono::milliseconds(timeoutMs));
    run(comm);
  } catch (const std::exception& e) {
    std::cerr << "rank " << std::getenv("RANK") << " failed: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
