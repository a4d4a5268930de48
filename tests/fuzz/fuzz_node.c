/*
 * fuzz_node.c — fuzz target for the node registry's record reader
 * (sgm__node_record_parse), which every sgm process and sgm-smi run on
 * records other processes (other users', with group sharing) wrote: every
 * byte is untrusted.
 *
 * Input: byte 0 chooses the mode, the rest is the record.
 *  - even: the bytes as they are (mostly refused at the size, magic or check word);
 *  - odd: the bytes padded or cut to a record's size with a plausible header
 *    written over them (magic, the current version unless bit 1 of byte 0
 *    asks for the input's own, the record size) and the check word sealed,
 *    so the fuzzer reaches the slot's words.
 *
 * Invariants (a violation aborts):
 *  - parse returns SGM_OK or a status with a non-empty, terminated reason;
 *  - on SGM_OK: the length was a record's; the name, key, UUID text and PCI
 *    bus id are NUL-terminated; the name is printable ASCII without space,
 *    comma, quote or backslash (it reaches terminals, CSV, JSON, labels);
 *    the UUID's text is "" or 36 characters; the PCI id holds hex digits,
 *    ':', '.' and '_' only; the pid is -1 or non-negative.
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
  if (mode & 1) len = SGM_NODE_RECORD_BYTES;
  /* A private copy, 8-aligned as a read buffer would be. */
  uint64_t *buf = calloc(len / 8 + 1, 8);
  if (!buf) return 0;
  unsigned char *mem = (unsigned char *)buf;
  memcpy(mem, data + 1, size - 1 < len ? size - 1 : len);
  if (mode & 1) {
    const uint64_t magic = UINT64_C(0x0045444f4e4d4753);
    memcpy(mem, &magic, 8);
    if (!(mode & 2)) {
      uint32_t v = SGM_NODE_VERSION;
      memcpy(mem + 8, &v, 4);
    }
    uint32_t rb = SGM_NODE_RECORD_BYTES;
    memcpy(mem + 12, &rb, 4);
    sgm__node_record_seal(mem, len);
  }
  sgm_node_proc p;
  sgm_node_devinfo d;
  char why[256];
  memset(why, 'x', sizeof why);
  int rc = sgm__node_record_parse(mem, len, &p, &d, why, sizeof why);
  if (rc != SGM_OK) {
    if (rc >= 0 || !memchr(why, '\0', sizeof why) || !why[0]) fuzz_node_fail("a refusal without a reason");
  } else {
    if (len != SGM_NODE_RECORD_BYTES) fuzz_node_fail("accepted a record of the wrong size");
    if (!memchr(d.key, '\0', sizeof d.key)) fuzz_node_fail("key not terminated");
    if (!memchr(d.uuid_text, '\0', sizeof d.uuid_text)) fuzz_node_fail("UUID text not terminated");
    if (d.uuid_text[0] && strlen(d.uuid_text) != 36) fuzz_node_fail("UUID text not 8-4-4-4-12");
    if (!memchr(d.pci_bus_id, '\0', sizeof d.pci_bus_id)) fuzz_node_fail("PCI bus id not terminated");
    if (strspn(d.pci_bus_id, "0123456789abcdefABCDEF:._") != strlen(d.pci_bus_id))
      fuzz_node_fail("PCI bus id holds a character sgm-smi cannot print");
    if (!memchr(p.name, '\0', sizeof p.name)) fuzz_node_fail("name not terminated");
    for (const char *c = p.name; *c; c++)
      if (*c < 0x21 || *c > 0x7e || *c == ',' || *c == '"' || *c == '\\' || *c == '\'')
        fuzz_node_fail("name holds a character sgm-smi cannot print");
    if (p.pid < -1) fuzz_node_fail("negative pid other than -1");
  }
  free(buf);
  return 0;
}
