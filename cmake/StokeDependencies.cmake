# Every dependency comes from a Debian 12 package; scripts/install-deps lists them.
find_package(PkgConfig REQUIRED)
pkg_check_modules(LMDB REQUIRED IMPORTED_TARGET lmdb)
find_package(libjpeg-turbo REQUIRED CONFIG)       # libjpeg-turbo::jpeg, libjpeg-turbo::turbojpeg
find_package(OpenCV REQUIRED COMPONENTS core imgproc imgcodecs)
find_package(TBB REQUIRED CONFIG)                  # TBB::tbb
find_package(spdlog REQUIRED CONFIG)               # spdlog::spdlog (with fmt::fmt)
find_package(fmt REQUIRED CONFIG)
find_package(nlohmann_json REQUIRED CONFIG)
find_package(CLI11 REQUIRED CONFIG)
find_package(yaml-cpp REQUIRED CONFIG)             # yaml-cpp
find_package(dnnl REQUIRED CONFIG)                 # DNNL::dnnl (Debian: OpenMP; its config wants OpenCL headers)
find_package(OpenMP REQUIRED)                      # to size oneDNN's OpenMP thread team
find_package(Threads REQUIRED)
if(STOKE_BUILD_TESTS)
  find_package(GTest REQUIRED CONFIG)
endif()
if(STOKE_BUILD_BENCH)
  find_package(benchmark REQUIRED CONFIG)
endif()

