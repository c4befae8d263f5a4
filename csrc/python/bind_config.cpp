// Python view of zeroshard::Config: read-only, with attribute names that mirror the JSON keys so
// that cfg.zero_optimization.stage reads like the file. All validation stays in C++.

#include "bindings.h"

#include <pybind11/stl.h>

#include <cmath>
#include <optional>

#include <nlohmann/json.hpp>

#include "zeroshard/config/auto_values.h"
#include "zeroshard/config/config.h"
#include "zeroshard/config/config_keys.h"
#include "zeroshard/config/config_reader.h"
#include "zeroshard/config/json_input.h"
#include "zeroshard/plan/sharding_plan.h"

namespace py = pybind11;

namespace zeroshard::python {
namespace {

// DeepSpeed keys zeroshard ignores reach Python users as UserWarnings, once per config read on
// rank 0 (Note [rank-0 warnings], zeroshard/_warnings.py), attributed to the user's line (the
// first frame outside the zeroshard package).
Config warned(Config config) {
  if (!config.warnings.empty()) {
    const py::object warn = py::module_::import("zeroshard._warnings").attr("warn_at_caller");
    for (const auto& message : config.warnings) warn(message);
  }
  return config;
}

// Note [from_dict checked]: json.dumps would turn what is not JSON into JSON silently (a key 1
// into "1", a tuple into a list) or fail with a TypeError, a ValueError not naming the key, or a
// RecursionError; so the value is walked first and anything but dict / list / tuple / str /
// int / float / bool / None, a key that is not a str, a float that is not finite, a str that is
// not valid Unicode (a lone surrogate) and nesting past kMaxJsonNesting (a dict holding itself)
// is a ConfigError naming its key path, as every other problem with a config is.
std::string configError(const std::string& source, const std::string& path, const std::string& what) {
  return validUtf8(detail::configMessagePrefix(source) + (path.empty() ? "the top level" : path) + ": " + what);
}

// The str's UTF-8, or nullopt with the Python error cleared when it holds a lone surrogate.
std::optional<std::string> utf8Of(const py::handle& text) {
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(text.ptr(), &size);
  if (data == nullptr) {
    PyErr_Clear();
    return std::nullopt;
  }
  return std::string(data, static_cast<size_t>(size));
}

void checkJsonValue(const py::handle& value, const std::string& path, int depth) {
  const char* source = "<dict>";
  if (py::isinstance<py::dict>(value) || py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value)) {
    if (depth >= kMaxJsonNesting) throw ConfigError(configError(source, path, jsonTooDeepMessage()));
  }
  if (py::isinstance<py::dict>(value)) {
    for (const auto& [key, item] : py::reinterpret_borrow<py::dict>(value)) {
      if (!py::isinstance<py::str>(key)) {
        throw ConfigError(configError(source, path, "the key " + shortText(py::repr(key).cast<std::string>(), 60) +
                                                        " is a " + Py_TYPE(key.ptr())->tp_name +
                                                        "; JSON object keys are strings"));
      }
      const auto name = utf8Of(key);
      if (!name) {
        throw ConfigError(configError(source, path, "a key holds a lone surrogate, which is not valid Unicode"));
      }
      checkJsonValue(item, path.empty() ? *name : path + "." + *name, depth + 1);
    }
  } else if (py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value)) {
    size_t i = 0;
    for (const auto& item : value) checkJsonValue(item, path + "[" + std::to_string(i++) + "]", depth + 1);
  } else if (py::isinstance<py::str>(value)) {
    if (!utf8Of(value)) throw ConfigError(configError(source, path, "the string holds a lone surrogate, which is not valid Unicode"));
  } else if (py::isinstance<py::float_>(value)) {
    if (!std::isfinite(value.cast<double>())) {
      throw ConfigError(configError(source, path, "must be a finite number, got " + py::repr(value).cast<std::string>()));
    }
  } else if (!(value.is_none() || py::isinstance<py::bool_>(value) || py::isinstance<py::int_>(value))) {
    throw ConfigError(configError(source, path, std::string("a ") + Py_TYPE(value.ptr())->tp_name +
                                                    " is not a JSON value (use dict, list, str, int, float, bool "
                                                    "or None)"));
  }
}

Config fromDict(const py::object& dict) {
  checkJsonValue(dict, "", 0);
  const auto text = py::module_::import("json").attr("dumps")(dict, py::arg("allow_nan") = false);
  return Config::fromJsonString(text.cast<std::string>(), "<dict>");
}

