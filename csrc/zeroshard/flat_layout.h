// Public include path (see docs/cpp.md); the definitions live in zeroshard/layout/flat_layout.h.
#pragma once

#include "zeroshard/layout/flat_layout.h"
