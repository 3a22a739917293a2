/*
 * option_list.h — the registry's entries (see option.h). No include guard:
 * it is expanded once per use with FL_OPT_ENUM defined.
 *
 * FL_OPT_ENUM(ID, "ENV_VARIABLE", KIND, "default" or NULL, "one-line doc")
 * KIND is BOOL, INT or STR. Keep each layer's options in its section.
 */

/* --- launcher ------------------------------------------------------------ */
FL_OPT_ENUM(SLURM_TEMPLATE, "FL_SLURM_TEMPLATE", STR, NULL,
            "sbatch template file used by `flotilla slurm` instead of the built-in one")

/* --- parallel ------------------------------------------------------------ */

/* --- runtime ------------------------------------------------------------- */

/* --- kernels ------------------------------------------------------------- */
FL_OPT_ENUM(CUDA_TUNE, "FL_CUDA_TUNE", STR, NULL,
            "CUDA tuning overrides for end-to-end A/B runs, NAME=VALUE[,NAME=VALUE...] "
            "(kernels/cuda/cuda_tune.h; bench_kernels --tune-list names them)")

/* --- tests and diagnostics ---------------------------------------------- */
