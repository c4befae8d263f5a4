// Reading checkpoints without an engine or a process group (python -m zeroshard.convert).
#include "bindings.h"

#include <torch/csrc/utils/pybind.h>

#include "zeroshard/checkpoint/convert.h"
#include "zeroshard/checkpoint/manifest.h"
#include "zeroshard/checkpoint/reader.h"
#include "zeroshard/checkpoint/progress.h"

#include <memory>
#include <optional>
#include <utility>

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
           [](CheckpointReader& r, const std::string& out, std::optional<at::ScalarType> dtype,
              std::optional<int> progressRank) {
             py::gil_scoped_release noGil;
             return writeConsolidatedSafetensors(r, out, dtype,
                                                 progressRank ? terminalProgress(*progressRank) : ProgressOutput{});
           },
           "out"_a, "dtype"_a = py::none(), "progress_rank"_a = py::none(),
           "progress_rank: this process's rank; on rank 0 a progress line goes to stderr when it is a terminal.");
  m.def("_manifest_text_for_body", &manifestTextForBody, "body"_a,
        "manifest.json's text for an edited manifest body (JSON text): the body with its checksum; "
        "CheckpointReader checks the rest.");
  // The same line for loops written in Python (convert's torch.save format).
  py::class_<Progress>(m, "_Progress", "zeroshard/checkpoint/progress.h: one updating line on stderr, on rank 0 at a terminal.")
      .def(py::init([](std::string title, int64_t total, std::string unit, int rank) {
             return std::make_unique<Progress>(std::move(title), total, std::move(unit), terminalProgress(rank));
           }),
           "title"_a, "total"_a, "unit"_a, "rank"_a)
      .def("advance", &Progress::advance, "bytes"_a)
      .def("finish", &Progress::finish)
      .def("stop", &Progress::stop);
}

} // namespace zeroshard::python
