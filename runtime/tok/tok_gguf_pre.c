/*
 * tok_gguf_pre.c — the pipeline of a GGUF-style vocabulary: for SPM
 * ("llama") vocabularies Llama-2's normalizers and decoders, for byte-level
 * BPE ("gpt2") ones the pre-tokenizer of the Hugging Face tokenizer.json
 * that tokenizer.ggml.pre names (convert_hf_to_gguf.py picks the name by
 * hashing what that tokenizer makes of a test text).
 *
 * Each family is HF's pre_tokenizer Sequence step for step (Split patterns
 * with behavior Isolated, Digits, ByteLevel) and its normalizer (NFC or
 * none); the regexes are those tokenizer.json files carry, as llama.cpp's
 * llama-vocab.cpp lists them per family.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/tok/tok_impl.h"

#define GPT2_RE "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"
#define LLAMA3_RE "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define QWEN2_RE "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
/* DeepSeek LLM: cased letters of many scripts, ASCII/full-width punctuation */
#define DEEPSEEK_LETTERS_RE "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+"
#define DEEPSEEK_PUNCT_RE "\\s?[!-/:-~！-／：-～‘-‟　-。]+"
#define DEEPSEEK_CJK_RE "[一-龥ࠀ-一가-퟿]+"
#define DEEPSEEK3_RE "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
/* HF's Punctuation pre-tokenizer: Unicode P* plus the ASCII symbols Rust's
 * is_ascii_punctuation adds; Contiguous runs == one Isolated match of "+" */
#define PUNCT_RE "[\\p{P}$+<=>^~|`]+"

/* One pre-tokenizer step; a zeroed entry (Split without a pattern) ends a list. */
typedef struct pre_step {
    pt_type type;
    const char *re;  /* PT_SPLIT: the Isolated pattern; PT_BYTELEVEL: use_regex's pattern or NULL */
    bool individual; /* PT_DIGITS: individual_digits */
} pre_step;

#define SPLIT(r) {PT_SPLIT, r, false}
#define DIGITS(ind) {PT_DIGITS, NULL, ind}
#define BYTELEVEL(r) {PT_BYTELEVEL, r, false}

/* tokenizer.ggml.pre names -> the HF pipeline of that family */
typedef struct pre_def {
    const char *names[8];
    bool nfc;           /* the HF tokenizer normalizes with NFC */
    bool ignore_merges; /* a word that is a token is that token (HF BPE ignore_merges) */
    pre_step steps[8];
} pre_def;

