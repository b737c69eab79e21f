# Third-party libraries of the MoE layer: the BLAS its expert GEMMs run on.
#
# OpenBLAS (Debian libopenblas-dev): cblas_sgemm, for f32 and for bf16 operands widened to
# f32 (Debian builds OpenBLAS without cblas_sbgemm). Found through its CMake package when present, else
# by name, so a plain Debian install is enough.
function(moed_link_deps target)
  get_target_property(type ${target} TYPE)
  set(scope PUBLIC)
  set(inc_scope PRIVATE)
  if(type STREQUAL "INTERFACE_LIBRARY")
    set(scope INTERFACE)
    set(inc_scope INTERFACE)
  endif()
  find_package(OpenBLAS CONFIG QUIET)
  if(OpenBLAS_FOUND AND OpenBLAS_LIBRARIES)
    target_include_directories(${target} ${inc_scope} ${OpenBLAS_INCLUDE_DIRS})
    target_link_libraries(${target} ${scope} ${OpenBLAS_LIBRARIES})
    return()
  endif()
  find_path(MOED_OPENBLAS_INCLUDE cblas.h PATH_SUFFIXES openblas openblas-pthread
            x86_64-linux-gnu/openblas-pthread)
  find_library(MOED_OPENBLAS_LIBRARY NAMES openblas)
  if(NOT MOED_OPENBLAS_INCLUDE OR NOT MOED_OPENBLAS_LIBRARY)
    message(FATAL_ERROR "moed: OpenBLAS not found (Debian: apt-get install libopenblas-dev)")
  endif()
  target_include_directories(${target} ${inc_scope} ${MOED_OPENBLAS_INCLUDE})
  target_link_libraries(${target} ${scope} ${MOED_OPENBLAS_LIBRARY})
endfunction()
