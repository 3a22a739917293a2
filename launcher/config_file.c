/*
 * config_file.c — `--config FILE.yaml`: a flat YAML mapping whose keys are a
 * subcommand's long options (dashes or underscores), e.g.
 *
 *     model: models/SmolLM2-135M-Instruct.Q4_1.gguf
 *     tp: 2
 *     max_num_seqs: 32
 *     verbose: true
 *
 * Flags given on the command line override the file. Unknown keys, nested
 * values and bad YAML are errors naming the file, line and key.
 *
 * A negative flag may be written positively: `prefix_caching: false` is
 * `--no-prefix-caching`.
 *
 * One nested mapping is allowed: `slurm:`, the batch job's own options
 * (nodes, gpus_per_node, partition, time, ...), so one file describes a
 * whole job. Every subcommand skips it; `flotilla slurm --config` reads it
 * (unknown keys there are errors) together with the top-level keys it knows
 * (model, input, output, tp, ep), and leaves the others to the job's
 * `flotilla generate`, which gets the same file.
 */
#include <stdlib.h>
#include <string.h>
#include <yaml.h>

#include "launcher/cli.h"

/* Values read from files live until exit (options point into them). */
static char **g_values;
static size_t g_n_values;

void fl_cli_config_values_free(void) {
    for (size_t i = 0; i < g_n_values; i++) free(g_values[i]);
    free(g_values);
    g_values = NULL;
    g_n_values = 0;
}

static const char *keep(const char *s) {
    char **nv = realloc(g_values, (g_n_values + 1) * sizeof *nv);
    char *copy = strdup(s);
    if (!nv || !copy) {
        free(copy);
        if (nv) g_values = nv;
        return NULL;
    }
    static bool at_exit;
    if (!at_exit) at_exit = atexit(fl_cli_config_values_free) == 0;
    g_values = nv;
    g_values[g_n_values++] = copy;
    return copy;
}

static bool same_key(const char *key, const char *opt) {
    for (; *key && *opt; key++, opt++)
        if (!(*key == *opt || (*key == '_' && *opt == '-'))) return false;
    return !*key && !*opt;
}

/* The keys flotilla slurm reads from the top level of a job file: those
 * generate also takes (the script passes them on); its own options (nodes,
 * partition, time, ...) belong under slurm:, where generate does not look. */
static bool job_key(const char *opt) {
    static const char *const shared[] = {"model", "input", "output", "tp", "ep", "backend", "summary"};
    for (size_t i = 0; i < sizeof shared / sizeof shared[0]; i++)
        if (!strcmp(opt, shared[i])) return true;
    return false;
}

/* The option of opts that key names (dashes or underscores), or NULL. */
static const fl_cli_opt *find_opt(const fl_cli_opt *opts, const char *key) {
    for (const fl_cli_opt *q = opts; q->name; q++)
        if (same_key(key, q->name) && strcmp(q->name, "config") && strcmp(q->name, "help")) return q;
    return NULL;
}

/* The flag --no-KEY of a switch, for a key written positively. */
static const fl_cli_opt *negated_opt(const fl_cli_opt *opts, const char *key) {
    char neg[160];
    snprintf(neg, sizeof neg, "no-%s", key);
    const fl_cli_opt *o = find_opt(opts, neg);
    return o && !o->has_arg ? o : NULL;
}

/* Stores v for o unless the command line gave o already (the flag wins). */
static fl_status set_opt(const char *path, size_t line, const char *key, const fl_cli_opt *o,
                         const char *v) {
    if (*o->value) return FL_OK;
    if (!o->has_arg) {
        if (!strcmp(v, "true") || !strcmp(v, "yes") || !strcmp(v, "1")) *o->value = "1";
        else if (strcmp(v, "false") && strcmp(v, "no") && strcmp(v, "0"))
            return FL_ERR(FL_ERR_INVALID_ARG, "%s:%zu: %s must be true or false, got '%s'", path, line,
                          key, v);
        return FL_OK;
    }
    const char *expected = NULL;
    if (!fl_cli_setting_value_ok(o->name, v, &expected))
        return FL_ERR(FL_ERR_INVALID_ARG, "%s:%zu: %s must be %s, got '%s'", path, line, key, expected, v);
    *o->value = keep(v);
    return *o->value ? FL_OK : FL_ERR(FL_ERR_OOM, "out of memory reading %s", path);
}

