// Public include path (see docs/cpp.md); the definitions live in zeroshard/config/config.h.
#pragma once

#include "zeroshard/config/config.h"
