/*
 * main.c — the flotilla command: dispatches to a subcommand.
 *
 * Started by mpirun, a PMIx/PMI launcher or srun with more than one task
 * (see fl_par_launch_from_env), every subcommand runs between MPI_Init and
 * MPI_Finalize; a plain run stays a single process without MPI (no
 * singleton start-up cost or warnings). Under srun, MPI's world must be
 * srun's tasks: `srun --mpi=none` with Debian's Open MPI fails in MPI_Init
 * itself, and any other disagreement is caught here, before N copies of the
 * job each write the whole output.
 *
 * The option registry (core/option.h) reads the FL_ variables first: a
 * malformed one stops every subcommand but `env` (which lists it) before
 * any work, with a line naming it and exit status 2.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/option.h"
#include "launcher/cli.h"
#include "parallel/rank.h"

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *help;
} cmds[] = {
    {"generate", fl_cmd_generate, "offline batch generation: JSONL requests in, JSONL results out"},
    {"serve", fl_cmd_serve, "OpenAI-compatible HTTP server (completions, chat, streaming, metrics)"},
    {"tokenize", fl_cmd_tokenize, "encode strings to token ids, or decode ids (--decode)"},
    {"logits", fl_cmd_logits, "run one prompt and write float32 logits for every position"},
    {"perplexity", fl_cmd_perplexity, "perplexity of a model on a text file (windows of --ctx tokens)"},
    {"quantize", fl_cmd_quantize, "AWQ: write an AutoAWQ int4 checkpoint from a float HF folder and calibration text"},
    {"inspect", fl_cmd_inspect, "print a model's architecture, shapes, dtypes and sizes"},
    {"plan", fl_cmd_plan, "each rank's memory for a model and layout, from headers only, and the KV capacity"},
    {"bench", fl_cmd_bench, "decode/prefill speed of a synthetic model vs the bandwidth ceiling"},
    {"slurm", fl_cmd_slurm, "write (or --submit) a Slurm batch script running a resumable generate job"},
    {"env", fl_cmd_env, "list the FL_ options (doc, default, value in force) and the launcher variables read"},
};
enum { N_CMDS = sizeof cmds / sizeof cmds[0] };

/* Exit status of a malformed FL_ variable (a usage error, like a bad command). */
enum { EXIT_BAD_OPTION = 2 };

static void usage(FILE *f) {
    fprintf(f, "usage: flotilla <command> [options]   (flotilla <command> --help)\n\ncommands:\n");
    for (size_t i = 0; i < N_CMDS; i++)
        fprintf(f, "  %-10s %s\n", cmds[i].name, cmds[i].help);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    for (size_t i = 0; i < N_CMDS; i++) {
        if (strcmp(argv[1], cmds[i].name)) continue;
        /* `flotilla env` reports malformed variables itself, after listing them */
        const bool opts_ok = cmds[i].fn == fl_cmd_env || fl_opt_init() == FL_OK;
        char opt_msg[600];
        snprintf(opt_msg, sizeof opt_msg, "%s", opts_ok ? "" : fl_error_msg());
        fl_par_launch_env env;
        fl_par_launch launch;
        fl_par_launch_env_read(&env);
        if (fl_par_launch_from_env(&env, &launch) != FL_OK) {
            fprintf(stderr, "flotilla: %s\n", fl_error_msg());
            return 1;
        }
        if (!launch.use_mpi) {
            if (!opts_ok) {
                fprintf(stderr, "flotilla: %s\n", opt_msg);
                return EXIT_BAD_OPTION;
            }
            return cmds[i].fn(argc - 1, argv + 1);
        }
        int provided, rank = 0, size = 1;
        if (MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
            fprintf(stderr, "flotilla: MPI_Init_thread failed\n");
            return 1;
        }
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        MPI_Comm_size(MPI_COMM_WORLD, &size);
        const bool launch_ok = fl_par_launch_check(&launch, rank, size) == FL_OK;
        int rc, mine_ok = launch_ok && opts_ok, all_ok = 0;
        /* decided together: a rank that stopped alone would leave the
         * others waiting in their first collective */
        if (MPI_Allreduce(&mine_ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD) != MPI_SUCCESS)
            all_ok = 0;
        if (!all_ok) {
            /* the first rank that disagrees says why; a malformed variable
             * anywhere makes it a usage error */
            int first = mine_ok ? size : rank, lowest = 0, mine_bad_opt = !opts_ok, any_bad_opt = 0;
            MPI_Allreduce(&first, &lowest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
            MPI_Allreduce(&mine_bad_opt, &any_bad_opt, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
            if (rank == lowest) fprintf(stderr, "flotilla: %s\n", opts_ok ? fl_error_msg() : opt_msg);
            rc = any_bad_opt ? EXIT_BAD_OPTION : 1;
        } else {
            rc = cmds[i].fn(argc - 1, argv + 1);
        }
        MPI_Finalize();
        return rc;
    }
    char names[256] = "";
    for (size_t i = 0; i < N_CMDS; i++) {
        size_t len = strlen(names);
        snprintf(names + len, sizeof names - len, "%s%s", i ? (i + 1 < N_CMDS ? ", " : " or ") : "", cmds[i].name);
    }
    fprintf(stderr, "flotilla: unknown command '%s' (expected %s)\n", argv[1], names);
    return 2;
}
