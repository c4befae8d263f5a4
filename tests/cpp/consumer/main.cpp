// Uses the installed headers and library: reads a config and lays out two parameters.
// Exits 1 if the numbers are not the ones the library is documented to give.
#include <zeroshard/config.h>
#include <zeroshard/flat_layout.h>

#include <iostream>

int main() {
  const auto config = zeroshard::Config::fromJsonString(
      R"({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}})");
  const auto batch = config.batchSizes(2);
  const zeroshard::FlatLayout layout({{"weight", {53}, 0, 0}, {"bias", {1}, 0, 0}}, 2);

  std::cout << "zeroshard consumer: stage " << config.zero.stage << ", train batch " << batch.train
            << " at 2 ranks, 54 parameters padded to " << layout.paddedNumel() << " (shards of "
            << layout.shardNumel() << ")\n";
  const bool ok = config.zero.stage == 2 && batch.train == 8 && layout.paddedNumel() == 64;
  return ok ? 0 : 1;
}
