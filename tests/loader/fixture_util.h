/*
 * fixture_util.h — helpers shared by the loader tests: temp folders,
 * writing small files (safetensors with a hand-written header, JSON) and
 * asserting that an error message names what it must.
 * Header-only (static functions) because every tests/test_*.c is its own
 * executable; include after <cmocka.h>.
 */
#ifndef FL_TEST_FIXTURE_UTIL_H
#define FL_TEST_FIXTURE_UTIL_H

/* the including test defines _GNU_SOURCE first (nftw, mkdtemp) */
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/status.h"
#include "core/tensor.h"

/* Fails the test unless the last error message contains `needle`. */
#define ASSERT_MSG_HAS(needle)                                                              \
    do {                                                                                    \
        if (!strstr(fl_error_msg(), (needle)))                                              \
            fail_msg("error message \"%s\" does not mention \"%s\"", fl_error_msg(), (needle)); \
    } while (0)

#define ASSERT_STATUS(call, want)                                                           \
    do {                                                                                    \
        fl_status got_ = (call);                                                            \
        if (got_ != (want))                                                                 \
            fail_msg("%s returned %s, expected %s (message: %s)", #call, fl_status_str(got_),  \
                     fl_status_str(want), fl_error_msg());                                  \
    } while (0)

static inline char *fx_mkdtemp(void) {
    char tmpl[] = "/tmp/fl_loader_test_XXXXXX";
    char *d = mkdtemp(tmpl);
    if (!d) fail_msg("mkdtemp failed");
    return strdup(d);
}

static inline int fx_rm_cb(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

static inline void fx_rmtree(char *dir) {
    if (!dir) return;
    nftw(dir, fx_rm_cb, 16, FTW_DEPTH | FTW_PHYS);
    free(dir);
}

/* Returns dir/name in a static rotating buffer (enough for one call's args). */
static inline const char *fx_path(const char *dir, const char *name) {
    static char bufs[4][1024];
    static int k;
    char *b = bufs[k++ & 3];
    snprintf(b, sizeof bufs[0], "%s/%s", dir, name);
    return b;
}

static inline void fx_write(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) fail_msg("cannot write %s", path);
    if (n && fwrite(data, 1, n, f) != n) fail_msg("short write %s", path);
    fclose(f);
}

static inline void fx_write_text(const char *path, const char *text) { fx_write(path, text, strlen(text)); }

/* Writes a safetensors file: u64 LE header length, the header text as
 * given (no validation: tests feed malformed headers on purpose), data. */
static inline void fx_write_st(const char *path, const char *header, const void *data, size_t n) {
    size_t hl = strlen(header);
    size_t total = 8 + hl + n;
    uint8_t *buf = malloc(total ? total : 1);
    uint64_t h = hl;
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)(h >> (8 * i));
    memcpy(buf + 8, header, hl);
    if (n) memcpy(buf + 8 + hl, data, n);
    fx_write(path, buf, total);
    free(buf);
}

/* A minimal valid config.json for folder tests. */
#define FX_CONFIG                                                                        \
    "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 16, \"hidden_size\": 8," \
    " \"num_hidden_layers\": 1, \"num_attention_heads\": 2, \"intermediate_size\": 16}"

/* w (rows [r0, ..) and columns [c0, ..) of a [.., in] weight) against the
 * f32 reference ref, value by value, bit for bit: the loaders' checks of a
 * tensor-parallel block against the generator's exact dequantization. */
static inline void fx_assert_block_equal(const fl_tensor *w, const float *ref, int64_t in, int64_t r0, int64_t c0) {
    const int64_t cols = w->shape[1];
    float *row = malloc((size_t)cols * sizeof(float));
    assert_non_null(row);
    for (int64_t r = 0; r < w->shape[0]; r++) {
        fl_tensor_row_f32(w, r, row);
        for (int64_t c = 0; c < cols; c++) {
            const float e = ref[(r0 + r) * in + c0 + c];
            if (memcmp(&row[c], &e, sizeof e) != 0)
                fail_msg("row %lld col %lld: %.9g != %.9g", (long long)(r0 + r), (long long)(c0 + c), row[c], e);
        }
    }
    free(row);
}

#endif /* FL_TEST_FIXTURE_UTIL_H */
