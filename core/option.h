/*
 * option.h — the option registry: every tunable of flotilla declared once
 * (core/option_list.h: name, environment variable, kind, default, one-line
 * doc), parsed by one function, listed by `flotilla env` with the values in
 * force. A second, small table (core/option_external.h) names the variables
 * flotilla reads that belong to others (launchers, CUDA), so that every
 * environment read goes through this module.
 *
 * User-facing settings are also fields of the engine/parallel configs, set
 * from CLI flags and --config YAML; the registry entry is their default and
 * the environment variable an override for experiments (precedence: flag >
 * YAML > environment > default; the launcher applies it). Kernel tuning
 * overrides are not product options: they belong to bench_kernels' arguments.
 *
 * Threading: fl_opt_init() parses the whole environment once; the getters
 * call it on first use (pthread_once), so they are safe from any thread and
 * cost a load afterwards. Values never change after that, except through
 * fl_opt_override (tests and benchmarks, before the engine starts).
 */
#ifndef FL_OPTION_H
#define FL_OPTION_H

#include <stdbool.h>
#include <stdio.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fl_opt_kind {
    FL_OPT_KIND_BOOL,   /* 0/1, also true/false, on/off, yes/no */
    FL_OPT_KIND_INT,    /* a decimal integer (long) */
    FL_OPT_KIND_STR,    /* free text, checked by its user */
    FL_OPT_KIND_CHOICE, /* one of a list of names ("off|on|serial"), or its index */
} fl_opt_kind;

typedef enum fl_opt_id {
#define FL_OPT_ENUM(id, env, kind, dflt, doc) FL_OPT_##id,
#define FL_OPT_CHOICE(id, env, choices, dflt, doc) FL_OPT_##id,
#include "core/option_list.h"
#undef FL_OPT_CHOICE
#undef FL_OPT_ENUM
    FL_OPT_COUNT
} fl_opt_id;

/* Reads every registered variable from the environment once. An empty
 * value counts as unset. A malformed value (FL_X=abc for an integer) is an
 * FL_ERR_INVALID_ARG naming the variable and what it takes (and how many
 * others are malformed); those options keep their defaults. Idempotent: a
 * later call returns the same status. */
fl_status fl_opt_init(void);

/* The value in force: the environment's when set and well-formed, else the
 * default. fl_opt_bool on a non-BOOL option, fl_opt_int on a STR or BOOL one
 * (it takes INT and CHOICE, whose value is the choice's index) is a bug and
 * aborts. */
bool fl_opt_bool(fl_opt_id id);
long fl_opt_int(fl_opt_id id);
/* The text in force (a CHOICE's canonical name), NULL when unset and
 * without a default. The registry owns the string. */
const char *fl_opt_str(fl_opt_id id);
/* The number in force of a BOOL (0/1), INT or CHOICE (the index) option. */
long fl_opt_num(fl_opt_id id);
/* Parses text as the option's kind would be (BOOL to 0/1, INT, CHOICE to
 * its index; STR takes anything, 0) without setting anything: flags and
 * config keys of user-facing settings take the same values as the
 * variable. false when it does not parse. */
bool fl_opt_parse(fl_opt_id id, const char *text, long *num);
/* Whether the environment (or fl_opt_override) sets the option, so it
 * overrides a config field's default. */
bool fl_opt_is_set(fl_opt_id id);

/* The declared defaults, with no environment: what config structs start
 * from (fl_engine_config_default and friends read no environment). */
bool fl_opt_default_bool(fl_opt_id id);
long fl_opt_default_int(fl_opt_id id);

/* Sets a value as if it came from the environment (tests, benchmarks); NULL
 * goes back to the default. The string is copied. Returns
 * FL_ERR_INVALID_ARG naming the variable when it does not parse. */
fl_status fl_opt_override(fl_opt_id id, const char *value);

/* Registry metadata. */
const char *fl_opt_env(fl_opt_id id);
const char *fl_opt_doc(fl_opt_id id);
const char *fl_opt_default(fl_opt_id id);

/* Everything `flotilla env` shows about one option. Strings are the
 * registry's. */
typedef struct fl_opt_info {
    const char *env;       /* "FL_CUDA_GRAPHS" */
    fl_opt_kind kind;
    const char *kind_name; /* "bool", "int", "str", "choice" */
    const char *choices;   /* CHOICE: "off|on|serial|alternate"; NULL otherwise */
    const char *dflt;      /* NULL: unset */
    const char *doc;
    const char *value;     /* the text in force, NULL when unset */
    const char *env_text;  /* the environment's text when set (even malformed), else NULL */
    bool from_env;         /* the value in force came from the environment or an override */
    bool invalid;          /* the environment's text did not parse (the default is in force) */
} fl_opt_info;
void fl_opt_info_get(fl_opt_id id, fl_opt_info *out);

/* One line an option: variable, value in force (marked when from the
 * environment or malformed), default and doc. */
void fl_opt_print(FILE *f);

/* --- external variables (core/option_external.h) ---------------------- */

/* How many variables of others flotilla reads, and the i-th's name and doc. */
int fl_opt_external_count(void);
const char *fl_opt_external_name(int i);
const char *fl_opt_external_doc(int i);
/* The current value of an external variable (NULL when unset), read at each
 * call: launchers set them before the process starts, tests may change them.
 * A name missing from the table is a bug and aborts, so every variable
 * flotilla reads is listed by `flotilla env`. */
const char *fl_opt_external(const char *name);

#ifdef __cplusplus
}
#endif
#endif /* FL_OPTION_H */
