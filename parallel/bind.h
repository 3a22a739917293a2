/*
 * bind.h — CPU/NUMA binding of a rank with hwloc.
 *
 * Why: a rank's host threads (the CPU backend's thread pool, the CUDA
 * driver's launch path, MPI progress) should run on the cores of the NUMA
 * node its GPU hangs off, so host↔device copies and host memory stay local;
 * without a GPU, ranks sharing a node should not fight over the same cores.
 *
 * Mode auto:
 *   with a GPU (its PCI bus id): the cpuset of the NUMA node(s) nearest the
 *     GPU, found with hwloc_get_pcidev_by_busidstring; when hwloc cannot see
 *     the device (containers often hide PCI), <sysfs>/bus/pci/devices/<busid>/
 *     local_cpulist, restricted to the CPUs this process may use. Ranks of
 *     GPUs on the same NUMA node share its cores.
 *   without a GPU: hwloc_distrib spreads the node's local_size ranks evenly
 *     over the allowed cores; local_rank gets its share (disjoint while
 *     local_size <= cores).
 *   The binding applies to the process and all its threads
 *   (HWLOC_CPUBIND_PROCESS), so threads created later inherit it.
 * Mode none: nothing is changed (the launcher's own binding, if any, stays).
 *
 * Nothing here keeps state between calls; each call loads the topology.
 */
#ifndef FL_PAR_BIND_H
#define FL_PAR_BIND_H

#include <stddef.h>

#include "core/status.h"

typedef enum fl_par_bind_mode {
    FL_PAR_BIND_AUTO = 0,
    FL_PAR_BIND_NONE,
} fl_par_bind_mode;

/* "auto" | "none" (the --bind values); anything else is FL_ERR_INVALID_ARG
 * naming the value. */
fl_status fl_par_bind_mode_parse(const char *s, fl_par_bind_mode *out);
const char *fl_par_bind_mode_name(fl_par_bind_mode m);

typedef struct fl_par_bind_req {
    fl_par_bind_mode mode;
    int local_rank, local_size;  /* this rank's place among the node's ranks */
    const char *gpu_busid;       /* PCI bus id of this rank's GPU, any accepted
                                    form (see fl_par_busid_normalize); NULL = no GPU */
    const char *sysfs_root;      /* NULL = "/sys"; tests point it at a fake tree */
} fl_par_bind_req;

/* Pure: PCI bus id → the canonical sysfs/hwloc form "dddd:bb:dd.f" (lower
 * case, 4-digit domain). Accepts "0000:3B:00.0", CUDA/NVML's 8-digit domain
 * "00000000:3b:00.0" and a missing domain "3b:00.0". Malformed input is
 * FL_ERR_INVALID_ARG naming it. out needs 13 bytes. */
fl_status fl_par_busid_normalize(const char *in, char *out, size_t out_size);

/* Computes, without applying, the CPU list ("0-3,8") req would bind to, and
 * in `how` (may be NULL) a short account of why ("NUMA node 0 near GPU
 * 0000:3b:00.0 (hwloc)"). Mode none gives the current binding. Errors:
 * FL_ERR_INVALID_ARG (local rank out of range, bad bus id), FL_ERR_NOT_FOUND
 * (GPU neither in hwloc's topology nor in sysfs), FL_ERR_HWLOC. */
fl_status fl_par_bind_plan(const fl_par_bind_req *req, char *cpulist, size_t cpulist_size,
                           char *how, size_t how_size);

/* Applies the plan to the calling process (all its threads) and writes a
 * human-readable description of the resulting binding into desc (for
 * --verbose), e.g. "bound to cpus 1 (local rank 1 of 2: hwloc_distrib over
 * 2 cores, no GPU)" or "not bound (--bind none); may run on cpus 0-1". */
fl_status fl_par_bind_apply(const fl_par_bind_req *req, char *desc, size_t desc_size);

/* The calling process's current CPU binding as a list ("0-1"). */
fl_status fl_par_bind_current(char *cpulist, size_t size);

/* PCI bus id of CUDA device `device` (cudaDeviceGetPCIBusId), normalized.
 * Builds without CUDA: FL_ERR_UNSUPPORTED. */
fl_status fl_par_gpu_busid(int device, char *busid, size_t size);

#endif /* FL_PAR_BIND_H */
