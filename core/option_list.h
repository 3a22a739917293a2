/*
 * option_list.h — the registry's entries (see option.h). No include guard:
 * it is expanded once per use with FL_OPT_ENUM and FL_OPT_CHOICE defined.
 *
 * FL_OPT_ENUM(ID, "ENV_VARIABLE", KIND, "default" or NULL, "one-line doc")
 * KIND is BOOL, INT or STR.
 * FL_OPT_CHOICE(ID, "ENV_VARIABLE", "name0|name1|...", "default", "doc"):
 * one of the names, or its index (fl_opt_int gives the index).
 * Keep each layer's options in its section. Entries marked "user-facing"
 * are also engine/parallel config fields set by a flag and a --config key
 * (the flag wins, then the key, then the variable, then the default).
 */

/* --- launcher ------------------------------------------------------------ */
FL_OPT_ENUM(SLURM_TEMPLATE, "FL_SLURM_TEMPLATE", STR, NULL,
            "sbatch template file used by `flotilla slurm` instead of the built-in one")
FL_OPT_ENUM(BENCH_PROFILE_LAST, "FL_BENCH_PROFILE_LAST", BOOL, "0",
            "flotilla bench: mark the last decode step as the profiler's range (ncu --profile-from-start off)")

/* --- parallel ------------------------------------------------------------ */
FL_OPT_ENUM(NCCL_OWN_STREAM, "FL_NCCL_OWN_STREAM", BOOL, "0",
            "user-facing (--nccl-own-stream): tensor-parallel NCCL on its own stream with host syncs, "
            "not on the compute stream")
FL_OPT_ENUM(P2P_AR, "FL_P2P_AR", BOOL, "0",
            "user-facing (--p2p-allreduce): one-shot all-reduce through peer GPU memory for small "
            "messages (one node, up to 8 ranks)")
FL_OPT_ENUM(P2P_AR_MAX_BYTES, "FL_P2P_AR_MAX_BYTES", INT, "65536",
            "user-facing (--p2p-allreduce-max-bytes): largest all-reduce the peer-memory path takes; "
            "the group's smallest value holds")

/* --- runtime ------------------------------------------------------------- */
FL_OPT_ENUM(CUDA_GRAPHS, "FL_CUDA_GRAPHS", BOOL, "1",
            "user-facing (--cuda-graphs): replay decode steps as CUDA graphs where the backend can")
FL_OPT_ENUM(GRAPH_CTX_BUCKETS, "FL_GRAPH_CTX_BUCKETS", BOOL, "1",
            "user-facing (--graph-ctx-buckets): one decode graph per context-length bucket (0: one per "
            "batch bucket, sized for the longest context)")
FL_OPT_ENUM(SWAP_SPACE, "FL_SWAP_SPACE", STR, "4",
            "user-facing (--swap-space): GiB of host memory per rank for the KV blocks of sequences "
            "preempted by swap (0: recompute them instead)")
FL_OPT_ENUM(KV_OFFLOAD_DIR, "FL_KV_OFFLOAD_DIR", STR, NULL,
            "user-facing (--kv-offload-dir): folder where prefix-cached KV blocks are written and read "
            "back by later jobs (needs prefix caching)")
FL_OPT_ENUM(STEP_TIMING, "FL_STEP_TIMING", BOOL, "0",
            "user-facing (--step-timing): time the phases of each decode step (adds a sync per phase)")
FL_OPT_CHOICE(MOE_OVERLAP, "FL_MOE_OVERLAP", "off|on|serial|alternate", "off",
              "user-facing (--moe-overlap): dp > 1 MoE all-to-all in one exchange (off), two "
              "overlapped micro-batches (on), two in order (serial), or off and on by turns")
FL_OPT_ENUM(MOE_MICRO_BATCHES, "FL_MOE_MICRO_BATCHES", INT, "2",
            "user-facing (--moe-micro-batches): micro-batches of the overlapped MoE exchange, 2 to 8")
FL_OPT_ENUM(GREEDY_ON_DEVICE, "FL_GREEDY_ON_DEVICE", BOOL, "1",
            "user-facing (--greedy-on-device): greedy steps take the argmax where the logits are and "
            "bring back token ids only")
FL_OPT_ENUM(SAMPLE_ON_DEVICE, "FL_SAMPLE_ON_DEVICE", BOOL, "1",
            "user-facing (--sample-on-device): sampled steps draw where the logits are when the "
            "backend samples (same tokens as the host sampler)")
FL_OPT_ENUM(MOE_DEVICE, "FL_MOE_DEVICE", BOOL, "1",
            "route MoE tokens on the device when the backend can (0: the host-routed path, for A/B)")
FL_OPT_ENUM(MOE_DEVICE_MAX_N, "FL_MOE_DEVICE_MAX_N", INT, "64",
            "largest step (rows) the device-routed MoE path takes, 0 to 4096; larger steps route on the host")
FL_OPT_CHOICE(FUSE, "FL_FUSE", "off|auto|qkv|all", "auto",
              "stack linear weights at load: none, q|k|v always and gate|up where measured faster "
              "(auto), q|k|v only, or all")
FL_OPT_ENUM(QKNORM_FUSE, "FL_QKNORM_FUSE", BOOL, "1",
            "q/k norms, RoPE and the cache store as one backend op where it has it (0: separate ops)")
FL_OPT_ENUM(DECODE_LAYER, "FL_DECODE_LAYER", BOOL, "1",
            "decode steps run each layer as the backend's one decode_layer op where it has it "
            "(0: the plain op sequence, the op's reference and A/B)")
FL_OPT_ENUM(MLA_PREP_FUSE, "FL_MLA_PREP_FUSE", BOOL, "1",
            "MLA input ropes, latent norm and cache store as one backend op where it has it (0: separate ops)")

/* --- kernels ------------------------------------------------------------- */
FL_OPT_ENUM(CUDA_TUNE, "FL_CUDA_TUNE", STR, NULL,
            "CUDA tuning overrides for end-to-end A/B runs, NAME=VALUE[,NAME=VALUE...] "
            "(kernels/cuda/cuda_tune.h; bench_kernels --tune-list names them)")

FL_OPT_CHOICE(CPU_KERNELS, "FL_CPU_KERNELS", "auto|c|avx2|avx512", "auto",
              "CPU backend matmul and attention kernels, chosen when it starts: the best this CPU "
              "runs (auto), the plain C reference (f32 activations), AVX2+FMA (activations "
              "rounded to int16 blocks of 32 for W4 and Q8_0 weights), or AVX-512 with VNNI (the same "
              "math, two blocks a vector)")

/* --- tests and diagnostics ---------------------------------------------- */
FL_OPT_ENUM(DIAG_SKIP, "FL_DIAG_SKIP", STR, NULL,
            "comma-separated forward ops to leave out of every step (timing only: outputs are wrong)")
FL_OPT_ENUM(TEST_FAIL_RANK, "FL_TEST_FAIL_RANK", INT, "-1",
            "world rank that fails while loading the model (tests of the job-wide abort); -1: none")
FL_OPT_ENUM(TEST_QUANTIZE_CLIP_TOKENS, "FL_TEST_QUANTIZE_CLIP_TOKENS", INT, "512",
            "tokens flotilla quantize's clipping search samples at most (every step-th of the calibration "
            "tokens); tests lower it to sample a small calibration set")
FL_OPT_ENUM(TEST_QUANTIZE_KILL, "FL_TEST_QUANTIZE_KILL", INT, "0",
            "flotilla quantize kills itself (SIGKILL) once layer N's tensors are written, before the layer is "
            "recorded as finished (tests of resuming); 0: never")
