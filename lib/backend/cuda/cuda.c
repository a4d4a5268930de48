/*
 * cuda.c — the CUDA backend. Not built yet: opening it fails with a message
 * that says how to run on the emulated device instead.
 */
#include "backend/backend.h"
#include "internal.h"

static int cuda_open(const sgm_config *cfg, sgm_backend **out) {
  (void)cfg;
  *out = NULL;
  return sgm__error_set(SGM_ERR_BACKEND,
                        "the CUDA backend is not available in this build of sgm; "
                        "set SGM_BACKEND=emu to run on the emulated device");
}

const sgm_backend_ops sgm__backend_cuda_ops = {.name = "cuda", .open = cuda_open};