// A str is read as its UTF-8; one holding a lone surrogate (which has none) is a ConfigError
// rather than pybind's TypeError about the argument's type. bytes are read as they are.
Config fromJsonText(const py::object& text) {
  if (py::isinstance<py::bytes>(text)) return Config::fromJsonString(text.cast<std::string>());
  if (!py::isinstance<py::str>(text)) {
    throw py::type_error(std::string("Config.from_json takes a str (or bytes), got ") + Py_TYPE(text.ptr())->tp_name);
  }
  const auto utf8 = utf8Of(text);
  if (!utf8) {
    throw ConfigError(detail::configMessagePrefix("<string>") +
                      "the text holds a lone surrogate, which is not valid Unicode, so it is not JSON text");
  }
  return Config::fromJsonString(*utf8);
}

py::dict batchSizes(const Config& config, int64_t worldSize) {
  const BatchSizes sizes = config.batchSizes(worldSize);
  py::dict result;
  result["train_batch_size"] = sizes.train;
  result["train_micro_batch_size_per_gpu"] = sizes.microPerRank;
  result["gradient_accumulation_steps"] = sizes.accumulationSteps;
  return result;
}

std::string repr(const Config& c) {
  const char* precision = c.bf16.enabled ? "bf16" : c.fp16.enabled ? "fp16" : "fp32";
  auto optional = [](const std::optional<int64_t>& v) {
    return v ? std::to_string(*v) : std::string("None");
  };
  return "zeroshard.Config(source=" + py::repr(py::str(c.source)).cast<std::string>() +
         ", stage=" + std::to_string(c.zero.stage) + ", precision='" + precision +
         "', train_batch_size=" + optional(c.trainBatchSize) +
         ", train_micro_batch_size_per_gpu=" + optional(c.trainMicroBatchSizePerGpu) +
         ", gradient_accumulation_steps=" + optional(c.gradientAccumulationSteps) +
         ", warnings=" + std::to_string(c.warnings.size()) + ")";
}

// The nested parts are returned by reference into their Config, which they keep alive.
template <typename Part>
auto part(Part Config::*member) {
  return [member](const Config& c) -> const Part& { return c.*member; };
}

}  // namespace

