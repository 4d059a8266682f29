# CUDA copy engine and MakeBestCopyEngine/BuiltWithCuda (CUDA module).
target_sources(nonstop_core PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/select.cc)
