/*
 * option.c — the registry's one parser and its listing (see option.h). The
 * only file of flotilla that calls getenv.
 */
#include "core/option.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

typedef struct opt_def {
    const char *name, *env;
    fl_opt_kind kind;
    const char *choices; /* CHOICE only */
    const char *dflt, *doc;
} opt_def;

static const opt_def defs[FL_OPT_COUNT] = {
#define FL_OPT_ENUM(id, env_, kind_, dflt_, doc_) \
    [FL_OPT_##id] = {#id, env_, FL_OPT_KIND_##kind_, NULL, dflt_, doc_},
#define FL_OPT_CHOICE(id, env_, choices_, dflt_, doc_) \
    [FL_OPT_##id] = {#id, env_, FL_OPT_KIND_CHOICE, choices_, dflt_, doc_},
#include "core/option_list.h"
#undef FL_OPT_CHOICE
#undef FL_OPT_ENUM
};

typedef struct ext_def {
    const char *name, *doc;
} ext_def;

static const ext_def externals[] = {
#define FL_OPT_EXTERNAL(name_, doc_) {name_, doc_},
#include "core/option_external.h"
#undef FL_OPT_EXTERNAL
};
enum { N_EXTERNAL = sizeof externals / sizeof externals[0] };

typedef struct opt_val {
    bool set;       /* from the environment or an override */
    bool bad;       /* the environment's text did not parse */
    long num;       /* BOOL, INT and CHOICE (the index) */
    char *str;      /* the text in force (owned) or NULL */
    char *env_text; /* the environment's text when set (owned) or NULL */
} opt_val;

static opt_val vals[FL_OPT_COUNT];
static pthread_once_t once = PTHREAD_ONCE_INIT;
static fl_status init_status = FL_OK;
static char init_msg[512];

static bool parse_bool(const char *s, long *out) {
    static const char *const yes[] = {"1", "true", "on", "yes"}, *const no[] = {"0", "false", "off", "no"};
    for (size_t i = 0; i < 4; i++) {
        if (!strcasecmp(s, yes[i])) return *out = 1, true;
        if (!strcasecmp(s, no[i])) return *out = 0, true;
    }
    return false;
}

static bool parse_int(const char *s, long *out) {
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end) return false;
    *out = v;
    return true;
}

/* A name of the '|'-separated list (case-insensitive) or its index. */
static bool parse_choice(const char *choices, const char *s, long *out) {
    long idx = 0;
    if (parse_int(s, &idx)) {
        long n = 1;
        for (const char *p = choices; *p; p++) n += *p == '|';
        if (idx < 0 || idx >= n) return false;
        *out = idx;
        return true;
    }
    size_t len = strlen(s);
    idx = 0;
    for (const char *p = choices;; idx++) {
        const char *bar = strchr(p, '|');
        size_t n = bar ? (size_t)(bar - p) : strlen(p);
        if (n == len && !strncasecmp(p, s, n)) return *out = idx, true;
        if (!bar) return false;
        p = bar + 1;
    }
}

static bool parse(const opt_def *d, const char *s, long *num) {
    switch (d->kind) {
    case FL_OPT_KIND_BOOL: return parse_bool(s, num);
    case FL_OPT_KIND_INT: return parse_int(s, num);
    case FL_OPT_KIND_CHOICE: return parse_choice(d->choices, s, num);
    case FL_OPT_KIND_STR: break;
    }
    return true;
}

/* The canonical text of a parsed value: a CHOICE's name, else the text. */
static char *canonical(const opt_def *d, const char *s, long num) {
    if (d->kind != FL_OPT_KIND_CHOICE) return strdup(s);
    const char *p = d->choices;
    for (long i = 0; i < num; i++) p = strchr(p, '|') + 1;
    const char *bar = strchr(p, '|');
    return strndup(p, bar ? (size_t)(bar - p) : strlen(p));
}

static const char *expected(const opt_def *d) {
    switch (d->kind) {
    case FL_OPT_KIND_BOOL: return "0 or 1 (true/false, on/off, yes/no)";
    case FL_OPT_KIND_INT: return "an integer";
    case FL_OPT_KIND_CHOICE: return d->choices;
    case FL_OPT_KIND_STR: break;
    }
    return "text";
}

static void set_default(int i) {
    const opt_def *d = &defs[i];
    vals[i].set = false;
    vals[i].num = 0;
    free(vals[i].str);
    vals[i].str = NULL;
    /* a default that does not parse is a bug in option_list.h */
    if (d->dflt && !parse(d, d->dflt, &vals[i].num)) abort();
    if (d->dflt) vals[i].str = canonical(d, d->dflt, vals[i].num);
}

static void init_once(void) {
    int n_bad = 0, first = -1;
    for (int i = 0; i < FL_OPT_COUNT; i++) {
        set_default(i);
        const char *e = getenv(defs[i].env);
        if (!e || !*e) continue;
        vals[i].env_text = strdup(e);
        long num = 0;
        if (!parse(&defs[i], e, &num)) {
            vals[i].bad = true;
            if (first < 0) first = i;
            n_bad++;
            continue;
        }
        vals[i].set = true;
        vals[i].num = num;
        free(vals[i].str);
        vals[i].str = canonical(&defs[i], e, num);
    }
    if (first >= 0) {
        if (n_bad > 1)
            snprintf(init_msg, sizeof init_msg, "%s=%s: expected %s (and %d more malformed FL_ variables: "
                     "see flotilla env)", defs[first].env, vals[first].env_text, expected(&defs[first]), n_bad - 1);
        else
            snprintf(init_msg, sizeof init_msg, "%s=%s: expected %s", defs[first].env, vals[first].env_text,
                     expected(&defs[first]));
        init_status = FL_ERR_INVALID_ARG;
    }
}

fl_status fl_opt_init(void) {
    pthread_once(&once, init_once);
    /* the message is set on each call: the caller's thread may not be the
     * one that parsed, and fl_error_msg is per thread */
    if (init_status != FL_OK) return FL_ERR(init_status, "%s", init_msg);
    return FL_OK;
}

/* A bad id, or reading an option as a kind it is not, is a bug. */
static void check_kind(fl_opt_id id, fl_opt_kind want) {
    if ((unsigned)id >= FL_OPT_COUNT) abort();
    const fl_opt_kind k = defs[id].kind;
    const bool ok = want == FL_OPT_KIND_STR || k == want || (want == FL_OPT_KIND_INT && k == FL_OPT_KIND_CHOICE);
    if (!ok) {
        fprintf(stderr, "flotilla: option %s read as the wrong kind\n", defs[id].env);
        abort();
    }
}

static const opt_val *get(fl_opt_id id, fl_opt_kind want) {
    pthread_once(&once, init_once);
    check_kind(id, want);
    return &vals[id];
}

bool fl_opt_bool(fl_opt_id id) { return get(id, FL_OPT_KIND_BOOL)->num != 0; }
long fl_opt_int(fl_opt_id id) { return get(id, FL_OPT_KIND_INT)->num; }
const char *fl_opt_str(fl_opt_id id) { return get(id, FL_OPT_KIND_STR)->str; }
bool fl_opt_is_set(fl_opt_id id) { return get(id, FL_OPT_KIND_STR)->set; }

long fl_opt_num(fl_opt_id id) {
    const opt_val *v = get(id, FL_OPT_KIND_STR);
    if (defs[id].kind == FL_OPT_KIND_STR) {
        fprintf(stderr, "flotilla: option %s read as a number\n", defs[id].env);
        abort();
    }
    return v->num;
}

/* Also without reading the environment. */
bool fl_opt_parse(fl_opt_id id, const char *text, long *num) {
    if ((unsigned)id >= FL_OPT_COUNT || !text) return false;
    long v = 0;
    if (!parse(&defs[id], text, &v)) return false;
    *num = v;
    return true;
}

/* From the declaration alone: the environment is not read. */
static long default_num(fl_opt_id id, fl_opt_kind want) {
    check_kind(id, want);
    long num = 0;
    if (defs[id].dflt) parse(&defs[id], defs[id].dflt, &num);
    return num;
}

bool fl_opt_default_bool(fl_opt_id id) { return default_num(id, FL_OPT_KIND_BOOL) != 0; }
long fl_opt_default_int(fl_opt_id id) { return default_num(id, FL_OPT_KIND_INT); }

fl_status fl_opt_override(fl_opt_id id, const char *value) {
    pthread_once(&once, init_once);
    if ((unsigned)id >= FL_OPT_COUNT) return FL_ERR(FL_ERR_INVALID_ARG, "no option %d", (int)id);
    if (!value) {
        set_default(id);
        return FL_OK;
    }
    long num = 0;
    if (!parse(&defs[id], value, &num))
        return FL_ERR(FL_ERR_INVALID_ARG, "%s=%s does not parse: expected %s", defs[id].env, value,
                      expected(&defs[id]));
    char *copy = canonical(&defs[id], value, num);
    if (!copy) return FL_ERR(FL_ERR_OOM, "out of memory");
    free(vals[id].str);
    vals[id].set = true;
    vals[id].num = num;
    vals[id].str = copy;
    return FL_OK;
}

const char *fl_opt_env(fl_opt_id id) { return (unsigned)id < FL_OPT_COUNT ? defs[id].env : NULL; }
const char *fl_opt_doc(fl_opt_id id) { return (unsigned)id < FL_OPT_COUNT ? defs[id].doc : NULL; }
const char *fl_opt_default(fl_opt_id id) { return (unsigned)id < FL_OPT_COUNT ? defs[id].dflt : NULL; }

void fl_opt_info_get(fl_opt_id id, fl_opt_info *out) {
    static const char *const kind_names[] = {"bool", "int", "str", "choice"};
    const opt_val *v = get(id, FL_OPT_KIND_STR);
    const opt_def *d = &defs[id];
    *out = (fl_opt_info){.env = d->env, .kind = d->kind, .kind_name = kind_names[d->kind],
                         .choices = d->choices, .dflt = d->dflt, .doc = d->doc, .value = v->str,
                         .env_text = v->env_text, .from_env = v->set, .invalid = v->bad};
}

void fl_opt_print(FILE *f) {
    for (int i = 0; i < FL_OPT_COUNT; i++) {
        fl_opt_info o;
        fl_opt_info_get((fl_opt_id)i, &o);
        char kind[160];
        if (o.choices) snprintf(kind, sizeof kind, "%s", o.choices);
        else snprintf(kind, sizeof kind, "%s", o.kind_name);
        fprintf(f, "%-26s %-12s %s(%s, default %s)\n    %s\n", o.env, o.value ? o.value : "(unset)",
                o.invalid ? "[malformed in the environment] " : o.from_env ? "[environment] " : "", kind,
                o.dflt ? o.dflt : "unset", o.doc);
        if (o.invalid) fprintf(f, "    the environment's %s=%s does not parse: expected %s\n", o.env, o.env_text,
                               expected(&defs[i]));
    }
}

int fl_opt_external_count(void) { return N_EXTERNAL; }
const char *fl_opt_external_name(int i) { return i >= 0 && i < N_EXTERNAL ? externals[i].name : NULL; }
const char *fl_opt_external_doc(int i) { return i >= 0 && i < N_EXTERNAL ? externals[i].doc : NULL; }

const char *fl_opt_external(const char *name) {
    for (int i = 0; i < N_EXTERNAL; i++)
        if (!strcmp(externals[i].name, name)) return getenv(name);
    fprintf(stderr, "flotilla: %s is read but not listed in core/option_external.h\n", name);
    abort();
}
