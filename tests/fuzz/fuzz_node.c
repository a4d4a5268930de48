/*
 * fuzz_node.c — fuzz target for the node registry's reader
 * (sgm__node_parse), which sgm and sgm-smi run on a segment any process of
 * the user may have scribbled on.
 *
 * Input: byte 0 chooses the mode, the rest is the segment.
 *  - even: the bytes as they are (mostly refused at the magic or check word);
 *  - odd: the bytes with a plausible header written over them (magic,
 *    the current version unless bit 1 of byte 0 asks for the input's own version, the
 *    slot count from the input, clamped only by a u32) and the check word
 *    sealed, so the fuzzer reaches the slots.
 *
 * Invariants (a violation aborts):
 *  - parse returns SGM_OK or a status with a non-empty reason;
 *  - on SGM_OK: n_slots in 1..SGM_NODE_MAX_SLOTS and the segment holds them;
 *    n_procs + n_unstable <= n_slots; every proc's slot < n_slots, strictly
 *    increasing; names and the key are NUL-terminated, names printable
 *    without comma or quote; the UUID's text is "" or 36 characters, the PCI
 *    bus id terminated and of hex digits, ':', '.' and '_' only (version 2).
 *
 * Threading: none.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static void fuzz_node_fail(const char *what) {
  fprintf(stderr, "fuzz_node: invariant broken: %s\n", what);
  abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  uint8_t mode = data[0];
  size_t len = size - 1;
  /* A private copy, 8-aligned as a mapping would be. */
  uint64_t *buf = calloc(len / 8 + 1, 8);
  if (!buf) return 0;
  unsigned char *mem = (unsigned char *)buf;
  memcpy(mem, data + 1, len);
  if ((mode & 1) && len >= 512) {
    const uint64_t magic = UINT64_C(0x0045444f4e4d4753);
    memcpy(mem, &magic, 8);
    uint32_t geo[3] = {512, 256, 0};
    memcpy(&geo[2], mem + 20, 4);
    if (!(mode & 4)) geo[2] = (uint32_t)((len - 512) / 256); /* the slots the input holds */
    if (!(mode & 2)) {
      uint32_t v = SGM_NODE_VERSION;
      memcpy(mem + 8, &v, 4);
    }
    memcpy(mem + 12, geo, sizeof geo);
    sgm__node_header_seal(mem, len);
  }
  sgm_node_view *v = malloc(sizeof *v);
  if (!v) {
    free(buf);
    return 0;
  }
  char why[256];
  int rc = sgm__node_parse(mem, len, v, why, sizeof why);
  if (rc != SGM_OK) {
    if (rc >= 0 || !why[0] || !memchr(why, '\0', sizeof why)) fuzz_node_fail("a refusal without a reason");
  } else {
    if (v->n_slots < 1 || v->n_slots > SGM_NODE_MAX_SLOTS) fuzz_node_fail("slot count out of range");
    if (512 + (size_t)v->n_slots * 256 > len) fuzz_node_fail("slots past the end of the segment");
    if (v->n_procs + v->n_unstable > v->n_slots) fuzz_node_fail("more processes than slots");
    if (!memchr(v->key, '\0', sizeof v->key)) fuzz_node_fail("key not terminated");
    if (!memchr(v->uuid_text, '\0', sizeof v->uuid_text)) fuzz_node_fail("UUID text not terminated");
    if (v->uuid_text[0] && strlen(v->uuid_text) != 36) fuzz_node_fail("UUID text not 8-4-4-4-12");
    if (!memchr(v->pci_bus_id, '\0', sizeof v->pci_bus_id)) fuzz_node_fail("PCI bus id not terminated");
    if (strspn(v->pci_bus_id, "0123456789abcdefABCDEF:._") != strlen(v->pci_bus_id))
      fuzz_node_fail("PCI bus id holds a character sgm-smi cannot print");
    for (size_t i = 0; i < v->n_procs; i++) {
      const sgm_node_proc *p = &v->procs[i];
      if (p->slot >= v->n_slots) fuzz_node_fail("slot index out of range");
      if (i && p->slot <= v->procs[i - 1].slot) fuzz_node_fail("slots out of order");
      if (!memchr(p->name, '\0', sizeof p->name)) fuzz_node_fail("name not terminated");
      for (const char *c = p->name; *c; c++)
        if (*c < 0x21 || *c > 0x7e || *c == ',' || *c == '"' || *c == '\\')
          fuzz_node_fail("name holds a character sgm-smi cannot print");
    }
  }
  free(v);
  free(buf);
  return 0;
}
