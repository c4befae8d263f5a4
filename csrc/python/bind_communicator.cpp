#include "bindings.h"

#include <torch/csrc/utils/pybind.h>

#include "zeroshard/comm/communicator.h"
#include "zeroshard/comm/process_group.h"

#include <chrono>

namespace py = pybind11;
using namespace pybind11::literals;

namespace zeroshard::python {
namespace {

std::chrono::milliseconds toMillis(double seconds) {
  TORCH_CHECK(seconds > 0, "zeroshard: timeout_seconds must be positive, got ", seconds);
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

// Mirrors torch.distributed: the blocking form returns None, async_op=True a handle.
py::object finish(CommHandle handle, bool asyncOp) {
  if (asyncOp) {
    return py::cast(std::move(handle));
  }
  {
    py::gil_scoped_release noGil;
    handle.wait();
  }
  return py::none();
}

} // namespace

py::dict commStatsDict(const CommStats& stats) {
  py::dict out;
  for (int k = 0; k < kNumCollectiveKinds; ++k) {
    const auto kind = static_cast<CollectiveKind>(k);
    out[collectiveName(kind)] = py::dict("calls"_a = stats[kind].calls, "bytes"_a = stats[kind].bytes);
  }
  out["traffic_bytes"] = stats.trafficBytes();
  return out;
}


void bindCommunicator(py::module_& m) {
  py::class_<CommHandle, HolderWithoutGil<CommHandle>>(m, "CommHandle", "A collective in flight; wait() completes it.")
      .def("wait", &CommHandle::wait, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("pending", &CommHandle::pending);

  py::class_<Communicator, HolderWithoutGil<Communicator>>(m, "Communicator")
      .def(py::init([](const std::string& groupName, double timeoutSeconds) {
             return Communicator::fromGroupName(groupName, toMillis(timeoutSeconds));
           }),
           "group_name"_a, "timeout_seconds"_a)
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("world_size", &Communicator::worldSize)
      .def_property_readonly("backend", &Communicator::backendName)
      .def_property_readonly("timeout_seconds",
                             [](const Communicator& c) { return c.timeout().count() / 1000.0; })
      .def(
          "all_gather",
          [](Communicator& c, const at::Tensor& shard, const at::Tensor& flat, bool asyncOp) {
            return finish(c.allGather(shard, flat), asyncOp);
          },
          "shard"_a, "flat"_a, py::kw_only(), "async_op"_a = false)
      .def(
          "reduce_scatter",
          [](Communicator& c, const at::Tensor& flat, const at::Tensor& shard, double scale, bool asyncOp) {
            return finish(c.reduceScatter(flat, shard, scale), asyncOp);
          },
          "flat"_a, "shard"_a, py::kw_only(), "scale"_a = 1.0, "async_op"_a = false)
      .def(
          "all_reduce",
          [](Communicator& c, const at::Tensor& tensor, double scale, bool asyncOp) {
            return finish(c.allReduce(tensor, scale), asyncOp);
          },
          "tensor"_a, py::kw_only(), "scale"_a = 1.0, "async_op"_a = false)
      .def(
          "broadcast",
          [](Communicator& c, const at::Tensor& tensor, int root, bool asyncOp) {
            return finish(c.broadcast(tensor, root), asyncOp);
          },
          "tensor"_a, "root"_a, py::kw_only(), "async_op"_a = false)
      .def("stats", [](const Communicator& c) { return commStatsDict(c.stats()); })
      .def("reset_stats", &Communicator::resetStats);
  m.def(
      "_choose_device",
      [](int localRank, int localWorldSize, int visibleGpus) {
        const auto c = chooseDevice(localRank, localWorldSize, visibleGpus);
        return py::make_tuple(c.useGpu, c.gpu, c.warning);
      },
      "local_rank"_a, "local_world_size"_a, "visible_gpus"_a,
      "The one-GPU-per-local-rank rule (comm/process_group.h): (use_gpu, gpu, warning).");
}

} // namespace zeroshard::python
