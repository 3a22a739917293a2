/*
 * cuda_tune.cu — the tuning overrides' values and their parser
 * (cuda_tune.h). Host code only.
 */
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "kernels/cuda/cuda_tune.h"

long fl_cuda_tune_values[FL_CUDA_TUNE_COUNT] = {
#define FL_CUDA_TUNE_INIT(id, name, doc) -1,
    FL_CUDA_TUNE_LIST(FL_CUDA_TUNE_INIT)
#undef FL_CUDA_TUNE_INIT
};

static const char *const tune_names[FL_CUDA_TUNE_COUNT] = {
#define FL_CUDA_TUNE_NAME(id, name, doc) name,
    FL_CUDA_TUNE_LIST(FL_CUDA_TUNE_NAME)
#undef FL_CUDA_TUNE_NAME
};

static const char *const tune_docs[FL_CUDA_TUNE_COUNT] = {
#define FL_CUDA_TUNE_DOC(id, name, doc) doc,
    FL_CUDA_TUNE_LIST(FL_CUDA_TUNE_DOC)
#undef FL_CUDA_TUNE_DOC
};

/* The words a setting takes besides numbers (what the list's docs name). */
static const struct {
    fl_cuda_tune_id id;
    const char *word;
    long value;
} tune_words[] = {
    {FL_CUDA_TUNE_W4_GEMV, "ring", 0},  {FL_CUDA_TUNE_W4_GEMV, "bulk", 1}, {FL_CUDA_TUNE_W4_GEMV, "dual", 2},
    {FL_CUDA_TUNE_GLU_FUSE, "none", 0}, {FL_CUDA_TUNE_GLU_FUSE, "dense", 1}, {FL_CUDA_TUNE_GLU_FUSE, "moe", 2},
    {FL_CUDA_TUNE_GLU_FUSE, "all", 3},  {FL_CUDA_TUNE_MOE_BULK, "none", 0}, {FL_CUDA_TUNE_MOE_BULK, "all", 1},
    {FL_CUDA_TUNE_MOE_BULK, "dual", 2}, {FL_CUDA_TUNE_MLA_KERNEL, "simt", 0}, {FL_CUDA_TUNE_MLA_KERNEL, "mma", 1},
};

extern "C" void fl_cuda_tune_set(fl_cuda_tune_id id, long value) {
    if ((int)id >= 0 && id < FL_CUDA_TUNE_COUNT) fl_cuda_tune_values[id] = value;
}

extern "C" void fl_cuda_tune_reset(void) {
    for (int i = 0; i < FL_CUDA_TUNE_COUNT; i++) fl_cuda_tune_values[i] = -1;
}

extern "C" fl_status fl_cuda_tune_parse(const char *setting) {
    const char *eq = setting ? strchr(setting, '=') : NULL;
    if (!eq) return FL_ERR(FL_ERR_INVALID_ARG, "tune setting '%s': expected NAME=VALUE", setting ? setting : "");
    const char *name = setting;
    if (!strncasecmp(name, "FL_", 3)) name += 3;
    const size_t len = (size_t)(eq - name);
    int id = -1;
    for (int i = 0; i < FL_CUDA_TUNE_COUNT; i++)
        if (strlen(tune_names[i]) == len && !strncasecmp(tune_names[i], name, len)) id = i;
    if (id < 0) return FL_ERR(FL_ERR_INVALID_ARG, "tune setting '%s': no such name (see --tune-list)", setting);
    const char *v = eq + 1;
    if (!strcmp(v, "auto")) {
        fl_cuda_tune_values[id] = -1;
        return FL_OK;
    }
    for (size_t i = 0; i < sizeof tune_words / sizeof tune_words[0]; i++)
        if (tune_words[i].id == id && !strcmp(tune_words[i].word, v)) {
            fl_cuda_tune_values[id] = tune_words[i].value;
            return FL_OK;
        }
    char *end = NULL;
    const long x = *v ? strtol(v, &end, 10) : 0;
    if (!*v || *end) return FL_ERR(FL_ERR_INVALID_ARG, "tune setting '%s': value is not a number, auto or a word "
                                   "the setting names (%s)", setting, tune_docs[id]);
    fl_cuda_tune_values[id] = x;
    return FL_OK;
}

extern "C" fl_status fl_cuda_tune_parse_list(const char *list) {
    if (!list) return FL_OK;
    char one[128];
    for (const char *p = list; *p;) {
        const char *end = strchr(p, ',');
        const size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len >= sizeof one) return FL_ERR(FL_ERR_INVALID_ARG, "tune list '%s': a setting is too long", list);
        memcpy(one, p, len);
        one[len] = 0;
        if (len) FL_TRY(fl_cuda_tune_parse(one));
        p += len + (end ? 1 : 0);
    }
    return FL_OK;
}

extern "C" void fl_cuda_tune_print(FILE *f) {
    for (int i = 0; i < FL_CUDA_TUNE_COUNT; i++)
        fprintf(f, "%-20s %4ld  %s\n", tune_names[i], fl_cuda_tune_values[i], tune_docs[i]);
}
