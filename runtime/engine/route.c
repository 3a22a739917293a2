/*
 * route.c — the counted set of prompt block identities behind
 * data-parallel placement (see route.h): linear probing, deletion by
 * backward shift, so lookups never cross tombstones.
 */
#include "runtime/engine/route.h"

#include <stdlib.h>

static uint64_t key_of(uint64_t h) { return h ? h : 1; }
static uint32_t home(const fl_route_set *s, uint64_t k) { return (uint32_t)(k ^ (k >> 29)) & s->mask; }

static int32_t slot_of(const fl_route_set *s, uint64_t k) {
    if (!s->mask) return -1;
    for (uint32_t i = home(s, k);; i = (i + 1) & s->mask) {
        if (s->keys[i] == k) return (int32_t)i;
        if (!s->keys[i]) return -1;
    }
}

static fl_status grow(fl_route_set *s) {
    const uint32_t old = s->mask ? s->mask + 1 : 0, cap = old ? 2 * old : 64;
    uint64_t *keys = calloc(cap, sizeof *keys);
    int32_t *counts = calloc(cap, sizeof *counts);
    if (!keys || !counts) {
        free(keys);
        free(counts);
        return FL_ERR(FL_ERR_OOM, "out of memory for %u prompt block identities", cap);
    }
    fl_route_set t = {keys, counts, cap - 1, s->n};
    for (uint32_t i = 0; i < old; i++) {
        if (!s->keys[i]) continue;
        uint32_t j = home(&t, s->keys[i]);
        while (t.keys[j]) j = (j + 1) & t.mask;
        t.keys[j] = s->keys[i];
        t.counts[j] = s->counts[i];
    }
    free(s->keys);
    free(s->counts);
    *s = t;
    return FL_OK;
}

fl_status fl_route_set_add(fl_route_set *s, const uint64_t *h, int n) {
    for (int b = 0; b < n; b++) {
        const uint64_t k = key_of(h[b]);
        int32_t i = slot_of(s, k);
        if (i < 0) {
            if (2 * (s->n + 1) > (int64_t)s->mask + 1) { /* load factor <= 1/2 */
                fl_status st = grow(s);
                if (st != FL_OK) {
                    fl_route_set_remove(s, h, b); /* all or nothing */
                    return st;
                }
            }
            uint32_t j = home(s, k);
            while (s->keys[j]) j = (j + 1) & s->mask;
            s->keys[j] = k;
            s->counts[j] = 0;
            s->n++;
            i = (int32_t)j;
        }
        s->counts[i]++;
    }
    return FL_OK;
}

void fl_route_set_remove(fl_route_set *s, const uint64_t *h, int n) {
    for (int b = 0; b < n; b++) {
        int32_t at = slot_of(s, key_of(h[b]));
        if (at < 0 || --s->counts[at] > 0) continue;
        /* empty the slot, then pull back the keys that probed past it */
        uint32_t i = (uint32_t)at;
        s->keys[i] = 0;
        s->n--;
        for (uint32_t j = (i + 1) & s->mask; s->keys[j]; j = (j + 1) & s->mask) {
            const uint32_t want = home(s, s->keys[j]);
            /* j's key may move to i when its home is not in (i, j] (cyclically) */
            if (((j - want) & s->mask) >= ((j - i) & s->mask)) {
                s->keys[i] = s->keys[j];
                s->counts[i] = s->counts[j];
                s->keys[j] = 0;
                s->counts[j] = 0;
                i = j;
            }
        }
    }
}

int fl_route_set_leading(const fl_route_set *s, const uint64_t *h, int n) {
    int b = 0;
    while (b < n && slot_of(s, key_of(h[b])) >= 0) b++;
    return b;
}

void fl_route_set_free(fl_route_set *s) {
    if (!s) return;
    free(s->keys);
    free(s->counts);
    s->keys = NULL;
    s->counts = NULL;
    s->mask = 0;
    s->n = 0;
}
