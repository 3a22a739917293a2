/*
 * fuzz_tokenizer.c — libFuzzer target for tokenizer.json loading
 * (runtime/tok/tok_json.c and the BPE / pre-tokenizer / normalizer builders
 * behind it): one input is one tokenizer.json.
 *
 * Any status is fine for malformed input; a crash, a sanitizer report or a
 * hang is a bug. A tokenizer that loads must then work: a few strings
 * (ASCII, special-token text, multi-byte UTF-8, invalid UTF-8, digits and
 * whitespace runs) are encoded with and without special-token parsing, every
 * id must lie in the vocabulary, and decoding the ids must succeed (or refuse
 * a decoder chain whose output compounds).
 */
#define _GNU_SOURCE
#include "fuzz/fuzz_memfd.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "runtime/tok/tokenizer.h"

static const char *const texts[] = {
    "Hello world! It's 2024, isn't it?",
    "<|im_start|>user\nHi<|im_end|>\n<s>[INST] x [/INST]</s><|endoftext|>",
    "  leading and   inner\t\twhitespace\n\n\r\n",
    "caf\xc3\xa9 na\xc3\xafve \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x98\x80 \xe2\x96\x81x",
    "bad \xff\xfe utf-8 \xc3 cut \xe6\x97",
    "1234567890 3.14159 -42",
    "",
};

static void exercise(const fl_tokenizer *tok) {
    int nv = fl_tokenizer_n_vocab(tok);
    if (nv <= 0) abort();
    for (size_t t = 0; t < sizeof texts / sizeof texts[0]; t++) {
        for (int special = 0; special < 2; special++) {
            int32_t *ids = NULL;
            size_t n = 0;
            if (fl_tokenizer_encode(tok, texts[t], strlen(texts[t]), special, &ids, &n) != FL_OK) {
                free(ids);
                continue;
            }
            for (size_t i = 0; i < n; i++) {
                /* added tokens may sit above the model's vocabulary, but
                 * every id must have a string */
                if (ids[i] < 0 || !fl_tokenizer_token_str(tok, ids[i])) abort();
            }
            char *text = NULL;
            /* a decoder chain that compounds is refused with UNSUPPORTED */
            fl_status st = fl_tokenizer_decode(tok, ids, n, special, &text);
            if (st != FL_OK && st != FL_ERR_UNSUPPORTED) abort();
            free(text);
            free(ids);
        }
    }
    /* every id decodes on its own, the specials too */
    int lim = nv < 64 ? nv : 64;
    for (int32_t id = 0; id < lim; id++) {
        char *text = NULL;
        if (fl_tokenizer_decode(tok, &id, 1, false, &text) == FL_OK) free(text);
        const char *s = fl_tokenizer_token_str(tok, id);
        if (s && fl_tokenizer_token_id(tok, s) < 0) abort();
    }
    (void)fl_tokenizer_bos(tok);
    (void)fl_tokenizer_eos(tok);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char path[64];
    int fd = fuzz_memfd(data, size, path);
    if (fd < 0) return 0;
    fl_tokenizer *tok = NULL;
    if (fl_tokenizer_load_json(path, &tok) == FL_OK) {
        exercise(tok);
        fl_tokenizer_free(tok);
    } else if (tok) {
        abort(); /* a failed load hands nothing out */
    }
    close(fd);
    return 0;
}
