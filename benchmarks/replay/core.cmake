# The replay core (trace readers, OPT, the sgm driver) as a static library,
# shared by sgm-replay and tests/unit/test_replay.c. Tests are configured
# before benchmarks, so both include this file; the guard defines it once.
include_guard(GLOBAL)
add_library(sgm_replay_core STATIC
  ${CMAKE_CURRENT_LIST_DIR}/trace.c
  ${CMAKE_CURRENT_LIST_DIR}/opt.c
  ${CMAKE_CURRENT_LIST_DIR}/driver.c
  ${CMAKE_CURRENT_LIST_DIR}/alloc.c
  ${CMAKE_CURRENT_LIST_DIR}/synth.c
  ${CMAKE_CURRENT_LIST_DIR}/args.c)
target_include_directories(sgm_replay_core PUBLIC ${CMAKE_CURRENT_LIST_DIR})
target_compile_options(sgm_replay_core PRIVATE -Wall -Wextra -Werror -Wshadow -Wvla)
target_link_libraries(sgm_replay_core PUBLIC sgm_static)
