// Engine::save16bitModel and Engine::consolidatedStateDict for Python (zeroshard.Engine.save_16bit_model,
// consolidated_state_dict).
#include "bindings.h"

#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include "zeroshard/engine.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;
using namespace pybind11::literals;

namespace zeroshard::python {

void CollectedWarnings::warnAtCaller() const {
  const pybind11::object warn = pybind11::module_::import("zeroshard._warnings").attr("warn_at_caller");
  // The C++ core already warned only where it should (rank 0, or the rank a warning is about).
  for (const auto& message : messages) warn(message, "every_rank"_a = true);
}


void bindExport(py::module_& m) {
  m.def(
      "_save_16bit_model",
      [](Engine& engine, const std::string& dir, const std::string& filename,
         const std::vector<std::string>& exclude) {
        CollectedWarnings warnings;
        ModelExportStats stats;
        bool saved = false;
        {
          const c10::WarningUtils::WarningHandlerGuard guard(&warnings);
          py::gil_scoped_release noGil;
          saved = engine.save16bitModel(dir, filename, ModelExportOptions{exclude}, &stats);
        }
        warnings.warnAtCaller();
        return py::dict("saved"_a = saved, "path"_a = stats.path, "tensors"_a = stats.tensors,
                        "file_bytes"_a = stats.fileBytes, "gathered_peak"_a = stats.gatheredPeakBytes);
      },
      "engine"_a, "dir"_a, "filename"_a = "model.safetensors", "exclude"_a = std::vector<std::string>(),
      "Engine::save16bitModel (checkpoint/model_export.h): collective; {saved, path, tensors, file_bytes, "
      "gathered_peak}. Warnings go through zeroshard._warnings.warn_at_caller.");
  m.def(
      "_consolidated_16bit_state_dict",
      [](Engine& engine, const std::vector<std::string>& exclude) {
        CollectedWarnings warnings;
        ModelExportStats stats;
        std::optional<std::vector<std::pair<std::string, at::Tensor>>> state;
        {
          const c10::WarningUtils::WarningHandlerGuard guard(&warnings);
          // The gathers are collectives; Gloo's workers may need the GIL (bindings.h).
          py::gil_scoped_release noGil;
          state = engine.consolidatedStateDict(ModelExportOptions{exclude}, &stats);
        }
        warnings.warnAtCaller();
        py::object items = py::none();
        if (state) items = py::cast(std::move(*state));
        return py::dict("state_dict"_a = items, "tensors"_a = stats.tensors, "gathered_peak"_a = stats.gatheredPeakBytes);
      },
      "engine"_a, "exclude"_a = std::vector<std::string>(),
      "Engine::consolidatedStateDict (engine.h): collective; {state_dict: [(name, CPU tensor)] on rank 0, None "
      "elsewhere; tensors; gathered_peak}.");
}

} // namespace zeroshard::python
