/*
 * chat_template.c — renders chat conversations for the template families in
 * chat_template.h, reading each family's variable details from the Jinja
 * source instead of interpreting it.
 *
 * Why not a Jinja interpreter: the handful of templates real instruct models
 * ship differ only in a few literal strings; a full Jinja engine in C would be
 * a large attack surface for a batch runtime. The cost is that an unknown
 * family is refused (FL_ERR_UNSUPPORTED) rather than guessed.
 *
 * The only part of the source we parse is its Jinja string literals (inside
 * {{ }} and {% %} blocks, so apostrophes in template text are not mistaken
 * for quotes), decoding Python-style escapes the way Jinja does.
 */
#include "runtime/tok/chat_template.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <utf8proc.h>

/* ---- growable string ----------------------------------------------------- */

typedef struct sbuf {
    char *p;
    size_t len, cap;
    bool oom;
} sbuf;

static void sb_putn(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) cap *= 2;
        char *np = realloc(b->p, cap);
        if (!np) {
            b->oom = true;
            return;
        }
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

static void sb_puts(sbuf *b, const char *s) { sb_putn(b, s, strlen(s)); }

/* Hands the string to *out (never NULL on success: "" for empty). */
static fl_status sb_finish(sbuf *b, char **out) {
    if (!b->oom && !b->p) sb_putn(b, "", 0);
    if (b->oom) {
        free(b->p);
        return FL_ERR(FL_ERR_OOM, "out of memory rendering a chat prompt");
    }
    *out = b->p;
    return FL_OK;
}

/* ---- Jinja string literals ------------------------------------------------ */

/* Decodes the literal starting at s[0] (a quote); returns a malloc'd string
 * and sets *end past the closing quote, or returns NULL (unterminated / OOM)
 * with *end at the string's end. */
static char *read_literal(const char *s, const char **end) {
    const char q = *s++;
    sbuf b = {0};
    while (*s && *s != q) {
        if (*s == '\\' && s[1]) {
            char c = s[1], d;
            switch (c) {
            case 'n': d = '\n'; break;
            case 't': d = '\t'; break;
            case 'r': d = '\r'; break;
            case '\\': d = '\\'; break;
            case '\'': d = '\''; break;
            case '"': d = '"'; break;
            default: d = 0; break;
            }
            if (d) {
                sb_putn(&b, &d, 1);
            } else {
                sb_putn(&b, s, 2); /* unknown escape: Python keeps it verbatim */
            }
            s += 2;
        } else {
            sb_putn(&b, s++, 1);
        }
    }
    if (*s != q || b.oom) {
        free(b.p);
        *end = s;
        return NULL;
    }
    *end = s + 1;
    if (!b.p) return strdup("");
    return b.p;
}

typedef bool (*literal_fn)(const char *lit, void *ctx); /* return true to stop */

/* Calls fn for every string literal inside {{ }} / {% %} blocks of src. */
static void for_each_literal(const char *src, literal_fn fn, void *ctx) {
    const char *s = src;
    while ((s = strchr(s, '{')) != NULL) {
        if (s[1] == '#') { /* comment: skip to #} */
            const char *e = strstr(s + 2, "#}");
            if (!e) return;
            s = e + 2;
            continue;
        }
        if (s[1] != '{' && s[1] != '%') {
            s++;
            continue;
        }
        const char close = s[1] == '{' ? '}' : '%';
        s += 2;
        while (*s && !(*s == close && s[1] == '}')) {
            if (*s == '\'' || *s == '"') {
                const char *e;
                char *lit = read_literal(s, &e);
                if (!lit) return;
                bool stop = fn(lit, ctx);
                free(lit);
                if (stop) return;
                s = e;
            } else {
                s++;
            }
        }
        if (!*s) return;
        s += 2;
    }
}

/* ---- detection ------------------------------------------------------------ */

fl_chat_family fl_chat_template_detect(const char *src) {
    if (!src) return FL_CHAT_FAMILY_NONE;
    if (strstr(src, "<|im_start|>")) return FL_CHAT_FAMILY_CHATML;
    if (strstr(src, "<|start_header_id|>")) return FL_CHAT_FAMILY_LLAMA3;
    if (strstr(src, "[INST]")) return FL_CHAT_FAMILY_MISTRAL;
    return FL_CHAT_FAMILY_NONE;
}

