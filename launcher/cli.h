/*
 * cli.h — what the flotilla subcommands share: option parsing with one
 * clear error line for bad flags, the model options every model-running
 * subcommand takes, and opening a model bundle (checkpoint, backend,
 * weights, tokenizer, engine).
 */
#ifndef FL_CLI_H
#define FL_CLI_H

#include <stdbool.h>
#include <stdio.h>

#include "kernels/backend.h"
#include "parallel/comm.h"
#include "parallel/groups.h"
#include "runtime/load/checkpoint.h"
#include "runtime/engine/engine.h"
#include "runtime/model/model.h"
#include "runtime/tok/tokenizer.h"

/* One option of a subcommand: --name VALUE (has_arg) or --name. */
typedef struct fl_cli_opt {
    const char *name;
    bool has_arg;
    const char **value;   /* receives the argument (or "1" for a flag) */
    const char *help;
} fl_cli_opt;

/* Parses argv[1..] (argv[0] is the subcommand) against opts (terminated by
 * a zero entry). Unknown flags, missing arguments and stray positional
 * arguments give FL_ERR_INVALID_ARG with one line naming the flag. */
fl_status fl_cli_parse(const char *cmd, int argc, char **argv, const fl_cli_opt *opts);
void fl_cli_usage(FILE *f, const char *cmd, const char *synopsis, const fl_cli_opt *opts);

/* Fills the options not given on the command line from a flat YAML file
 * (launcher/config_file.c); fl_cli_parse calls it for --config. */
fl_status fl_cli_config_load(const char *path, const fl_cli_opt *opts);
/* slurm = true (flotilla slurm): loads the keys of the file's `slurm:`
 * section (each must be an option of opts) and the top-level keys that are
 * options of opts, skipping the other top-level keys (the job's generate
 * options). slurm = false: every top-level key must be an option; the
 * `slurm:` section is skipped. */
fl_status fl_cli_config_load_mode(const char *path, const fl_cli_opt *opts, bool slurm);
/* Frees every value the config files loaded so far stored (options still
 * pointing at them dangle): runs at exit; a caller that loads many files
 * (the fuzz target) calls it after each. */
void fl_cli_config_values_free(void);

/* Numeric option values, checked: names the flag on error. */
fl_status fl_cli_int(const char *flag, const char *s, long lo, long hi, long *out);
fl_status fl_cli_float(const char *flag, const char *s, double lo, double hi, double *out);
/* --quantize: none (or NULL) | w4 | fp8. */
fl_status fl_cli_quant(const char *s, fl_load_quant *out);
/* What a run's weights are, for reports: w4, fp8, or unquantized ("as
 * stored" for a checkpoint, "bf16" for a preset). */
const char *fl_cli_quant_name(fl_load_quant q, bool checkpoint);

/* Room for a subcommand's option table (its own, the model options, the
 * settings and the terminating zero entry). */
enum { FL_CLI_MAX_OPTS = 64 };

/* The model options shared by generate, logits, inspect, bench. */
typedef struct fl_cli_model_opts {
    const char *model, *backend, *quantize, *threads, *kv_cache_mb, *max_num_seqs,
        *max_batched_tokens, *max_model_len, *block_size, *verbose, *tp, *ep, *dp, *bind, *config,
        *kv_cache_dtype, *gpu_memory_utilization, *memory_budget;
    /* The user-facing engine and communicator settings (fl_cli_settings_add):
     * registry options (core/option_list.h) that are also flags and keys. */
    const char *cuda_graphs, *graph_ctx_buckets, *step_timing, *moe_overlap, *moe_micro_batches,
        *greedy_on_device, *sample_on_device, *p2p_allreduce, *p2p_allreduce_max_bytes, *nccl_own_stream;
    const char *no_prefix_caching, *swap_space, *kv_offload_dir;
} fl_cli_model_opts;

/* Appends the model options' table entries to opts at *n, the settings'
 * included. */
void fl_cli_model_opts_add(fl_cli_model_opts *mo, fl_cli_opt *opts, int *n);
/* Appends the KV cache and batch limits' entries (--kv-cache-mb,
 * --kv-cache-dtype, --gpu-memory-utilization, --memory-budget,
 * --max-num-seqs, --max-batched-tokens, --block-size, --no-prefix-caching);
 * fl_cli_model_opts_add includes them. */
void fl_cli_engine_limits_add(fl_cli_model_opts *mo, fl_cli_opt *opts, int *n);
/* Those limits (and --max-model-len) into ec, each checked and named on
 * error; limits not given keep ec's values (0: sized from memory). */
fl_status fl_cli_engine_limits(const fl_cli_model_opts *mo, fl_engine_config *ec);
/* Appends only the settings' entries (--cuda-graphs, --moe-overlap, ...). */
void fl_cli_settings_add(fl_cli_model_opts *mo, fl_cli_opt *opts, int *n);
/* Appends the KV tiers' entries only (--swap-space, --kv-offload-dir), as
 * generate declares them (`flotilla plan`). */
