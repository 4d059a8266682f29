# CUDA copy engine and MakeBestCopyEngine/BuiltWithCuda (copy).
#
# The engine is plain C++ over the CUDA runtime API, built by the host
# compiler and linked with CUDA::cudart_static (see cmake/Dependencies.cmake),
# so a CUDA build runs on machines with no driver and falls back to host copies.
target_sources(nonstop_copy PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/select.cc)
if(NONSTOP_HAVE_CUDA)
  target_sources(nonstop_copy PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/cuda_copy_engine.cc)
else()
  target_sources(nonstop_copy PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/cuda_unavailable.cc)
endif()

nonstop_add_test(NAME cuda_select_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/cuda_select_test.cc
                 LABELS copy cuda)

# Plain GPU tests and the copy benchmark (no GoogleTest: the GPU machines
# lack it). They exit 77 (skipped) where no device is usable.
if(NONSTOP_HAVE_CUDA AND NONSTOP_BUILD_TESTS)
  add_subdirectory(${PROJECT_SOURCE_DIR}/tests/gpu ${PROJECT_BINARY_DIR}/tests/gpu)
endif()
