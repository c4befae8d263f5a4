#include "bindings.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/utils/pybind.h>

#include "zeroshard/engine.h"

#include <algorithm>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string_view>
#include <type_traits>

namespace py = pybind11;
using namespace pybind11::literals;

namespace zeroshard::python {
namespace {

// "names" is filled in by _param_groups; users give the others.
constexpr std::string_view kGroupKeys[] = {"betas", "eps", "lr", "names", "params", "weight_decay"};

// groups: [{"params": [Tensor], "names": [str] (optional before naming), optional "lr",
// "weight_decay", "betas", "eps"}]
std::vector<ParamGroupSpec> groupSpecs(const py::list& groups) {
  std::vector<ParamGroupSpec> specs;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto group = groups[g].cast<py::dict>();
    std::string unknown;
    for (const auto& [key, value] : group) {
      const auto name = py::str(key).cast<std::string>();
      if (std::find(std::begin(kGroupKeys), std::end(kGroupKeys), name) == std::end(kGroupKeys)) {
        unknown += (unknown.empty() ? "'" : ", '") + name + "'";
      }
    }
    if (!unknown.empty()) {
      throw py::value_error("zeroshard.initialize: param group " + std::to_string(g) + " has unknown keys [" + unknown +
                            "]; allowed: ['betas', 'eps', 'lr', 'params', 'weight_decay']");
    }
    ParamGroupSpec spec;
    if (group.contains("names")) spec.names = group["names"].cast<std::vector<std::string>>();
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

py::list groupDicts(const std::vector<ParamGroupSpec>& specs) {
  py::list out;
  for (const auto& spec : specs) {
    py::dict group("names"_a = spec.names, "params"_a = spec.params);
    if (spec.lr) group["lr"] = *spec.lr;
    if (spec.weightDecay) group["weight_decay"] = *spec.weightDecay;
    if (spec.eps) group["eps"] = *spec.eps;
    if (spec.beta1) group["betas"] = py::make_tuple(*spec.beta1, *spec.beta2);
    out.append(group);
  }
  return out;
}

using EngineClass = py::class_<Engine, HolderWithoutGil<Engine>>;

// An Engine method that may settle the deferred nonfinite check (a rank-0 warning in "skip"
// mode, a wait on the device), without the GIL and with its warnings at the caller's line.
template <typename R>
auto withWarnings(R (Engine::*method)()) {
  return [method](Engine& e) {
    CollectedWarnings warnings;
    auto call = [&] {
      const c10::WarningUtils::WarningHandlerGuard guard(&warnings);
      py::gil_scoped_release noGil;
      return (e.*method)();
    };
    if constexpr (std::is_void_v<R>) {
      call();
      warnings.warnAtCaller();
    } else {
      R result = call();
      warnings.warnAtCaller();
      return result;
    }
  };
}

const LrSchedule& scheduleOf(const Engine& e) {
  if (e.lrSchedule() == nullptr) throw py::value_error("zeroshard: the config has no \"scheduler\"");
  return *e.lrSchedule();
}

// The config's schedule, for python/zeroshard/lr_schedule.py (what user code sees as
// engine.lr_scheduler).
void bindSchedule(EngineClass& engine) {
  engine
      .def_property_readonly("lr_schedule_type",
                             [](const Engine& e) { return e.lrSchedule() ? e.lrSchedule()->type() : std::string(); })
      .def_property_readonly("lr_schedule_last_batch_iteration",
                             [](const Engine& e) { return scheduleOf(e).lastBatchIteration(); })
      .def(
          "lr_schedule_lrs",
          [](const Engine& e) {
            const LrSchedule& s = scheduleOf(e);
            std::vector<double> lrs;
            for (const auto& v : s.valuesAt(s.lastBatchIteration())) lrs.push_back(v.lr);
            return lrs;
          },
          "The schedule's lr per group at its last_batch_iteration (DeepSpeed's get_lr()).")
      .def("load_lr_schedule_state", &Engine::loadLrScheduleState, "last_batch_iteration"_a);
}

void bindLogging(EngineClass& engine) {
  engine
      .def(
          "set_log_sink",
          [](Engine& e, const py::object& sink) {
            if (sink.is_none()) {
              e.setLogSink({});
              return;
            }
            // Called from inside step(), which runs without the GIL, and dropped with the
            // engine, which is deleted without it (Note [no group destroyed under the GIL]).
            std::shared_ptr<py::object> held(new py::object(sink), [](py::object* o) {
              py::gil_scoped_acquire gil;
              delete o;
            });
            e.setLogSink([held](const std::string& line) {
              py::gil_scoped_acquire gil;
              (*held)(line);
            });
          },
          "sink"_a, "sink(line) gets rank 0's progress lines (None: print them to stdout).")
      .def("begin_forward", &Engine::beginForward, py::call_guard<py::gil_scoped_release>())
      .def("end_forward", &Engine::endForward, py::call_guard<py::gil_scoped_release>());
}

// Meta-device initialisation steps from (name, [parameter names], callable) tuples. Each step
// is run from C++ without the GIL, so it takes the GIL, and turns a Python exception into a C++
// one there (its message keeps the Python type and text). The callable is released under the
// GIL too: the steps are dropped inside the engine's constructor, where the GIL is not held.
std::vector<InitStep> metaInitSteps(const py::list& steps) {
  std::vector<InitStep> out;
  for (const auto& item : steps) {
    const auto step = item.cast<py::tuple>();
    std::shared_ptr<py::object> fn(new py::object(step[2]), [](py::object* o) {
      py::gil_scoped_acquire gil;
      delete o;
    });
    out.push_back(InitStep{step[0].cast<std::string>(), step[1].cast<std::vector<std::string>>(), [fn] {
                             py::gil_scoped_acquire gil;
                             try {
                               (*fn)();
                             } catch (py::error_already_set& e) {
                               throw std::runtime_error(e.what());
                             }
                           }});
  }
  return out;
}

} // namespace

void bindEngine(py::module_& m) {
  m.def(
      "_param_groups",
      [](const py::object& groups, const std::vector<std::pair<std::string, at::Tensor>>& modelParams) {
        // None: one group of every trainable parameter.
        return groupDicts(nameParamGroups(
            groups.is_none() ? std::nullopt : std::optional(groupSpecs(groups.cast<py::list>())), modelParams));
      },
      "groups"_a, "model_params"_a,
      "Names and checks param groups by the model's parameters (layout/param_groups.h).");
  m.def("_set_tensor_data", &setTensorData, "tensor"_a, "data"_a,
        "tensor.data = data, also from the meta device to a real one (layout/bucket.h).");
  m.def(
      "_assign_units",
      [](const std::vector<std::pair<std::string, at::Tensor>>& modelParams, const std::vector<std::string>& names,
         const std::vector<std::vector<at::Tensor>>& unitParams) {
        py::list out;
        for (const auto& spec : assignUnits(modelParams, names, unitParams)) {
          out.append(py::dict("name"_a = spec.name, "params"_a = spec.paramNames, "root"_a = spec.root,
                              "frozen"_a = spec.frozenNames));
        }
        return out;
      },
      "model_params"_a, "unit_names"_a, "unit_params"_a,
      "Stage 3: which parameters each unit holds (stage3/unit_builder.h).");
  py::class_<Engine, HolderWithoutGil<Engine>> engine(m, "Engine");
  engine
      .def(py::init([](const py::list& groups, const std::string& groupName, const Config& config,
                       const py::list& units, const std::string& initDevice, const py::list& initSteps,
                       std::vector<std::pair<std::string, at::Tensor>> frozen) {
             auto specs = groupSpecs(groups);
             std::vector<UnitSpec> unitSpecs;
             for (const auto& item : units) {
               const auto unit = item.cast<py::dict>();
               unitSpecs.push_back(UnitSpec{unit["name"].cast<std::string>(),
                                            unit["params"].cast<std::vector<std::string>>(), unit["root"].cast<bool>(),
                                            unit.contains("frozen") ? unit["frozen"].cast<std::vector<std::string>>()
                                                                    : std::vector<std::string>{}});
             }
             MetaInit init{at::Device(initDevice), metaInitSteps(initSteps)};
             auto processGroup = c10d::resolve_process_group(groupName);
             // The Python layer compiles the units itself (zeroshard.initialize, config "compile"):
             // the core must not warn that a C++ engine runs eagerly.
             Config core = config;
             core.compile.enabled = false;
             CollectedWarnings warnings;  // e.g. one intra-op thread for an offloaded optimizer
             HolderWithoutGil<Engine> built;
             {
               const c10::WarningUtils::WarningHandlerGuard guard(&warnings);
               // Construction waits on collectives; Gloo's worker threads may need the GIL to drop
               // the last reference to a Python-owned tensor, so it must not be held here.
               py::gil_scoped_release noGil;
               built.reset(new Engine(std::move(specs), std::move(processGroup), core, std::move(unitSpecs),
                                      std::move(init), std::move(frozen)));
             }
             warnings.warnAtCaller();
             return built;
           }),
           "param_groups"_a, "group_name"_a, "config"_a, "units"_a = py::list(), "init_device"_a = "cpu",
           "init_steps"_a = py::list(), "frozen"_a = std::vector<std::pair<std::string, at::Tensor>>{},
           "init_device, init_steps: a model on the meta device (state/meta_init.h, MetaInit): steps are "
           "(name, [parameter names], callable()), run in order. frozen: the model's frozen parameters "
           "[(name, tensor)], sharded with their units at stage 3.")
      .def("pre_forward", &Engine::preForward, "unit"_a, "inputs"_a = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def("watches_inputs", &Engine::watchesInputs, "unit"_a)
      .def("broadcast_module_state", &Engine::broadcastModuleState, py::call_guard<py::gil_scoped_release>())
      .def("post_forward", &Engine::postForward, "unit"_a, "outputs"_a,
           py::call_guard<py::gil_scoped_release>())
      .def("gather_parameters", &Engine::gatherParameters, py::call_guard<py::gil_scoped_release>())
      .def("reshard_parameters", &Engine::reshardParameters, py::call_guard<py::gil_scoped_release>())
      .def("backward", &Engine::backward, "loss"_a, "scale_wrt_gas"_a = true, py::call_guard<py::gil_scoped_release>(),
           "Backpropagates loss / gradient_accumulation_steps (the loss itself with scale_wrt_gas=False; fp16's "
           "loss scale either way) and reduces the gradients.")
      .def("set_gradient_accumulation_boundary", &Engine::setAccumulationBoundary, "is_boundary"_a,
           "True / False: whether each following micro-step ends the accumulation window, until set again; None: "
           "count gradient_accumulation_steps micro-steps from the last boundary (engine.h).")
      .def("step",
           [](Engine& e) {
             CollectedWarnings warnings;  // e.g. a step skipped for non-finite gradients
             bool taken = false;
             {
               const c10::WarningUtils::WarningHandlerGuard guard(&warnings);
               py::gil_scoped_release noGil;
               taken = e.step();
             }
             warnings.warnAtCaller();
             return taken;
           })
      .def("plan", &Engine::describePlan)
      .def_property_readonly("stage", &Engine::stage)
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("world_size", &Engine::worldSize)
      .def_property_readonly("micro_steps", &Engine::microSteps)
      .def_property_readonly("accumulation_boundaries", &Engine::accumulationBoundaries,
                             "Accumulation windows ended: optimizer steps taken plus steps skipped.")
      .def_property_readonly("global_steps", withWarnings(&Engine::globalSteps))
      .def_property_readonly("is_gradient_accumulation_boundary", &Engine::isAccumulationBoundary)
      .def_property_readonly("gradient_accumulation_steps",
                             [](const Engine& e) { return e.batchSizes().accumulationSteps; })
      .def_property_readonly("train_batch_size", [](const Engine& e) { return e.batchSizes().train; })
      .def_property_readonly("train_micro_batch_size_per_gpu",
                             [](const Engine& e) { return e.batchSizes().microPerRank; })
      .def_property_readonly("last_grad_norm", &Engine::lastGradNorm)
      .def_property_readonly("loss_scale", &Engine::lossScale)
      .def_property_readonly("skipped_steps", withWarnings(&Engine::skippedSteps))
      .def("check_last_step", withWarnings(&Engine::checkLastStep),
           "zeroshard.nonfinite_check \"deferred\": reads whether the last optimizer step was skipped on the "
           "device for non-finite gradients; \"error\" raises naming it, \"skip\" counts it. Blocking; every "
           "rank calls it (engine.h, checkLastStep).")
      .def("memory_stats",
           [](const Engine& e) {
             const auto s = e.memoryStats();
             return py::dict("params"_a = s.paramBytes, "grads"_a = s.gradBytes,
                             "optimizer"_a = s.optimizerBytes, "frozen"_a = s.frozenBytes, "total"_a = s.totalBytes(),
                             "host_frozen"_a = s.hostFrozenBytes, "device_frozen"_a = s.deviceFrozenBytes(),
                             "gathered_peak"_a = s.gatheredPeakBytes, "secondary_peak"_a = s.secondaryPeakBytes,
                             "staging_peak"_a = s.stagingPeakBytes,
                             "fp32_grads_peak"_a = s.fp32GradsPeakBytes, "host_params"_a = s.hostParamBytes,
                             "host_grads"_a = s.hostGradBytes, "host_optimizer"_a = s.hostOptimizerBytes,
                             "host_total"_a = s.hostTotalBytes(), "device_params"_a = s.deviceParamBytes(),
                             "device_grads"_a = s.deviceGradBytes(), "device_optimizer"_a = s.deviceOptimizerBytes(),
                             "device_total"_a = s.deviceTotalBytes());
           })
      .def("comm_stats",
           [](const Engine& e) {
             py::dict out = commStatsDict(e.commStats());
             if (e.plan().twoLevels()) {
               out["intra"] = commStatsDict(e.intraStats());
               out["inter"] = commStatsDict(e.interStats());
             }
             return out;
           })
      .def("named_parameters", &Engine::namedParameters)
      .def("master_weights", &Engine::masterWeights, py::call_guard<py::gil_scoped_release>())
      .def("stage3_units",
           [](const Engine& e) {
             py::list units;
             for (const auto& u : e.stage3Units()) {
               units.append(py::dict("name"_a = u.name, "numel"_a = u.numel, "params"_a = u.params,
                                     "persistent"_a = u.persistent, "persistent_numel"_a = u.persistentNumel,
                                     "root"_a = u.root, "frozen"_a = u.frozen, "frozen_numel"_a = u.frozenNumel));
             }
             return units;
           })
      .def("set_module_state_from", &Engine::setModuleStateFrom, "state_dict"_a)
      .def("set_module_state",
           [](Engine& e, std::vector<std::string> keys, std::vector<std::pair<std::string, at::Tensor>> tensors,
              std::vector<std::pair<std::string, std::string>> aliases) {
             e.setModuleState(ModuleState{std::move(keys), std::move(tensors), std::move(aliases)});
           },
           "keys"_a, "tensors"_a, "aliases"_a)
      .def("save_checkpoint",
           [](Engine& e, const std::string& dir, const std::string& tag, const py::bytes& clientState,
              const std::string& rankError, bool excludeFrozen) {
             std::string bytes = clientState;
             CollectedWarnings warnings;  // e.g. older checkpoints that could not be removed
             std::string path;
             {
               const c10::WarningUtils::WarningHandlerGuard guard(&warnings);
               py::gil_scoped_release noGil;
               path = e.saveCheckpoint(dir, tag, bytes, rankError, excludeFrozen);
             }
             warnings.warnAtCaller();
             return path;
           },
           "dir"_a, "tag"_a = "", "client_state"_a = py::bytes(), "rank_error"_a = "",
           "exclude_frozen_parameters"_a = false)
      .def("load_checkpoint",
           [](Engine& e, const std::string& dir, const std::string& tag, const std::string& rankError,
              bool optimizerStates, const py::object& checkClientState, bool loadSchedulerStates) {
             LoadOptions options{optimizerStates, rankError, {}};
             options.loadSchedulerState = loadSchedulerStates;
             if (!checkClientState.is_none()) {
               // Called from inside the load (GIL released), before anything changes; it is
               // destroyed with `options`, below, under the GIL.
               options.checkClientState = [checkClientState](const std::string& blob) {
                 py::gil_scoped_acquire gil;
                 const py::object error = checkClientState(py::bytes(blob));
                 return error.is_none() ? std::string() : error.cast<std::string>();
               };
             }
             LoadedCheckpoint loaded;
             CollectedWarnings warnings;  // the batch guard's, a scheduler of another type
             {
               const c10::WarningUtils::WarningHandlerGuard guard(&warnings);
               py::gil_scoped_release noGil;
               loaded = e.loadCheckpoint(dir, tag, options);
             }
             warnings.warnAtCaller();
             return py::make_tuple(loaded.path, loaded.tag, py::bytes(loaded.clientState));
           },
           "dir"_a, "tag"_a = "", "rank_error"_a = "", "load_optimizer_states"_a = true,
           "check_client_state"_a = py::none(), "load_lr_scheduler_states"_a = true)
      .def("checkpoint_due", &Engine::checkpointDue, py::call_guard<py::gil_scoped_release>(),
           "zeroshard.checkpoint.every_minutes: whether this boundary saves (rank 0's clock; collective).")
      .def("set_clock_saves", &Engine::setClockSaves, "on"_a)
      .def(
          "_set_clock",
          [](Engine& e, const py::object& minutes) {
            // The engine may be destroyed without the GIL: the callable is released under it.
            std::shared_ptr<py::object> held(new py::object(minutes), [](py::object* o) {
              py::gil_scoped_acquire gil;
              delete o;
            });
            e.setClock([held] {
              py::gil_scoped_acquire gil;
              return (*held)().cast<double>();
            });
          },
          "minutes"_a, "Tests: the clock checkpoint_due() reads, a callable returning minutes.")
      .def("set_lr", &Engine::setLearningRate, "lr"_a, "group"_a = -1)
      .def("get_lr", &Engine::learningRate, "group"_a = 0)
      .def("get_lrs", &Engine::learningRates, "Every param group's lr, as the next optimizer step uses it.")
      .def("get_betas", &Engine::betas, "Every param group's (beta1, beta2).");
  bindSchedule(engine);
  bindLogging(engine);
}

} // namespace zeroshard::python
