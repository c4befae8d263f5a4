#pragma once

// Internal to config.cpp: JSON text to a validated Config. Kept apart from the Config methods so
// that the reader, the larger half, reads in one sitting.

#include <string>

#include "zeroshard/config/config.h"

namespace zeroshard::detail {

// "zeroshard config (<source>): ", the start of every ConfigError message.
std::string configMessagePrefix(const std::string& source);

// Parses and validates `text`; throws ConfigError. Config::fromJsonString is this.
Config readConfig(const std::string& text, const std::string& source);

}  // namespace zeroshard::detail
