// The engine's learning rates: the config's schedule (optim/lr_schedule.h) and the lr a client
// sets without one.
#include "zeroshard/engine/engine.h"

#include <c10/util/Exception.h>

namespace zeroshard {

void Engine::initSchedule() {
  if (!config_.scheduler.enabled()) return;
  // The groups' lrs before the schedule touches them: WarmupCosineLR's ratios multiply them,
  // WarmupLR without warmup_max_lr warms up to them.
  std::vector<double> baseLrs;
  for (int g = 0; g < optimizer_.numGroups(); ++g) baseLrs.push_back(optimizer_.hyper(g).lr);
  schedule_.emplace(config_.scheduler, std::move(baseLrs));
  if (schedule_->current()) applySchedule(*schedule_->current());
}

void Engine::applySchedule(const std::vector<ScheduledValues>& values) {
  TORCH_INTERNAL_ASSERT(static_cast<int>(values.size()) == optimizer_.numGroups());
  for (int g = 0; g < optimizer_.numGroups(); ++g) {
    AdamWHyper& hyper = optimizer_.hyper(g);
    const ScheduledValues& v = values[g];
    hyper.lr = v.lr;
    if (v.beta1) hyper.beta1 = *v.beta1;
    if (v.beta2) hyper.beta2 = *v.beta2;
  }
}

void Engine::setLearningRate(double lr, int group) {
  TORCH_CHECK(!schedule_, "zeroshard: set_lr: the config's scheduler (", config_.scheduler.type,
              ") sets the learning rate after every optimizer step, so a value set here would not last; "
              "remove \"scheduler\" from the config to schedule the lr yourself");
  TORCH_CHECK(lr >= 0, "zeroshard: learning rate must be >= 0, got ", lr);
  TORCH_CHECK(group >= -1 && group < optimizer_.numGroups(), "zeroshard: param group ", group,
              " does not exist (", optimizer_.numGroups(), " groups)");
  for (int g = 0; g < optimizer_.numGroups(); ++g) {
    if (group == -1 || group == g) optimizer_.hyper(g).lr = lr;
  }
}

double Engine::learningRate(int group) const {
  TORCH_CHECK(group >= 0 && group < optimizer_.numGroups(), "zeroshard: param group ", group,
              " does not exist (", optimizer_.numGroups(), " groups)");
  return optimizer_.hyper(group).lr;
}

std::vector<double> Engine::learningRates() const {
  std::vector<double> out;
  for (int g = 0; g < optimizer_.numGroups(); ++g) out.push_back(optimizer_.hyper(g).lr);
  return out;
}

std::vector<std::pair<double, double>> Engine::betas() const {
  std::vector<std::pair<double, double>> out;
  for (int g = 0; g < optimizer_.numGroups(); ++g) {
    out.emplace_back(optimizer_.hyper(g).beta1, optimizer_.hyper(g).beta2);
  }
  return out;
}

void Engine::loadLrScheduleState(int64_t lastBatchIteration) {
  TORCH_CHECK(schedule_, "zeroshard: lr_scheduler.load_state_dict: the config has no \"scheduler\"");
  TORCH_CHECK(lastBatchIteration >= -1, "zeroshard: lr_scheduler.load_state_dict: last_batch_iteration must be -1 "
              "or more, got ", lastBatchIteration);
  settleLastStep("at lr_scheduler.load_state_dict()");  // a rewind after the restore would undo it
  schedule_->restore(lastBatchIteration);
}

} // namespace zeroshard
