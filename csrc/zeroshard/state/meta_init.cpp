// initFromMeta: initialising a model built on the meta device step by step, into storage that
// holds only what this rank keeps (meta_init.h; docs/design.md "Models on the meta device").
#include "zeroshard/state/meta_init.h"

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include "zeroshard/comm/communicator.h"
#include "zeroshard/comm/gather_values.h"
#include "zeroshard/state/model_state.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace zeroshard {
namespace {

struct ParamAt {
  size_t bucket;
  size_t index;
  bool frozen = false;  // a frozen bucket's (stage 3), written into this rank's shard
};

// The default generators a step may draw from: the CPU's, and the device's when it is another.
std::vector<at::Generator> generatorsFor(at::Device device) {
  std::vector<at::Generator> out{at::globalContext().defaultGenerator(at::kCPU)};
  if (!device.is_cpu()) out.push_back(at::globalContext().defaultGenerator(device));
  return out;
}

std::vector<at::Tensor> statesOf(std::vector<at::Generator>& gens) {
  std::vector<at::Tensor> out;
  for (auto& g : gens) {
    const std::lock_guard<std::mutex> lock(g.mutex());
    out.push_back(g.get_state());
  }
  return out;
}

void restoreStates(std::vector<at::Generator>& gens, const std::vector<at::Tensor>& states) {
  for (size_t i = 0; i < gens.size(); ++i) {
    const std::lock_guard<std::mutex> lock(gens[i].mutex());
    gens[i].set_state(states[i]);
  }
}

int64_t bitsOf(double value) {
  int64_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

} // namespace

// Note [meta initialisation]: every rank runs every step, in the caller's order (for Python
// models: named_modules() order, the order a normal build constructs and initialises modules
// in), from rank 0's generator state. So the values do not depend on which rank keeps what, on
// the world size or on the stage, and where reset_parameters draws in construction order they
// are those of a normal build with the same seed. A step's parameters exist whole (fp32, on the
// device) only during the step; setParameters then writes them, as an fp32 value, into this
// rank's master slice and compute-dtype storage exactly as the normal construction fills them
// from a built model. Every other trained parameter points at a meta tensor meanwhile, so a
// step that writes one it did not name cannot write into freed or sharded storage: the write
// bumps that parameter's version counter, and the step is run again from the same generator
// state with the parameter whole too (nn.MultiheadAttention's reset_parameters zeroes its
// out_proj's bias, for instance).
//
// Stage 3's frozen parameters take the same path into their shard (Bucket::writeShardOf), in
// their own dtype; those kept whole are written in place by the steps, as buffers are.
void initFromMeta(ModelState& model, Communicator& world, const MetaInit& init) {
  std::vector<Bucket>& buckets = model.buckets();
  std::vector<Bucket>& frozenBuckets = model.frozenBuckets();
  std::unordered_map<std::string, ParamAt> where;
  std::vector<std::pair<std::string, ParamAt>> all;
  for (size_t b = 0; b < buckets.size(); ++b) {
    const auto& params = buckets[b].layout().params();
    for (size_t i = 0; i < params.size(); ++i) {
      where.emplace(params[i].name, ParamAt{b, i});
      all.emplace_back(params[i].name, ParamAt{b, i});
    }
  }
  for (size_t b = 0; b < frozenBuckets.size(); ++b) {
    const auto& params = frozenBuckets[b].layout().params();
    for (size_t i = 0; i < params.size(); ++i) {
      where.emplace(params[i].name, ParamAt{b, i, true});
      all.emplace_back(params[i].name, ParamAt{b, i, true});
    }
  }
  std::unordered_set<std::string> whole;
  for (const auto& [name, p] : model.frozenWhole()) whole.insert(name);
  const auto bucketOf = [&](const ParamAt& place) -> Bucket& {
    return place.frozen ? frozenBuckets[place.bucket] : buckets[place.bucket];
  };
  const auto paramOf = [&](const ParamAt& place) { return bucketOf(place).params()[place.index]; };
  // A trained parameter is fp32 during its step (it seeds the master weights); a frozen one
  // keeps its dtype, so the step draws into it as it would into the module's own tensor.
  const auto stepDtype = [&](const ParamAt& place) {
    return place.frozen ? frozenBuckets[place.bucket].flatParams().scalar_type() : at::kFloat;
  };
  const auto pointAtMeta = [&](const ParamAt& place) {
    at::Tensor p = paramOf(place);
    setTensorData(p, at::empty(p.sizes(), p.options().dtype(stepDtype(place)).device(at::kMeta)));
  };
  for (const auto& [name, place] : all) pointAtMeta(place);

  // Every rank draws what rank 0 would.
  std::vector<at::Generator> gens = generatorsFor(init.device);
  std::vector<at::Tensor> states = statesOf(gens);
  for (auto& state : states) {
    at::Tensor onGroup = state.to(init.device);
    world.broadcast(onGroup, 0).wait();
    state = onGroup.cpu();
  }
  restoreStates(gens, states);

  std::vector<at::Tensor> checksums;
  std::unordered_set<std::string> written;
  std::string error;
  for (const auto& step : init.steps) {
    try {
      std::vector<std::string> names;
      std::vector<ParamAt> places;
      for (const auto& name : step.params) {
        if (whole.count(name)) continue;  // a frozen parameter kept whole: written in place
        const auto it = where.find(name);
        TORCH_CHECK(it != where.end(), "step '", step.name, "' names '", name,
                    "', which is not a parameter this engine holds");
        names.push_back(name);
        places.push_back(it->second);
      }
      std::vector<std::pair<std::string, at::Tensor>> values;
      const std::vector<at::Tensor> before = statesOf(gens);
      for (int attempt = 0;; ++attempt) {
        values.clear();
        for (size_t k = 0; k < names.size(); ++k) {
          at::Tensor scratch = at::zeros(paramOf(places[k]).sizes(),
                                         at::TensorOptions().dtype(stepDtype(places[k])).device(init.device));
          setTensorData(paramOf(places[k]), scratch);
          values.emplace_back(names[k], scratch);
        }
        std::unordered_set<std::string> named(names.begin(), names.end());
        std::vector<std::pair<std::string, int64_t>> versions;
        for (const auto& [name, place] : all) {
          if (!named.count(name)) versions.emplace_back(name, paramOf(place)._version());
        }
        step.run();
        std::vector<std::string> also;
        for (const auto& [name, version] : versions) {
          if (paramOf(where.at(name))._version() != version) also.push_back(name);
        }
        for (const auto& place : places) pointAtMeta(place);
        if (also.empty()) break;
        TORCH_CHECK(attempt == 0, "step '", step.name, "' writes parameter '", also.front(),
                    "', which it did not write when run with it whole");
        restoreStates(gens, before);
        for (const auto& name : also) {
          names.push_back(name);
          places.push_back(where.at(name));
        }
      }
      std::vector<std::pair<std::string, at::Tensor>> trainedValues;
      for (size_t k = 0; k < names.size(); ++k) {
        if (places[k].frozen) {
          frozenBuckets[places[k].bucket].writeShardOf(places[k].index, values[k].second);
        } else {
          trainedValues.push_back(values[k]);
        }
      }
      model.setParameters(trainedValues);
      at::Tensor sum = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(init.device));
      for (const auto& [name, value] : values) {
        // Summed in fp32 (sum(kDouble) would make a float64 copy of the whole module first).
        sum.add_(value.sum().to(at::kDouble));
        written.insert(name);
      }
      checksums.push_back(sum);
    } catch (const std::exception& e) {
      error = "initialising '" + step.name + "': " + e.what();
      break;
    }
  }
  for (const auto& [name, place] : all) bucketOf(place).restoreParamView(place.index);

