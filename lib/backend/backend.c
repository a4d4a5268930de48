/*
 * backend.c — choosing and opening a backend.
 *
 * SGM_BACKEND=cuda (the default) opens the CUDA driver; emu opens the emulated
 * device; auto tries cuda and falls back to emu with a one-line notice (at
 * SGM_VERBOSE >= 1) whenever the CUDA backend cannot open a device: no driver
 * library, cuInit failing, no device, or the SGM_DEVICE ordinal out of range.
 * The emulated device is never chosen silently.
 */
#include "backend/backend.h"

#include "internal.h"

int sgm__backend_open(const sgm_config *cfg, const sgm_backend_ops **ops_out,
                      sgm_backend **be_out) {
  *ops_out = NULL;
  *be_out = NULL;
  const sgm_backend_ops *ops = NULL;
  switch (cfg->backend) {
    case SGM_BACKEND_CUDA: ops = &sgm__backend_cuda_ops; break;
    case SGM_BACKEND_EMU: ops = &sgm__backend_emu_ops; break;
    case SGM_BACKEND_AUTO: {
      sgm_backend *be = NULL;
      if (sgm__backend_cuda_ops.open(cfg, &be) == SGM_OK) {
        *ops_out = &sgm__backend_cuda_ops;
        *be_out = be;
        return SGM_OK;
      }
      sgm__log(cfg->verbose, 1, "SGM_BACKEND=auto: no CUDA device answered (%s); using the emulated device",
               sgm_last_error());
      /* The fallback is the answer, not an error: leave no stale message. */
      sgm__error_clear();
      ops = &sgm__backend_emu_ops;
      break;
    }
    default:
      return sgm__error_set(SGM_ERR_INVALID, "unknown backend kind %d in sgm_config.backend "
                            "(use SGM_BACKEND_CUDA, SGM_BACKEND_EMU or SGM_BACKEND_AUTO)",
                            (int)cfg->backend);
  }
  int rc = ops->open(cfg, be_out);
  if (rc != SGM_OK) return rc;
  *ops_out = ops;
  return SGM_OK;
}
