# find_package(zeroshard) end to end, run by ctest as
#   cmake -DZEROSHARD_BUILD_DIR=... -DCONSUMER_SOURCE_DIR=... -DCONSUMER_BINARY_DIR=...
#         -DINSTALL_PREFIX=... [-DTORCH_PREFIX=...] [-DPYTHON_EXECUTABLE=...] [-DGENERATOR=...]
#         [-DCXX_COMPILER=...] [-DCXX_COMPILER_LAUNCHER=...] -P check.cmake
# (a) installs the zeroshard build into INSTALL_PREFIX, (b) configures and builds the consumer
# project against it, (c) runs the consumer. Any failing step fails the test with its output.
cmake_minimum_required(VERSION 3.21)

foreach(var ZEROSHARD_BUILD_DIR CONSUMER_SOURCE_DIR CONSUMER_BINARY_DIR INSTALL_PREFIX)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "check.cmake: pass -D${var}=...")
  endif()
endforeach()

# After each execute_process below: stop with the step's output unless it exited 0.
macro(check_step what)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "find_package consumer: ${what} failed (${result}):\n${output}")
  endif()
  message(STATUS "${what}: ok")
endmacro()

# A fresh install, so a file the install rules forgot cannot linger from an earlier run.
file(REMOVE_RECURSE "${INSTALL_PREFIX}")
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${ZEROSHARD_BUILD_DIR}" --prefix "${INSTALL_PREFIX}"
  RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
check_step("install")

set(prefix_path "${INSTALL_PREFIX}")
if(TORCH_PREFIX)
  list(APPEND prefix_path "${TORCH_PREFIX}")
endif()
# Optional arguments, none with a semicolon in it (CMAKE_PREFIX_PATH, which has one, is
# passed quoted below so that it stays one argument).
set(configure_args)
if(GENERATOR)
  list(APPEND configure_args -G "${GENERATOR}")
endif()
if(CXX_COMPILER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()
if(CXX_COMPILER_LAUNCHER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER_LAUNCHER=${CXX_COMPILER_LAUNCHER}")
endif()
if(PYTHON_EXECUTABLE)
  # zeroshardConfig.cmake asks this Python where torch lives.
  list(APPEND configure_args "-DPython3_EXECUTABLE=${PYTHON_EXECUTABLE}")
endif()
# --fresh: a cached zeroshard_DIR or Torch_DIR from an earlier run must not hide a broken config.
execute_process(COMMAND "${CMAKE_COMMAND}" -S "${CONSUMER_SOURCE_DIR}" -B "${CONSUMER_BINARY_DIR}" --fresh
    "-DCMAKE_PREFIX_PATH=${prefix_path}" -DCMAKE_BUILD_TYPE=Release ${configure_args}
  RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
check_step("configure")

execute_process(COMMAND "${CMAKE_COMMAND}" --build "${CONSUMER_BINARY_DIR}"
  RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
check_step("build")

execute_process(COMMAND "${CONSUMER_BINARY_DIR}/zeroshard_consumer"
  RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
check_step("run")
message(STATUS "${output}")
