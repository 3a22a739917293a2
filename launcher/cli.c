/*
 * cli.c — option parsing and model-bundle opening shared by the subcommands.
 */
#include "launcher/cli.h"

#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "core/option.h"
#include "kernels/pool.h"
#include "parallel/abort.h"
#include "parallel/bind.h"
#include "parallel/rank.h"
#include "runtime/model/forward_moe.h"
#include "core/status.h"

bool fl_cli_mpi_active(void) {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    return init && !fin;
}

int fl_cli_world_rank(void) {
    int r = 0;
    if (fl_cli_mpi_active()) MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
}

int fl_cli_world_size(void) {
    int n = 1;
    if (fl_cli_mpi_active()) MPI_Comm_size(MPI_COMM_WORLD, &n);
    return n;
}

/* Set when every rank fails the same way at the same point (a layout that
 * does not divide): rank 0 reports it and the ranks leave together, with no
 * MPI_Abort and no duplicated message. */
static bool g_same_error_everywhere;

int fl_cli_fail(const char *cmd, fl_status st) {
    char msg[1400];
    if (g_same_error_everywhere) {
        if (fl_cli_world_rank() == 0)
            fprintf(stderr, "flotilla %s: %s\n", cmd, fl_error_msg()[0] ? fl_error_msg() : fl_status_str(st));
        return 1;
    }
    snprintf(msg, sizeof msg, "flotilla %s: %s", cmd, fl_error_msg()[0] ? fl_error_msg() : fl_status_str(st));
    if (fl_cli_world_size() > 1) fl_par_abort(msg);
    fprintf(stderr, "%s\n", msg);
    return 1;
}

int fl_cli_finish(const char *cmd, fl_cli_bundle *b, fl_status st) {
    if (st != FL_OK && !g_same_error_everywhere && fl_cli_world_size() > 1) return fl_cli_fail(cmd, st);
    fl_cli_bundle_close(b);
    return st == FL_OK ? 0 : fl_cli_fail(cmd, st);
}

fl_status fl_cli_parse(const char *cmd, int argc, char **argv, const fl_cli_opt *opts) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--", 2) != 0)
            return FL_ERR(FL_ERR_INVALID_ARG, "unexpected argument '%s' (see flotilla %s --help)", a, cmd);
        const char *name = a + 2, *eq = strchr(name, '=');
        size_t nlen = eq ? (size_t)(eq - name) : strlen(name);
        const fl_cli_opt *o = NULL;
        for (const fl_cli_opt *p = opts; p->name; p++)
            if (strlen(p->name) == nlen && !strncmp(p->name, name, nlen)) o = p;
        if (!o)
            return FL_ERR(FL_ERR_INVALID_ARG, "unknown option '%.*s' (see flotilla %s --help)",
                          (int)(nlen + 2), a, cmd);
        if (o->has_arg) {
            if (eq) {
                *o->value = eq + 1;
            } else {
                if (i + 1 >= argc)
                    return FL_ERR(FL_ERR_INVALID_ARG, "option --%s needs a value", o->name);
                *o->value = argv[++i];
            }
        } else {
            if (eq) return FL_ERR(FL_ERR_INVALID_ARG, "option --%s takes no value", o->name);
            *o->value = "1";
        }
    }
    for (const fl_cli_opt *p = opts; p->name; p++)
        if (!strcmp(p->name, "config") && *p->value)
            return fl_cli_config_load_mode(*p->value, opts, !strcmp(cmd, "slurm"));
    return FL_OK;
}

void fl_cli_usage(FILE *f, const char *cmd, const char *synopsis, const fl_cli_opt *opts) {
    fprintf(f, "usage: flotilla %s %s\n\noptions:\n", cmd, synopsis);
    bool config = false, settings = false;
    for (const fl_cli_opt *p = opts; p->name; p++) {
        char left[64];
        snprintf(left, sizeof left, "--%s%s", p->name, p->has_arg ? " VALUE" : "");
        fprintf(f, "  %-28s %s\n", left, p->help);
        config |= !strcmp(p->name, "config");
        settings |= !strcmp(p->name, "cuda-graphs");
    }
    if (config)
        fprintf(f, "\nA --config YAML file takes the long options as keys, with dashes or underscores\n"
                   "(max_num_seqs: 32); a flag on the command line wins over its key.\n");
    if (settings)
        fprintf(f, "Settings that name an FL_ variable: the flag wins, then the --config key, then the\n"
                   "environment variable, then the default (`flotilla env` lists them all).\n");
}

