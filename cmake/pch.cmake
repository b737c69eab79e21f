# Precompiled headers (MOED_PCH, on by default): the standard library headers that nearly every
# file includes are parsed once per build instead of once per file (parsing them is about a
# quarter of a typical file's compile time here), and gtest with them for the test programs.
#
#   moed_use_pch(target LIBRARY)   a static or object library
#   moed_use_pch(target PROGRAM)   a test program (gtest too)
#
# GCC takes a precompiled header only where it was built with the same -fPIC / -fPIE and debug
# settings as the file (it silently parses the headers again otherwise), so there are two
# donors, a library and a program, and every other target reuses one of them.
option(MOED_PCH "Precompile the standard headers (and gtest for the tests)" ON)

set(MOED_PCH_STD <algorithm> <atomic> <chrono> <cmath> <cstddef> <cstdint> <cstdio> <cstdlib>
    <cstring> <functional> <map> <memory> <mutex> <optional> <random> <span> <string>
    <string_view> <thread> <utility> <vector>)

if(MOED_PCH)
  # A header rejected for its settings is a warning, not a silent slow build.
  add_compile_options(-Winvalid-pch)
  add_library(moed_pch_library OBJECT ${CMAKE_CURRENT_LIST_DIR}/pch.cc)
  target_precompile_headers(moed_pch_library PRIVATE ${MOED_PCH_STD})
endif()

function(moed_use_pch target kind)
  if(NOT MOED_PCH)
    return()
  endif()
  if(kind STREQUAL "LIBRARY")
    target_precompile_headers(${target} REUSE_FROM moed_pch_library)
  else()
    if(NOT TARGET moed_pch_program)
      add_executable(moed_pch_program EXCLUDE_FROM_ALL ${PROJECT_SOURCE_DIR}/cmake/pch.cc)
      target_link_libraries(moed_pch_program PRIVATE GTest::gtest GTest::gtest_main)
      target_precompile_headers(moed_pch_program PRIVATE ${MOED_PCH_STD} <gtest/gtest.h>)
    endif()
    target_precompile_headers(${target} REUSE_FROM moed_pch_program)
  endif()
endfunction()