void bindConfig(py::module_& m) {
  py::class_<Fp16Config>(m, "Fp16Config", "The \"fp16\" section (read-only).")
      .def_readonly("enabled", &Fp16Config::enabled)
      .def_readonly("loss_scale", &Fp16Config::lossScale, "0 means dynamic loss scaling.")
      .def_readonly("initial_scale_power", &Fp16Config::initialScalePower)
      .def_readonly("loss_scale_window", &Fp16Config::lossScaleWindow)
      .def_readonly("hysteresis", &Fp16Config::hysteresis)
      .def_readonly("min_loss_scale", &Fp16Config::minLossScale);

  py::class_<Bf16Config>(m, "Bf16Config", "The \"bf16\" section (read-only).")
      .def_readonly("enabled", &Bf16Config::enabled);

  py::class_<OptimizerConfig>(m, "OptimizerConfig",
                              "The \"optimizer\" section, params flattened (read-only).")
      .def_readonly("type", &OptimizerConfig::type, "Always \"AdamW\" (\"Adam\" is read as AdamW).")
      .def_readonly("lr", &OptimizerConfig::lr)
      .def_property_readonly(
          "betas", [](const OptimizerConfig& o) { return py::make_tuple(o.beta1, o.beta2); })
      .def_readonly("eps", &OptimizerConfig::eps)
      .def_readonly("weight_decay", &OptimizerConfig::weightDecay);

  py::class_<ZeroConfig>(m, "ZeroConfig", "The \"zero_optimization\" section (read-only).")
      .def_readonly("stage", &ZeroConfig::stage)
      .def_readonly("reduce_bucket_size", &ZeroConfig::reduceBucketSize)
      .def_readonly("allgather_bucket_size", &ZeroConfig::allgatherBucketSize)
      .def_property_readonly(
          "overlap_comm", [](const ZeroConfig& z) { return z.overlapComm; },
          "As set; None when not set: then on at stage 3 and wherever the gradients are on a GPU.")
      .def("overlap_comm_on", &ZeroConfig::overlapCommResolved, py::arg("grads_on_gpu"),
           "Whether an engine overlaps gradient reductions with backward, for gradients on a GPU or not.")
      .def_readonly("stage3_prefetch_bucket_size", &ZeroConfig::stage3PrefetchBucketSize)
      .def_readonly("stage3_param_persistence_threshold",
                    &ZeroConfig::stage3ParamPersistenceThreshold)
      .def_readonly("stage3_max_live_parameters", &ZeroConfig::stage3MaxLiveParameters)
      .def_readonly("stage3_gather_16bit_weights_on_model_save", &ZeroConfig::gather16bitWeightsOnModelSave);

  py::class_<SchedulerConfig>(m, "SchedulerConfig", "The \"scheduler\" section (read-only).")
      .def_readonly("type", &SchedulerConfig::type, "\"\" when there is no schedule.")
      .def_readonly("params", &SchedulerConfig::params, "The params as written (flags as 1.0/0.0).")
      .def_readonly("warmup_type", &SchedulerConfig::warmupType)
      .def_property_readonly("enabled", &SchedulerConfig::enabled)
      .def("param", &SchedulerConfig::param, py::arg("key"),
           "The written value, else DeepSpeed's default (KeyError-like IndexError when neither).");

  py::class_<CompileConfig>(m, "CompileConfig", "The \"compile\" section (read-only, docs/compile.md).")
      .def_readonly("enabled", &CompileConfig::enabled, "initialize compiles each unit (engine.compile()).")
      .def_readonly("backend", &CompileConfig::backend)
      .def_property_readonly(
          "kwargs", [](const CompileConfig& c) { return py::module_::import("json").attr("loads")(c.kwargs); },
          "torch.compile's keyword arguments (a new dict each time).");

  py::class_<ZeroshardExtras>(m, "ZeroshardExtras", "The \"zeroshard\" section (read-only).")
      .def_readonly("collective_timeout_seconds", &ZeroshardExtras::collectiveTimeoutSeconds)
      .def_readonly("reshard_after_forward", &ZeroshardExtras::reshardAfterForward)
      .def_readonly("stage3_unit_classes", &ZeroshardExtras::unitClasses)
      .def_readonly("reduce_dtype", &ZeroshardExtras::reduceDtype)
      .def_readonly("checkpoint_keep_last", &ZeroshardExtras::checkpointKeepLast)
      .def_readonly("checkpoint_every_minutes", &ZeroshardExtras::checkpointEveryMinutes)
      .def_readonly("checkpoint_dir", &ZeroshardExtras::checkpointDir)
      .def_readonly("batch_guard", &ZeroshardExtras::batchGuard)
      .def_readonly("nonfinite", &ZeroshardExtras::nonfinite)
      .def_readonly("nonfinite_check", &ZeroshardExtras::nonfiniteCheck)
      .def_readonly("shard_group_size", &ZeroshardExtras::shardGroupSize)
      .def_readonly("max_inflight_reductions", &ZeroshardExtras::maxInflightReductions)
      .def_readonly("stage3_gather_stream", &ZeroshardExtras::stage3GatherStream);

  m.def(
      "_resolve_auto",
      [](const Config& config, const std::map<std::string, std::string>& given,
         std::optional<int64_t> hiddenSize, const std::string& hiddenSizeSource, int64_t worldSize) {
        AutoResolution r = resolveAuto(config, AutoInputs{given, hiddenSize, hiddenSizeSource, worldSize});
        return py::make_tuple(std::move(r.config), r.summary);
      },
      py::arg("config"), py::arg("given"), py::arg("hidden_size"), py::arg("hidden_size_source"),
      py::arg("world_size"),
      "(resolved Config, summary line): config/auto_values.h. `given` maps dotted paths to JSON text.");
  m.def(
      "_without_scheduler",
      [](Config config) {
        // For a client scheduler, which replaces the config's (DeepSpeed's rule).
        config.scheduler = SchedulerConfig{};
        if (!config.text.empty()) {
          auto json = nlohmann::ordered_json::parse(config.text);
          json.erase("scheduler");
          config.text = json.dump(2);
        }
        return config;
      },
      py::arg("config"));
  m.def(
      "_with_immediate_nonfinite_check",
      [](Config config) {
        // For a client scheduler, which cannot be rewound after a step found non-finite a step
        // late (engine.py, initialize; docs/reliability.md).
        config.extras.nonfiniteCheck = "immediate";
        if (!config.text.empty()) {
          auto json = nlohmann::ordered_json::parse(config.text);
          json["zeroshard"]["nonfinite_check"] = "immediate";
          config.text = json.dump(2);
        }
        return config;
      },
      py::arg("config"));
  m.def("_hidden_size_from_shapes", &hiddenSizeFromShapes, py::arg("shapes"));

  m.def(
      "_config_keys",
      []() {
        py::list keys;
        for (const auto& section : detail::configSections()) {
          for (auto key : section.readKeys) keys.append(py::make_tuple(section.path, key, "read"));
          for (auto key : section.ignoredKeys) keys.append(py::make_tuple(section.path, key, "ignored"));
          for (auto key : section.inertKeys) keys.append(py::make_tuple(section.path, key, "inert"));
        }
        return keys;
      },
      "(section path, key, \"read\", \"ignored\" or \"inert\") for every key the config reader accepts.");

  const auto internal = py::return_value_policy::reference_internal;
  py::class_<Config>(m, "Config",
                     "A validated DeepSpeed-style config (read-only). Build one with from_file, "
                     "from_json or from_dict; errors raise ValueError naming the key path.")
      .def_static("from_file", [](const std::string& path) { return warned(Config::fromFile(path)); },
                  py::arg("path"))
      .def_static("from_json", [](const py::object& text) { return warned(fromJsonText(text)); },
                  py::arg("text"))
      .def_static("from_dict", [](const py::object& d) { return warned(fromDict(d)); }, py::arg("d"))
      .def_readonly("source", &Config::source)
      .def_readonly("train_batch_size", &Config::trainBatchSize, "None when not set.")
      .def_readonly("train_micro_batch_size_per_gpu", &Config::trainMicroBatchSizePerGpu,
                    "None when not set.")
      .def_readonly("gradient_accumulation_steps", &Config::gradientAccumulationSteps,
                    "None when not set.")
      .def_readonly("gradient_clipping", &Config::gradientClipping, "0 means no clipping.")
      .def_property_readonly("stage", [](const Config& c) { return c.zero.stage; })
      // The plan's question, so that Python asks it rather than compare stage numbers.
      .def_property_readonly("params_sharded",
                             [](const Config& c) { return ShardingPlan::forStage(c.zero.stage, 1).paramsSharded(); })
      .def_property_readonly("bf16_enabled", [](const Config& c) { return c.bf16.enabled; })
      .def_property_readonly("fp16_enabled", [](const Config& c) { return c.fp16.enabled; })
      .def_property_readonly("fp16", part(&Config::fp16), internal)
      .def_property_readonly("bf16", part(&Config::bf16), internal)
      .def_property_readonly("optimizer", part(&Config::optimizer), internal)
      .def_property_readonly("zero_optimization", part(&Config::zero), internal)
      .def_property_readonly("zeroshard", part(&Config::extras), internal)
      .def_property_readonly("scheduler", part(&Config::scheduler), internal)
      .def_property_readonly("compile", part(&Config::compile), internal)
      .def_readonly("steps_per_print", &Config::stepsPerPrint)
      .def_readonly("wall_clock_breakdown", &Config::wallClockBreakdown)
      .def_readonly("auto_keys", &Config::autoKeys,
                    "Dotted paths of the keys written \"auto\", in the file's order.")
      .def_readonly("warnings", &Config::warnings,
                    "One message per DeepSpeed key that zeroshard ignores.")
      .def("batch_sizes", &batchSizes, py::arg("world_size"),
           "The three batch sizes resolved for world_size ranks, by DeepSpeed's rules.")
      .def("to_json", &Config::toJsonString)
      .def("to_dict",
           [](const Config& c) {
             return py::module_::import("json").attr("loads")(c.toJsonString());
           })
      .def("__repr__", &repr)
      // Pickling keeps the source and warnings, so that a Config sent to spawned ranks is the
      // same Config.
      .def(py::pickle(
          // The text as read when there is one, so that "auto" keys survive the trip.
          [](const Config& c) {
            return py::make_tuple(c.text.empty() ? c.toJsonString() : c.text, c.source, c.warnings);
          },
          [](const py::tuple& state) {
            Config c = Config::fromJsonString(state[0].cast<std::string>(),
                                              state[1].cast<std::string>());
            c.warnings = state[2].cast<std::vector<std::string>>();
            return c;
          }));
}

}  // namespace zeroshard::python