fl_status fl_cli_quant(const char *s, fl_load_quant *out) {
    *out = FL_LOAD_AS_STORED;
    if (!s || !strcmp(s, "none")) return FL_OK;
    if (!strcmp(s, "w4"))
        *out = FL_LOAD_W4;
    else if (!strcmp(s, "fp8"))
        *out = FL_LOAD_FP8;
    else
        return FL_ERR(FL_ERR_INVALID_ARG, "--quantize must be none, w4 or fp8, got '%s'", s);
    return FL_OK;
}

const char *fl_cli_quant_name(fl_load_quant q, bool checkpoint) {
    return q == FL_LOAD_W4 ? "w4" : q == FL_LOAD_FP8 ? "fp8" : checkpoint ? "as stored" : "bf16";
}

fl_status fl_cli_int(const char *flag, const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return FL_ERR(FL_ERR_INVALID_ARG, "--%s must be an integer in [%ld, %ld], got '%s'", flag, lo,
                      hi, s);
    *out = v;
    return FL_OK;
}

fl_status fl_cli_float(const char *flag, const char *s, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v) || v < lo || v > hi)
        return FL_ERR(FL_ERR_INVALID_ARG, "--%s must be a number in [%g, %g], got '%s'", flag, lo,
                      hi, s);
    *out = v;
    return FL_OK;
}

void fl_cli_model_opts_add(fl_cli_model_opts *mo, fl_cli_opt *opts, int *n) {
    const fl_cli_opt add[] = {
        {"model", true, &mo->model, "Hugging Face model folder or .gguf file (required)"},
        {"backend", true, &mo->backend, "auto | cpu | cuda (default auto)"},
        {"quantize", true, &mo->quantize, "none | w4: round-to-nearest 4-bit weights at load | fp8: e4m3 weights "
                                          "(a scale a row) and activations (a scale a token)"},
        {"threads", true, &mo->threads, "CPU threads (default: OMP_NUM_THREADS, else the cores the rank may use)"},
        {"max-model-len", true, &mo->max_model_len, "max prompt+completion tokens"},
        {"verbose", false, &mo->verbose, "print settings and timings to stderr"},
        {"tp", true, &mo->tp, "tensor-parallel ranks (default: world / dp)"},
        {"ep", true, &mo->ep, "expert-parallel ranks for MoE layers (default 1)"},
        {"dp", true, &mo->dp, "data-parallel replicas, each a tp group with its own KV cache "
                               "(default world / tp)"},
        {"config", true, &mo->config, "YAML file of options (flags override it), e.g. configs/*.yaml"},
        {"bind", true, &mo->bind, "auto | none: pin each rank to the cores near its GPU, or spread "
                                   "ranks over the cores (default auto under mpirun)"},
    };
    for (size_t i = 0; i < sizeof add / sizeof add[0]; i++) opts[(*n)++] = add[i];
    fl_cli_engine_limits_add(mo, opts, n);
    fl_cli_settings_add(mo, opts, n);
}

void fl_cli_engine_limits_add(fl_cli_model_opts *mo, fl_cli_opt *opts, int *n) {
    const fl_cli_opt add[] = {
        {"kv-cache-mb", true, &mo->kv_cache_mb, "KV cache size in MiB (default: sized from memory)"},
        {"kv-cache-dtype", true, &mo->kv_cache_dtype, "auto | f32 | bf16 | int8 | fp8 (default auto: the backend's)"},
        {"gpu-memory-utilization", true, &mo->gpu_memory_utilization,
         "CUDA: share of device memory for weights, workspaces and the KV cache (default 0.90)"},
        {"memory-budget", true, &mo->memory_budget,
         "CPU: bytes (8G) or N% of available memory for the model and KV cache (default 50%, at most 8G)"},
        {"max-num-seqs", true, &mo->max_num_seqs, "sequences per step (default: what the cache holds, <= 256)"},
        {"max-batched-tokens", true, &mo->max_batched_tokens, "tokens per step (default 8192 CUDA, 512 CPU)"},
        {"block-size", true, &mo->block_size, "KV block size in tokens (default 16)"},
        {"no-prefix-caching", false, &mo->no_prefix_caching, "compute every prompt in full instead of "
                                                               "sharing the KV blocks of equal prefixes"},
    };
    for (size_t i = 0; i < sizeof add / sizeof add[0]; i++) opts[(*n)++] = add[i];
}

