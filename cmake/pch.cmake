# Precompiled headers (MOED_PCH, on by default): the standard library headers that nearly every
# file includes are parsed once per build instead of once per file (parsing them is about a
# quarter of a typical file's compile time here), and gtest with them for the test programs.
#
#   moed_use_pch(target LIBRARY)       a static or object library
#   moed_use_pch(target PROGRAM)       a test program (gtest too)
#   moed_use_pch(target CLI_LIBRARY)   a library of the command line, replay or plan: CLI11,
#   moed_use_pch(target CLI_PROGRAM)   nlohmann-json and fmt too (parsing CLI11 and json takes
#                                      longer than compiling most of those files' own code)
#
# GCC takes a precompiled header only where it was built with the same -fPIC / -fPIE and debug
# settings as the file (it silently parses the headers again otherwise), so each kind has a
# donor, a library or a program built with those headers, and its targets reuse the donor's.
option(MOED_PCH "Precompile the standard headers (and gtest for the tests)" ON)

set(MOED_PCH_STD <algorithm> <atomic> <chrono> <cmath> <cstddef> <cstdint> <cstdio> <cstdlib>
    <cstring> <functional> <map> <memory> <mutex> <optional> <random> <span> <string>
    <string_view> <thread> <utility> <vector>)
set(MOED_PCH_CLI <CLI/CLI.hpp> <fmt/format.h> <nlohmann/json.hpp>)

if(MOED_PCH)
  # A header rejected for its settings is a warning, not a silent slow build.
  add_compile_options(-Winvalid-pch)
endif()

function(moed_use_pch target kind)
  if(NOT MOED_PCH)
    return()
  endif()
  set(donor moed_pch_${kind})
  string(TOLOWER ${donor} donor)
  if(NOT TARGET ${donor})
    # The donor of this kind: a library or a program, built with the headers of its kind.
    set(headers ${MOED_PCH_STD})
    if(kind MATCHES "^CLI_")
      list(APPEND headers ${MOED_PCH_CLI})
    endif()
    if(kind STREQUAL "PROGRAM")
      add_executable(${donor} EXCLUDE_FROM_ALL ${PROJECT_SOURCE_DIR}/cmake/pch.cc)
    elseif(kind STREQUAL "CLI_PROGRAM")
      add_executable(${donor} EXCLUDE_FROM_ALL ${PROJECT_SOURCE_DIR}/cmake/pch_main.cc)
    else()
      add_library(${donor} OBJECT EXCLUDE_FROM_ALL ${PROJECT_SOURCE_DIR}/cmake/pch.cc)
    endif()
    if(kind STREQUAL "PROGRAM")
      target_link_libraries(${donor} PRIVATE GTest::gtest GTest::gtest_main)
      list(APPEND headers <gtest/gtest.h>)
    elseif(kind MATCHES "^CLI_")
      # fmt::fmt defines FMT_SHARED, which the users must define too (they link fmt::fmt).
      target_link_libraries(${donor} PRIVATE fmt::fmt nlohmann_json::nlohmann_json)
    endif()
    target_precompile_headers(${donor} PRIVATE ${headers})
  endif()
  target_precompile_headers(${target} REUSE_FROM ${donor})
endfunction()
