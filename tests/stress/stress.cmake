# Fault sweep, fork and crash tests (tests/stress/), included by
# tests/CMakeLists.txt after cuda.cmake (the double's folder comes from there).
set(_sgm_stress_dir ${CMAKE_CURRENT_LIST_DIR})

# Every emulated-device call failing in turn across a workload over all tiers.
sgm_add_test(stress_fault_sweep SOURCES ${_sgm_stress_dir}/test_fault_sweep.c
  LABELS "stress;fault" TIMEOUT 600)
target_link_libraries(stress_fault_sweep PRIVATE ${CMAKE_DL_LIBS})

# The same sweep on the CUDA backend, every driver-double call failing in turn.
# Known defect (not in issue 12's list): when cuCtxGetCurrent fails inside the
# backend's event_destroy (lib/backend/cuda/cuda.c, cuda_enter), the event is
# dropped from sgm's table but never destroyed: one CUDA event leaks per
# failure. The sweep excuses it (SGM_SWEEP_KNOWN_LEAKS); the _event_leak test
# holds it, WILL_FAIL until fixed (then drop both).
if(SGM_CUDA_INCLUDE_DIR AND SGM_FAKE_CUDA_DIR)
  add_dependencies(stress_fault_sweep sgm_fake_cuda)
  add_test(NAME cuda_stress_fault_sweep COMMAND stress_fault_sweep)
  add_test(NAME cuda_stress_fault_sweep_event_leak COMMAND stress_fault_sweep --stop-at-first)
  set_tests_properties(cuda_stress_fault_sweep cuda_stress_fault_sweep_event_leak PROPERTIES
    ENVIRONMENT_MODIFICATION "LD_LIBRARY_PATH=path_list_prepend:${SGM_FAKE_CUDA_DIR}"
    TIMEOUT 600 SKIP_RETURN_CODE 77)
  set_tests_properties(cuda_stress_fault_sweep PROPERTIES
    ENVIRONMENT "SGM_BACKEND=cuda;SGM_VERBOSE=0;SGM_SWEEP_KNOWN_LEAKS=cuCtxGetCurrent"
    LABELS "stress;fault;cuda-double")
  set_tests_properties(cuda_stress_fault_sweep_event_leak PROPERTIES
    ENVIRONMENT "SGM_BACKEND=cuda;SGM_VERBOSE=0"
    LABELS "stress;fault;cuda-double;known-defect" WILL_FAIL TRUE)
endif()