fl_status fl_cli_engine_limits(const fl_cli_model_opts *mo, fl_engine_config *ec) {
    long v = 0;
    if (mo->kv_cache_mb) {
        FL_TRY(fl_cli_int("kv-cache-mb", mo->kv_cache_mb, 1, 1L << 24, &v));
        ec->kv_cache_bytes = (size_t)v << 20;
    }
    if (mo->kv_cache_dtype) FL_TRY(fl_kv_dtype_parse(mo->kv_cache_dtype, &ec->kv_dtype));
    if (mo->gpu_memory_utilization)
        FL_TRY(fl_cli_float("gpu-memory-utilization", mo->gpu_memory_utilization, 0.01, 1.0,
                            &ec->gpu_memory_utilization));
    if (mo->memory_budget) FL_TRY(fl_mem_parse_size("memory-budget", mo->memory_budget, &ec->memory_budget));
    if (mo->max_num_seqs) {
        FL_TRY(fl_cli_int("max-num-seqs", mo->max_num_seqs, 1, 4096, &v));
        ec->max_num_seqs = (int)v;
    }
    if (mo->max_batched_tokens) {
        FL_TRY(fl_cli_int("max-batched-tokens", mo->max_batched_tokens, 1, 1 << 20, &v));
        ec->max_num_batched_tokens = (int)v;
    }
    if (mo->max_model_len) {
        FL_TRY(fl_cli_int("max-model-len", mo->max_model_len, 2, 1 << 24, &v));
        ec->max_model_len = (int)v;
    }
    if (mo->block_size) {
        FL_TRY(fl_cli_int("block-size", mo->block_size, 1, 1024, &v));
        ec->block_size = (int)v;
    }
    ec->prefix_caching = !mo->no_prefix_caching;
    return FL_OK;
}

/* The user-facing settings: a flag, its --config key (the flag's name with
 * underscores) and the registry option that gives its default and its
 * environment override. */
typedef struct setting {
    const char *flag;
    fl_opt_id id;
    const char *values; /* NULL: a bare flag (on when given) */
    const char *what;
    size_t field;       /* offset of its value in fl_cli_model_opts */
} setting;

#define MO(f) offsetof(fl_cli_model_opts, f)
static const setting settings[] = {
    {"cuda-graphs", FL_OPT_CUDA_GRAPHS, "on | off", "replay decode steps as CUDA graphs where the backend can",
     MO(cuda_graphs)},
    {"graph-ctx-buckets", FL_OPT_GRAPH_CTX_BUCKETS, "on | off",
     "a decode graph per context-length bucket (off: per batch bucket, sized for the longest context)",
     MO(graph_ctx_buckets)},
    {"step-timing", FL_OPT_STEP_TIMING, NULL, "time the phases of each decode step (adds syncs)", MO(step_timing)},
    {"moe-overlap", FL_OPT_MOE_OVERLAP, "off | on | serial | alternate",
     "dp > 1 MoE all-to-all: one exchange, two overlapped micro-batches, two in order, or off and on by "
     "turns to compare", MO(moe_overlap)},
    {"moe-micro-batches", FL_OPT_MOE_MICRO_BATCHES, "2..8", "micro-batches of the split MoE exchange",
     MO(moe_micro_batches)},
    {"greedy-on-device", FL_OPT_GREEDY_ON_DEVICE, "on | off",
     "greedy steps take the argmax where the logits are (only token ids travel)", MO(greedy_on_device)},
    {"sample-on-device", FL_OPT_SAMPLE_ON_DEVICE, "on | off",
     "sampled steps draw where the logits are when the backend samples (same tokens)", MO(sample_on_device)},
    {"p2p-allreduce", FL_OPT_P2P_AR, "on | off",
     "small tensor-parallel all-reduces through peer GPU memory (one node, up to 8 GPUs)", MO(p2p_allreduce)},
    {"p2p-allreduce-max-bytes", FL_OPT_P2P_AR_MAX_BYTES, "BYTES", "largest all-reduce the peer-memory path takes",
     MO(p2p_allreduce_max_bytes)},
    {"nccl-own-stream", FL_OPT_NCCL_OWN_STREAM, "on | off",
     "tensor-parallel NCCL on its own stream with host syncs, not the compute stream", MO(nccl_own_stream)},
    {"swap-space", FL_OPT_SWAP_SPACE, "GIB",
     "host memory per rank for the KV blocks of preempted sequences (0: recompute them)", MO(swap_space)},
    {"kv-offload-dir", FL_OPT_KV_OFFLOAD_DIR, "DIR",
     "write prefix-cached KV blocks to files there and read them back in later jobs", MO(kv_offload_dir)},
};
#undef MO
enum { N_SETTINGS = sizeof settings / sizeof settings[0] };