void fl_cli_kv_tiers_add(fl_cli_model_opts *mo, fl_cli_opt *opts, int *n);
/* Those two by precedence (flag or --config key, else FL_SWAP_SPACE /
 * FL_KV_OFFLOAD_DIR, else the values already there); fl_cli_engine_settings
 * calls it. A bad value names the flag or the variable. */
fl_status fl_cli_kv_tiers(const fl_cli_model_opts *mo, size_t *swap_space_bytes, const char **kv_offload_dir);

/* The settings in force, by precedence: the flag, else its --config key
 * (fl_cli_parse already merged the two, the flag winning), else the FL_
 * environment variable, else the default already in the struct (from
 * fl_engine_config_default / fl_comm_config_default). A bad value is an
 * FL_ERR_INVALID_ARG naming the flag or the variable. */
fl_status fl_cli_engine_settings(const fl_cli_model_opts *mo, fl_engine_config *ec);
fl_status fl_cli_comm_settings(const fl_cli_model_opts *mo, fl_comm_config *cc);
/* For --config: whether value is one a setting named flag takes (true for
 * options that are not settings); else *expected says what it takes. */
bool fl_cli_setting_value_ok(const char *flag, const char *value, const char **expected);

typedef struct fl_cli_bundle {
    fl_ckpt *ck;
    fl_backend *be;
    fl_model *model;
    fl_tokenizer *tok;    /* when asked for */
    fl_engine *eng;       /* when asked for */
    bool verbose;
    fl_par_groups *groups; /* multi-rank runs only */
    fl_comm *comm;         /* the group the model is sharded over (NULL: one rank) */
    MPI_Comm tp_comm;      /* its MPI communicator (multi-rank runs) */
    fl_comm *ep_comm;      /* dp > 1 with MoE layers: the expert-parallel group's (all-to-all) */
    int gpu;               /* this rank's CUDA device (rank discovery), 0 when alone */
    fl_comm_config comm_cfg; /* the NCCL communicators' settings (fl_cli_backend_open) */
} fl_cli_bundle;

/* MPI: started by main when the process was launched by mpirun/srun. */
bool fl_cli_mpi_active(void);
int fl_cli_world_rank(void);
int fl_cli_world_size(void);

enum { FL_CLI_NEED_TOKENIZER = 1, FL_CLI_NEED_ENGINE = 2, FL_CLI_NEED_WEIGHTS = 4 };

fl_status fl_cli_bundle_open(const fl_cli_model_opts *mo, int need, fl_cli_bundle *b);
/* The two halves of opening a bundle without a checkpoint (flotilla bench):
 * checks mo's --tp/--ep/--dp against cfg, builds the process groups, binds
 * the rank and fills this rank's shard (all of the model on one rank); then
 * the backend on this rank's GPU and, in multi-rank runs, the collectives
 * (MPI for the CPU backend, NCCL for CUDA) into b->be / b->comm. */
fl_status fl_cli_parallel_open(const fl_cli_model_opts *mo, const fl_model_config *cfg, fl_cli_bundle *b,
                               fl_shard *shard);
fl_status fl_cli_backend_open(const fl_cli_model_opts *mo, fl_cli_bundle *b);
/* After the model is in b: the engine's communicators (tp; with dp > 1 the
 * world for plans and logits and, for MoE, the ep group's all-to-all). */
fl_status fl_cli_engine_parallel(fl_cli_bundle *b, fl_engine_config *ec);
void fl_cli_bundle_close(fl_cli_bundle *b);

/* Reads a whole file (or stdin when path is NULL or "-"); malloc'd, NUL-terminated. */
fl_status fl_cli_read_all(const char *path, char **out, size_t *len);

/* The subcommands: each returns the process exit code. */
int fl_cmd_generate(int argc, char **argv);
int fl_cmd_tokenize(int argc, char **argv);
int fl_cmd_logits(int argc, char **argv);
int fl_cmd_perplexity(int argc, char **argv);
int fl_cmd_inspect(int argc, char **argv);
int fl_cmd_bench(int argc, char **argv);
int fl_cmd_slurm(int argc, char **argv);
int fl_cmd_env(int argc, char **argv);
int fl_cmd_plan(int argc, char **argv);
int fl_cmd_serve(int argc, char **argv);
int fl_cmd_quantize(int argc, char **argv);

/* Prints "flotilla <cmd>: <message>" for the last error and returns 1; in
 * a multi-rank job it ends the whole job instead (fl_par_abort), so no rank
 * is left waiting in a collective. */
int fl_cli_fail(const char *cmd, fl_status st);
/* The end of a subcommand that opened a bundle: on success closes it and
 * returns 0; on failure in a multi-rank job ends the job through
 * fl_cli_fail FIRST (closing an NCCL communicator whose peers still wait in
 * a collective would hang), else closes and reports. */
int fl_cli_finish(const char *cmd, fl_cli_bundle *b, fl_status st);

#endif /* FL_CLI_H */
