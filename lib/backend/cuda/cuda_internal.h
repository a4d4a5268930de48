/*
 * cuda_internal.h — functions shared by the files of the CUDA backend and
 * reached by its unit test. Nothing here is exported from libsgm.so.
 */
#ifndef SGM_CUDA_INTERNAL_H
#define SGM_CUDA_INTERNAL_H

#include <hwloc.h>

/*
 * The NUMA node (OS index) the PCI device pci_bus_id ("0000:65:00.0", the
 * format of cuDeviceGetPCIBusId) is local to in topo, which must have been
 * loaded with I/O devices kept: the first node of the nodeset of its first
 * non-I/O ancestor. -1 when unknown: no such device, or it hangs directly off
 * the machine and the machine has several nodes (no local node).
 */
int sgm__cuda_numa_node_in(hwloc_topology_t topo, const char *pci_bus_id);

/* The same for this machine: loads the topology (with PCI devices) and drops
 * it again. -1 when unknown or hwloc fails. Takes milliseconds: call at open. */
int sgm__cuda_numa_node(const char *pci_bus_id);

#endif /* SGM_CUDA_INTERNAL_H */
