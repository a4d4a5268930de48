/*
 * cuda_numa.c — which NUMA node a GPU sits on, from its PCI bus id.
 *
 * The shared tier's pinned chunks should live on the node the GPU's PCIe root
 * hangs off: host<->device traffic then does not cross the socket link. hwloc
 * knows the PCI tree; the first non-I/O ancestor of the GPU's PCI object (a
 * package, a NUMA-bearing group or the machine) carries the nodeset. Needs no
 * CUDA headers, so it is built (and tested) everywhere.
 *
 * Threading: no shared state; each call loads its own topology.
 */
#include "backend/cuda/cuda_internal.h"

#include <stddef.h>

int sgm__cuda_numa_node_in(hwloc_topology_t topo, const char *pci_bus_id) {
  if (!topo || !pci_bus_id || !pci_bus_id[0]) return -1;
  hwloc_obj_t pci = hwloc_get_pcidev_by_busidstring(topo, pci_bus_id);
  if (!pci) return -1;
  hwloc_obj_t anc = hwloc_get_non_io_ancestor_obj(topo, pci);
  if (!anc || !anc->nodeset) return -1;
  /* Attached to the whole machine (most VMs, or hwloc could not place the
   * bridge) with several nodes: there is no local node, and "the first" would
   * pin memory far from the GPU half of the time. Below a package with several
   * nodes (sub-NUMA clustering), any of them is on the right socket. */
  if (anc->parent == NULL && hwloc_bitmap_weight(anc->nodeset) > 1) return -1;
  return hwloc_bitmap_first(anc->nodeset);
}

int sgm__cuda_numa_node(const char *pci_bus_id) {
  if (!pci_bus_id || !pci_bus_id[0]) return -1;
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0) return -1;
  /* hwloc's Linux component reads the PCI tree from sysfs by itself. The
   * plugin components would add nothing we need and cost: "pci" (libpciaccess)
   * leaks on every load; the GPU ones (opencl, cuda, nvml, ...) would load and
   * initialise vendor libraries, the NVIDIA driver among them, inside sgm's
   * open. A name this hwloc does not know is simply not blacklisted. */
  static const char *const skip[] = {"pci", "opencl", "gl", "cuda", "nvml", "rsmi", "levelzero"};
  for (size_t i = 0; i < sizeof skip / sizeof skip[0]; i++)
    (void)hwloc_topology_set_components(topo, HWLOC_TOPOLOGY_COMPONENTS_FLAG_BLACKLIST, skip[i]);
  int node = -1;
  /* PCI devices and bridges only: no OS devices. */
  if (hwloc_topology_set_io_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT) == 0 &&
      hwloc_topology_set_type_filter(topo, HWLOC_OBJ_OS_DEVICE, HWLOC_TYPE_FILTER_KEEP_NONE) == 0 &&
      hwloc_topology_load(topo) == 0)
    node = sgm__cuda_numa_node_in(topo, pci_bus_id);
  hwloc_topology_destroy(topo);
  return node;
}
