// One bind function per bound area; module.cpp calls each once.
#pragma once

#include <pybind11/pybind11.h>

#include <c10/util/Exception.h>

#include <memory>
#include <string>
#include <vector>

namespace zeroshard {
class CommStats;
} // namespace zeroshard

namespace zeroshard::python {

void bindConfig(pybind11::module_& m);
void bindCommunicator(pybind11::module_& m);
void bindEngine(pybind11::module_& m);
void bindCheckpoint(pybind11::module_& m);
void bindExport(pybind11::module_& m);
// After bindEngine: adds the parameter-writing methods to its Engine class.
void bindParams(pybind11::module_& m);

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

// Keeps the TORCH_WARN messages made on this thread while installed (c10's
// WarningHandlerGuard), to hand them to zeroshard._warnings.warn_at_caller with the GIL held
// after the call, which attributes them to the user's line. Every one collected is warned: the
// core made them only on the rank they are for (rank 0 for what every rank would say).
class CollectedWarnings final : public c10::WarningHandler {
 public:
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  void warnAtCaller() const;
  std::vector<std::string> messages;
};

} // namespace zeroshard::python