static const pre_def PRE_DEFS[] = {
    {{"default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "phi-2", "roberta-bpe"}, false, false,
     {SPLIT(GPT2_RE), BYTELEVEL(NULL)}},
    {{"llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe", "falcon3"}, false, true,
     {SPLIT(LLAMA3_RE), BYTELEVEL(NULL)}},
    {{"qwen2", "stablelm2", "deepseek-r1-qwen", "megrez"}, true, false, {SPLIT(QWEN2_RE), BYTELEVEL(NULL)}},
    {{"smollm", "starcoder", "refact", "command-r", "codeshell"}, false, false,
     {DIGITS(true), SPLIT(GPT2_RE), BYTELEVEL(NULL)}},
    {{"deepseek-llm"}, false, false,
     {SPLIT("[\\r\\n]"), SPLIT(DEEPSEEK_LETTERS_RE), SPLIT(DEEPSEEK_PUNCT_RE), SPLIT("\\s+$"),
      SPLIT(DEEPSEEK_CJK_RE), DIGITS(true), BYTELEVEL(NULL)}},
    {{"deepseek-coder"}, false, false,
     {SPLIT("[\\r\\n]"), SPLIT("\\s?\\p{L}+"), SPLIT("\\s?\\p{P}+"), SPLIT(DEEPSEEK_CJK_RE), DIGITS(true),
      BYTELEVEL(NULL)}},
    {{"deepseek-v3"}, false, false,
     {SPLIT("\\p{N}{1,3}"), SPLIT("[一-龥぀-ゟ゠-ヿ]+"), SPLIT(DEEPSEEK3_RE), BYTELEVEL(NULL)}},
    /* Falcon splits digits after ByteLevel, on the byte-level alphabet */
    {{"falcon"}, false, false,
     {SPLIT(PUNCT_RE), BYTELEVEL(GPT2_RE), DIGITS(false), SPLIT("[0-9][0-9][0-9]")}},
};
#define N_PRE_DEFS (sizeof PRE_DEFS / sizeof *PRE_DEFS)

static bool step_end(const pre_step *s) { return s->type == PT_SPLIT && !s->re; }

static fl_status unknown_pre(const char *pre) {
    char known[512];
    size_t n = 0;
    known[0] = '\0';
    for (size_t i = 0; i < N_PRE_DEFS; i++)
        for (int k = 0; k < 8 && PRE_DEFS[i].names[k]; k++) {
            int w = snprintf(known + n, sizeof known - n, "%s%s", n ? ", " : "", PRE_DEFS[i].names[k]);
            if (w < 0 || (size_t)w >= sizeof known - n) break;
            n += (size_t)w;
        }
    return FL_ERR(FL_ERR_UNSUPPORTED, "GGUF tokenizer.ggml.pre \"%.64s\" is not supported (known: %s)", pre, known);
}

fl_status tok_vocab_pipeline(fl_tokenizer *tok, const fl_tokenizer_spec *spec) {
    const char *pre = spec->pre ? spec->pre : "default";
    if (spec->kind == FL_TOK_SPM_BPE) {
        tok->model = MODEL_SPM;
        /* llama.cpp: add_space_prefix + escape whitespace == HF Llama-2's
         * Prepend("▁") + Replace(" ", "▁") normalizers. */
        tok->norms = calloc(2, sizeof *tok->norms);
        if (!tok->norms) return FL_ERR(FL_ERR_OOM, "out of memory building a tokenizer");
        tok->n_norms = 2;
        tok->norms[0].type = NORM_PREPEND;
        tok->norms[0].str = strdup("\xe2\x96\x81");
        tok->norms[0].str_len = 3;
        tok->norms[1].type = NORM_REPLACE;
        tok->norms[1].str = strdup(" ");
        tok->norms[1].str_len = 1;
        tok->norms[1].content = strdup("\xe2\x96\x81");
        tok->norms[1].content_len = 3;
        tok->decs = calloc(4, sizeof *tok->decs);
        if (!tok->norms[0].str || !tok->norms[1].str || !tok->norms[1].content || !tok->decs)
            return FL_ERR(FL_ERR_OOM, "out of memory building a tokenizer");
        tok->n_decs = 4;
        tok->decs[0].type = DEC_REPLACE;
        tok->decs[0].pat = strdup("\xe2\x96\x81");
        tok->decs[0].pat_len = 3;
        tok->decs[0].content = strdup(" ");
        tok->decs[0].content_len = 1;
        tok->decs[1].type = DEC_BYTEFALLBACK;
        tok->decs[2].type = DEC_FUSE;
        tok->decs[3].type = DEC_STRIP;
        tok->decs[3].content = strdup(" ");
        tok->decs[3].content_len = 1;
        tok->decs[3].start = 1;
        if (!tok->decs[0].pat || !tok->decs[0].content || !tok->decs[3].content)
            return FL_ERR(FL_ERR_OOM, "out of memory building a tokenizer");
        tok->byte_fallback = true;
        return FL_OK;
    }
    const pre_def *def = NULL;
    for (size_t i = 0; i < N_PRE_DEFS && !def; i++)
        for (int k = 0; k < 8 && PRE_DEFS[i].names[k]; k++)
            if (strcmp(PRE_DEFS[i].names[k], pre) == 0) def = &PRE_DEFS[i];
    if (!def) return unknown_pre(pre);
    tok->model = MODEL_BPE;
    tok->ignore_merges = def->ignore_merges;
    if (def->nfc) {
        tok->norms = calloc(1, sizeof *tok->norms);
        if (!tok->norms) return FL_ERR(FL_ERR_OOM, "out of memory building a tokenizer");
        tok->n_norms = 1;
        tok->norms[0].type = NORM_NFC;
    }
    int n = 0;
    while (n < 8 && !step_end(&def->steps[n])) n++;
    tok->pretoks = calloc((size_t)n, sizeof *tok->pretoks);
    tok->decs = calloc(1, sizeof *tok->decs);
    if (!tok->pretoks || !tok->decs) return FL_ERR(FL_ERR_OOM, "out of memory building a tokenizer");
    for (int k = 0; k < n; k++) {
        const pre_step *s = &def->steps[k];
        tok_pretok *p = &tok->pretoks[k];
        p->type = s->type;
        p->behavior = SPLIT_ISOLATED;
        p->individual_digits = s->individual;
        /* counted before compiling so that fl_tokenizer_free frees what compiled */
        tok->n_pretoks = k + 1;
        if (s->re) FL_TRY(tok_compile_regex(s->re, strlen(s->re), false, pre, &p->re));
    }
    tok->decs[0].type = DEC_BYTELEVEL;
    tok->n_decs = 1;
    return FL_OK;
}
