/*
 * bind.c — hwloc binding of a rank near its GPU or spread over the node's
 * cores (see bind.h for the policy and why).
 */
#include "parallel/bind.h"

#include <ctype.h>
#include <errno.h>
#include <hwloc.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "parallel/check.h"

#ifdef FL_HAVE_NCCL
#include <cuda_runtime_api.h>
#endif

fl_status fl_par_bind_mode_parse(const char *s, fl_par_bind_mode *out) {
    if (s && !strcmp(s, "auto")) *out = FL_PAR_BIND_AUTO;
    else if (s && !strcmp(s, "none")) *out = FL_PAR_BIND_NONE;
    else
        return FL_ERR(FL_ERR_INVALID_ARG, "--bind '%s': expected auto or none", s ? s : "(null)");
    return FL_OK;
}

const char *fl_par_bind_mode_name(fl_par_bind_mode m) {
    return m == FL_PAR_BIND_NONE ? "none" : "auto";
}

/* Reads 1..maxd hex digits into *v; returns the number read (0 = none). */
static int hex_field(const char **p, int maxd, unsigned long *v) {
    int n = 0;
    *v = 0;
    while (n < maxd && isxdigit((unsigned char)**p)) {
        int c = tolower((unsigned char)**p);
        *v = *v * 16 + (unsigned long)(isdigit(c) ? c - '0' : c - 'a' + 10);
        (*p)++;
        n++;
    }
    return n;
}

fl_status fl_par_busid_normalize(const char *in, char *out, size_t out_size) {
    unsigned long f[4] = {0, 0, 0, 0};
    if (!in) return FL_ERR(FL_ERR_INVALID_ARG, "PCI bus id is NULL");
    /* Two colons: domain:bus:dev.fn; one colon: bus:dev.fn. */
    int colons = 0;
    for (const char *q = in; *q; q++) colons += *q == ':';
    const char *p = in;
    int ok = colons == 1 || colons == 2;
    if (ok && colons == 2) ok = hex_field(&p, 8, &f[0]) > 0 && *p++ == ':';
    ok = ok && hex_field(&p, 2, &f[1]) > 0 && *p++ == ':';
    ok = ok && hex_field(&p, 2, &f[2]) > 0 && *p++ == '.';
    ok = ok && hex_field(&p, 1, &f[3]) > 0 && *p == 0;
    if (!ok || f[0] > 0xffff || f[2] > 0x1f || f[3] > 7)
        return FL_ERR(FL_ERR_INVALID_ARG,
                      "PCI bus id '%s' is not of the form [domain:]bus:device.function", in);
    if (out_size < 13)
        return FL_ERR(FL_ERR_INVALID_ARG, "PCI bus id buffer of %zu bytes is too small",
                      out_size);
    snprintf(out, out_size, "%04lx:%02lx:%02lx.%lx", f[0], f[1], f[2], f[3]);
    return FL_OK;
}

static fl_status list_out(hwloc_const_bitmap_t set, char *buf, size_t size) {
    int n = hwloc_bitmap_list_snprintf(buf, size, set);
    if (n < 0 || (size_t)n >= size)
        return FL_ERR(FL_ERR_INVALID_ARG, "CPU list needs %d bytes, buffer has %zu", n, size);
    return FL_OK;
}

