/*
 * option.c — the registry's one parser and its listing (see option.h).
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
    const char *dflt, *doc;
} opt_def;

static const opt_def defs[FL_OPT_COUNT] = {
#define FL_OPT_ENUM(id, env_, kind_, dflt_, doc_) \
    [FL_OPT_##id] = {#id, env_, FL_OPT_KIND_##kind_, dflt_, doc_},
#include "core/option_list.h"
#undef FL_OPT_ENUM
};

typedef struct opt_val {
    bool set;     /* from the environment or an override */
    long num;     /* BOOL and INT */
    char *str;    /* the text in force (owned) or NULL */
} opt_val;

static opt_val vals[FL_OPT_COUNT];
static pthread_once_t once = PTHREAD_ONCE_INIT;
static fl_status init_status = FL_OK;

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

static bool parse(fl_opt_kind kind, const char *s, long *num) {
    if (kind == FL_OPT_KIND_BOOL) return parse_bool(s, num);
    if (kind == FL_OPT_KIND_INT) return parse_int(s, num);
    return true;
}

static void set_default(int i) {
    const opt_def *d = &defs[i];
    vals[i].set = false;
    vals[i].num = 0;
    free(vals[i].str);
    vals[i].str = d->dflt ? strdup(d->dflt) : NULL;
    /* a default that does not parse is a bug in option_list.h */
    if (d->dflt && !parse(d->kind, d->dflt, &vals[i].num)) abort();
}

static void init_once(void) {
    for (int i = 0; i < FL_OPT_COUNT; i++) {
        set_default(i);
        const char *e = getenv(defs[i].env);
        if (!e) continue;
        long num = 0;
        if (!parse(defs[i].kind, e, &num)) {
            if (init_status == FL_OK)
                init_status = FL_ERR(FL_ERR_INVALID_ARG, "%s=%s: expected %s", defs[i].env, e,
                                     defs[i].kind == FL_OPT_KIND_BOOL ? "0 or 1" : "an integer");
            continue;
        }
        vals[i].set = true;
        vals[i].num = num;
        free(vals[i].str);
        vals[i].str = strdup(e);
    }
}

fl_status fl_opt_init(void) {
    pthread_once(&once, init_once);
    return init_status;
}

static const opt_val *get(fl_opt_id id, fl_opt_kind want) {
    pthread_once(&once, init_once);
    if ((unsigned)id >= FL_OPT_COUNT) abort();
    if (want != FL_OPT_KIND_STR && defs[id].kind != want) {
        fprintf(stderr, "flotilla: option %s read as the wrong kind\n", defs[id].env);
        abort();
    }
    return &vals[id];
}

bool fl_opt_bool(fl_opt_id id) { return get(id, FL_OPT_KIND_BOOL)->num != 0; }
long fl_opt_int(fl_opt_id id) { return get(id, FL_OPT_KIND_INT)->num; }
const char *fl_opt_str(fl_opt_id id) { return get(id, FL_OPT_KIND_STR)->str; }
bool fl_opt_is_set(fl_opt_id id) { return get(id, FL_OPT_KIND_STR)->set; }

fl_status fl_opt_override(fl_opt_id id, const char *value) {
    pthread_once(&once, init_once);
    if ((unsigned)id >= FL_OPT_COUNT) return FL_ERR(FL_ERR_INVALID_ARG, "no option %d", (int)id);
    if (!value) {
        set_default(id);
        return FL_OK;
    }
    long num = 0;
    if (!parse(defs[id].kind, value, &num))
        return FL_ERR(FL_ERR_INVALID_ARG, "%s=%s does not parse", defs[id].env, value);
    char *copy = strdup(value);
    if (!copy) return FL_ERR(FL_ERR_OOM, "out of memory");
    free(vals[id].str);
    vals[id] = (opt_val){.set = true, .num = num, .str = copy};
    return FL_OK;
}

const char *fl_opt_env(fl_opt_id id) { return (unsigned)id < FL_OPT_COUNT ? defs[id].env : NULL; }
const char *fl_opt_doc(fl_opt_id id) { return (unsigned)id < FL_OPT_COUNT ? defs[id].doc : NULL; }
const char *fl_opt_default(fl_opt_id id) { return (unsigned)id < FL_OPT_COUNT ? defs[id].dflt : NULL; }

void fl_opt_print(FILE *f) {
    pthread_once(&once, init_once);
    for (int i = 0; i < FL_OPT_COUNT; i++) {
        const opt_def *d = &defs[i];
        fprintf(f, "%-28s %-12s %s (default %s)\n    %s\n", d->env, vals[i].str ? vals[i].str : "(unset)",
                vals[i].set ? "[environment]" : "", d->dflt ? d->dflt : "unset", d->doc);
    }
}
