/*
 * cmd_slurm.c — `flotilla slurm`: writes a Slurm batch script that runs a
 * `flotilla generate` job with `srun --mpi=pmix`, one task per GPU, resuming
 * into the same output when resubmitted (see launcher/slurm/job.sbatch.in).
 * With --submit the script is piped to sbatch instead of printed.
 *
 * The template is a file, not a string in this binary, so a site can adapt
 * it (modules, containers) without rebuilding: --template, else
 * $FL_SLURM_TEMPLATE, else launcher/slurm/job.sbatch.in next to the build
 * folder holding this binary (build/flotilla -> launcher/slurm/...), else
 * ../share/flotilla/job.sbatch.in. Placeholders are @NAME@; an unknown one is
 * an error naming the template line, so a typo never reaches sbatch.
 *
 * Arguments after `--` are passed to `flotilla generate` unchanged.
 *
 * --config FILE.yaml describes a whole job: generate's options at the top
 * level, the Slurm ones in a `slurm:` section (see config_file.c); slurm
 * takes what it knows, and the script passes the file on to generate
 * (flags on either command line override it).
 *
 * --gpus-per-node 0 writes a CPU job: no GPU request, --tasks-per-node ranks
 * per node (default 1), and `--backend cpu` unless the arguments after `--`
 * name a backend (with no GPU allocated, "auto" must not find one that
 * belongs to another job). With GPUs, tasks per node = GPUs per node.
 */
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/option.h"
#include "launcher/cli.h"

/* A growable string. */
typedef struct sbuf {
    char *s;
    size_t len, cap;
} sbuf;

static fl_status sb_add(sbuf *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t nc = (b->len + n + 1) * 2;
        char *ns = realloc(b->s, nc);
        if (!ns) return FL_ERR(FL_ERR_OOM, "out of memory writing the batch script");
        b->s = ns;
        b->cap = nc;
    }
    memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = 0;
    return FL_OK;
}

static fl_status sb_str(sbuf *b, const char *s) { return sb_add(b, s, strlen(s)); }

