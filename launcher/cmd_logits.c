/*
 * cmd_logits.c — `flotilla logits`: one prompt of token ids through the
 * model; float32 little-endian logits [T, vocab] for every position. This
 * is how golden comparisons against transformers are made end to end.
 */
#include <cjson/cJSON.h>
#include <stdint.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "launcher/cli.h"
#include "runtime/load/json_file.h"

static fl_status read_ids(const char *path, int32_t **ids, int *n) {
    char *text = NULL;
    size_t len;
    FL_TRY(fl_cli_read_all(path, &text, &len));
    fl_status st = FL_OK;
    cJSON *a = cJSON_ParseWithLength(text, len);
    free(text);
    if (!a || !cJSON_IsArray(a) || cJSON_GetArraySize(a) == 0) {
        cJSON_Delete(a);
        return FL_ERR(FL_ERR_FORMAT, "%s: expected a non-empty JSON array of token ids", path);
    }
    *n = cJSON_GetArraySize(a);
    *ids = malloc((size_t)*n * sizeof **ids);
    FL_CHECK_ALLOC(*ids, st, done);
    int i = 0;
    const cJSON *x;
    cJSON_ArrayForEach(x, a) {
        long long v;
        if (!fl_json_int(x, 0, INT32_MAX, &v)) {
            st = FL_ERR(FL_ERR_FORMAT, "%s: element %d is not a non-negative integer token id", path, i);
            free(*ids);
            *ids = NULL;
            goto done;
        }
        (*ids)[i++] = (int32_t)v;
    }
done:
    cJSON_Delete(a);
    return st;
}

int fl_cmd_logits(int argc, char **argv) {
    fl_cli_model_opts mo = {0};
    const char *in = NULL, *outp = NULL, *help = NULL;
    fl_cli_opt opts[FL_CLI_MAX_OPTS] = {
        {"input-ids", true, &in, "JSON array of token ids (required)"},
        {"output", true, &outp, "output file: float32 LE [T, vocab] (required)"},
        {"help", false, &help, "show this help"},
    };
    int n = 3;
    fl_cli_model_opts_add(&mo, opts, &n);
    fl_status st = fl_cli_parse("logits", argc, argv, opts);
    if (st != FL_OK) return fl_cli_fail("logits", st);
    if (help) {
        fl_cli_usage(stdout, "logits", "--model PATH --input-ids FILE.json --output FILE.f32", opts);
        return 0;
    }
    if (!in || !outp || !mo.model) {
        fprintf(stderr, "flotilla logits: --model, --input-ids and --output are required\n");
        return 1;
    }
    int32_t *ids = NULL;
    int T = 0;
    float *logits = NULL;
    FILE *f = NULL;
    fl_cli_bundle b;
    memset(&b, 0, sizeof b);
    FL_TRY_GOTO(read_ids(in, &ids, &T), st, done);
    if (mo.max_model_len == NULL) {
        /* the prompt is all there is: make sure the engine takes it */
        static char len_buf[32];
        snprintf(len_buf, sizeof len_buf, "%d", T + 1);
        mo.max_model_len = len_buf;
    }
    FL_TRY_GOTO(fl_cli_bundle_open(&mo, FL_CLI_NEED_ENGINE, &b), st, done);
    if (!fl_engine_is_leader(b.eng)) {
        st = fl_engine_follow(b.eng); /* rank 0 drives and writes the file */
        goto done;
    }
    const int V = b.model->cfg.vocab_size;
    for (int i = 0; i < T; i++)
        if (ids[i] >= V) {
            st = FL_ERR(FL_ERR_INVALID_ARG, "%s: token id %d at index %d is outside the vocabulary (%d)",
                        in, ids[i], i, V);
            goto done;
        }
    logits = malloc((size_t)T * V * sizeof(float));
    FL_CHECK_ALLOC(logits, st, done);
    double t0 = fl_engine_now();
    FL_TRY_GOTO(fl_engine_prompt_logits(b.eng, ids, T, logits), st, done);
    FL_TRY_GOTO(fl_engine_release_followers(b.eng), st, done);
    if (b.verbose)
        fprintf(stderr, "flotilla: %d positions in %.3f s\n", T, fl_engine_now() - t0);
    f = fopen(outp, "wb");
    if (!f) {
        st = FL_ERR(FL_ERR_IO, "cannot create %s: %s", outp, strerror(errno));
        goto done;
    }
    if (fwrite(logits, sizeof(float), (size_t)T * V, f) != (size_t)T * V || fflush(f) != 0) {
        st = FL_ERR(FL_ERR_IO, "cannot write %s: %s", outp, strerror(errno));
        goto done;
    }
done:
    if (f && fclose(f) != 0 && st == FL_OK) st = FL_ERR(FL_ERR_IO, "cannot write %s", outp);
    free(logits);
    free(ids);
    return fl_cli_finish("logits", &b, st);
}
