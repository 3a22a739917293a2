/*
 * forward_skip.c — FL_DIAG_SKIP's names (see forward_skip.h).
 */
#include "runtime/model/forward_skip.h"

#include <string.h>

static const struct {
    const char *name;
    unsigned bit;
} skip_names[] = {
    {"none", 0u}, /* a baseline value for A/B scripts */
    {"norm_attn", FL_SKIP_NORM_ATTN}, {"qkv", FL_SKIP_QKV},     {"attn", FL_SKIP_ATTN}, {"o", FL_SKIP_O},
    {"norm_mlp", FL_SKIP_NORM_MLP},   {"gate_up", FL_SKIP_GATE_UP}, {"down", FL_SKIP_DOWN}, {"head", FL_SKIP_HEAD},
};

fl_status fl_forward_skip_parse(const char *spec, unsigned *mask) {
    *mask = 0;
    for (const char *p = spec; p && *p;) {
        const size_t len = strcspn(p, ",");
        size_t i = 0;
        while (i < sizeof skip_names / sizeof skip_names[0] &&
               !(strlen(skip_names[i].name) == len && !strncmp(p, skip_names[i].name, len)))
            i++;
        if (i == sizeof skip_names / sizeof skip_names[0])
            return FL_ERR(FL_ERR_INVALID_ARG,
                          "FL_DIAG_SKIP: unknown op '%.*s' (none, norm_attn, qkv, attn, o, norm_mlp, gate_up, down, head)",
                          (int)len, p);
        *mask |= skip_names[i].bit;
        p += len + (p[len] == ',');
    }
    return FL_OK;
}
