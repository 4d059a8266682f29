# Host copy engine sources.
target_sources(nonstop_copy PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/copy_engine.cc
                                    ${CMAKE_CURRENT_SOURCE_DIR}/host_copy_engine.cc)
nonstop_add_test(NAME host_copy_engine_test
                 SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/host_copy_engine_test.cc
                 LABELS unit concurrency)
