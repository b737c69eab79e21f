# The Python package: decides MOED_PYTHON before any library target exists.
#
# Off under ThreadSanitizer (an uninstrumented interpreter's threads would be invisible to it)
# and when pybind11 (Debian pybind11-dev) or the Python 3 headers are missing. The interpreter
# is Debian's /usr/bin/python3 (the one python3-torch installs into), not whatever python3
# comes first on PATH, unless Python3_EXECUTABLE says otherwise.
if(MOED_PYTHON AND MOED_TSAN)
  message(STATUS "moed: Python package off under ThreadSanitizer")
  set(MOED_PYTHON OFF)
endif()
if(MOED_PYTHON)
  if(NOT Python3_EXECUTABLE AND EXISTS /usr/bin/python3)
    set(Python3_EXECUTABLE /usr/bin/python3)
  endif()
  find_package(Python3 COMPONENTS Interpreter Development.Module QUIET)
  if(Python3_FOUND)
    find_package(pybind11 CONFIG QUIET)
  endif()
  if(NOT Python3_FOUND OR NOT pybind11_FOUND)
    message(STATUS "moed: Python package off (needs pybind11-dev and python3-dev)")
    set(MOED_PYTHON OFF)
  endif()
endif()
if(MOED_PYTHON)
  set(CMAKE_POSITION_INDEPENDENT_CODE ON)
endif()
# Under AddressSanitizer + UBSan the extension is instrumented and the interpreter is not: the
# Python tests load the ASan runtime first (LD_PRELOAD), as a sanitized executable would, and
# libstdc++ right after it: ASan finds the C++ runtime's __cxa_throw when it starts, and CPython
# loads no C++ before the extension (the first exception thrown would stop the process).
# NOTE: no leak check there: at exit LeakSanitizer would report what the interpreter and torch
# keep by design, and a frame-pointer stack through them cannot tell moed's allocations apart;
# the C++ suites check the same allocations for leaks. The ownership reproductions run 10 times
# each there (50 in the Release pass): a bad access fails the first run under ASan.
set(MOED_PYTHON_TEST_ENV "")
if(MOED_PYTHON AND MOED_SANITIZE)
  execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libasan.so
                  OUTPUT_VARIABLE MOED_ASAN_RUNTIME OUTPUT_STRIP_TRAILING_WHITESPACE)
  execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so.6
                  OUTPUT_VARIABLE MOED_CXX_RUNTIME OUTPUT_STRIP_TRAILING_WHITESPACE)
  get_filename_component(MOED_CXX_RUNTIME ${MOED_CXX_RUNTIME} REALPATH)
  set(MOED_PYTHON_TEST_ENV
      "LD_PRELOAD=${MOED_ASAN_RUNTIME}:${MOED_CXX_RUNTIME};ASAN_OPTIONS=detect_leaks=0;MOED_OWNERSHIP_RUNS=10")
endif()