static const char **setting_value(const fl_cli_model_opts *mo, const setting *s) {
    return (const char **)((const char *)mo + s->field);
}

/* Setting i's table entry; its help line carries the registry's default
 * and variable. */
static fl_cli_opt setting_opt(fl_cli_model_opts *mo, int i) {
    static char help[N_SETTINGS][256];
    const setting *s = &settings[i];
    fl_opt_info o;
    fl_opt_info_get(s->id, &o);
    const char *d = o.kind == FL_OPT_KIND_BOOL ? (fl_opt_default_bool(s->id) ? "on" : "off") : o.dflt;
    snprintf(help[i], sizeof help[i], "%s%s%s (default %s; %s)", s->values ? s->values : "", s->values ? ": " : "",
             s->what, d ? d : "unset", o.env);
    return (fl_cli_opt){s->flag, s->values != NULL, setting_value(mo, s), help[i]};
}

void fl_cli_settings_add(fl_cli_model_opts *mo, fl_cli_opt *opts, int *n) {
    for (int i = 0; i < N_SETTINGS; i++) opts[(*n)++] = setting_opt(mo, i);
}

void fl_cli_kv_tiers_add(fl_cli_model_opts *mo, fl_cli_opt *opts, int *n) {
    for (int i = 0; i < N_SETTINGS; i++)
        if (settings[i].id == FL_OPT_SWAP_SPACE || settings[i].id == FL_OPT_KV_OFFLOAD_DIR)
            opts[(*n)++] = setting_opt(mo, i);
}

/* The range of each numeric setting (BOOL 0..1; CHOICE its indexes). */
static void setting_range(const setting *s, long *lo, long *hi) {
    *lo = 0, *hi = 1;
    if (s->id == FL_OPT_MOE_OVERLAP) *lo = FL_MOE_OVERLAP_OFF, *hi = FL_MOE_OVERLAP_ALTERNATE;
    if (s->id == FL_OPT_MOE_MICRO_BATCHES) *lo = 2, *hi = FL_MOE_MICRO_BATCHES_MAX;
    if (s->id == FL_OPT_P2P_AR_MAX_BYTES) *lo = 0, *hi = 1L << 40;
}

bool fl_cli_setting_value_ok(const char *flag, const char *value, const char **expected) {
    for (int i = 0; i < N_SETTINGS; i++) {
        const setting *s = &settings[i];
        if (strcmp(s->flag, flag) || !s->values) continue;
        *expected = s->values;
        double gib;
        if (s->id == FL_OPT_SWAP_SPACE) return fl_engine_parse_swap_space(value, &gib) == FL_OK;
        if (s->id == FL_OPT_KV_OFFLOAD_DIR) return *value != 0;
        long lo, hi, v;
        setting_range(s, &lo, &hi);
        *expected = s->values;
        return fl_opt_parse(s->id, value, &v) && v >= lo && v <= hi;
    }
    return true;
}

static const setting *find_setting(fl_opt_id id) {
    for (int i = 0; i < N_SETTINGS; i++)
        if (settings[i].id == id) return &settings[i];
    return NULL;
}

/* One setting's number (BOOL 0/1, INT, CHOICE index): the flag's or key's
 * text, else the environment's, else *out unchanged; in [lo, hi]. */
