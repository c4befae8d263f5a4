// Public include path (see docs/cpp.md); the definitions live in zeroshard/comm/process_group.h.
#pragma once

#include "zeroshard/comm/process_group.h"
