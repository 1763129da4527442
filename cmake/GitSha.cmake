# Run at every build (cmake -DSOURCE_DIR=... -DOUT=... -P GitSha.cmake, from a custom target in
# common/): writes OUT, the source of stoke::GitSha(), when the revision it names is not HEAD's.
# The version line and the manifests of an incremental build then name the revision built (read
# only when CMake configured, they named an older one), at the cost of one small file compiled
# again after a commit.
execute_process(COMMAND git rev-parse --short=12 HEAD WORKING_DIRECTORY "${SOURCE_DIR}"
                OUTPUT_VARIABLE sha OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR NOT sha)
  set(sha unknown)
endif()
set(text "// Written by cmake/GitSha.cmake at build time.\n#include \"common/version.h\"\n\nconst char* stoke::GitSha() { return \"${sha}\"; }\n")
set(old "")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
endif()
if(NOT old STREQUAL text)
  file(WRITE "${OUT}" "${text}")
endif()
