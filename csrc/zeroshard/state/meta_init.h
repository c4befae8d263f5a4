// A model built on the meta device (its parameters have shapes but no values, e.g. built under
// torch.device("meta")): the model state allocates only what this rank keeps under the plan, on
// `device`, and initialises it step by step (initFromMeta, Note [meta initialisation] in
// meta_init.cpp; docs/design.md "Models on the meta device"). Each step names the trained
// parameters it writes; during its `run` those are whole fp32 tensors on `device` (every other
// trained parameter is on the meta device), which it fills in place, e.g. with a module's
// reset_parameters(). The step's values are then cast and sliced into this rank's storage and
// freed, so at most one step's parameters exist whole. A step that also writes a parameter it
// did not name is run again, from the same generator state, with that parameter whole too.
//
// Every rank runs every step in order, from rank 0's default generator state (broadcast first),
// so the weights do not depend on the world size or the stage; they are compared across ranks
// after the last step (a step that draws differently on some rank is an error naming it).
#pragma once

#include <c10/core/Device.h>

#include <functional>
#include <string>
#include <vector>

namespace zeroshard {

class Communicator;
class ModelState;

struct InitStep {
  std::string name;  // for errors, e.g. the module's name
  std::vector<std::string> params;
  std::function<void()> run;
};
struct MetaInit {
  at::Device device = at::kCPU;
  std::vector<InitStep> steps;
};

// Runs `init`'s steps into `state`'s storage (collective over `world`: the generator state is
// broadcast, errors and checksums are gathered). Called while the state is built, once its
// parameter storage and master weights exist and before its gradient hooks.
void initFromMeta(ModelState& state, Communicator& world, const MetaInit& init);

} // namespace zeroshard
