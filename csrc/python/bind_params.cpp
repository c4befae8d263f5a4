// Engine methods that write parameters (state/model_params.cpp, checkpoint/pretrained_load.cpp),
// added to the Engine class that bind_engine.cpp defines; module.cpp binds this after it.
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
  engine.def(
      "load_pretrained",
      [](Engine& e, const std::string& path, bool strict, const TensorRenames& renames) {
        PretrainedLoad loaded;
        {
          py::gil_scoped_release noGil;
          loaded = e.loadPretrained(path, strict, renames);
        }
        py::list mismatched;
        for (const auto& m : loaded.mismatched) {
          mismatched.append(
              py::make_tuple(m.name, py::tuple(py::cast(m.fileShape)), py::tuple(py::cast(m.modelShape))));
        }
        return py::dict("missing"_a = loaded.missing, "unexpected"_a = loaded.unexpected, "mismatched"_a = mismatched,
                        "files"_a = loaded.files, "param_bytes_read"_a = loaded.paramBytesRead,
                        "module_state_bytes_read"_a = loaded.moduleStateBytesRead,
                        "header_bytes_read"_a = loaded.headerBytesRead, "bytes_read"_a = loaded.bytesRead);
      },
      "path"_a, "strict"_a = true, "renames"_a = TensorRenames{},
      "Engine::loadPretrained: collective; renames {file tensor name: state-dict name}; {missing, unexpected, mismatched [(name, file shape, model shape)], "
      "files, param_bytes_read, module_state_bytes_read, header_bytes_read, bytes_read} for this rank.");
  // Local (no collective): the Python layer turns regex key mappings into exact renames with it.
  m.def(
      "pretrained_tensor_names",
      [](const std::string& path) { return PretrainedFiles(path).names(); }, "path"_a,
      py::call_guard<py::gil_scoped_release>(),
      "The tensor names of a pretrained checkpoint's files (headers only), file by file; errors as load_pretrained's.");
}

} // namespace zeroshard::python
