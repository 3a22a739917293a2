/*
 * fuzz_gguf.c — libFuzzer target for the GGUF reader (runtime/load/gguf.c).
 *
 * The reader takes a path (it mmaps the file), so each input is written to
 * an anonymous memfd and opened through /proc/self/fd/N. On success every
 * tensor's [data, data + nbytes) must lie inside the mapping (or the block of
 * tensors the reader built, DeepSeek-V2's joined kv_b_proj) and be readable,
 * its first row must decode (fl_tensor_row_f32: the block kinds' decoders),
 * and the tokenizer metadata is turned into a tokenizer spec; any status is
 * fine, a crash, a sanitizer report or an out-of-range tensor is a bug.
 *
 * Built by fuzz/CMakeLists.txt: scripts/fuzz.sh runs it under libFuzzer,
 * ctest replays fuzz/corpus/gguf/ and fuzz/regress/gguf/ in every build.
 */
#define _GNU_SOURCE
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "runtime/load/checkpoint_impl.h"
#include "runtime/load/gguf.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    int fd = memfd_create("fuzz_gguf", MFD_CLOEXEC);
    if (fd < 0) return 0;
    if (size && write(fd, data, size) != (ssize_t)size) {
        close(fd);
        return 0;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    fl_ckpt *ck = NULL;
    if (fl_ckpt_open_gguf(path, &ck) == FL_OK) {
        const uint8_t *lo = ck->maps[0].data, *hi = lo + ck->maps[0].size;
        volatile uint8_t sink = 0;
        for (size_t i = 0; i < fl_ckpt_count(ck); i++) {
            const fl_ckpt_tensor *t = fl_ckpt_at(ck, i);
            const uint8_t *p = t->data;
            if (t->nbytes == 0) continue;
            const uint8_t *blo = ck->built, *bhi = blo ? blo + ck->built_size : NULL; /* no NULL + 0 */
            const bool mapped = p >= lo && p <= hi && t->nbytes <= (size_t)(hi - p);
            const bool built = blo && p >= blo && p <= bhi && t->nbytes <= (size_t)(bhi - p);
            if (!mapped && !built) abort();
            sink ^= p[0];
            sink ^= p[t->nbytes - 1];
            const int64_t cols = t->shape[t->ndim - 1];
            if (cols <= 0 || cols > (1 << 16)) continue;
            float *row = malloc((size_t)cols * sizeof *row);
            if (!row) continue;
            fl_tensor v = {.dtype = t->dtype, .ndim = t->ndim, .data = (void *)t->data};
            memcpy(v.shape, t->shape, sizeof v.shape);
            fl_tensor_row_f32(&v, 0, row);
            sink ^= (uint8_t)(row[cols - 1] != 0);
            free(row);
        }
        (void)sink;
        fl_tokenizer *tok = NULL;
        if (fl_gguf_tokenizer(ck, &tok) == FL_OK) fl_tokenizer_free(tok);
        fl_ckpt_free(ck);
    }
    close(fd);
    return 0;
}
