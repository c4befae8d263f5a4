#pragma once

// Internal to config.cpp: the keys each object of a config may hold, and the message for a key
// that is not one of them. Kept apart from the reader so that the tables read as a list.

#include <string>
#include <string_view>
#include <vector>

namespace zeroshard::detail {

// One JSON object of the config ("" is the top level, else a dotted path such as
// "optimizer.params").
struct ConfigSection {
  std::string_view path;
  std::vector<std::string_view> readKeys;     // zeroshard reads and validates these
  std::vector<std::string_view> ignoredKeys;  // DeepSpeed keys zeroshard ignores with a warning

  bool reads(std::string_view key) const;
  bool ignores(std::string_view key) const;
};

// The section at `path`; `path` must be one of the sections the reader descends into.
const ConfigSection& configSection(std::string_view path);
// Every section the reader descends into (tests/python/test_config.py holds each key to an
// effect or a warning).
const std::vector<ConfigSection>& configSections();

// Optimal string alignment distance: Levenshtein plus adjacent transpositions, so "stgae" is one
// edit from "stage", as a person counts it.
size_t editDistance(std::string_view a, std::string_view b);

// The message for `key` found in `section` (written at `writtenPath`, which differs from
// section.path only for the alias "bfloat16"), without the "zeroshard config (...)" prefix:
// the full key path, then the closest known key at that level when one is close enough, else
// the section where that exact key belongs, else the keys this section takes.
std::string unknownKeyMessage(const ConfigSection& section, const std::string& writtenPath,
                              const std::string& key);

}  // namespace zeroshard::detail
