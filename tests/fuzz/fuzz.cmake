# Fuzz targets (libFuzzer entry points, tests/fuzz/*.c), included by
# tests/CMakeLists.txt.
#
#  - Normal builds (every preset): each target is linked with standalone.c and
#    runs as a ctest over its committed seed corpus, tests/fuzz/corpus/<name>/
#    (label "fuzz"). Inputs that show a known defect of issue 12 live in
#    tests/fuzz/known/<defect>/ and run as WILL_FAIL tests until it is fixed.
#  - SGM_FUZZ=ON (tests/fuzz/run_fuzz.sh configures build/fuzz with clang and
#    SGM_SANITIZE=address;undefined;fuzzer-no-link): the same sources linked
#    with -fsanitize=fuzzer, built by name, fuzzed for a bounded time.
option(SGM_FUZZ "Link the fuzz targets with libFuzzer (clang) instead of the plain driver" OFF)

include(${PROJECT_SOURCE_DIR}/benchmarks/replay/core.cmake)
set(_sgm_fuzz_dir ${CMAKE_CURRENT_LIST_DIR})

# sgm_add_fuzz(NAME SOURCES file... LIBS lib... [DEFS def...])
function(sgm_add_fuzz name)
  cmake_parse_arguments(F "" "" "SOURCES;LIBS;DEFS" ${ARGN})
  if(SGM_FUZZ)
    add_executable(${name} ${F_SOURCES})
    target_link_options(${name} PRIVATE -fsanitize=fuzzer)
  else()
    add_executable(${name} ${F_SOURCES} ${_sgm_fuzz_dir}/standalone.c)
  endif()
  target_compile_options(${name} PRIVATE -Wall -Wextra -Werror)
  target_compile_definitions(${name} PRIVATE ${F_DEFS})
  target_link_libraries(${name} PRIVATE ${F_LIBS})
endfunction()

# sgm_add_fuzz_test(TEST_NAME TARGET INPUT_DIR [WILL_FAIL reason] [ENV VAR=value...])
function(sgm_add_fuzz_test test target dir)
  cmake_parse_arguments(F "" "WILL_FAIL" "ENV" ${ARGN})
  add_test(NAME ${test} COMMAND ${target} ${dir})
  set_tests_properties(${test} PROPERTIES
    ENVIRONMENT "SGM_VERBOSE=0;${F_ENV}" LABELS "fuzz" TIMEOUT 120)
  if(F_WILL_FAIL)
    set_tests_properties(${test} PROPERTIES WILL_FAIL TRUE LABELS "fuzz;known-defect")
  endif()
endfunction()

set(_sgm_fuzz_trace_formats csv minimalloc mooncake)
foreach(fmt ${_sgm_fuzz_trace_formats})
  string(TOUPPER ${fmt} FMT)
  sgm_add_fuzz(fuzz_trace_${fmt} SOURCES ${_sgm_fuzz_dir}/fuzz_trace.c LIBS sgm_replay_core
    DEFS FUZZ_TRACE_FORMAT=REPLAY_FMT_${FMT})
endforeach()

# The node registry's reader (lib/node.c), on hand-made and sealed segments.
sgm_add_fuzz(fuzz_node SOURCES ${_sgm_fuzz_dir}/fuzz_node.c LIBS sgm_internal)

# sgm-replay's command line (benchmarks/replay/args.c; issue 29).
sgm_add_fuzz(fuzz_replay_args SOURCES ${_sgm_fuzz_dir}/fuzz_replay_args.c LIBS sgm_replay_core)

if(SGM_FUZZ)
  sgm_add_fuzz(fuzz_options SOURCES ${_sgm_fuzz_dir}/fuzz_options.c LIBS sgm_internal)
  return()
endif()
sgm_add_fuzz_test(fuzz_replay_args fuzz_replay_args ${_sgm_fuzz_dir}/corpus/replay_args)
sgm_add_fuzz_test(fuzz_node fuzz_node ${_sgm_fuzz_dir}/corpus/node)

sgm_add_fuzz(fuzz_options SOURCES ${_sgm_fuzz_dir}/fuzz_options.c LIBS sgm_internal)
sgm_add_fuzz_test(fuzz_options fuzz_options ${_sgm_fuzz_dir}/corpus/options
  ENV "SGM_FUZZ_DICT=${_sgm_fuzz_dir}/options.dict")
foreach(fmt ${_sgm_fuzz_trace_formats})
  sgm_add_fuzz_test(fuzz_trace_${fmt} fuzz_trace_${fmt} ${_sgm_fuzz_dir}/corpus/trace_${fmt})
endforeach()
# Inputs that once showed a defect stay in the corpora: issue 12 defect 6's
# budgets in corpus/options/defect6-*, the trace readers' size wrap-around
# (block sizes whose 256-byte rounding or sum wrapped past 2^64) in
# corpus/trace_<format>/size-wrap-*.
