// One bind function per bound area; module.cpp calls each once.
#pragma once

#include <pybind11/pybind11.h>

namespace zeroshard::python {

void bindConfig(pybind11::module_& m);
void bindCommunicator(pybind11::module_& m);

} // namespace zeroshard::python