const char *fl_chat_family_name(fl_chat_family family) {
    switch (family) {
    case FL_CHAT_FAMILY_CHATML: return "chatml";
    case FL_CHAT_FAMILY_LLAMA3: return "llama3";
    case FL_CHAT_FAMILY_MISTRAL: return "mistral";
    case FL_CHAT_FAMILY_NONE: break;
    }
    return "none";
}

/* ---- ChatML ---------------------------------------------------------------- */

typedef struct sys_find {
    char *text;
    bool oom;
} sys_find;

static bool find_default_system(const char *lit, void *ctx) {
    static const char head[] = "<|im_start|>system\n";
    sys_find *f = ctx;
    if (strncmp(lit, head, sizeof head - 1) != 0) return false;
    const char *body = lit + sizeof head - 1;
    const char *end = strstr(body, "<|im_end|>");
    /* '<|im_start|>system\n' + messages[0]['content'] + ... has no
     * <|im_end|> inside the literal: not a default. */
    if (!end) return false;
    f->text = strndup(body, (size_t)(end - body));
    if (!f->text) f->oom = true;
    return true;
}

fl_status fl_chat_template_default_system(const char *jinja_source, char **out) {
    if (!out) return FL_ERR(FL_ERR_INVALID_ARG, "fl_chat_template_default_system: out is NULL");
    *out = NULL;
    if (!jinja_source) return FL_OK;
    sys_find f = {0};
    for_each_literal(jinja_source, find_default_system, &f);
    if (f.oom) return FL_ERR(FL_ERR_OOM, "out of memory reading the chat template");
    *out = f.text;
    return FL_OK;
}

static bool is_role(const char *r, const char *want) { return r && strcmp(r, want) == 0; }

static fl_status check_roles(const char *fam, const fl_chat_message *m, size_t n) {
    if (n == 0) return FL_ERR(FL_ERR_INVALID_ARG, "chat template (%s): no messages to render", fam);
    for (size_t i = 0; i < n; i++) {
        if (!m[i].content)
            return FL_ERR(FL_ERR_INVALID_ARG, "chat template (%s): messages[%zu] has no content",
                          fam, i);
        if (!is_role(m[i].role, "system") && !is_role(m[i].role, "user") &&
            !is_role(m[i].role, "assistant"))
            return FL_ERR(FL_ERR_INVALID_ARG,
                          "chat template (%s): messages[%zu].role must be system, user or "
                          "assistant (got '%s')", fam, i, m[i].role ? m[i].role : "(null)");
    }
    return FL_OK;
}

/* Python's s.rstrip('\n') / lstrip('\n') on a slice. */
static void strip_nl(const char **p, size_t *n, bool left, bool right) {
    while (left && *n > 0 && **p == '\n') {
        (*p)++;
        (*n)--;
    }
    while (right && *n > 0 && (*p)[*n - 1] == '\n') (*n)--;
}

/* Last occurrence of needle in hay[0..n), or NULL. */
static const char *last_in(const char *hay, size_t n, const char *needle) {
    size_t k = strlen(needle);
    for (size_t i = n >= k ? n - k + 1 : 0; i-- > 0;)
        if (memcmp(hay + i, needle, k) == 0) return hay + i;
    return NULL;
}

static bool is_tool_response(const char *c) {
    static const char open[] = "<tool_response>", close[] = "</tool_response>";
    size_t n = strlen(c);
    return strncmp(c, open, sizeof open - 1) == 0 && n >= sizeof close - 1 &&
           strcmp(c + n - (sizeof close - 1), close) == 0;
}

/* Qwen3-style assistant turn (templates with "last_query_index"): reasoning
 * between <think> and </think> is cut out of the content; it is written back,
 * in a <think> block, only for assistant turns after the last user query
 * that are the final message or have reasoning. */
