/*
 * fuzz_safetensors.c — libFuzzer target for the safetensors parser.
 *
 * The parser's promise (safetensors.h) is that once it returns FL_OK every
 * tensor's [data, data + nbytes) lies inside the input, and that malformed
 * input of any shape gives an error rather than a crash. This target checks
 * both: it reads every byte of every accepted tensor (ASan flags any
 * out-of-bounds read) and asserts the ranges. Built by fuzz/CMakeLists.txt:
 * scripts/fuzz.sh runs it under libFuzzer, ctest replays
 * fuzz/corpus/safetensors/ and fuzz/regress/safetensors/ in every build.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/load/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* A private copy so reads past the end hit ASan's redzone. */
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    memcpy(buf, data, size);
    fl_ckpt_tensor *ts = NULL;
    size_t n = 0;
    if (fl_safetensors_parse("fuzz.safetensors", buf, size, &ts, &n) == FL_OK) {
        volatile uint8_t sink = 0;
        for (size_t i = 0; i < n; i++) {
            const uint8_t *p = ts[i].data;
            if (p < buf || p + ts[i].nbytes > buf + size) abort();
            for (size_t j = 0; j < ts[i].nbytes; j++) sink ^= p[j];
            if (ts[i].ndim < 0 || ts[i].ndim > FL_MAX_DIMS) abort();
        }
        (void)sink;
        fl_safetensors_tensors_free(ts, n);
    } else if (ts != NULL || n != 0) {
        abort();
    }
    free(buf);
    return 0;
}