/* Single-quoted for bash: ' becomes '\''. Plain words stay bare. */
static fl_status sb_quote(sbuf *b, const char *s) {
    if (*s && strspn(s, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-+=./:,@%")
                  == strlen(s))
        return sb_str(b, s);
    FL_TRY(sb_str(b, "'"));
    for (const char *p = s; *p; p++) FL_TRY(*p == '\'' ? sb_str(b, "'\\''") : sb_add(b, p, 1));
    return sb_str(b, "'");
}

/* --name value, value quoted, with a leading space. */
static fl_status sb_flag(sbuf *b, const char *name, const char *value) {
    if (!value) return FL_OK;
    FL_TRY(sb_str(b, " --"));
    FL_TRY(sb_str(b, name));
    FL_TRY(sb_str(b, " "));
    return sb_quote(b, value);
}

/* An #SBATCH value must not contain a newline (it would end the directive). */
static fl_status sbatch_safe(const char *flag, const char *v) {
    if (v && strpbrk(v, "\n\r"))
        return FL_ERR(FL_ERR_INVALID_ARG, "--%s must not contain a line break", flag);
    return FL_OK;
}

/* Absolute path (the job runs elsewhere, from another directory). Paths
 * that do not exist yet (the output) are made absolute against the cwd. */
static fl_status absolute(const char *p, char *out, size_t n) {
    if (p[0] == '/') {
        snprintf(out, n, "%s", p);
        return FL_OK;
    }
    char cwd[PATH_MAX];
    if (!getcwd(cwd, sizeof cwd)) return FL_ERR(FL_ERR_SYSTEM, "getcwd: %s", strerror(errno));
    if ((size_t)snprintf(out, n, "%s/%s", cwd, p) >= n)
        return FL_ERR(FL_ERR_INVALID_ARG, "path too long: %s", p);
    return FL_OK;
}

static fl_status find_template(const char *given, char *out, size_t n) {
    const char *env = fl_opt_str(FL_OPT_SLURM_TEMPLATE);
    if (given || (env && *env)) {
        snprintf(out, n, "%s", given ? given : env);
        if (access(out, R_OK) != 0)
            return FL_ERR(FL_ERR_IO, "cannot read the batch script template %s: %s", out,
                          strerror(errno));
        return FL_OK;
    }
    char exe[PATH_MAX];
    ssize_t k = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (k <= 0) return FL_ERR(FL_ERR_SYSTEM, "readlink /proc/self/exe: %s", strerror(errno));
    exe[k] = 0;
    char *slash = strrchr(exe, '/');
    if (slash) *slash = 0;
    static const char *rel[] = {"/../launcher/slurm/job.sbatch.in", "/../share/flotilla/job.sbatch.in"};
    for (size_t i = 0; i < 2; i++) {
        if ((size_t)snprintf(out, n, "%s%s", exe, rel[i]) < n && access(out, R_OK) == 0)
            return FL_OK;
    }
    return FL_ERR(FL_ERR_NOT_FOUND, "no batch script template at %s%s or %s%s; pass --template "
                  "launcher/slurm/job.sbatch.in", exe, rel[0], exe, rel[1]);
}

typedef struct var {
    const char *name, *value;
} var;

/* Replaces @NAME@ in tmpl; "@@" and lone '@' stay as they are. */
static fl_status expand(const char *path, const char *tmpl, const var *vars, size_t nv, sbuf *out) {
    long line = 1;
    for (const char *p = tmpl; *p;) {
        if (*p == '\n') line++;
        const char *end;
        if (*p != '@' || !(end = strchr(p + 1, '@')) || end == p + 1 ||
            strspn(p + 1, "ABCDEFGHIJKLMNOPQRSTUVWXYZ_") != (size_t)(end - p - 1)) {
            FL_TRY(sb_add(out, p, 1));
            p++;
            continue;
        }
        size_t nlen = (size_t)(end - p - 1);
        size_t i = 0;
        while (i < nv && !(strlen(vars[i].name) == nlen && !strncmp(vars[i].name, p + 1, nlen))) i++;
        if (i == nv)
            return FL_ERR(FL_ERR_FORMAT, "%s:%ld: unknown placeholder @%.*s@", path, line, (int)nlen,
                          p + 1);
        FL_TRY(sb_str(out, vars[i].value));
        p = end + 1;
    }
    return FL_OK;
}

int fl_cmd_slurm(int argc, char **argv) {
    const char *nodes = NULL, *gpus = NULL, *partition = NULL, *time_l = NULL, *account = NULL,
               *job_name = NULL, *cpus = NULL, *model = NULL, *input = NULL, *output = NULL,
               *tp = NULL, *ep = NULL, *summary = NULL, *log = NULL, *sig_s = NULL, *tmpl = NULL,
               *submit = NULL, *help = NULL, *tasks_pn = NULL, *config = NULL, *backend = NULL;
    fl_cli_opt opts[] = {
        {"model", true, &model, "model folder or .gguf (required)"},
        {"input", true, &input, "requests JSONL (required)"},
        {"output", true, &output, "results JSONL (required; resubmitting resumes into it)"},
        {"nodes", true, &nodes, "nodes (default 1)"},
        {"gpus-per-node", true, &gpus, "GPUs per node = tasks per node (default 1; 0: CPU tasks)"},
        {"tasks-per-node", true, &tasks_pn, "ranks per node (default: one per GPU; 1 with 0 GPUs)"},
        {"cpus-per-task", true, &cpus, "CPU cores per task (default 8)"},
        {"partition", true, &partition, "Slurm partition"},
        {"time", true, &time_l, "time limit (Slurm syntax, e.g. 4:00:00)"},
        {"account", true, &account, "Slurm account"},
        {"job-name", true, &job_name, "job name (default flotilla)"},
        {"config", true, &config, "YAML job file: generate options at the top, Slurm options under slurm:"},
        {"backend", true, &backend, "the job's backend (default auto; cpu with --gpus-per-node 0)"},
        {"tp", true, &tp, "tensor parallel size (default: all tasks)"},
        {"ep", true, &ep, "expert parallel size (default 1)"},
        {"summary", true, &summary, "summary JSON (default OUTPUT.summary.json)"},
        {"log", true, &log, "Slurm log file (default flotilla-%j.log)"},
        {"signal-seconds", true, &sig_s, "SIGTERM this many seconds before the time limit (default 120)"},
        {"template", true, &tmpl, "batch script template (default launcher/slurm/job.sbatch.in)"},
        {"submit", false, &submit, "pipe the script to sbatch instead of printing it"},
        {"help", false, &help, "show this help"},
        {0},
    };
    /* everything after "--" goes to flotilla generate */
    int own = argc;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--")) {
            own = i;
            break;
        }
    char *tmpl_text = NULL;
    sbuf gen = {0}, script = {0}, gpu_line = {0}, extra = {0}, out_q = {0}, exe_q = {0};
    FILE *sb = NULL;
    fl_status st = fl_cli_parse("slurm", own, argv, opts);
    if (st != FL_OK) return fl_cli_fail("slurm", st);
    if (help) {
        fl_cli_usage(stdout, "slurm",
                     "--model M --input I --output O [--nodes N --gpus-per-node G ...] "
                     "[-- generate options] > job.sbatch", opts);
        return 0;
    }
    if (!model || !input || !output) {
        fprintf(stderr, "flotilla slurm: --model, --input and --output are required\n");
        return 1;
    }
    long n_nodes = 1, n_gpus = 1, n_cpus = 8, n_sig = 120, n_tasks = -1, v;
    if (nodes) FL_TRY_GOTO(fl_cli_int("nodes", nodes, 1, 100000, &n_nodes), st, done);
    if (gpus) FL_TRY_GOTO(fl_cli_int("gpus-per-node", gpus, 0, 1024, &n_gpus), st, done);
    if (tasks_pn) FL_TRY_GOTO(fl_cli_int("tasks-per-node", tasks_pn, 1, 4096, &n_tasks), st, done);
    if (n_tasks > 0 && n_gpus > 0 && n_tasks != n_gpus) {
        st = FL_ERR(FL_ERR_INVALID_ARG, "--tasks-per-node %ld differs from --gpus-per-node %ld: "
                    "flotilla runs one task per GPU (--gpus-per-node 0 for CPU tasks)",
                    n_tasks, n_gpus);
        goto done;
    }
    if (n_tasks < 0) n_tasks = n_gpus > 0 ? n_gpus : 1;
    if (cpus) FL_TRY_GOTO(fl_cli_int("cpus-per-task", cpus, 1, 4096, &n_cpus), st, done);
    if (sig_s) FL_TRY_GOTO(fl_cli_int("signal-seconds", sig_s, 1, 65535, &n_sig), st, done);
    if (tp) FL_TRY_GOTO(fl_cli_int("tp", tp, 1, 1 << 20, &v), st, done);
    if (ep) FL_TRY_GOTO(fl_cli_int("ep", ep, 1, 1 << 20, &v), st, done);
    const char *sb_vals[][2] = {{"partition", partition}, {"time", time_l}, {"account", account},
                                {"job-name", job_name}, {"log", log}};
    for (size_t i = 0; i < sizeof sb_vals / sizeof sb_vals[0]; i++)
        FL_TRY_GOTO(sbatch_safe(sb_vals[i][0], sb_vals[i][1]), st, done);

    char tpath[PATH_MAX], exe[PATH_MAX], m_abs[PATH_MAX], i_abs[PATH_MAX], o_abs[PATH_MAX],
        s_abs[PATH_MAX + 16], c_abs[PATH_MAX];
    FL_TRY_GOTO(find_template(tmpl, tpath, sizeof tpath), st, done);
    size_t tlen;
    FL_TRY_GOTO(fl_cli_read_all(tpath, &tmpl_text, &tlen), st, done);
    ssize_t k = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (k <= 0) {
        st = FL_ERR(FL_ERR_SYSTEM, "readlink /proc/self/exe: %s", strerror(errno));
        goto done;
    }
    exe[k] = 0;
    FL_TRY_GOTO(absolute(model, m_abs, sizeof m_abs), st, done);
    FL_TRY_GOTO(absolute(input, i_abs, sizeof i_abs), st, done);
    FL_TRY_GOTO(absolute(output, o_abs, sizeof o_abs), st, done);
    if (config) FL_TRY_GOTO(absolute(config, c_abs, sizeof c_abs), st, done);
    if (summary)
        FL_TRY_GOTO(absolute(summary, s_abs, sizeof s_abs), st, done);
    else
        snprintf(s_abs, sizeof s_abs, "%s.summary.json", o_abs);

    /* the generate command line: resumable by construction, progress lines
     * every 60 s in the Slurm log */
    /* the job file goes to generate too, for the options slurm left alone */
    if (config) FL_TRY_GOTO(sb_flag(&gen, "config", c_abs), st, done);
    FL_TRY_GOTO(sb_flag(&gen, "model", m_abs), st, done);
    FL_TRY_GOTO(sb_flag(&gen, "input", i_abs), st, done);
    FL_TRY_GOTO(sb_flag(&gen, "output", o_abs), st, done);
    FL_TRY_GOTO(sb_str(&gen, " --resume"), st, done);
    FL_TRY_GOTO(sb_flag(&gen, "summary", s_abs), st, done);
    FL_TRY_GOTO(sb_flag(&gen, "progress-interval", "60"), st, done);
    FL_TRY_GOTO(sb_flag(&gen, "tp", tp), st, done);
    FL_TRY_GOTO(sb_flag(&gen, "ep", ep), st, done);
    FL_TRY_GOTO(sb_flag(&gen, "backend", backend), st, done);
    bool backend_given = backend != NULL;
    for (int i = own + 1; i < argc; i++) {
        FL_TRY_GOTO(sb_str(&gen, " "), st, done);
        FL_TRY_GOTO(sb_quote(&gen, argv[i]), st, done);
        if (!strcmp(argv[i], "--backend") || !strncmp(argv[i], "--backend=", 10)) backend_given = true;
    }
    if (n_gpus == 0 && !backend_given) FL_TRY_GOTO(sb_flag(&gen, "backend", "cpu"), st, done);
    char num[4][32];
    snprintf(num[0], sizeof num[0], "%ld", n_nodes);
    snprintf(num[1], sizeof num[1], "%ld", n_tasks);
    snprintf(num[2], sizeof num[2], "%ld", n_cpus);
    snprintf(num[3], sizeof num[3], "%ld", n_sig);
    if (n_gpus > 0) {
        char g[32];
        snprintf(g, sizeof g, "%ld", n_gpus);
        FL_TRY_GOTO(sb_str(&gpu_line, "#SBATCH --gpus-per-node="), st, done);
        FL_TRY_GOTO(sb_str(&gpu_line, g), st, done);
    } else {
        FL_TRY_GOTO(sb_str(&gpu_line, "# (no GPUs requested: CPU tasks)"), st, done);
    }
    if (partition) FL_TRY_GOTO(sb_str(&extra, "#SBATCH --partition="), st, done);
    if (partition) FL_TRY_GOTO(sb_str(&extra, partition), st, done);
    if (partition) FL_TRY_GOTO(sb_str(&extra, "\n"), st, done);
    if (time_l) FL_TRY_GOTO(sb_str(&extra, "#SBATCH --time="), st, done);
    if (time_l) FL_TRY_GOTO(sb_str(&extra, time_l), st, done);
    if (time_l) FL_TRY_GOTO(sb_str(&extra, "\n"), st, done);
    if (account) FL_TRY_GOTO(sb_str(&extra, "#SBATCH --account="), st, done);
    if (account) FL_TRY_GOTO(sb_str(&extra, account), st, done);
    if (account) FL_TRY_GOTO(sb_str(&extra, "\n"), st, done);
    FL_TRY_GOTO(sb_quote(&out_q, o_abs), st, done);
    FL_TRY_GOTO(sb_quote(&exe_q, exe), st, done);
    var vars[] = {
        {"JOB_NAME", job_name ? job_name : "flotilla"},
        {"NODES", num[0]},
        {"TASKS_PER_NODE", num[1]},
        {"GPU_LINE", gpu_line.s},
        {"CPUS_PER_TASK", num[2]},
        {"SIGNAL_SECONDS", num[3]},
        {"LOG", log ? log : "flotilla-%j.log"},
        {"EXTRA_SBATCH", extra.s ? extra.s : ""},
        {"OUTPUT_Q", out_q.s},
        {"FLOTILLA", exe_q.s},
        {"GENERATE_ARGS", gen.s + 1}, /* without the leading space */
    };
    st = expand(tpath, tmpl_text, vars, sizeof vars / sizeof vars[0], &script);
    if (st != FL_OK) goto done;
    if (!submit) {
        if (fwrite(script.s, 1, script.len, stdout) != script.len || fflush(stdout) != 0)
            st = FL_ERR(FL_ERR_IO, "cannot write the batch script: %s", strerror(errno));
        goto done;
    }
    sb = popen("sbatch", "w");
    if (!sb) {
        st = FL_ERR(FL_ERR_SYSTEM, "cannot run sbatch: %s", strerror(errno));
        goto done;
    }
    size_t wr = fwrite(script.s, 1, script.len, sb);
    int rc = pclose(sb);
    sb = NULL;
    if (wr != script.len || rc != 0)
        st = FL_ERR(FL_ERR_SYSTEM, "sbatch failed (exit status %d); run without --submit to see "
                    "the script", rc == -1 ? -1 : WEXITSTATUS(rc));
done:
    free(tmpl_text);
    free(gen.s);
    free(script.s);
    free(gpu_line.s);
    free(extra.s);
    free(out_q.s);
    free(exe_q.s);
    return st == FL_OK ? 0 : fl_cli_fail("slurm", st);
}