static void put_qwen3_assistant(sbuf *b, const char *content, bool after_last_query, bool last) {
    const char *c = content, *r = "";
    size_t cn = strlen(content), rn = 0;
    const char *close = strstr(content, "</think>");
    if (close) {
        /* reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') */
        r = content;
        rn = (size_t)(close - content);
        strip_nl(&r, &rn, false, true);
        const char *open = last_in(r, rn, "<think>");
        if (open) {
            rn -= (size_t)(open + 7 - r);
            r = open + 7;
        }
        strip_nl(&r, &rn, true, false);
        /* content = content.split('</think>')[-1].lstrip('\n') */
        c = last_in(content, cn, "</think>") + 8;
        cn = strlen(c);
        strip_nl(&c, &cn, true, false);
    }
    sb_puts(b, "<|im_start|>assistant\n");
    if (after_last_query && (last || rn > 0)) {
        strip_nl(&r, &rn, true, true);
        sb_puts(b, "<think>\n");
        sb_putn(b, r, rn);
        sb_puts(b, "\n</think>\n\n");
        strip_nl(&c, &cn, true, false);
    }
    sb_putn(b, c, cn);
}

static fl_status render_chatml(const char *src, const fl_chat_message *m, size_t n,
                               const char *bos, char **out) {
    char *def = NULL;
    FL_TRY(fl_chat_template_default_system(src, &def));
    const bool qwen3 = src && strstr(src, "last_query_index") && strstr(src, "</think>");
    size_t last_query = n - 1;
    if (qwen3) {
        for (size_t i = n; i-- > 0;)
            if (is_role(m[i].role, "user") && !is_tool_response(m[i].content)) {
                last_query = i;
                break;
            }
    }
    sbuf b = {0};
    /* SmolLM2/Qwen templates never write bos_token; some ChatML fine-tunes
     * start with {{ bos_token }}. */
    if (src && strstr(src, "bos_token")) sb_puts(&b, bos);
    if (def && !is_role(m[0].role, "system")) {
        sb_puts(&b, "<|im_start|>system\n");
        sb_puts(&b, def);
        sb_puts(&b, "<|im_end|>\n");
    }
    free(def);
    for (size_t i = 0; i < n; i++) {
        if (qwen3 && is_role(m[i].role, "assistant")) {
            put_qwen3_assistant(&b, m[i].content, i > last_query, i == n - 1);
        } else {
            sb_puts(&b, "<|im_start|>");
            sb_puts(&b, m[i].role);
            sb_puts(&b, "\n");
            sb_puts(&b, m[i].content);
        }
        sb_puts(&b, "<|im_end|>\n");
    }
    sb_puts(&b, "<|im_start|>assistant\n");
    return sb_finish(&b, out);
}

/* ---- Llama 3 --------------------------------------------------------------- */

/* Python's str.isspace(), which Jinja's |trim (str.strip()) uses. */
static bool py_isspace(utf8proc_int32_t c) {
    if (c == ' ' || (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f) || c == 0x85) return true;
    if (c < 0xa0) return false;
    utf8proc_category_t cat = utf8proc_category(c);
    return cat == UTF8PROC_CATEGORY_ZS || cat == UTF8PROC_CATEGORY_ZL ||
           cat == UTF8PROC_CATEGORY_ZP;
}

/* Appends s with leading and trailing whitespace removed. Invalid UTF-8 bytes
 * count as non-space (they reach the tokenizer unchanged). */
static void sb_put_trimmed(sbuf *b, const char *s) {
    const utf8proc_uint8_t *p = (const utf8proc_uint8_t *)s;
    utf8proc_ssize_t len = (utf8proc_ssize_t)strlen(s), start = 0, stop = 0, i = 0;
    bool seen = false;
    while (i < len) {
        utf8proc_int32_t c;
        utf8proc_ssize_t k = utf8proc_iterate(p + i, len - i, &c);
        if (k <= 0) {
            k = 1;
            c = -1;
        }
        if (c < 0 || !py_isspace(c)) {
            if (!seen) start = i;
            seen = true;
            stop = i + k;
        }
        i += k;
    }
    if (seen) sb_putn(b, s + start, (size_t)(stop - start));
}

/* The date a Llama-3.1+ template puts in its system header: today's when it
 * calls strftime_now (HF provides it, so Jinja takes that branch), else the
 * literal of `set date_string = "..."`, else Meta's default. */
