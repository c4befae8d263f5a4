// Reading checkpoints without an engine or a process group (python -m zeroshard.convert).
#include "bindings.h"

#include <torch/csrc/utils/pybind.h>

#include "zeroshard/checkpoint/convert.h"
#include "zeroshard/checkpoint/reader.h"

#include <optional>

namespace py = pybind11;
using namespace pybind11::literals;

namespace zeroshard::python {

void bindCheckpoint(py::module_& m) {
  py::class_<CheckpointReader, HolderWithoutGil<CheckpointReader>>(m, "CheckpointReader",
                               "A saved checkpoint, read tensor by tensor with every byte checked.")
      .def(py::init<const std::string&, const std::optional<std::string>&>(), "dir"_a, "tag"_a = py::none())
      .def_property_readonly("path", &CheckpointReader::path)
      .def_property_readonly("tag", [](const CheckpointReader& r) { return r.manifest().tag; })
      .def_property_readonly("world_size", [](const CheckpointReader& r) { return r.manifest().worldSize; })
      .def_property_readonly("stage", [](const CheckpointReader& r) { return r.manifest().stage; })
      .def_property_readonly("global_steps", [](const CheckpointReader& r) { return r.manifest().globalSteps; })
      .def("state_dict_names", &CheckpointReader::stateDictNames)
      .def("is_trained_parameter",
           [](const CheckpointReader& r, const std::string& name) { return r.paramOfStateDictEntry(name) != nullptr; },
           "name"_a, "Whether a state-dict name is a trained parameter (or a second name of one).")
      .def("read", &CheckpointReader::readStateDictEntry, "name"_a, py::call_guard<py::gil_scoped_release>(),
           "The full tensor for a state-dict name, on CPU (trained parameters: fp32 master weights).")
      .def("client_state", [](CheckpointReader& r) { return py::bytes(r.readClientState()); })
      .def("write_safetensors",
           [](CheckpointReader& r, const std::string& out, std::optional<at::ScalarType> dtype) {
             py::gil_scoped_release noGil;
             return writeConsolidatedSafetensors(r, out, dtype);
           },
           "out"_a, "dtype"_a = py::none());
}

} // namespace zeroshard::python