static void how_out(char *how, size_t size, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void how_out(char *how, size_t size, const char *fmt, ...) {
    if (!how || !size) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(how, size, fmt, ap);
    va_end(ap);
}

static fl_status load_topology(hwloc_topology_t *topo, int want_pci) {
    fl_status st = FL_OK;
    *topo = NULL;
    FL_HWLOC_CHECK_GOTO(hwloc_topology_init(topo), st, fail);
    if (want_pci)
        FL_HWLOC_CHECK_GOTO(
            hwloc_topology_set_io_types_filter(*topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT), st,
            fail);
    FL_HWLOC_CHECK_GOTO(hwloc_topology_load(*topo), st, fail);
    return FL_OK;
fail:
    if (*topo) hwloc_topology_destroy(*topo);
    *topo = NULL;
    return st;
}

/* The GPU's NUMA locality from sysfs: local_cpulist of the PCI device. */
static fl_status sysfs_cpuset(hwloc_topology_t topo, const char *root, const char *busid,
                              hwloc_bitmap_t set) {
    char path[512], line[4096];
    snprintf(path, sizeof path, "%s/bus/pci/devices/%s/local_cpulist", root ? root : "/sys",
             busid);
    FILE *f = fopen(path, "r");
    if (!f)
        return FL_ERR(FL_ERR_NOT_FOUND,
                      "GPU %s: hwloc does not see this PCI device and %s cannot be read (%s)",
                      busid, path, strerror(errno));
    char *got = fgets(line, sizeof line, f);
    fclose(f);
    if (got) line[strcspn(line, "\n")] = 0;
    if (!got || hwloc_bitmap_list_sscanf(set, line) < 0 || hwloc_bitmap_iszero(set))
        return FL_ERR(FL_ERR_FORMAT, "%s: '%s' is not a CPU list", path, got ? line : "");
    hwloc_bitmap_and(set, set, hwloc_topology_get_allowed_cpuset(topo));
    if (hwloc_bitmap_iszero(set))
        return FL_ERR(FL_ERR_NOT_FOUND,
                      "%s: CPUs '%s' near GPU %s are all outside this process's allowed set",
                      path, line, busid);
    return FL_OK;
}

/* Fills set with the plan for req (topology already loaded). */
static fl_status plan_set(hwloc_topology_t topo, const fl_par_bind_req *req, hwloc_bitmap_t set,
                          char *how, size_t how_size) {
    if (req->mode == FL_PAR_BIND_NONE) {
        if (hwloc_get_cpubind(topo, set, HWLOC_CPUBIND_PROCESS) < 0)
            return fl_par_hwloc_error(errno, "hwloc_get_cpubind(topo, set, HWLOC_CPUBIND_PROCESS)",
                                      __FILE__, __LINE__);
        how_out(how, how_size, "--bind none: left as inherited");
        return FL_OK;
    }
    if (req->local_size < 1 || req->local_rank < 0 || req->local_rank >= req->local_size)
        return FL_ERR(FL_ERR_INVALID_ARG, "local rank %d is not in [0, local size %d)",
                      req->local_rank, req->local_size);
    if (req->gpu_busid) {
        char busid[16];
        FL_TRY(fl_par_busid_normalize(req->gpu_busid, busid, sizeof busid));
        hwloc_obj_t pci = hwloc_get_pcidev_by_busidstring(topo, busid);
        hwloc_obj_t anc = pci ? hwloc_get_non_io_ancestor_obj(topo, pci) : NULL;
        if (anc && anc->nodeset && !hwloc_bitmap_iszero(anc->nodeset)) {
            /* The whole NUMA node(s), not only the ancestor's cores: the
             * nearest memory is what matters, and all its cores share it. */
            hwloc_cpuset_from_nodeset(topo, set, anc->nodeset);
            hwloc_bitmap_and(set, set, hwloc_topology_get_allowed_cpuset(topo));
            char nodes[64] = "?";
            hwloc_bitmap_list_snprintf(nodes, sizeof nodes, anc->nodeset);
            how_out(how, how_size, "NUMA node %s near GPU %s (hwloc PCI locality)", nodes, busid);
        } else {
            FL_TRY(sysfs_cpuset(topo, req->sysfs_root, busid, set));
            how_out(how, how_size, "local_cpulist of GPU %s (sysfs)", busid);
        }
        if (hwloc_bitmap_iszero(set))
            return FL_ERR(FL_ERR_NOT_FOUND, "GPU %s: its NUMA node has no allowed CPUs", busid);
        return FL_OK;
    }
    /* No GPU: spread the node's ranks over the allowed cores. */
    hwloc_obj_t root = hwloc_get_root_obj(topo);
    int n = req->local_size;
    hwloc_bitmap_t *sets = calloc((size_t)n, sizeof *sets);
    if (!sets) return FL_ERR(FL_ERR_OOM, "out of memory for %d cpusets", n);
    fl_status st = FL_OK;
    if (hwloc_distrib(topo, &root, 1, sets, (unsigned)n, INT_MAX, 0) < 0) {
        st = fl_par_hwloc_error(errno, "hwloc_distrib", __FILE__, __LINE__);
    } else {
        hwloc_bitmap_copy(set, sets[req->local_rank]);
        int cores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
        how_out(how, how_size, "local rank %d of %d: hwloc_distrib over %d cores, no GPU",
                req->local_rank, n, cores);
    }
    for (int i = 0; i < n; i++) hwloc_bitmap_free(sets[i]);
    free(sets);
    return st;
}

fl_status fl_par_bind_plan(const fl_par_bind_req *req, char *cpulist, size_t cpulist_size,
                           char *how, size_t how_size) {
    fl_status st = FL_OK;
    hwloc_topology_t topo = NULL;
    hwloc_bitmap_t set = hwloc_bitmap_alloc();
    FL_CHECK_ALLOC(set, st, fail);
    FL_TRY_GOTO(load_topology(&topo, req->gpu_busid != NULL), st, fail);
    FL_TRY_GOTO(plan_set(topo, req, set, how, how_size), st, fail);
    FL_TRY_GOTO(list_out(set, cpulist, cpulist_size), st, fail);
fail:
    hwloc_bitmap_free(set);
    if (topo) hwloc_topology_destroy(topo);
    return st;
}

fl_status fl_par_bind_apply(const fl_par_bind_req *req, char *desc, size_t desc_size) {
    fl_status st = FL_OK;
    hwloc_topology_t topo = NULL;
    char how[256] = "", list[1024] = "";
    hwloc_bitmap_t set = hwloc_bitmap_alloc();
    FL_CHECK_ALLOC(set, st, fail);
    FL_TRY_GOTO(load_topology(&topo, req->gpu_busid != NULL), st, fail);
    FL_TRY_GOTO(plan_set(topo, req, set, how, sizeof how), st, fail);
    if (req->mode != FL_PAR_BIND_NONE)
        FL_HWLOC_CHECK_GOTO(hwloc_set_cpubind(topo, set, HWLOC_CPUBIND_PROCESS), st, fail);
    FL_TRY_GOTO(list_out(set, list, sizeof list), st, fail);
    if (desc && desc_size) {
        if (req->mode == FL_PAR_BIND_NONE)
            snprintf(desc, desc_size, "not bound (--bind none); may run on cpus %s", list);
        else
            snprintf(desc, desc_size, "bound to cpus %s (%s)", list, how);
    }
fail:
    hwloc_bitmap_free(set);
    if (topo) hwloc_topology_destroy(topo);
    return st;
}

fl_status fl_par_bind_current(char *cpulist, size_t size) {
    fl_status st = FL_OK;
    hwloc_topology_t topo = NULL;
    hwloc_bitmap_t set = hwloc_bitmap_alloc();
    FL_CHECK_ALLOC(set, st, fail);
    FL_TRY_GOTO(load_topology(&topo, 0), st, fail);
    FL_HWLOC_CHECK_GOTO(hwloc_get_cpubind(topo, set, HWLOC_CPUBIND_PROCESS), st, fail);
    FL_TRY_GOTO(list_out(set, cpulist, size), st, fail);
fail:
    hwloc_bitmap_free(set);
    if (topo) hwloc_topology_destroy(topo);
    return st;
}

fl_status fl_par_gpu_busid(int device, char *busid, size_t size) {
#ifdef FL_HAVE_NCCL
    char raw[64];
    FL_CUDA_CHECK(cudaDeviceGetPCIBusId(raw, (int)sizeof raw, device));
    return fl_par_busid_normalize(raw, busid, size);
#else
    (void)busid;
    (void)size;
    return FL_ERR(FL_ERR_UNSUPPORTED,
                  "this flotilla was built without CUDA: no PCI bus id for GPU %d", device);
#endif
}