static fl_status llama3_date(const char *src, char *buf, size_t cap) {
    if (strstr(src, "strftime_now")) {
        time_t now = time(NULL);
        struct tm tm;
        if (!localtime_r(&now, &tm) || strftime(buf, cap, "%d %b %Y", &tm) == 0)
            return FL_ERR(FL_ERR_SYSTEM, "chat template (llama3): cannot format today's date");
        return FL_OK;
    }
    snprintf(buf, cap, "26 Jul 2024");
    const char *p = strstr(src, "set date_string");
    if (p) {
        p += strlen("set date_string");
        while (*p == ' ' || *p == '=') p++;
        if (*p == '"' || *p == '\'') {
            const char *e;
            char *lit = read_literal(p, &e);
            if (!lit) return FL_ERR(FL_ERR_OOM, "chat template (llama3): bad date_string literal");
            snprintf(buf, cap, "%s", lit);
            free(lit);
        }
    }
    return FL_OK;
}

typedef struct lit_find {
    const char *prefix;
    char *text;
} lit_find;

static bool find_prefixed(const char *lit, void *ctx) {
    lit_find *f = ctx;
    if (strncmp(lit, f->prefix, strlen(f->prefix)) != 0) return false;
    f->text = strdup(lit);
    return true;
}

static fl_status render_llama3(const char *src, const fl_chat_message *m, size_t n,
                               const char *bos, char **out) {
    sbuf b = {0};
    sb_puts(&b, bos);
    size_t first = 0;
    if (src && strstr(src, "Cutting Knowledge Date")) {
        /* Llama 3.1 / 3.2 / 3.3: a system header is always written, with the
         * knowledge cutoff and date lines before the (trimmed) system text. */
        char date[64];
        lit_find kd = {"Cutting Knowledge Date", NULL};
        fl_status st = llama3_date(src, date, sizeof date);
        if (st != FL_OK) {
            free(b.p);
            return st;
        }
        for_each_literal(src, find_prefixed, &kd);
        sb_puts(&b, "<|start_header_id|>system<|end_header_id|>\n\n");
        sb_puts(&b, kd.text ? kd.text : "Cutting Knowledge Date: December 2023\n");
        free(kd.text);
        sb_puts(&b, "Today Date: ");
        sb_puts(&b, date);
        sb_puts(&b, "\n\n");
        if (is_role(m[0].role, "system")) {
            sb_put_trimmed(&b, m[0].content);
            first = 1;
        }
        sb_puts(&b, "<|eot_id|>");
    }
    for (size_t i = first; i < n; i++) {
        sb_puts(&b, "<|start_header_id|>");
        sb_puts(&b, m[i].role);
        sb_puts(&b, "<|end_header_id|>\n\n");
        sb_put_trimmed(&b, m[i].content);
        sb_puts(&b, "<|eot_id|>");
    }
    sb_puts(&b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    return sb_finish(&b, out);
}

/* ---- Mistral --------------------------------------------------------------- */

typedef enum sys_place { SYS_FIRST_USER, SYS_LAST_USER } sys_place;

typedef struct mistral_style {
    const char *open;      /* "[INST] ", " [INST] ", "[INST]" */
    const char *close;     /* " [/INST]", "[/INST]" */
    bool asst_space;       /* ' ' + message['content'] */
    bool asst_trim;        /* message['content']|trim */
    sys_place sys;
} mistral_style;

/* src with every " turned into ' and, in the squeezed copy, all whitespace
 * removed: lets one pattern match both quoting styles and any spacing. */
static char *normalize(const char *src, bool squeeze) {
    size_t n = strlen(src);
    char *o = malloc(n + 1), *w = o;
    if (!o) return NULL;
    for (const char *s = src; *s; s++) {
        if (squeeze && (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r')) continue;
        *w++ = *s == '"' ? '\'' : *s;
    }
    *w = 0;
    return o;
}

static fl_status mistral_style_of(const char *src, mistral_style *st) {
    /* Defaults: the original Mistral-7B-Instruct-v0.1 template. */
    *st = (mistral_style){"[INST] ", " [/INST]", false, false, SYS_FIRST_USER};
    if (!src) return FL_OK;
    char *q = normalize(src, false), *sq = normalize(src, true);
    if (!q || !sq) {
        free(q);
        free(sq);
        return FL_ERR(FL_ERR_OOM, "out of memory reading the chat template");
    }
    if (strstr(q, "' [INST] '")) st->open = " [INST] ";
    else if (strstr(q, "'[INST] '")) st->open = "[INST] ";
    else if (strstr(q, "'[INST]'")) st->open = "[INST]";
    if (strstr(q, "' [/INST]'")) st->close = " [/INST]";
    else if (strstr(q, "'[/INST]'")) st->close = "[/INST]";
    st->asst_space = strstr(q, "' ' + message['content']") || strstr(q, "' ' + message.content");
    st->asst_trim = strstr(sq, "message['content']|trim+eos_token") ||
                    strstr(sq, "message.content|trim+eos_token");
    if (strstr(sq, "loop.lastandsystem_message")) st->sys = SYS_LAST_USER;
    free(q);
    free(sq);
    return FL_OK;
}

static fl_status render_mistral(const char *src, const fl_chat_message *m, size_t n,
                                const char *bos, char **out) {
    mistral_style st;
    FL_TRY(mistral_style_of(src, &st));
    const char *sys = NULL;
    size_t first = 0;
    if (is_role(m[0].role, "system")) {
        sys = m[0].content;
        first = 1;
    }
    if (first == n)
        return FL_ERR(FL_ERR_INVALID_ARG,
                      "chat template (mistral): a system message alone cannot be rendered; add a "
                      "user message");
    for (size_t i = first; i < n; i++) {
        const char *want = ((i - first) % 2 == 0) ? "user" : "assistant";
        if (!is_role(m[i].role, want))
            return FL_ERR(FL_ERR_INVALID_ARG,
                          "chat template (mistral): messages[%zu].role is '%s' but after the "
                          "optional system message roles must alternate user/assistant/user/...",
                          i, m[i].role);
    }
    sbuf b = {0};
    sb_puts(&b, bos);
    for (size_t i = first; i < n; i++) {
        if (is_role(m[i].role, "user")) {
            bool with_sys = sys && ((st.sys == SYS_FIRST_USER && i == first) ||
                                    (st.sys == SYS_LAST_USER && i == n - 1));
            sb_puts(&b, st.open);
            if (with_sys) {
                sb_puts(&b, sys);
                sb_puts(&b, "\n\n");
            }
            sb_puts(&b, m[i].content);
            sb_puts(&b, st.close);
        } else {
            if (st.asst_space) sb_puts(&b, " ");
            if (st.asst_trim) sb_put_trimmed(&b, m[i].content);
            else sb_puts(&b, m[i].content);
            /* Every Mistral tokenizer's eos_token is "</s>"; the render API
             * carries only the BOS text. */
            sb_puts(&b, "</s>");
        }
    }
    return sb_finish(&b, out);
}

/* ---- entry point ----------------------------------------------------------- */

fl_status fl_chat_template_render(fl_chat_family family, const char *jinja_source,
                                  const fl_chat_message *messages, size_t n,
                                  const char *bos_text, char **out) {
    if (!out) return FL_ERR(FL_ERR_INVALID_ARG, "fl_chat_template_render: out is NULL");
    *out = NULL;
    const char *fam = fl_chat_family_name(family);
    if (family == FL_CHAT_FAMILY_NONE)
        return FL_ERR(FL_ERR_UNSUPPORTED,
                      "the model has no chat template flotilla recognises (ChatML, Llama-3, "
                      "Mistral); send requests with 'prompt' instead of 'messages'");
    if (n > 0 && !messages)
        return FL_ERR(FL_ERR_INVALID_ARG, "fl_chat_template_render: messages is NULL");
    FL_TRY(check_roles(fam, messages, n));
    const char *bos = bos_text ? bos_text : "";
    switch (family) {
    case FL_CHAT_FAMILY_CHATML: return render_chatml(jinja_source, messages, n, bos, out);
    case FL_CHAT_FAMILY_LLAMA3: return render_llama3(jinja_source, messages, n, bos, out);
    case FL_CHAT_FAMILY_MISTRAL: return render_mistral(jinja_source, messages, n, bos, out);
    case FL_CHAT_FAMILY_NONE: break;
    }
    return FL_ERR(FL_ERR_INVALID_ARG, "fl_chat_template_render: unknown family %d", (int)family);
}
