/*
 * gguf_moe.c — expands llama.cpp's stacked expert tensors into per-expert
 * views (see gguf_moe.h).
 */
#include "runtime/load/gguf_moe.h"

#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char EXPERTS[] = ".mlp.experts.";

/* A stacked expert tensor: 3-D and named "...mlp.experts.<proj>.weight"
 * (no expert index yet). */
static const char *stacked_at(const fl_ckpt_tensor *t) {
    if (t->ndim != 3) return NULL;
    const char *p = strstr(t->name, EXPERTS);
    if (!p) return NULL;
    p += sizeof EXPERTS - 1;
    return *p >= '0' && *p <= '9' ? NULL : p;
}

static bool ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

fl_status fl_gguf_split_experts(const char *path, fl_ckpt_tensor **tensors, char ***gguf_names, size_t *n) {
    fl_ckpt_tensor *in = *tensors;
    size_t total = 0;
    for (size_t i = 0; i < *n; i++) {
        if (ends_with(in[i].name, ".mlp.shared_expert_gate.weight") && in[i].ndim == 1) {
            in[i].ndim = 2;
            in[i].shape[1] = in[i].shape[0];
            in[i].shape[0] = 1;
        }
        if (!stacked_at(&in[i])) {
            total++;
            continue;
        }
        int64_t ne = in[i].shape[0];
        /* a non-empty slab per expert bounds the views by the file's size */
        if (ne <= 0 || ne > 65536 || in[i].nbytes < (size_t)ne || in[i].nbytes % (size_t)ne != 0)
            return FL_ERR(FL_ERR_FORMAT, "%s: GGUF expert tensor '%s' has %" PRId64 " experts in %zu bytes", path,
                          (*gguf_names)[i], ne, in[i].nbytes);
        total += (size_t)ne;
    }
    if (total == *n) return FL_OK;

    fl_ckpt_tensor *out = calloc(total, sizeof *out);
    char **names = calloc(total, sizeof *names);
    if (!out || !names) {
        free(out);
        free(names);
        return FL_ERR(FL_ERR_OOM, "%s: out of memory splitting expert tensors", path);
    }
    /* new arrays own copies of every name: on failure they are simply dropped */
    size_t k = 0;
    fl_status st = FL_OK;
    for (size_t i = 0; i < *n && st == FL_OK; i++) {
        const char *proj = stacked_at(&in[i]);
        const int64_t ne = proj ? in[i].shape[0] : 1;
        const size_t slab = in[i].nbytes / (size_t)ne, stem = proj ? (size_t)(proj - in[i].name) : 0;
        for (int64_t e = 0; e < ne; e++, k++) {
            fl_ckpt_tensor *t = &out[k];
            *t = in[i];
            size_t hl = strlen(in[i].name) + 24, gl = strlen((*gguf_names)[i]) + 24;
            char *hn = malloc(hl), *gn = malloc(gl);
            t->name = hn;
            names[k] = gn;
            if (!hn || !gn) {
                st = FL_ERR(FL_ERR_OOM, "%s: out of memory splitting expert tensors", path);
                k++;
                break;
            }
            if (!proj) {
                snprintf(hn, hl, "%s", in[i].name);
                snprintf(gn, gl, "%s", (*gguf_names)[i]);
                continue;
            }
            t->ndim = 2;
            t->shape[0] = in[i].shape[1];
            t->shape[1] = in[i].shape[2];
            t->shape[2] = 0;
            t->nbytes = slab;
            t->data = (const uint8_t *)in[i].data + (size_t)e * slab;
            snprintf(hn, hl, "%.*s%" PRId64 ".%s", (int)stem, in[i].name, e, proj);
            snprintf(gn, gl, "%s[%" PRId64 "]", (*gguf_names)[i], e);
        }
    }
    if (st != FL_OK) {
        for (size_t i = 0; i < k; i++) {
            free((char *)out[i].name);
            free(names[i]);
        }
        free(out);
        free(names);
        return st;
    }
    for (size_t i = 0; i < *n; i++) {
        free((char *)in[i].name);
        free((*gguf_names)[i]);
    }
    free(in);
    free(*gguf_names);
    *tensors = out;
    *gguf_names = names;
    *n = total;
    return FL_OK;
}

fl_status fl_gguf_mixtral_names(const char *path, fl_ckpt_tensor *tensors, size_t n) {
    static const struct { const char *from, *to; } proj[] = {
        {"gate_proj.weight", "w1.weight"}, {"up_proj.weight", "w3.weight"}, {"down_proj.weight", "w2.weight"}};
    for (size_t i = 0; i < n; i++) {
        const char *name = tensors[i].name, *mlp = strstr(name, ".mlp.");
        if (!mlp) continue;
        const char *rest = mlp + 5;
        const int stem = (int)(mlp - name);
        char buf[512] = "";
        if (strcmp(rest, "gate.weight") == 0) {
            snprintf(buf, sizeof buf, "%.*s.block_sparse_moe.gate.weight", stem, name);
        } else if (strncmp(rest, "experts.", 8) == 0) {
            const char *leaf = strchr(rest + 8, '.'); /* rest = "experts.E.gate_proj.weight" */
            for (size_t k = 0; leaf && k < 3; k++)
                if (strcmp(leaf + 1, proj[k].from) == 0)
                    snprintf(buf, sizeof buf, "%.*s.block_sparse_moe.%.*s.%s", stem, name, (int)(leaf - rest), rest,
                             proj[k].to);
        }
        if (!buf[0]) continue;
        char *renamed = strdup(buf);
        if (!renamed) return FL_ERR(FL_ERR_OOM, "%s: out of memory renaming tensors", path);
        free((char *)tensors[i].name);
        tensors[i].name = renamed;
    }
    return FL_OK;
}