static fl_status setting_num(const fl_cli_model_opts *mo, fl_opt_id id, long *out) {
    const setting *s = find_setting(id);
    long lo, hi;
    setting_range(s, &lo, &hi);
    const char *v = *setting_value(mo, s);
    long num = 0;
    if (v) {
        if (!fl_opt_parse(id, v, &num) || num < lo || num > hi) {
            fl_opt_info o;
            fl_opt_info_get(id, &o);
            if (o.kind == FL_OPT_KIND_INT)
                return FL_ERR(FL_ERR_INVALID_ARG, "--%s must be an integer in [%ld, %ld], got '%s'", s->flag, lo, hi,
                              v);
            return FL_ERR(FL_ERR_INVALID_ARG, "--%s must be %s, got '%s'", s->flag, s->values ? s->values : "on | off",
                          v);
        }
    } else if (fl_opt_is_set(id)) {
        num = fl_opt_num(id);
        if (num < lo || num > hi)
            return FL_ERR(FL_ERR_INVALID_ARG, "%s=%s: must be %ld to %ld", fl_opt_env(id), fl_opt_str(id), lo, hi);
    } else {
        return FL_OK;
    }
    *out = num;
    return FL_OK;
}

static fl_status setting_bool(const fl_cli_model_opts *mo, fl_opt_id id, bool *out) {
    long v = *out;
    FL_TRY(setting_num(mo, id, &v));
    *out = v != 0;
    return FL_OK;
}

fl_status fl_cli_engine_settings(const fl_cli_model_opts *mo, fl_engine_config *ec) {
    fl_forward_config *fc = &ec->fwd;
    long v;
    FL_TRY(setting_bool(mo, FL_OPT_CUDA_GRAPHS, &fc->cuda_graphs));
    FL_TRY(setting_bool(mo, FL_OPT_GRAPH_CTX_BUCKETS, &fc->graph_ctx_buckets));
    FL_TRY(setting_bool(mo, FL_OPT_STEP_TIMING, &fc->step_timing));
    v = fc->moe_overlap;
    FL_TRY(setting_num(mo, FL_OPT_MOE_OVERLAP, &v));
    fc->moe_overlap = (int)v;
    v = fc->moe_micro_batches;
    FL_TRY(setting_num(mo, FL_OPT_MOE_MICRO_BATCHES, &v));
    fc->moe_micro_batches = (int)v;
    FL_TRY(setting_bool(mo, FL_OPT_GREEDY_ON_DEVICE, &ec->greedy_on_device));
    FL_TRY(setting_bool(mo, FL_OPT_SAMPLE_ON_DEVICE, &ec->sample_on_device));
    return fl_cli_kv_tiers(mo, &ec->swap_space_bytes, &ec->kv_offload_dir);
}

fl_status fl_cli_kv_tiers(const fl_cli_model_opts *mo, size_t *swap_space_bytes, const char **kv_offload_dir) {
    /* --swap-space: GiB as a decimal number (a text option of the registry) */
    const char *sw = mo->swap_space ? mo->swap_space : fl_opt_is_set(FL_OPT_SWAP_SPACE) ? fl_opt_str(FL_OPT_SWAP_SPACE) : NULL;
    if (sw) {
        double gib = 0;
        if (fl_engine_parse_swap_space(sw, &gib) != FL_OK)
            return FL_ERR(FL_ERR_INVALID_ARG, "%s must be a number of GiB from 0 to 1048576, got '%s'",
                          mo->swap_space ? "--swap-space" : fl_opt_env(FL_OPT_SWAP_SPACE), sw);
        *swap_space_bytes = (size_t)(gib * 1073741824.0);
    }
    /* --kv-offload-dir: a folder (a text option of the registry) */
    const char *kd = mo->kv_offload_dir ? mo->kv_offload_dir
                     : fl_opt_is_set(FL_OPT_KV_OFFLOAD_DIR) ? fl_opt_str(FL_OPT_KV_OFFLOAD_DIR) : NULL;
    if (kd && !*kd) return FL_ERR(FL_ERR_INVALID_ARG, "--kv-offload-dir needs a folder");
    if (kd) *kv_offload_dir = kd;
    return FL_OK;
}

fl_status fl_cli_comm_settings(const fl_cli_model_opts *mo, fl_comm_config *cc) {
    FL_TRY(setting_bool(mo, FL_OPT_NCCL_OWN_STREAM, &cc->own_stream));
    FL_TRY(setting_bool(mo, FL_OPT_P2P_AR, &cc->p2p_allreduce));
    return setting_num(mo, FL_OPT_P2P_AR_MAX_BYTES, &cc->p2p_allreduce_max_bytes);
}