# CUDA is optional: the CUDA backend is compiled whenever a toolkit is found (AUTO), required (ON)
# or never (OFF). STOKE_WITH_CUDA is always defined to 0 or 1 for the C++ code.
set(STOKE_WITH_CUDA OFF)
include(CheckLanguage)
if(NOT STOKE_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)  # A100, H100/H200
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    # The backend needs cuDNN beside the toolkit; NVIDIA's toolkit packages do not ship it.
    find_library(STOKE_CUDNN_LIBRARY cudnn HINTS ${CUDAToolkit_LIBRARY_DIR})
    find_path(STOKE_CUDNN_INCLUDE_DIR cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    if(STOKE_CUDNN_LIBRARY AND STOKE_CUDNN_INCLUDE_DIR)
      set(STOKE_WITH_CUDA ON)
    elseif(STOKE_CUDA STREQUAL "ON")
      message(FATAL_ERROR "STOKE_CUDA=ON: the CUDA toolkit is at ${CUDAToolkit_BIN_DIR}/.. but cuDNN 9 is not "
                          "(libcudnn: ${STOKE_CUDNN_LIBRARY}, cudnn.h: ${STOKE_CUDNN_INCLUDE_DIR}); install it")
    else()
      message(STATUS "stoke: the CUDA toolkit is here but cuDNN is not (libcudnn, cudnn.h): no CUDA backend")
    endif()
  elseif(STOKE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "STOKE_CUDA=ON but no CUDA compiler found")
  endif()
endif()
message(STATUS "stoke: CUDA backend ${STOKE_WITH_CUDA}")

# The end of an optional feature's check, for STOKE_<NAME> = AUTO | ON | OFF: STOKE_WITH_<NAME> ON
# when the condition given after `missing` holds; a fatal error naming what is missing when it
# does not and STOKE_<NAME> is ON.
#   stoke_optional(ONNX "ONNX was not found (apt-get install ...)" ONNX_FOUND AND TARGET onnx)
function(stoke_optional name missing)
  if(${ARGN})
    set(STOKE_WITH_${name} ON PARENT_SCOPE)
  elseif(STOKE_${name} STREQUAL "ON")
    message(FATAL_ERROR "STOKE_${name}=ON but ${missing}")
  endif()
endfunction()

# MPI is optional like CUDA: data-parallel training (dist/) is built whenever Open MPI's development
# files are found (AUTO), required (ON) or never (OFF). NCCL, for the CUDA backend's collectives,
# comes with the CUDA toolkit under /usr/local/cuda and is used when both CUDA and MPI are built
# (its unique id travels over MPI).
set(STOKE_MPI AUTO CACHE STRING "Data-parallel training over MPI: AUTO, ON or OFF")
set(STOKE_WITH_MPI OFF)
set(STOKE_WITH_NCCL OFF)
if(NOT STOKE_MPI STREQUAL "OFF")
  find_package(MPI COMPONENTS C QUIET)
  stoke_optional(MPI "MPI was not found (apt-get install libopenmpi-dev openmpi-bin)" MPI_C_FOUND)
endif()
if(STOKE_WITH_MPI AND STOKE_WITH_CUDA)
  find_path(STOKE_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
  find_library(STOKE_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64)
  if(STOKE_NCCL_INCLUDE_DIR)  # the library itself is loaded at run time (train/cuda/nccl.h)
    set(STOKE_WITH_NCCL ON)
  endif()
endif()
message(STATUS "stoke: MPI ${STOKE_WITH_MPI} (${MPIEXEC_EXECUTABLE}), NCCL found ${STOKE_WITH_NCCL}")

# The Python package (python/): pybind11 and DLPack's header from Debian, a Python 3 with its
# headers. Not in sanitizer builds (an instrumented module cannot load into a plain interpreter).
set(STOKE_PYTHON AUTO CACHE STRING "The Python package: AUTO, ON or OFF")
set(STOKE_WITH_PYTHON OFF)
if(NOT STOKE_PYTHON STREQUAL "OFF" AND STOKE_SANITIZE STREQUAL "")
  set(PYBIND11_FINDPYTHON ON)
  # Debian's interpreter (where python3-torch is), not one that happens to be first on PATH.
  if(NOT Python_EXECUTABLE AND EXISTS /usr/bin/python3)
    set(Python_EXECUTABLE /usr/bin/python3)
  endif()
  find_package(Python COMPONENTS Interpreter Development.Module QUIET)
  find_package(pybind11 CONFIG QUIET)
  find_path(STOKE_DLPACK_INCLUDE_DIR dlpack/dlpack.h)
  stoke_optional(PYTHON "pybind11, Python's headers or dlpack.h were not found (apt-get install pybind11-dev python3-dev libdlpack-dev)"
                 Python_FOUND AND pybind11_FOUND AND STOKE_DLPACK_INCLUDE_DIR)
endif()
if(STOKE_WITH_PYTHON)
  set(CMAKE_POSITION_INDEPENDENT_CODE ON)  # the libraries are linked into a shared module
endif()
message(STATUS "stoke: Python package ${STOKE_WITH_PYTHON} (${Python_EXECUTABLE})")

# ONNX export (`stoke export`): ONNX's protobuf classes and checker from Debian (libonnx-dev,
# libprotobuf-dev). Optional like CUDA and MPI; without it the command says it is not in this build.
set(STOKE_ONNX AUTO CACHE STRING "ONNX export: AUTO, ON or OFF")
set(STOKE_WITH_ONNX OFF)
if(NOT STOKE_ONNX STREQUAL "OFF")
  find_package(Protobuf QUIET)
  find_package(ONNX CONFIG QUIET)
  stoke_optional(ONNX "ONNX was not found (apt-get install libonnx-dev libprotobuf-dev)"
                 ONNX_FOUND AND Protobuf_FOUND AND TARGET onnx)
endif()
message(STATUS "stoke: ONNX export ${STOKE_WITH_ONNX}")

# TensorBoard event files written by every training run: TensorBoard's Event/Summary messages
# compiled by protoc (protobuf-compiler, libprotobuf-dev). Without them a run writes metrics.jsonl only.
set(STOKE_TENSORBOARD AUTO CACHE STRING "TensorBoard event files: AUTO, ON or OFF")
set(STOKE_WITH_TENSORBOARD OFF)
if(NOT STOKE_TENSORBOARD STREQUAL "OFF")
  find_package(Protobuf QUIET)
  stoke_optional(TENSORBOARD "protobuf was not found (apt-get install libprotobuf-dev protobuf-compiler)"
                 Protobuf_FOUND AND Protobuf_PROTOC_EXECUTABLE AND TARGET protobuf::libprotobuf)
endif()
message(STATUS "stoke: TensorBoard event files ${STOKE_WITH_TENSORBOARD}")

# The live monitor (`stoke monitor`, `stoke train --monitor`): cpp-httplib from Debian
# (libcpp-httplib-dev, a compiled library) and Chart.js (libjs-chart.js), embedded into the binary.
set(STOKE_MONITOR AUTO CACHE STRING "stoke monitor: AUTO, ON or OFF")
set(STOKE_WITH_MONITOR OFF)
if(NOT STOKE_MONITOR STREQUAL "OFF")
  pkg_check_modules(HTTPLIB QUIET IMPORTED_TARGET cpp-httplib)
  find_file(STOKE_CHARTJS chart.umd.js chart.min.js PATHS /usr/share/javascript/chart.js NO_DEFAULT_PATH)
  stoke_optional(MONITOR "cpp-httplib or Chart.js was not found (apt-get install libcpp-httplib-dev libjs-chart.js)"
                 HTTPLIB_FOUND AND STOKE_CHARTJS)
endif()
message(STATUS "stoke: monitor ${STOKE_WITH_MONITOR} (${STOKE_CHARTJS})")
