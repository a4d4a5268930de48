# The model-based random test (tests/model/), included by tests/CMakeLists.txt:
# test_model in every configuration (label "model"); the soak (sgm-soak, not a
# test: minutes, reports RSS, committed bytes and descriptors) with the benchmarks.
set(_sgm_model_dir ${CMAKE_CURRENT_LIST_DIR})
add_library(sgm_model STATIC ${_sgm_model_dir}/model.c)
target_include_directories(sgm_model PUBLIC ${_sgm_model_dir})
target_compile_options(sgm_model PRIVATE -Wall -Wextra -Werror -Wshadow -Wvla)
target_link_libraries(sgm_model PUBLIC sgm_test_support)
sgm_add_test(model_test_model SOURCES ${_sgm_model_dir}/test_model.c LIBS sgm_model
  LABELS model TIMEOUT 300)
if(SGM_BUILD_BENCHMARKS)
  add_executable(sgm-soak ${_sgm_model_dir}/soak.c)
  target_compile_options(sgm-soak PRIVATE -Wall -Wextra -Werror)
  target_link_libraries(sgm-soak PRIVATE sgm_model)
endif()
