# Warnings and sanitizers for stoke's own targets only (never global flags, and never for programs
# that use the installed package: those get only the include directory and the definitions).
include(GNUInstallDirs)
add_library(stoke_compile_options INTERFACE)
target_compile_features(stoke_compile_options INTERFACE cxx_std_20)
target_compile_options(stoke_compile_options INTERFACE
  $<BUILD_INTERFACE:$<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wundef -Wno-missing-field-initializers>>)
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  target_compile_options(stoke_compile_options INTERFACE $<BUILD_INTERFACE:$<$<COMPILE_LANGUAGE:CXX>:-Wno-clobbered>>)
endif()
if(STOKE_WERROR)
  target_compile_options(stoke_compile_options INTERFACE $<BUILD_INTERFACE:$<$<COMPILE_LANGUAGE:CXX>:-Werror>>)
endif()
target_include_directories(stoke_compile_options INTERFACE
  $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}> $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}/stoke>)
target_compile_definitions(stoke_compile_options INTERFACE
  STOKE_VERSION="${PROJECT_VERSION}" STOKE_WITH_CUDA=$<BOOL:${STOKE_WITH_CUDA}>
  STOKE_WITH_MPI=$<BOOL:${STOKE_WITH_MPI}> STOKE_WITH_NCCL=$<BOOL:${STOKE_WITH_NCCL}>
  STOKE_WITH_ONNX=$<BOOL:${STOKE_WITH_ONNX}> STOKE_WITH_TENSORBOARD=$<BOOL:${STOKE_WITH_TENSORBOARD}>
  STOKE_WITH_MONITOR=$<BOOL:${STOKE_WITH_MONITOR}>)

if(STOKE_SANITIZE STREQUAL "address")
  set(_stoke_san -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
elseif(STOKE_SANITIZE STREQUAL "fuzzer")
  # libFuzzer builds (clang only, scripts/fuzz): coverage for libFuzzer plus ASan+UBSan; the fuzz
  # targets add -fsanitize=fuzzer when they link.
  set(_stoke_san -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
elseif(STOKE_SANITIZE STREQUAL "thread")
  set(_stoke_san -fsanitize=thread -fno-omit-frame-pointer)
elseif(NOT STOKE_SANITIZE STREQUAL "")
  message(FATAL_ERROR "STOKE_SANITIZE must be '', 'address', 'thread' or 'fuzzer', not '${STOKE_SANITIZE}'")
endif()
# Sanitized builds are for finding faults, not for speed: -O1 (what the sanitizers' own docs advise)
# and line tables only (-g1, enough for symbolised stacks) compile stoke's sources about twice as fast
# as the build type's -O2 -g. These come after the build type's flags, so they win; set
# STOKE_SANITIZE_CODEGEN to "" to keep the build type's, or to "-O0 -g" to step through a report.
set(STOKE_SANITIZE_CODEGEN "-O1 -g1" CACHE STRING "Optimisation and debug flags of sanitized builds")
if(_stoke_san)
  separate_arguments(_stoke_san_codegen UNIX_COMMAND "${STOKE_SANITIZE_CODEGEN}")
  set(_stoke_san_compile ${_stoke_san} ${_stoke_san_codegen})
  target_compile_options(stoke_compile_options INTERFACE
    $<BUILD_INTERFACE:$<$<COMPILE_LANGUAGE:CXX>:${_stoke_san_compile}>>)
  target_link_options(stoke_compile_options INTERFACE $<BUILD_INTERFACE:${_stoke_san}>)
endif()

