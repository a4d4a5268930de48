/*
 * stress_util.h — what the fault sweep and the fork tests share: the byte
 * pattern their buffers and allocations hold, and the small three-tier
 * configuration on the emulated device they start from.
 */
#ifndef SGM_STRESS_UTIL_H
#define SGM_STRESS_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "sgm.h"

#define STRESS_KiB (UINT64_C(1) << 10)
#define STRESS_MiB (UINT64_C(1) << 20)

/* n bytes of a pattern that differs for every seed and every offset. */
static inline void stress_pattern(unsigned char *p, size_t n, unsigned seed) {
  unsigned x = seed * 2654435761u + 7;
  for (size_t i = 0; i < n; i++) {
    x = x * 1103515245u + 12345u;
    p[i] = (unsigned char)(x >> 16);
  }
}

/* Defaults and environment, then the emulated device (64 MiB) with the given
 * VRAM and shared budgets and a disk tier in spill_dir (spill_bytes). */
static inline void stress_config(sgm_config *cfg, uint64_t vram_bytes, uint64_t shared_bytes,
                                 const char *spill_dir, uint64_t spill_bytes) {
  sgm_config_init(cfg);
  cfg->backend = SGM_BACKEND_EMU;
  cfg->emu_vram_bytes = 64 * STRESS_MiB;
  cfg->vram_limit = (sgm_size){.bytes = vram_bytes};
  cfg->shared_limit = (sgm_size){.bytes = shared_bytes};
  snprintf(cfg->spill_dir, sizeof cfg->spill_dir, "%s", spill_dir);
  cfg->spill_limit = (sgm_size){.bytes = spill_bytes};
}

#endif
