#include "bindings.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/utils/pybind.h>

#include "zeroshard/engine.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace zeroshard::python {
namespace {

// groups: [{"names": [str], "params": [Tensor], optional "lr", "weight_decay", "betas", "eps"}]
std::vector<ParamGroupSpec> groupSpecs(const py::list& groups) {
  std::vector<ParamGroupSpec> specs;
  for (const auto& item : groups) {
    const auto group = item.cast<py::dict>();
    ParamGroupSpec spec;
    spec.names = group["names"].cast<std::vector<std::string>>();
    spec.params = group["params"].cast<std::vector<at::Tensor>>();
    if (group.contains("lr")) spec.lr = group["lr"].cast<double>();
    if (group.contains("weight_decay")) spec.weightDecay = group["weight_decay"].cast<double>();
    if (group.contains("eps")) spec.eps = group["eps"].cast<double>();
    if (group.contains("betas")) {
      const auto betas = group["betas"].cast<std::pair<double, double>>();
      spec.beta1 = betas.first;
      spec.beta2 = betas.second;
    }
    specs.push_back(std::move(spec));
  }
  return specs;
}

} // namespace

void bindEngine(py::module_& m) {
  py::class_<Engine, HolderWithoutGil<Engine>>(m, "Engine")
      .def(py::init([](const py::list& groups, const std::string& groupName, const Config& config,
                       const py::list& units) {
             auto specs = groupSpecs(groups);
             std::vector<UnitSpec> unitSpecs;
             for (const auto& item : units) {
               const auto unit = item.cast<py::dict>();
               unitSpecs.push_back(UnitSpec{unit["name"].cast<std::string>(),
                                            unit["params"].cast<std::vector<std::string>>(),
                                            unit["root"].cast<bool>()});
             }
             auto processGroup = c10d::resolve_process_group(groupName);
             // Construction waits on collectives; Gloo's worker threads may need the GIL to drop
             // the last reference to a Python-owned tensor, so it must not be held here.
             py::gil_scoped_release noGil;
             return HolderWithoutGil<Engine>(
                 new Engine(std::move(specs), std::move(processGroup), config, std::move(unitSpecs)));
           }),
           "param_groups"_a, "group_name"_a, "config"_a, "units"_a = py::list())
      .def("pre_forward", &Engine::preForward, "unit"_a, py::call_guard<py::gil_scoped_release>())
      .def("post_forward", &Engine::postForward, "unit"_a, "outputs"_a,
           py::call_guard<py::gil_scoped_release>())
      .def("gather_parameters", &Engine::gatherParameters, py::call_guard<py::gil_scoped_release>())
      .def("reshard_parameters", &Engine::reshardParameters, py::call_guard<py::gil_scoped_release>())
      .def("backward", &Engine::backward, "loss"_a, py::call_guard<py::gil_scoped_release>())
      .def("step", &Engine::step, py::call_guard<py::gil_scoped_release>())
      .def("plan", [](const Engine& e) { return e.plan().describe(); })
      .def_property_readonly("stage", &Engine::stage)
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("world_size", &Engine::worldSize)
      .def_property_readonly("micro_steps", &Engine::microSteps)
      .def_property_readonly("global_steps", &Engine::globalSteps)
      .def_property_readonly("is_gradient_accumulation_boundary", &Engine::isAccumulationBoundary)
      .def_property_readonly("gradient_accumulation_steps",
                             [](const Engine& e) { return e.batchSizes().accumulationSteps; })
      .def_property_readonly("train_batch_size", [](const Engine& e) { return e.batchSizes().train; })
      .def_property_readonly("train_micro_batch_size_per_gpu",
                             [](const Engine& e) { return e.batchSizes().microPerRank; })
      .def_property_readonly("last_grad_norm", &Engine::lastGradNorm)
      .def_property_readonly("loss_scale", &Engine::lossScale)
      .def_property_readonly("skipped_steps", &Engine::skippedSteps)
      .def("memory_stats",
           [](const Engine& e) {
             const auto s = e.memoryStats();
             return py::dict("params"_a = s.paramBytes, "grads"_a = s.gradBytes,
                             "optimizer"_a = s.optimizerBytes, "total"_a = s.totalBytes(),
                             "gathered_peak"_a = s.gatheredPeakBytes, "staging_peak"_a = s.stagingPeakBytes,
                             "fp32_grads_peak"_a = s.fp32GradsPeakBytes);
           })
      .def("comm_stats", [](const Engine& e) { return commStatsDict(e.commStats()); })
      .def("named_parameters", &Engine::namedParameters)
      .def("master_weights", &Engine::masterWeights, py::call_guard<py::gil_scoped_release>())
      .def("stage3_units",
           [](const Engine& e) {
             py::list units;
             for (const auto& u : e.stage3Units()) {
               units.append(py::dict("name"_a = u.name, "numel"_a = u.numel, "params"_a = u.params,
                                     "persistent"_a = u.persistent, "persistent_numel"_a = u.persistentNumel,
                                     "root"_a = u.root));
             }
             return units;
           })
      .def("set_module_state",
           [](Engine& e, std::vector<std::string> keys, std::vector<std::pair<std::string, at::Tensor>> tensors,
              std::vector<std::pair<std::string, std::string>> aliases) {
             e.setModuleState(ModuleState{std::move(keys), std::move(tensors), std::move(aliases)});
           },
           "keys"_a, "tensors"_a, "aliases"_a)
      .def("save_checkpoint",
           [](Engine& e, const std::string& dir, const std::string& tag, const py::bytes& clientState,
              const std::string& rankError) {
             std::string bytes = clientState;
             py::gil_scoped_release noGil;
             return e.saveCheckpoint(dir, tag, bytes, rankError);
           },
           "dir"_a, "tag"_a = "", "client_state"_a = py::bytes(), "rank_error"_a = "")
      .def("load_checkpoint",
           [](Engine& e, const std::string& dir, const std::string& tag, const std::string& rankError,
              bool optimizerStates) {
             LoadedCheckpoint loaded;
             {
               py::gil_scoped_release noGil;
               loaded = e.loadCheckpoint(dir, tag, LoadOptions{optimizerStates, rankError});
             }
             return py::make_tuple(loaded.path, loaded.tag, py::bytes(loaded.clientState));
           },
           "dir"_a, "tag"_a = "", "rank_error"_a = "", "load_optimizer_states"_a = true)
      .def("set_lr", &Engine::setLearningRate, "lr"_a, "group"_a = -1)
      .def("get_lr", &Engine::learningRate, "group"_a = 0);
}

} // namespace zeroshard::python