fl_status fl_cli_config_load(const char *path, const fl_cli_opt *opts) {
    return fl_cli_config_load_mode(path, opts, false);
}

fl_status fl_cli_config_load_mode(const char *path, const fl_cli_opt *opts, bool slurm) {
    fl_status st = FL_OK;
    FILE *f = fopen(path, "rb");
    if (!f) return FL_ERR(FL_ERR_IO, "cannot open config file %s", path);
    yaml_parser_t p;
    yaml_event_t ev;
    if (!yaml_parser_initialize(&p)) {
        fclose(f);
        return FL_ERR(FL_ERR_OOM, "out of memory reading %s", path);
    }
    yaml_parser_set_input_file(&p, f);
    int depth = 0;          /* mapping depth */
    char key[128] = "";
    bool have_key = false, done = false, in_slurm = false;
    while (!done) {
        if (!yaml_parser_parse(&p, &ev)) {
            st = FL_ERR(FL_ERR_FORMAT, "%s:%zu: %s", path, p.problem_mark.line + 1,
                        p.problem ? p.problem : "invalid YAML");
            break;
        }
        size_t line = ev.start_mark.line + 1;
        switch (ev.type) {
        case YAML_MAPPING_START_EVENT:
            if (++depth == 2 && have_key && !strcmp(key, "slurm")) {
                in_slurm = true;
                have_key = false;
            } else if (depth > 1) {
                st = FL_ERR(FL_ERR_FORMAT, "%s:%zu: key '%s' has a nested mapping; the config is a "
                            "flat list of options (plus a 'slurm:' section)", path, line, key);
            }
            break;
        case YAML_SEQUENCE_START_EVENT:
            st = FL_ERR(FL_ERR_FORMAT, "%s:%zu: %s%s takes one value, not a list", path, line,
                        have_key ? "" : "the file ", have_key ? key : "");
            break;
        case YAML_SCALAR_EVENT: {
            const char *v = (const char *)ev.data.scalar.value;
            if (depth < 1) {
                st = FL_ERR(FL_ERR_FORMAT, "%s:%zu: expected a mapping of option: value", path, line);
                break;
            }
            if (!have_key) {
                snprintf(key, sizeof key, "%s", v);
                have_key = true;
                break;
            }
            have_key = false;
            if (in_slurm && !slurm) break; /* the batch job's section: flotilla slurm's */
            const fl_cli_opt *o = find_opt(opts, key);
            if (!o && (o = negated_opt(opts, key))) {
                /* `x: false` sets --no-x; `x: true` is the default, nothing to set */
                if (!strcmp(v, "true") || !strcmp(v, "yes") || !strcmp(v, "1")) break;
                if (!strcmp(v, "false") || !strcmp(v, "no") || !strcmp(v, "0")) v = "true";
            }
            if (!o && slurm && !in_slurm) break; /* a generate option: the job checks it */
            if (o && slurm && !in_slurm && !job_key(o->name)) {
                st = FL_ERR(FL_ERR_INVALID_ARG, "%s:%zu: '%s' is a Slurm option: put it under slurm: "
                            "(the job's generate reads the top level)", path, line, key);
                break;
            }
            if (!o) {
                st = FL_ERR(FL_ERR_INVALID_ARG, "%s:%zu: unknown key '%s'%s", path, line, key,
                            in_slurm ? " in the slurm: section" : "");
                break;
            }
            st = set_opt(path, line, key, o, v);
            break;
        }
        case YAML_MAPPING_END_EVENT:
            if (depth-- == 2) in_slurm = false;
            break;
        case YAML_STREAM_END_EVENT:
            done = true;
            break;
        default:
            break;
        }
        yaml_event_delete(&ev);
        if (st != FL_OK) break;
    }
    yaml_parser_delete(&p);
    fclose(f);
    return st;
}