  // One rank's failure fails every rank, naming it, before anything else is compared.
  const auto errors = allGatherText(world, error, init.device);
  for (size_t r = 0; r < errors.size(); ++r) {
    TORCH_CHECK(errors[r].empty(), "zeroshard: meta-device initialisation failed on rank ", r, ": ", errors[r]);
  }
  std::vector<std::string> unwritten;
  for (const auto& [name, place] : all) {
    // Frozen parameters no step writes stay zero, as buffers do (load_pretrained fills a base).
    if (!written.count(name) && !place.frozen) unwritten.push_back(name);
  }
  if (!unwritten.empty()) {
    std::ostringstream out;
    for (size_t i = 0; i < unwritten.size() && i < 10; ++i) out << (i ? ", " : "") << "'" << unwritten[i] << "'";
    if (unwritten.size() > 10) out << " and " << unwritten.size() - 10 << " more";
    TORCH_CHECK(false, "zeroshard: meta-device initialisation: no step initialised ", out.str(),
                " (their module has no reset_parameters(); pass initialize(..., init_fn=fn), which is called with "
                "every module that holds parameters or buffers of its own)");
  }
  std::vector<int64_t> bits;
  if (!checksums.empty()) {
    const at::Tensor sums = at::stack(checksums).cpu();
    for (int64_t i = 0; i < sums.numel(); ++i) bits.push_back(bitsOf(sums[i].item<double>()));
  }
  const auto byRank = allGatherValues(world, bits, init.device);
  for (size_t r = 1; r < byRank.size(); ++r) {
    size_t i = 0;
    while (i < bits.size() && i < byRank[r].size() && byRank[r][i] == byRank[0][i]) ++i;
    TORCH_CHECK(byRank[r] == byRank[0], "zeroshard: meta-device initialisation: step '",
                init.steps[std::min(i, init.steps.size() - 1)].name, "' gave rank ", r,
                " other values than rank 0; the initialisation must draw the same on every rank (from torch's "
                "default generators, which every rank starts from rank 0's state)");
  }
}

} // namespace zeroshard
