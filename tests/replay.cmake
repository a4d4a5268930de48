# The replay core for unit_test_replay (benchmarks/replay/core.cmake defines
# it once, whichever of tests/ and benchmarks/ comes first).
include(${PROJECT_SOURCE_DIR}/benchmarks/replay/core.cmake)
if(TARGET unit_test_replay)
  target_link_libraries(unit_test_replay PRIVATE sgm_replay_core)
endif()
# The shipped tiny traces (tests/bench/traces): test_replay pins LRU and OPT on them.
if(TARGET unit_test_replay)
  target_compile_definitions(unit_test_replay PRIVATE
    SGM_TEST_TRACES="${PROJECT_SOURCE_DIR}/tests/bench/traces")
endif()
