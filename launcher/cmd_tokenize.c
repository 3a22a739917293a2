/*
 * cmd_tokenize.c — `flotilla tokenize`: JSON array of strings in, JSON
 * array of id arrays out; with --decode the reverse. Meant for scripts and
 * for checking against HF tokenizers: the ids are those of HF's
 * encode(text, add_special_tokens=False) — no BOS/EOS added, but added and
 * special tokens written in the text ("<|im_start|>") become their ids, as
 * in `flotilla generate`. --split-special is HF's split_special_tokens=True:
 * special tokens in the text are tokenized as plain text (non-special added
 * tokens are still matched, as HF does).
 */
#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "launcher/cli.h"
#include "runtime/load/json_file.h"
#include "runtime/engine/request.h"

static fl_status run(const char *tok_path, const char *model, const char *input, bool decode,
                     bool parse_special) {
    fl_status st = FL_OK;
    fl_tokenizer *tok = NULL;
    fl_ckpt *ck = NULL;
    char *text = NULL, *outs = NULL;
    size_t len;
    cJSON *in = NULL, *out = NULL;
    if (!!tok_path == !!model)
        return FL_ERR(FL_ERR_INVALID_ARG, "give exactly one of --tokenizer FILE.json or --model PATH");
    if (tok_path) {
        FL_TRY_GOTO(fl_tokenizer_load_json(tok_path, &tok), st, done);
    } else {
        FL_TRY_GOTO(fl_ckpt_open(model, &ck), st, done);
        FL_TRY_GOTO(fl_ckpt_tokenizer(ck, &tok), st, done);
    }
    const char *src = input ? input : "standard input";
    FL_TRY_GOTO(fl_cli_read_all(input, &text, &len), st, done);
    in = cJSON_ParseWithLength(text, len);
    if (!in || !cJSON_IsArray(in)) {
        st = FL_ERR(FL_ERR_FORMAT, "%s: expected a JSON array of %s", src,
                    decode ? "arrays of token ids" : "strings");
        goto done;
    }
    char nul_path[64];
    if (fl_request_find_nul_escape(text, len, nul_path, sizeof nul_path)) {
        /* strings are NUL-terminated inside: the text would be cut there */
        st = FL_ERR(FL_ERR_FORMAT, "%s: element %d contains an escaped NUL (\\u0000); strings "
                    "with NUL characters are refused", src,
                    nul_path[0] == '[' ? atoi(nul_path + 1) : -1);
        goto done;
    }
    out = cJSON_CreateArray();
    FL_CHECK_ALLOC(out, st, done);
    int i = 0;
    const cJSON *item;
    cJSON_ArrayForEach(item, in) {
        if (decode) {
            int n = cJSON_GetArraySize(item);
            if (!cJSON_IsArray(item)) {
                st = FL_ERR(FL_ERR_FORMAT, "%s: element %d is not an array of ids", src, i);
                goto done;
            }
            int32_t *ids = malloc(((size_t)n + 1) * sizeof *ids);
            FL_CHECK_ALLOC(ids, st, done);
            int j = 0;
            const cJSON *id;
            cJSON_ArrayForEach(id, item) {
                long long v;
                if (!fl_json_int(id, INT32_MIN, INT32_MAX, &v)) {
                    free(ids);
                    st = FL_ERR(FL_ERR_FORMAT, "%s: element %d, position %d is not an integer id", src,
                                i, j);
                    goto done;
                }
                ids[j++] = (int32_t)v;
            }
            char *s = NULL;
            st = fl_tokenizer_decode(tok, ids, (size_t)n, false, &s);
            free(ids);
            if (st != FL_OK) goto done;
            cJSON_AddItemToArray(out, cJSON_CreateString(s));
            free(s);
        } else {
            if (!cJSON_IsString(item)) {
                st = FL_ERR(FL_ERR_FORMAT, "%s: element %d is not a string", src, i);
                goto done;
            }
            int32_t *ids = NULL;
            size_t n = 0;
            FL_TRY_GOTO(fl_tokenizer_encode(tok, item->valuestring, strlen(item->valuestring),
                                            parse_special, &ids, &n), st, done);
            cJSON *arr = cJSON_CreateArray();
            for (size_t j = 0; j < n; j++) cJSON_AddItemToArray(arr, cJSON_CreateNumber(ids[j]));
            free(ids);
            cJSON_AddItemToArray(out, arr);
        }
        i++;
    }
    outs = cJSON_PrintUnformatted(out);
    FL_CHECK_ALLOC(outs, st, done);
    fputs(outs, stdout);
    fputc('\n', stdout);
done:
    free(outs);
    cJSON_Delete(in);
    cJSON_Delete(out);
    free(text);
    fl_tokenizer_free(tok);
    fl_ckpt_free(ck);
    return st;
}

int fl_cmd_tokenize(int argc, char **argv) {
    const char *tok = NULL, *model = NULL, *input = NULL, *decode = NULL, *split = NULL, *help = NULL;
    const fl_cli_opt opts[] = {
        {"tokenizer", true, &tok, "tokenizer.json file"},
        {"model", true, &model, "model folder or .gguf (its tokenizer)"},
        {"input", true, &input, "input file (default: standard input)"},
        {"decode", false, &decode, "decode id arrays to strings"},
        {"split-special", false, &split, "special tokens in the text stay plain text (HF split_special_tokens)"},
        {"help", false, &help, "show this help"},
        {0},
    };
    if (fl_cli_world_rank() != 0) return 0; /* one rank is enough */
    fl_status st = fl_cli_parse("tokenize", argc, argv, opts);
    if (st != FL_OK) return fl_cli_fail("tokenize", st);
    if (help) {
        fl_cli_usage(stdout, "tokenize",
                     "(--tokenizer FILE.json | --model PATH) [--input FILE] [--decode] [--split-special]",
                     opts);
        fputs("\nInput: a JSON array of strings (with --decode: of id arrays). Output: one JSON\n"
              "array, one id array per string, equal to Hugging Face tokenizers'\n"
              "encode(text, add_special_tokens=False).ids: no BOS/EOS is added, and added or\n"
              "special tokens written in the text (\"<|im_start|>\", \"<|begin_of_text|>\") become\n"
              "their ids, with their lstrip/rstrip/single_word/normalized flags, as in\n"
              "`flotilla generate`. --split-special tokenizes special tokens in the text as\n"
              "plain text instead; non-special added tokens are still matched, as in HF.\n",
              stdout);
        return 0;
    }
    if (decode && split) {
        st = FL_ERR(FL_ERR_INVALID_ARG, "--split-special applies to encoding, not to --decode");
        return fl_cli_fail("tokenize", st);
    }
    st = run(tok, model, input, decode != NULL, split == NULL);
    return st == FL_OK ? 0 : fl_cli_fail("tokenize", st);
}