fl_status fl_cli_read_all(const char *path, char **out, size_t *len) {
    bool is_stdin = !path || !strcmp(path, "-");
    FILE *f = is_stdin ? stdin : fopen(path, "rb");
    if (!f) return FL_ERR(FL_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    fl_status st = FL_OK;
    FL_CHECK_ALLOC(buf, st, done);
    for (;;) {
        if (n + 1 >= cap) {
            char *nb = realloc(buf, cap *= 2);
            FL_CHECK_ALLOC(nb, st, done);
            buf = nb;
        }
        size_t r = fread(buf + n, 1, cap - n - 1, f);
        n += r;
        if (r == 0) break;
    }
    if (ferror(f)) st = FL_ERR(FL_ERR_IO, "cannot read %s", is_stdin ? "standard input" : path);
done:
    if (!is_stdin) fclose(f);
    if (st != FL_OK) {
        free(buf);
        return st;
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return FL_OK;
}

/* Multi-rank jobs: checks the layout against the model, builds the process
 * groups and the collectives, and says which shard this rank holds. */
fl_status fl_cli_parallel_open(const fl_cli_model_opts *mo, const fl_model_config *cfg, fl_cli_bundle *b,
                               fl_shard *shard) {
    const int world = fl_cli_world_size();
    long v = 0;
    fl_par_layout lay = {.world = world, .tp = world, .dp = 0, .ep = 1};
    /* every rank sees the same flags and config, so the checks up to the
     * groups fail everywhere alike */
    g_same_error_everywhere = true;
    if (mo->tp) {
        FL_TRY(fl_cli_int("tp", mo->tp, 1, 1 << 16, &v));
        lay.tp = (int)v;
    }
    if (mo->ep) {
        FL_TRY(fl_cli_int("ep", mo->ep, 1, 1 << 16, &v));
        lay.ep = (int)v;
    }
    if (mo->dp) {
        FL_TRY(fl_cli_int("dp", mo->dp, 1, 1 << 16, &v));
        lay.dp = (int)v;
        /* --dp alone: each replica's tp group takes the rest of the world */
        if (!mo->tp) {
            if (world % lay.dp)
                return FL_ERR(FL_ERR_INVALID_ARG, "world size %d is not divisible by dp %d", world, lay.dp);
            lay.tp = world / lay.dp;
        }
    }
    if (world == 1 && lay.tp == 1 && lay.ep == 1 && lay.dp <= 1) {
        g_same_error_everywhere = false;
        return FL_OK;
    }
    if (!fl_cli_mpi_active())
        return FL_ERR(FL_ERR_INVALID_ARG, "--tp/--ep/--dp need a multi-rank launch "
                      "(mpirun -np N flotilla ... or srun)");
    const fl_model_config c = *cfg;
    fl_par_shape shape = {.n_heads = c.n_heads, .n_kv_heads = c.n_kv_heads,
                          .n_experts = c.n_experts, .intermediate = c.intermediate_size};
    FL_TRY(fl_par_layout_check(&lay, &shape));
    /* dp = 1: every rank sees every token, so each expert's columns are
     * split again over the world / ep copies (one all-reduce completes the
     * layer). dp > 1: replicas hold different tokens and exchange only the
     * routed ones (all-to-all within each ep group), so each ep group holds
     * whole experts. */
    const int ex_size = lay.dp > 1 ? 1 : world / lay.ep;
    fl_model_dims dims;
    fl_shard probe = {.tp_rank = 0, .tp_size = lay.tp, .ep_size = lay.ep, .ex_size = ex_size};
    FL_TRY(fl_model_dims_init(&c, &probe, &dims));
    g_same_error_everywhere = false;
    FL_TRY(fl_par_groups_init(MPI_COMM_WORLD, &lay, &shape, &b->groups));
    /* Pin the rank before its threads start (the thread pool starts on its
     * first loop), so they inherit the binding and are counted from it. */
    fl_par_bind_mode mode = FL_PAR_BIND_AUTO;
    if (mo->bind) FL_TRY(fl_par_bind_mode_parse(mo->bind, &mode));
    fl_par_rank_info ri;
    FL_TRY(fl_par_rank_discover(MPI_COMM_WORLD, NULL, &ri));
    b->gpu = ri.gpu > 0 ? ri.gpu : 0;
    if (mode != FL_PAR_BIND_NONE) {
        char busid[64], desc[256];
        bool gpu = (!mo->backend || strcmp(mo->backend, "cpu")) && ri.gpu >= 0 &&
                   fl_par_gpu_busid(ri.gpu, busid, sizeof busid) == FL_OK;
        fl_par_bind_req req = {.mode = mode, .local_rank = ri.local_rank, .local_size = ri.local_size,
                               .gpu_busid = gpu ? busid : NULL};
        FL_TRY(fl_par_bind_apply(&req, desc, sizeof desc));
        if (b->verbose) fprintf(stderr, "flotilla: rank %d: %s\n", ri.world_rank, desc);
    }
    const fl_par_coords *co = fl_par_groups_coords(b->groups);
    b->tp_comm = fl_par_groups_comm(b->groups, FL_PAR_GROUP_TP);
    shard->tp_rank = co->tp_rank;
    shard->tp_size = lay.tp;
    shard->ep_rank = co->ep_rank;
    shard->ep_size = lay.ep;
    shard->ex_rank = ex_size > 1 ? co->ep_group : 0;
    shard->ex_size = ex_size;
    if (b->verbose) {
        /* The host name tells a multi-node job's ranks apart in its log. */
        char host[MPI_MAX_PROCESSOR_NAME] = "?";
        int host_len = 0;
        if (MPI_Get_processor_name(host, &host_len) != MPI_SUCCESS) snprintf(host, sizeof host, "?");
        fprintf(stderr, "flotilla: rank %d of %d: tp %d/%d, dp %d/%d, ep %d/%d, host %s\n", co->rank,
                world, co->tp_rank, lay.tp, co->dp_rank, lay.dp, co->ep_rank, lay.ep, host);
    }
    return FL_OK;
}

/* Collectives over `group` in the backend's memory: MPI on host buffers for
 * the CPU backend, NCCL on this rank's GPU for CUDA, enqueued on the
 * compute stream so each block's reduction follows its matmul with no host
 * wait (b->comm_cfg.own_stream, --nccl-own-stream on: NCCL's own stream and
 * host syncs around each collective, for comparison). own_stream: NCCL
 * keeps its own stream whatever the setting (the MoE all-to-all orders it
 * against the compute stream with events, so one micro-batch's exchange
 * overlaps the other's experts). */
static fl_status open_comm(fl_cli_bundle *b, MPI_Comm group, bool own_stream, fl_comm **out) {
    if (!strcmp(b->be->name, "cpu")) return fl_comm_init_mpi(group, out);
    fl_comm_config cc = b->comm_cfg;
    cc.own_stream |= own_stream;
    FL_TRY(fl_comm_init_nccl(group, b->gpu, &cc, out));
    return fl_comm_use_stream(*out, fl_backend_native_stream(b->be));
}

fl_status fl_cli_engine_parallel(fl_cli_bundle *b, fl_engine_config *ec) {
    ec->comm = b->comm;
    const int dp = b->groups ? fl_par_groups_layout(b->groups)->dp : 1;
    if (dp == 1) return FL_OK;
    ec->dp = dp;
    ec->world = fl_par_groups_comm(b->groups, FL_PAR_GROUP_WORLD);
    /* the MoE all-to-all runs over the ep group, in the backend's memory like
     * tp, on a stream of its own (forward_moe.c overlaps it with experts) */
    if (b->model->cfg.n_experts) {
        FL_TRY(open_comm(b, fl_par_groups_comm(b->groups, FL_PAR_GROUP_EP), true, &b->ep_comm));
        ec->ep_comm = b->ep_comm;
    }
    return FL_OK;
}

fl_status fl_cli_backend_open(const fl_cli_model_opts *mo, fl_cli_bundle *b) {
    /* --verbose: the options the environment sets (flotilla env lists all) */
    if (b->verbose && fl_cli_world_rank() == 0)
        for (int i = 0; i < FL_OPT_COUNT; i++)
            if (fl_opt_is_set((fl_opt_id)i))
                fprintf(stderr, "flotilla: %s=%s (environment)\n", fl_opt_env((fl_opt_id)i),
                        fl_opt_str((fl_opt_id)i));
    fl_comm_config_default(&b->comm_cfg);
    FL_TRY(fl_cli_comm_settings(mo, &b->comm_cfg));
    FL_TRY(fl_backend_init_by_name(mo->backend ? mo->backend : "auto", b->gpu, &b->be));
    if (b->verbose && b->be->detail && fl_cli_world_rank() == 0)
        fprintf(stderr, "flotilla: backend %s: %s\n", b->be->name, b->be->detail);
    if (!b->groups) return FL_OK;
    return open_comm(b, b->tp_comm, false, &b->comm);
}

fl_status fl_cli_bundle_open(const fl_cli_model_opts *mo, int need, fl_cli_bundle *b) {
    fl_status st = FL_OK;
    /* Test hook: FL_TEST_FAIL_RANK=R makes world rank R fail while loading,
     * so tests can check that one failing rank ends the whole job cleanly. */
    const long fail_rank = fl_opt_int(FL_OPT_TEST_FAIL_RANK);
    memset(b, 0, sizeof *b);
    b->verbose = mo->verbose != NULL;
    if (!mo->model) return FL_ERR(FL_ERR_INVALID_ARG, "--model is required");
    long v = 0;
    if (mo->threads) {
        FL_TRY(fl_cli_int("threads", mo->threads, 1, 4096, &v));
        FL_TRY(fl_pool_set_threads((int)v));
    }
    fl_model_load_opts lo = {.quant = FL_LOAD_AS_STORED};
    FL_TRY(fl_cli_quant(mo->quantize, &lo.quant));
    fl_engine_config ec;
    fl_engine_config_default(&ec);
    FL_TRY(fl_cli_engine_settings(mo, &ec));
    FL_TRY(fl_cli_engine_limits(mo, &ec));
    ec.verbose = b->verbose;
    ec.model_id = mo->model;
    FL_TRY_GOTO(fl_ckpt_open(mo->model, &b->ck), st, fail);
    fl_model_config cfg;
    FL_TRY_GOTO(fl_ckpt_model_config(b->ck, &cfg), st, fail);
    FL_TRY_GOTO(fl_cli_parallel_open(mo, &cfg, b, &lo.shard), st, fail);
    if (fail_rank >= 0 && fail_rank == fl_cli_world_rank()) {
        st = FL_ERR(FL_ERR_INTERNAL, "injected failure on rank %d (FL_TEST_FAIL_RANK)", fl_cli_world_rank());
        goto fail;
    }
    /* only the scheduling rank tokenizes */
    if ((need & FL_CLI_NEED_TOKENIZER) && fl_cli_world_rank() == 0)
        FL_TRY_GOTO(fl_ckpt_tokenizer(b->ck, &b->tok), st, fail);
    /* what the files say, checked against itself before any weight is read */
    FL_TRY_GOTO(fl_ckpt_validate(b->ck, &cfg, b->tok), st, fail);
    if (!(need & (FL_CLI_NEED_WEIGHTS | FL_CLI_NEED_ENGINE))) return FL_OK;
    FL_TRY_GOTO(fl_cli_backend_open(mo, b), st, fail);
    double t0 = fl_engine_now();
    FL_TRY_GOTO(fl_model_load(b->ck, b->be, &lo, &b->model), st, fail);
    if (b->verbose)
        fprintf(stderr, "flotilla: rank %d: loaded %s (%s) on %s in %.2f s, %.1f MB of weights, "
                "%.1f MB read from the checkpoint\n", fl_cli_world_rank(), mo->model,
                fl_arch_name(b->model->cfg.arch), b->be->name, fl_engine_now() - t0,
                b->model->weight_bytes / 1e6, fl_ckpt_bytes_read(b->ck) / 1e6);
    if (need & FL_CLI_NEED_ENGINE) {
        int32_t eos = b->tok ? fl_tokenizer_eos(b->tok) : -1;
        ec.extra_eos = &eos;
        ec.n_extra_eos = 1;
        FL_TRY_GOTO(fl_cli_engine_parallel(b, &ec), st, fail);
        FL_TRY_GOTO(fl_engine_init(b->model, &ec, &b->eng), st, fail);
    }
    return FL_OK;
fail:
    fl_cli_bundle_close(b);
    return st;
}

void fl_cli_bundle_close(fl_cli_bundle *b) {
    if (!b) return;
    /* the communicators may use the backend's stream: free them first */
    fl_engine_free(b->eng);
    fl_comm_free(b->ep_comm);
    fl_comm_free(b->comm);
    fl_model_free(b->model);
    fl_backend_free(b->be);
    fl_tokenizer_free(b->tok);
    fl_ckpt_free(b->ck);
    fl_par_groups_free(b->groups);
    memset(b, 0, sizeof *b);
}
