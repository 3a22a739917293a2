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
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "launcher/cli.h"
#include "parallel/rank.h"

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *help;
} cmds[] = {
    {"generate", fl_cmd_generate, "offline batch generation: JSONL requests in, JSONL results out"},
    {"tokenize", fl_cmd_tokenize, "encode strings to token ids, or decode ids (--decode)"},
    {"logits", fl_cmd_logits, "run one prompt and write float32 logits for every position"},
    {"inspect", fl_cmd_inspect, "print a model's architecture, shapes, dtypes and sizes"},
    {"plan", fl_cmd_plan, "each rank's memory for a model and layout, from headers only, and the KV capacity"},
    {"bench", fl_cmd_bench, "decode/prefill speed of a synthetic model vs the bandwidth ceiling"},
    {"slurm", fl_cmd_slurm, "write (or --submit) a Slurm batch script running a resumable generate job"},
};

static void usage(FILE *f) {
    fprintf(f, "usage: flotilla <command> [options]   (flotilla <command> --help)\n\ncommands:\n");
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
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
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        if (strcmp(argv[1], cmds[i].name)) continue;
        fl_par_launch_env env;
        fl_par_launch launch;
        fl_par_launch_env_read(&env);
        if (fl_par_launch_from_env(&env, &launch) != FL_OK) {
            fprintf(stderr, "flotilla: %s\n", fl_error_msg());
            return 1;
        }
        if (!launch.use_mpi) return cmds[i].fn(argc - 1, argv + 1);
        int provided, rank = 0, size = 1;
        if (MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
            fprintf(stderr, "flotilla: MPI_Init_thread failed\n");
            return 1;
        }
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        MPI_Comm_size(MPI_COMM_WORLD, &size);
        int rc, mine_ok = fl_par_launch_check(&launch, rank, size) == FL_OK, all_ok = 0;
        /* decided together: a rank that stopped alone would leave the
         * others waiting in their first collective */
        if (MPI_Allreduce(&mine_ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD) != MPI_SUCCESS)
            all_ok = 0;
        if (!all_ok) {
            /* the first rank that disagrees says why */
            int first = mine_ok ? size : rank, lowest = 0;
            MPI_Allreduce(&first, &lowest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
            if (rank == lowest) fprintf(stderr, "flotilla: %s\n", fl_error_msg());
            rc = 1;
        } else {
            rc = cmds[i].fn(argc - 1, argv + 1);
        }
        MPI_Finalize();
        return rc;
    }
    fprintf(stderr, "flotilla: unknown command '%s' (expected generate, tokenize, logits, inspect, plan, bench or slurm)\n",
            argv[1]);
    return 2;
}
