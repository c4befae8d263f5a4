// The public include path of the engine (docs/cpp.md): the class is in zeroshard/engine/engine.h.
#pragma once

#include "zeroshard/engine/engine.h"
