# CUDA copy engine and MakeBestCopyEngine/BuiltWithCuda (CUDA module).
#
# The engine is plain C++ over the CUDA runtime API, built by the host
# compiler and linked with CUDA::cudart_static (see cmake/Dependencies.cmake),
# so a CUDA build runs on machines with no driver and falls back to host copies.
target_sources(nonstop_core PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/select.cc)
if(NONSTOP_HAVE_CUDA)
  target_sources(nonstop_core PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/cuda_copy_engine.cc)
else()
  target_sources(nonstop_core PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/cuda_unavailable.cc)
endif()

# Until the engine module's host engine lands, select.cc uses its own memcpy
# fallback; once host_copy_engine.cc defines MakeHostCopyEngine, it uses that.
set(_nonstop_host_engine ${CMAKE_CURRENT_SOURCE_DIR}/host_copy_engine.cc)
if(EXISTS ${_nonstop_host_engine})
  file(STRINGS ${_nonstop_host_engine} _nonstop_host_engine_def REGEX "MakeHostCopyEngine\\(")
  if(_nonstop_host_engine_def)
    set_source_files_properties(${CMAKE_CURRENT_SOURCE_DIR}/select.cc PROPERTIES
                                COMPILE_DEFINITIONS NONSTOP_HAVE_HOST_COPY_ENGINE=1)
  endif()
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_nonstop_host_engine})
endif()

nonstop_add_test(NAME cuda_select_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/cuda_select_test.cc
                 LABELS copy cuda)

# Plain GPU tests and the copy benchmark (no GoogleTest: the GPU machines
# lack it). They exit 77 (skipped) where no device is usable.
if(NONSTOP_HAVE_CUDA AND NONSTOP_BUILD_TESTS)
  add_subdirectory(${PROJECT_SOURCE_DIR}/tests/gpu ${PROJECT_BINARY_DIR}/tests/gpu)
endif()
