// zeroshard._C: the bindings. Each bound area lives in its own translation unit.
#include "bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "zeroshard C++ core (ZeRO sharding engine on LibTorch)";
  zeroshard::python::bindConfig(m);
  zeroshard::python::bindCommunicator(m);
  zeroshard::python::bindEngine(m);
  zeroshard::python::bindCheckpoint(m);
  zeroshard::python::bindExport(m);
}
