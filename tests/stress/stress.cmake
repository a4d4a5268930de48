# Fault sweep, fork and crash tests (tests/stress/), included by
# tests/CMakeLists.txt after cuda.cmake (the double's folder comes from there).
set(_sgm_stress_dir ${CMAKE_CURRENT_LIST_DIR})

# Every emulated-device call failing in turn across a workload over all tiers.
sgm_add_test(stress_fault_sweep SOURCES ${_sgm_stress_dir}/test_fault_sweep.c
  LABELS "stress;fault" TIMEOUT 600)
target_link_libraries(stress_fault_sweep PRIVATE ${CMAKE_DL_LIBS})

# The same sweep on the CUDA backend, every driver-double call failing in turn.
# (A failed context lookup inside event_destroy used to leak the event; the
# backend now retries and, failing that, keeps it for close().)
if(SGM_CUDA_INCLUDE_DIR AND SGM_FAKE_CUDA_DIR)
  add_dependencies(stress_fault_sweep sgm_fake_cuda)
  add_test(NAME cuda_stress_fault_sweep COMMAND stress_fault_sweep)
  set_tests_properties(cuda_stress_fault_sweep PROPERTIES
    ENVIRONMENT "SGM_BACKEND=cuda;SGM_VERBOSE=0"
    ENVIRONMENT_MODIFICATION "LD_LIBRARY_PATH=path_list_prepend:${SGM_FAKE_CUDA_DIR}"
    LABELS "stress;fault;cuda-double" TIMEOUT 600 SKIP_RETURN_CODE 77)
endif()
