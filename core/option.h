/*
 * option.h — the option registry: every tunable of flotilla declared once
 * (core/option_list.h: name, environment variable, kind, default, one-line
 * doc), parsed by one function, listed by `flotilla env` with the values in
 * force.
 *
 * User-facing settings are also fields of the engine/parallel configs, set
 * from CLI flags and --config YAML; the registry entry is their default and
 * the environment variable an override for experiments. Kernel tuning
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
    FL_OPT_KIND_BOOL, /* 0/1, also true/false, on/off, yes/no */
    FL_OPT_KIND_INT,  /* a decimal integer (long) */
    FL_OPT_KIND_STR,  /* free text, checked by its user */
} fl_opt_kind;

typedef enum fl_opt_id {
#define FL_OPT_ENUM(id, env, kind, dflt, doc) FL_OPT_##id,
#include "core/option_list.h"
#undef FL_OPT_ENUM
    FL_OPT_COUNT
} fl_opt_id;

/* Reads every registered variable from the environment once. A malformed
 * value (FL_X=abc for an integer) is an FL_ERR_INVALID_ARG naming the
 * variable; the option then keeps its default. Idempotent. */
fl_status fl_opt_init(void);

/* The value in force: the environment's when set and well-formed, else the
 * default. fl_opt_bool/fl_opt_int on a STR option (or the other way round)
 * is a bug and aborts. */
bool fl_opt_bool(fl_opt_id id);
long fl_opt_int(fl_opt_id id);
/* NULL when unset and without a default. The registry owns the string. */
const char *fl_opt_str(fl_opt_id id);
/* Whether the environment sets the option (so it overrides a config field). */
bool fl_opt_is_set(fl_opt_id id);

/* Sets a value as if it came from the environment (tests, benchmarks). The
 * string is copied. Returns FL_ERR_INVALID_ARG when it does not parse. */
fl_status fl_opt_override(fl_opt_id id, const char *value);

/* Registry metadata. */
const char *fl_opt_env(fl_opt_id id);
const char *fl_opt_doc(fl_opt_id id);
const char *fl_opt_default(fl_opt_id id);

/* One line an option: variable, value in force (marked when from the
 * environment), default and doc. */
void fl_opt_print(FILE *f);

#ifdef __cplusplus
}
#endif
#endif /* FL_OPTION_H */
