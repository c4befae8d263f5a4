// Public include path (see docs/cpp.md); the definitions live in zeroshard/checkpoint/reader.h.
#pragma once

#include "zeroshard/checkpoint/reader.h"
