/*
 * fuzz_chat_template.c — libFuzzer target for the chat template renderer
 * (runtime/tok/chat_template.c): a Jinja template source and a conversation.
 *
 * Input layout, fields separated by NUL bytes:
 *   byte 0       family: 0 = detect from the source, 1..3 = CHATML, LLAMA3,
 *                MISTRAL forced (the source then only supplies details)
 *   field 0      the Jinja source ("-" alone: no source, NULL)
 *   field 1      the BOS text
 *   then pairs   role, content   (a one-byte role r < 3 stands for
 *                system / user / assistant, so short inputs reach rendering)
 * Any status is fine; a crash, a sanitizer report or a hang is a bug. A
 * successful render is a NUL-terminated string, and an accepted ChatML
 * conversation must end with the generation prompt.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/tok/chat_template.h"

enum { MAX_FIELDS = 66 };

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    unsigned pick = data[0] % 4;
    /* a NUL-terminated copy whose NULs split it into fields */
    char *buf = malloc(size);
    if (!buf) return 0;
    memcpy(buf, data + 1, size - 1);
    buf[size - 1] = 0;
    char *field[MAX_FIELDS];
    size_t nf = 0;
    for (char *p = buf; nf < MAX_FIELDS && p <= buf + size - 1; p += strlen(p) + 1) field[nf++] = p;

    static char *const roles[] = {"system", "user", "assistant"};
    const char *src = nf > 0 && strcmp(field[0], "-") ? field[0] : NULL;
    const char *bos = nf > 1 ? field[1] : NULL;
    fl_chat_message msgs[MAX_FIELDS / 2];
    size_t nm = 0;
    for (size_t i = 2; i + 1 < nf; i += 2, nm++) {
        unsigned char r0 = (unsigned char)field[i][0];
        msgs[nm].role = field[i][0] && !field[i][1] && r0 < 3 ? roles[r0] : field[i];
        msgs[nm].content = field[i + 1];
    }

    fl_chat_family fam = pick ? (fl_chat_family)pick : fl_chat_template_detect(src);
    if (!fl_chat_family_name(fam)) abort();
    char *def = NULL;
    if (src && fl_chat_template_default_system(src, &def) == FL_OK) free(def);
    char *out = NULL;
    if (fl_chat_template_render(fam, src, msgs, nm, bos, &out) == FL_OK) {
        if (!out) abort();
        size_t n = strlen(out);
        static const char gen[] = "<|im_start|>assistant\n";
        if (fam == FL_CHAT_FAMILY_CHATML && (n < sizeof gen - 1 || strcmp(out + n - (sizeof gen - 1), gen)))
            abort();
        free(out);
    }
    free(buf);
    return 0;
}
