// One bind function per bound area; module.cpp calls each once.
#pragma once

#include <pybind11/pybind11.h>

namespace zeroshard {
class CommStats;
} // namespace zeroshard

namespace zeroshard::python {

void bindConfig(pybind11::module_& m);
void bindCommunicator(pybind11::module_& m);
void bindEngine(pybind11::module_& m);
void bindCheckpoint(pybind11::module_& m);

// {kind: {"calls", "bytes"}, ..., "traffic_bytes": n}, shared by Communicator and Engine.
pybind11::dict commStatsDict(const CommStats& stats);

} // namespace zeroshard::python
