/*
 * route.h — what rank 0 remembers of the prompts it sent to each
 * data-parallel replica: a counted set of prompt block identities
 * (fl_scheduler_prompt_hashes), added when a request is placed and
 * taken back when it finishes, so that requests sharing a prefix can
 * follow the first one to its replica before any of them has been
 * computed (fl_engine_pick_replica, docs/parallel.md).
 */
#ifndef FL_ROUTE_H
#define FL_ROUTE_H

#include <stdbool.h>
#include <stdint.h>

#include "core/status.h"

typedef struct fl_route_set {
    uint64_t *keys;   /* open addressing; 0 marks an empty slot (hash 0 is kept as 1) */
    int32_t *counts;
    uint32_t mask;    /* slots - 1 (a power of two), or 0 before the first add */
    int n;            /* keys held */
} fl_route_set;

/* Counts each of h[0 .. n) once more. */
fl_status fl_route_set_add(fl_route_set *s, const uint64_t *h, int n);
/* Takes back what fl_route_set_add(s, h, n) counted. */
void fl_route_set_remove(fl_route_set *s, const uint64_t *h, int n);
/* How many of h[0 .. n) are held, as a run from the first. */
int fl_route_set_leading(const fl_route_set *s, const uint64_t *h, int n);
/* NULL and a zeroed one are no-ops. */
void fl_route_set_free(fl_route_set *s);

#endif /* FL_ROUTE_H */
