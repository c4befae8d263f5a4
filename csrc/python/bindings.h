// One bind function per bound area; module.cpp calls each once.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

namespace zeroshard {
class CommStats;
} // namespace zeroshard

namespace zeroshard::python {

void bindConfig(pybind11::module_& m);
void bindCommunicator(pybind11::module_& m);
void bindEngine(pybind11::module_& m);
void bindCheckpoint(pybind11::module_& m);
void bindExport(pybind11::module_& m);

// Note [no group destroyed under the GIL]: a bound object that holds a c10d process group (the
// Engine, a Communicator, a CommHandle's work, a checkpoint handle) may hold its last
// reference once the user has called destroy_process_group(). ~ProcessGroupGloo joins Gloo's
// worker threads, and a worker that is destroying a finished Work (a barrier's) may need the
// GIL to drop a Python-owned tensor: deleting such an object with the GIL held can deadlock.
// Their Python objects own them through this deleter, which releases the GIL around `delete`
// (anything inside that needs it, like torch's tensor decref, acquires it itself).
template <typename T>
struct DeleteWithoutGil {
  void operator()(T* object) const {
    if (object == nullptr) return;
    if (PyGILState_Check() != 0) {
      pybind11::gil_scoped_release noGil;
      delete object;
    } else {
      delete object;
    }
  }
};
template <typename T>
using HolderWithoutGil = std::unique_ptr<T, DeleteWithoutGil<T>>;

// {kind: {"calls", "bytes"}, ..., "traffic_bytes": n}, shared by Communicator and Engine.
pybind11::dict commStatsDict(const CommStats& stats);

} // namespace zeroshard::python
