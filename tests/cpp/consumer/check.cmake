# find_package(zeroshard) end to end, run by ctest as
#   cmake -DZEROSHARD_BUILD_DIR=... -DCONSUMER_SOURCE_DIR=... -DCONSUMER_BINARY_DIR=...
#         -DINSTALL_PREFIX=... -DTORCH_DIR=... -DTORCH_VERSION=... -DPYTHON_EXECUTABLE=...
#         [-DGENERATOR=...] [-DMAKE_PROGRAM=...] [-DCXX_COMPILER=...] [-DCXX_COMPILER_LAUNCHER=...]
#         -P check.cmake
# (a) installs the zeroshard build into INSTALL_PREFIX; (b) configures the consumer project
# against it with nothing that leads to torch: no Torch_DIR, no torch in CMAKE_PREFIX_PATH, and
# a python3 on PATH that has no torch. It must find the torch the build recorded (TORCH_DIR;
# Note [recorded torch] in cmake/zeroshardConfig.cmake.in); (c) builds and runs the consumer;
# (d) edits the recorded torch version in the installed package and expects the consumer's
# configure to fail with an error that names both versions and the recorded directory.
# Any failing step fails the test with its output.
cmake_minimum_required(VERSION 3.21)

foreach(var ZEROSHARD_BUILD_DIR CONSUMER_SOURCE_DIR CONSUMER_BINARY_DIR INSTALL_PREFIX TORCH_DIR TORCH_VERSION
            PYTHON_EXECUTABLE)
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

# A python3 that runs, but fails on anything that mentions torch, first on a PATH that holds
# no other Python with torch: the consumer's configure runs under it.
set(no_torch_bin "${CONSUMER_BINARY_DIR}-no-torch-bin")
file(REMOVE_RECURSE "${no_torch_bin}")
file(WRITE "${no_torch_bin}/python3"
  "#!/bin/sh\n"
  "# Written by tests/cpp/consumer/check.cmake: a python3 without torch.\n"
  "case \"$*\" in *torch*) echo \"python3 (check.cmake): no module named torch\" >&2; exit 1 ;; esac\n"
  "exec \"${PYTHON_EXECUTABLE}\" \"$@\"\n")
file(CHMOD "${no_torch_bin}/python3" PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE)
set(no_torch_env "${CMAKE_COMMAND}" -E env "PATH=${no_torch_bin}:/usr/bin:/bin")
execute_process(COMMAND ${no_torch_env} python3 -c "import sys"
  RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
check_step("python3 without torch runs")
execute_process(COMMAND ${no_torch_env} python3 -c "import torch"
  RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
if(result EQUAL 0)
  message(FATAL_ERROR "find_package consumer: the python3 on the consumer's PATH imports torch")
endif()

# Optional arguments, none with a semicolon in it. The tools go by absolute path: PATH has
# only the python3 above and /usr/bin, /bin.
set(configure_args)
if(GENERATOR)
  list(APPEND configure_args -G "${GENERATOR}")
endif()
if(MAKE_PROGRAM)
  list(APPEND configure_args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()
if(CXX_COMPILER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()
if(CXX_COMPILER_LAUNCHER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER_LAUNCHER=${CXX_COMPILER_LAUNCHER}")
endif()
# --fresh: a cached zeroshard_DIR or Torch_DIR from an earlier run must not hide a broken config.
execute_process(COMMAND ${no_torch_env} "${CMAKE_COMMAND}" -S "${CONSUMER_SOURCE_DIR}" -B "${CONSUMER_BINARY_DIR}"
    --fresh "-DCMAKE_PREFIX_PATH=${INSTALL_PREFIX}" -DCMAKE_BUILD_TYPE=Release ${configure_args}
  RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
check_step("configure (python3 on PATH without torch)")

# The Torch found is the recorded one.
file(STRINGS "${CONSUMER_BINARY_DIR}/CMakeCache.txt" found_torch_dir REGEX "^Torch_DIR:")
string(REGEX REPLACE "^Torch_DIR:[A-Z]+=" "" found_torch_dir "${found_torch_dir}")
file(REAL_PATH "${found_torch_dir}" found_torch_real)
file(REAL_PATH "${TORCH_DIR}" recorded_torch_real)
if(NOT found_torch_real STREQUAL recorded_torch_real)
  message(FATAL_ERROR "find_package consumer: the consumer found Torch in '${found_torch_dir}', "
                      "not in the directory zeroshard was built against, '${TORCH_DIR}'")
endif()
message(STATUS "Torch found through the recorded directory: ok")

execute_process(COMMAND "${CMAKE_COMMAND}" --build "${CONSUMER_BINARY_DIR}"
  RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
check_step("build")

execute_process(COMMAND "${CONSUMER_BINARY_DIR}/zeroshard_consumer"
  RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
check_step("run")
message(STATUS "${output}")

# A torch of another version than the recorded one: the recorded version is edited, as if the
# package had been built against torch 1.0.0. The install is restored afterwards.
set(config_file "${INSTALL_PREFIX}/lib/cmake/zeroshard/zeroshardConfig.cmake")
if(NOT EXISTS "${config_file}")
  file(GLOB config_file "${INSTALL_PREFIX}/lib*/cmake/zeroshard/zeroshardConfig.cmake")
endif()
file(READ "${config_file}" config_text)
set(recorded_line "set(zeroshard_TORCH_VERSION \"${TORCH_VERSION}\")")
string(FIND "${config_text}" "${recorded_line}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "find_package consumer: ${config_file} does not record torch ${TORCH_VERSION} "
                      "(no line ${recorded_line})")
endif()
string(REPLACE "${recorded_line}" "set(zeroshard_TORCH_VERSION \"1.0.0\")" edited_text "${config_text}")
file(WRITE "${config_file}" "${edited_text}")
execute_process(COMMAND ${no_torch_env} "${CMAKE_COMMAND}" -S "${CONSUMER_SOURCE_DIR}" -B "${CONSUMER_BINARY_DIR}-mismatch"
    --fresh "-DCMAKE_PREFIX_PATH=${INSTALL_PREFIX}" -DCMAKE_BUILD_TYPE=Release ${configure_args}
  RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
file(WRITE "${config_file}" "${config_text}")
if(result EQUAL 0)
  message(FATAL_ERROR "find_package consumer: configure against a package recorded for torch 1.0.0 "
                      "succeeded with torch ${TORCH_VERSION}:\n${output}")
endif()
# CMake indents and may wrap the package's message: compare without the whitespace.
string(REGEX REPLACE "[ \t\r\n]+" "" output_flat "${output}")
foreach(expected "built against torch 1.0.0 (${TORCH_DIR})" "Torch found is ${TORCH_VERSION}")
  string(REGEX REPLACE "[ \t\r\n]+" "" expected_flat "${expected}")
  string(FIND "${output_flat}" "${expected_flat}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "find_package consumer: the version-mismatch error does not name '${expected}':\n${output}")
  endif()
endforeach()
message(STATUS "configure with another torch version fails and names both versions: ok")
