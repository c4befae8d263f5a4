// Engine methods that write parameters (engine_params.cpp), added to the Engine class that
// bind_engine.cpp defines; module.cpp binds this after it.
#include "bindings.h"

#include <torch/csrc/utils/pybind.h>

#include "zeroshard/engine.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace zeroshard::python {

void bindParams(py::module_& m) {
  auto engine = py::reinterpret_borrow<py::class_<Engine, HolderWithoutGil<Engine>>>(m.attr("Engine"));
  engine.def("set_parameters", &Engine::setParameters, "values"_a, py::call_guard<py::gil_scoped_release>(),
             "Writes whole values [(name, tensor)] into the fp32 master weights and compute-dtype "
             "parameters (this rank's shards); every rank must pass the same values.");
}

} // namespace zeroshard::python
