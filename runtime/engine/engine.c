/*
 * engine.c — the engine step loop (see engine.h).
 *
 * Data parallelism (dp > 1): world rank 0 keeps one scheduler per replica,
 * each with its replica's KV block budget (every replica has the same cache),
 * and assigns each request to a replica (fl_engine_pick_replica: the least
 * loaded, unless one shares its prompt's prefix). A step schedules
 * every replica, sends all replicas' plans to all ranks in one MPI_Bcast
 * (header: the word count of each plan), every rank runs its replica's plan
 * (an empty one when the replica has no work: the forward then only joins
 * the MoE all-to-all exchanges, or does nothing for dense models), and the
 * logits of each replica's tp rank 0 reach rank 0 with one MPI_Gatherv over
 * the world, laid out replica after replica, where rank 0 samples them.
 */
#include "runtime/engine/engine.h"

#include "core/option.h"
#include "runtime/engine/kv_disk.h"
#include "runtime/engine/kv_swap.h"
#include "parallel/check.h"
#include "runtime/model/forward_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>

struct fl_engine {
    fl_model *m;
    fl_engine_config cfg;
    fl_kv_cache kv;
    fl_kv_swap swap;     /* the host pool of swapped-out blocks (n_blocks 0: none) */
    fl_kv_disk disk;     /* the disk tier (--kv-offload-dir) when has_disk */
    bool has_disk;
    fl_forward *fwd;
    int dp;              /* replicas (1: no data parallelism) */
    int world_rank, tp, tp_rank, dp_rank;
    fl_scheduler *sched; /* [dp] one per replica (only rank 0's are used) */
    fl_route_set *routed; /* [dp] rank 0, dp > 1 with prefix caching: prompts placed, not finished */
    fl_step_plan *plans; /* [dp] this step's plans; plans[0] is also the plan followers run */
    int32_t *wire;       /* dp > 1: every replica's plan, concatenated for the broadcast */
    size_t wire_cap;     /* words */
    int32_t *dp_hdr;     /* [2 + dp] broadcast header: magic, command, words of each plan */
    int *gv_counts, *gv_displs; /* [world] MPI_Gatherv of the logits (rank 0) */
    float *logits;       /* [max_logits, vocab] host; rank 0 with dp > 1: [dp * max_logits, vocab] */
    int32_t *picks;      /* greedy steps: the tokens of the logit rows, laid out like logits */
    int max_logits;      /* rows projected per forward */
    void *sample_ws;
    float *host_row;     /* [vocab] a logits row with the OpenAI options applied */
    uint8_t *seen;       /* [vocab] zero; scratch of fl_sampler_penalize_counts */
    fl_sample_row *smp_rows; /* sampled-on-device steps: each logit row's sampling, [max_logits]
                                per replica (rank 0: all replicas', replica after replica) */
    int32_t *smp_hist;       /* the penalised rows' histories, concatenated, replica after replica */
    size_t smp_hist_cap;
    size_t *smp_hist_lo;     /* [dp + 1] rank 0: where each replica's histories start in smp_hist */
    fl_gen **updated;    /* [dp * (max_num_seqs + 1)] */
    int32_t eos[FL_MAX_EOS + 8];
    int n_eos;
    fl_engine_stats stats;
    size_t mem_budget;   /* the budget the cache was sized from (0: --kv-cache-mb or n_blocks given) */
};

const char *fl_finish_reason_str(fl_finish_reason r) {
    switch (r) {
    case FL_FINISH_STOP: return "stop";
    case FL_FINISH_LENGTH: return "length";
    case FL_FINISH_ERROR: return "error";
    default: return "none";
    }
}

double fl_engine_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

fl_status fl_gen_init(fl_gen *g, int64_t id, const int32_t *prompt, int n_prompt,
                      const fl_sampling_params *sp, int max_new_tokens) {
    memset(g, 0, sizeof *g);
    FL_TRY(fl_seq_init(&g->seq, id, prompt, n_prompt));
    if (sp)
        g->sp = *sp;
    else
        fl_sampling_params_default(&g->sp);
    fl_rng_seed(&g->rng, g->sp.seed);
    g->max_new_tokens = max_new_tokens;
    return FL_OK;
}

void fl_gen_free(fl_gen *g) {
    if (!g) return;
    fl_seq_free(&g->seq);
    free(g->lp);
    g->lp = NULL;
    g->lp_cap = 0;
}

void fl_engine_config_default(fl_engine_config *c) {
    memset(c, 0, sizeof *c);
    c->block_size = 16;
    c->gpu_memory_utilization = FL_MEM_GPU_UTILIZATION;
    c->dp = 1;
    c->world = MPI_COMM_NULL;
    c->greedy_on_device = fl_opt_default_bool(FL_OPT_GREEDY_ON_DEVICE);
    c->sample_on_device = fl_opt_default_bool(FL_OPT_SAMPLE_ON_DEVICE);
    fl_forward_config_default(&c->fwd);
    c->prefix_caching = true;
    double gib = 0;
    (void)fl_engine_parse_swap_space(fl_opt_default(FL_OPT_SWAP_SPACE), &gib);
    c->swap_space_bytes = (size_t)(gib * 1073741824.0);
}

fl_status fl_engine_parse_swap_space(const char *text, double *gib) {
    char *end = NULL;
    double v = text ? strtod(text, &end) : -1;
    if (!text || end == text || *end || !(v >= 0) || v > 1 << 20)
        return FL_ERR(FL_ERR_INVALID_ARG, "swap space must be a number of GiB from 0 to 1048576, got '%s'",
                      text ? text : "(none)");
    *gib = v;
    return FL_OK;
}

/* The prefix cache's fingerprint: everything besides the tokens that
 * changes a block's bytes (docs/engine.md, "Prefix caching"). */
static uint64_t cache_fingerprint(const fl_model *m, const fl_engine_config *cfg, int dp) {
    char text[1024];
    const fl_model_config *mc = &m->cfg;
    snprintf(text, sizeof text,
             "flotilla-kv/3 model=%s arch=%s layers=%d kv_heads=%d head_dim=%d act_dtype=%s kv_dtype=%s "
             "weight_bytes=%zu tp=%d ep=%d dp=%d block_size=%d",
             cfg->model_id ? cfg->model_id : "", fl_arch_name(mc->arch), mc->n_layers, mc->n_kv_heads,
             mc->head_dim, fl_dtype_name(m->be->act_dtype), fl_kv_dtype_name(cfg->kv_dtype), m->weight_bytes,
             m->shard.tp_size > 0 ? m->shard.tp_size : 1, m->shard.ep_size > 0 ? m->shard.ep_size : 1, dp,
             cfg->block_size);
    return fl_kv_fingerprint(text);
}

/* The longest context the model was made for: max_position_embeddings,
 * stretched by the RoPE scaling factor for the kinds whose configs keep the
 * original length there (as vLLM derives max_model_len). */
static int derived_max_len(const fl_model_config *mc) {
    double len = mc->max_position_embeddings;
    const fl_rope_config *r = &mc->rope;
    if ((r->kind == FL_ROPE_LINEAR || r->kind == FL_ROPE_DYNAMIC) && r->factor > 1) len *= r->factor;
    if (r->kind == FL_ROPE_YARN && r->factor > 1 && r->original_max_pos > 0 &&
        r->original_max_pos * r->factor > len)
        len = r->original_max_pos * r->factor;
    return len > 1 << 30 ? 1 << 30 : (int)len;
}

static fl_mem_backend mem_backend(const fl_backend *be) {
    return be->ops->mem_info ? FL_MEM_BACKEND_CUDA : FL_MEM_BACKEND_CPU;
}

/* The rank number for logs: the world rank with dp > 1, else the tp rank. */
static int log_rank(const fl_engine *e) { return e->dp > 1 ? e->world_rank : e->tp_rank; }

/* The planner's inputs for this engine's model, layout and limits. */
static void plan_inputs(const fl_engine *e, fl_mem_plan_in *in, const fl_model_config *mc) {
    const fl_engine_config *cfg = &e->cfg;
    memset(in, 0, sizeof *in);
    in->cfg = mc;
    in->ck = e->m->ck;
    in->quant = e->m->quant;
    in->shard = e->m->shard;
    in->backend = mem_backend(e->m->be);
    in->kv_dtype = cfg->kv_dtype;
    in->block_size = cfg->block_size;
    in->max_model_len = cfg->max_model_len;
    in->max_num_batched_tokens = cfg->max_num_batched_tokens;
    in->max_num_seqs = cfg->max_num_seqs > 0 ? cfg->max_num_seqs : FL_MEM_MAX_SEQS_DEFAULT;
    in->tp = e->tp;
    in->dp = e->world_rank == 0 ? e->dp : 1;
}

/* Fills the sizes left to memory: tokens per step, the KV dtype check, the
 * cache's blocks (from kv_cache_bytes, or from what memory leaves, agreed
 * as the minimum over the ranks) and max_num_seqs. */
static fl_status size_memory(fl_engine *e) {
    fl_engine_config *cfg = &e->cfg;
    const fl_model *m = e->m;
    const fl_model_config *mc = &m->cfg;
    const fl_mem_backend mb = mem_backend(m->be);
    const fl_kv_dtype kvd = fl_kv_dtype_resolve(cfg->kv_dtype, mb);
    const fl_kv_dtype native = m->be->act_dtype == FL_DTYPE_F32 ? FL_KV_DTYPE_F32 : FL_KV_DTYPE_BF16;
    const bool quant = kvd == FL_KV_DTYPE_INT8 || kvd == FL_KV_DTYPE_FP8;
    if (quant && !(kvd == FL_KV_DTYPE_FP8 ? m->be->ops->kv_fp8 : m->be->ops->kv_int8))
        return FL_ERR(FL_ERR_UNSUPPORTED, "--kv-cache-dtype %s is not implemented on the %s backend; it keeps "
                      "its KV cache in %s", fl_kv_dtype_name(kvd), m->be->name, fl_kv_dtype_name(native));
    if (quant && mc->arch == FL_ARCH_DEEPSEEK_V2 && !m->be->ops->kv_int8_mla)
        return FL_ERR(FL_ERR_UNSUPPORTED, "--kv-cache-dtype %s is not implemented for MLA (DeepSeek-V2) models "
                      "on the %s backend", fl_kv_dtype_name(kvd), m->be->name);
    const bool half = kvd == FL_KV_DTYPE_BF16 && native == FL_KV_DTYPE_F32 && m->be->ops->kv_bf16;
    if (kvd != native && !quant && !half)
        return FL_ERR(FL_ERR_UNSUPPORTED, "the %s backend keeps its KV cache in %s; --kv-cache-dtype %s is not "
                      "supported there", m->be->name, fl_kv_dtype_name(native), fl_kv_dtype_name(kvd));
    cfg->kv_dtype = kvd;
    if (cfg->block_size <= 0) return FL_ERR(FL_ERR_INVALID_ARG, "block size %d", cfg->block_size);
    if (cfg->max_num_batched_tokens <= 0) cfg->max_num_batched_tokens = fl_mem_default_batched_tokens(mb);
    if (cfg->max_model_len <= 0) cfg->max_model_len = derived_max_len(mc);
    const size_t per_block = (size_t)mc->n_layers * fl_kv_token_layer_bytes(kvd, m->dims.n_kv_heads, mc->head_dim, fl_kv_int8_group(mc)) *
                             cfg->block_size;
    if (cfg->n_blocks <= 0 && cfg->kv_cache_bytes > 0) {
        cfg->n_blocks = (int)(cfg->kv_cache_bytes / per_block);
        if (cfg->n_blocks < 1)
            return FL_ERR(FL_ERR_INVALID_ARG, "the KV cache budget (%zu bytes) holds no block of %d tokens (%zu bytes)",
                          cfg->kv_cache_bytes, cfg->block_size, per_block);
    } else if (cfg->n_blocks <= 0) {
        fl_mem_plan_in in;
        plan_inputs(e, &in, mc);
        in.ck = NULL; /* the workspaces only: the weights are measured, not predicted */
        fl_mem_plan p;
        FL_TRY(fl_mem_plan_compute(&in, &p));
        const size_t ws = p.fixed - p.weights_total; /* workspaces, logits, estimates */
        size_t avail = 0, budget = 0, used = 0;
        if (mb == FL_MEM_BACKEND_CUDA) {
            size_t free_b = 0, total = 0;
            FL_TRY(m->be->ops->mem_info(m->be, &free_b, &total));
            budget = (size_t)(cfg->gpu_memory_utilization * (double)total);
            used = total - free_b + ws; /* what the device holds now (weights, context) + workspaces */
        } else {
            budget = cfg->memory_budget ? cfg->memory_budget : fl_mem_cpu_default_budget();
            used = m->weight_bytes + ws;
        }
        avail = budget > used ? budget - used : 0;
        e->mem_budget = budget;
        int64_t blocks = (int64_t)(avail / per_block);
        /* no more than max_model_len x max_num_seqs tokens can be in use */
        const int64_t seqs = cfg->max_num_seqs > 0 ? cfg->max_num_seqs : FL_MEM_MAX_SEQS_DEFAULT;
        const int64_t cap = ((int64_t)cfg->max_model_len * seqs + cfg->block_size - 1) / cfg->block_size;
        if (blocks > cap) blocks = cap;
        if (blocks > INT32_MAX / cfg->block_size) blocks = INT32_MAX / cfg->block_size;
        int mine = (int)blocks, least = mine;
        /* every rank runs the same plans: the job takes the smallest cache */
        if (e->dp > 1 && cfg->world != MPI_COMM_NULL) {
            FL_MPI_CHECK(MPI_Allreduce(&mine, &least, 1, MPI_INT, MPI_MIN, cfg->world));
        } else if (cfg->comm) {
            FL_TRY(fl_comm_agree_min(cfg->comm, mine, &least));
        }
        if (least < 1)
            return FL_ERR(FL_ERR_OOM, "no memory is left for the KV cache on %s: budget %.1f MiB, weights and "
                          "workspaces %.1f MiB, one block %.2f MiB (lower --max-batched-tokens or --max-num-seqs, "
                          "or raise the budget)", least < mine ? "another rank" : "this rank", budget / 1048576.0,
                          used / 1048576.0, per_block / 1048576.0);
        cfg->n_blocks = least;
        if (cfg->verbose && log_rank(e) == 0)
            fprintf(stderr, "flotilla: KV cache sized from memory: %d blocks of %d tokens (%.1f MiB per rank%s), "
                    "budget %.1f MiB, in use %.1f MiB\n", least, cfg->block_size, (double)least * per_block / 1048576.0,
                    e->dp > 1 || cfg->comm ? ", the minimum over ranks" : "", budget / 1048576.0, used / 1048576.0);
    }
    if (cfg->max_num_seqs <= 0) {
        int64_t tokens = (int64_t)cfg->n_blocks * cfg->block_size;
        int len = cfg->max_model_len < tokens ? cfg->max_model_len : (int)tokens;
        cfg->max_num_seqs = fl_mem_default_max_seqs(tokens, len);
    }
    return FL_OK;
}

static void log_memory(const fl_engine *e, size_t mem0, size_t mem1, size_t mem2) {
    const fl_model *m = e->m;
    fl_mem_plan_in in;
    plan_inputs(e, &in, &m->cfg);
    in.budget = e->mem_budget;
    in.swap_space_bytes = e->cfg.swap_space_bytes;
    fl_mem_plan p;
    if (fl_mem_plan_compute(&in, &p) != FL_OK) {
        fprintf(stderr, "flotilla: rank %d: memory plan: %s\n", log_rank(e), fl_error_msg());
        return;
    }
    /* the cache and pool as made (given, capped, or the minimum over the ranks) */
    fl_mem_plan_set_blocks(&p, e->cfg.n_blocks, e->swap.n_blocks, e->cfg.block_size);
    const bool dev = m->be->ops->mem_info != NULL;
    const char *what = dev ? "device memory in use" : "resident set";
    const int r = log_rank(e);
    char prefix[64];
    snprintf(prefix, sizeof prefix, "flotilla: rank %d:   ", r);
    fprintf(stderr, "flotilla: rank %d: memory plan (%s backend, KV %s):\n", r, m->be->name,
            fl_kv_dtype_name(e->cfg.kv_dtype));
    fl_mem_plan_print(&p, prefix, stderr);
    const double MiB = 1048576.0, kv = (double)e->cfg.n_blocks * (double)p.kv_block_bytes;
    fprintf(stderr, "flotilla: rank %d: measured (%s): loading weights %+.2f MiB, KV cache %+.2f MiB, "
            "workspaces %+.2f MiB\n", r, what, ((double)m->mem_after_load - (double)m->mem_before_load) / MiB,
            ((double)mem1 - (double)mem0) / MiB, ((double)mem2 - (double)mem1) / MiB);
    if (dev)
        fprintf(stderr, "flotilla: rank %d: predicted: weights %.2f MiB (W4 scratch included), KV cache "
                "%.2f MiB, workspaces %.2f MiB\n", r, (double)(p.weights_total + p.w4_scratch) / MiB, kv / MiB,
                (double)(p.workspace + p.logits) / MiB);
    else
        fprintf(stderr, "flotilla: rank %d: predicted: weights %.2f MiB held, %.2f MiB resident once every weight "
                "is read (converted copies + checkpoint pages); KV cache %.2f MiB and workspaces %.2f MiB, "
                "resident as they are written (CPU memory is taken lazily)\n", r, (double)p.weights_total / MiB,
                (double)p.rss_predicted / MiB, kv / MiB, (double)(p.workspace + p.logits + p.host_scratch) / MiB);
}

const fl_engine_config *fl_engine_config_of(const fl_engine *e) { return &e->cfg; }

/* The host swap pool: swap_space_bytes of this rank's blocks, capped by
 * fl_kv_swap_pool_blocks (which `flotilla plan` predicts with), the minimum
 * over the ranks (rank 0 decides for all); rank 0 measures the copy time
 * the cost model needs (scheduler.h). */
static fl_status init_swap(fl_engine *e, fl_sched_config *sc) {
    fl_engine_config *cfg = &e->cfg;
    const int64_t want = fl_kv_swap_pool_blocks(cfg->swap_space_bytes, fl_kv_swap_block_bytes(&e->kv), cfg->n_blocks);
    int mine = (int)want, least = mine;
    if (e->dp > 1 && cfg->world != MPI_COMM_NULL) {
        FL_MPI_CHECK(MPI_Allreduce(&mine, &least, 1, MPI_INT, MPI_MIN, cfg->world));
    } else if (cfg->comm) {
        FL_TRY(fl_comm_agree_min(cfg->comm, mine, &least));
    }
    if (least <= 0) return FL_OK; /* recompute only */
    FL_TRY(fl_kv_swap_init(&e->kv, least, &e->swap));
    sc->n_host_blocks = least;
    if (fl_engine_is_leader(e)) FL_TRY(fl_kv_swap_measure(&e->swap, &e->kv, &sc->block_copy_seconds));
    if (cfg->verbose && log_rank(e) == 0)
        fprintf(stderr, "flotilla: KV swap space: %d blocks (%.1f MiB per rank, %s), %.1f us to move a block\n",
                least, (double)least * fl_kv_swap_block_bytes(&e->kv) / 1048576.0,
                e->swap.pinned ? "pinned" : "host memory", sc->block_copy_seconds * 1e6);
    return FL_OK;
}

/* The disk tier (--kv-offload-dir): every rank opens its files; rank 0's
 * schedulers, one a replica, share its index, so a block two replicas
 * compute is written once, and a block is read only where every rank of
 * every replica has its file. It needs prefix caching (block identities). */
static fl_status init_disk(fl_engine *e, const fl_sched_config *sc) {
    const char *dir = e->cfg.kv_offload_dir;
    e->cfg.kv_offload_dir = NULL;
    if (!dir || !*dir) return FL_OK;
    if (!sc->prefix_caching) {
        if (log_rank(e) == 0)
            fprintf(stderr, "flotilla: warning: --kv-offload-dir %s does nothing without prefix caching "
                    "(--no-prefix-caching, or a model with dynamic-NTK RoPE)\n", dir);
        return FL_OK;
    }
    const fl_kv_disk_geom g = {
        .fingerprint = sc->prefix_seed, .block_size = sc->block_size, .n_layers = e->kv.n_layers,
        .layer_bytes = fl_kv_swap_block_bytes(&e->kv) / (2 * (size_t)e->kv.n_layers), .tp_rank = e->tp_rank,
    };
    if (e->dp > 1 && e->cfg.world != MPI_COMM_NULL) { /* agreed over the world: every replica's ranks */
        fl_comm *world = NULL;
        FL_TRY(fl_comm_init_mpi(e->cfg.world, &world));
        const fl_status st = fl_kv_disk_open(dir, &g, world, log_rank(e), &e->disk);
        fl_comm_free(world);
        FL_TRY(st);
    } else {
        FL_TRY(fl_kv_disk_open(dir, &g, e->cfg.comm, log_rank(e), &e->disk));
    }
    e->has_disk = true;
    if (fl_engine_is_leader(e)) {
        for (int r = 0; r < e->dp; r++) e->sched[r].disk = &e->disk;
        fprintf(stderr, "flotilla: KV offload: %s: %d blocks on disk for this cache (%.2f MiB a block on each "
                "of %d ranks)\n", e->disk.dir, fl_kv_disk_n_loadable(&e->disk),
                (double)e->disk.file_bytes / 1048576.0, e->tp);
    }
    return FL_OK;
}

fl_status fl_engine_init(fl_model *m, const fl_engine_config *cfg_in, fl_engine **out) {
    fl_status st = FL_OK;
    fl_engine *e = calloc(1, sizeof *e);
    if (!e) return FL_ERR(FL_ERR_OOM, "out of memory");
    e->m = m;
    e->cfg = *cfg_in;
    fl_engine_config *cfg = &e->cfg;
    const fl_model_config *mc = &m->cfg;
    const int kv_dim = m->dims.n_kv_heads * mc->head_dim; /* this rank's KV heads */
    e->dp = cfg->dp > 1 ? cfg->dp : 1;
    e->tp = cfg->comm ? fl_comm_size(cfg->comm) : 1;
    e->tp_rank = cfg->comm ? fl_comm_rank(cfg->comm) : 0;
    if (e->dp > 1 && cfg->world != MPI_COMM_NULL)
        FL_MPI_CHECK_GOTO(MPI_Comm_rank(cfg->world, &e->world_rank), st, fail);
    FL_TRY_GOTO(size_memory(e), st, fail);
    if (e->dp > 1) {
        int wsize = 0;
        if (cfg->world == MPI_COMM_NULL) {
            st = FL_ERR(FL_ERR_INVALID_ARG, "dp %d needs the world communicator", e->dp);
            goto fail;
        }
        FL_MPI_CHECK_GOTO(MPI_Comm_rank(cfg->world, &e->world_rank), st, fail);
        FL_MPI_CHECK_GOTO(MPI_Comm_size(cfg->world, &wsize), st, fail);
        if (wsize != e->dp * e->tp) {
            st = FL_ERR(FL_ERR_INVALID_ARG, "dp %d x tp %d does not match the %d ranks of the world",
                        e->dp, e->tp, wsize);
            goto fail;
        }
        e->dp_rank = e->world_rank / e->tp;
        e->dp_hdr = malloc((2 + (size_t)e->dp) * sizeof *e->dp_hdr);
        e->gv_counts = calloc((size_t)wsize, sizeof *e->gv_counts);
        e->gv_displs = calloc((size_t)wsize, sizeof *e->gv_displs);
        FL_CHECK_ALLOC(e->dp_hdr, st, fail);
        FL_CHECK_ALLOC(e->gv_counts, st, fail);
        FL_CHECK_ALLOC(e->gv_displs, st, fail);
    }
    e->sched = calloc((size_t)e->dp, sizeof *e->sched);
    e->plans = calloc((size_t)e->dp, sizeof *e->plans);
    FL_CHECK_ALLOC(e->sched, st, fail);
    FL_CHECK_ALLOC(e->plans, st, fail);
    int cache_tokens = cfg->n_blocks * cfg->block_size;
    if (cfg->max_model_len <= 0 || cfg->max_model_len > cache_tokens) cfg->max_model_len = cache_tokens;
    const size_t mem0 = fl_model_mem_in_use(m->be);
    FL_TRY_GOTO(fl_kv_cache_init_dtype(m->be, mc->n_layers, cfg->n_blocks, cfg->block_size, kv_dim, cfg->kv_dtype,
                                       mc->arch == FL_ARCH_DEEPSEEK_V2 ? 0 : mc->head_dim, fl_kv_int8_group(mc),
                                       &e->kv),
                st, fail);
    const size_t mem1 = fl_model_mem_in_use(m->be);
    fl_forward_limits lim = {
        .max_tokens = cfg->max_num_batched_tokens,
        .max_seqs = cfg->max_num_seqs,
        .max_blocks = (cfg->max_model_len + cfg->block_size - 1) / cfg->block_size,
        .max_logits = cfg->max_num_seqs > 64 ? cfg->max_num_seqs : 64,
    };
    e->max_logits = lim.max_logits;
    /* dp > 1: every replica's logits reach rank 0 in one MPI_Gatherv, whose
     * counts are ints; refused here, alike on every rank, not mid-job */
    if (e->dp > 1 && (int64_t)lim.max_logits * mc->vocab_size * e->dp > INT32_MAX) {
        st = FL_ERR(FL_ERR_INVALID_ARG, "dp %d x %d logits rows x vocabulary %d exceed one MPI "
                    "gather (2^31 values): lower max_num_seqs", e->dp, lim.max_logits, mc->vocab_size);
        goto fail;
    }
    FL_TRY_GOTO(fl_forward_init(m, &e->kv, &lim, cfg->comm, &cfg->fwd, &e->fwd), st, fail);
    const size_t mem2 = fl_model_mem_in_use(m->be);
    if (e->dp > 1 && mc->n_experts) {
        /* replicas hold different tokens: the MoE layers must exchange them */
        if (!cfg->ep_comm) {
            st = FL_ERR(FL_ERR_INVALID_ARG, "dp %d with a MoE model needs the expert-parallel "
                        "communicator", e->dp);
            goto fail;
        }
        FL_TRY_GOTO(fl_forward_moe_enable_a2a(e->fwd, cfg->ep_comm), st, fail);
    }
    fl_sched_config sc = {
        .block_size = cfg->block_size, .n_blocks = cfg->n_blocks,
        .max_num_seqs = cfg->max_num_seqs, .max_num_batched_tokens = cfg->max_num_batched_tokens,
        .max_model_len = cfg->max_model_len,
        .prefix_caching = cfg->prefix_caching && mc->rope.kind != FL_ROPE_DYNAMIC,
        .prefix_seed = cache_fingerprint(m, cfg, e->dp),
    };
    cfg->prefix_caching = sc.prefix_caching;
    cfg->model_id = NULL;
    FL_TRY_GOTO(init_swap(e, &sc), st, fail);
    for (int r = 0; r < e->dp; r++) FL_TRY_GOTO(fl_scheduler_init(&e->sched[r], &sc), st, fail);
    if (e->dp > 1 && sc.prefix_caching && e->world_rank == 0) {
        e->routed = calloc((size_t)e->dp, sizeof *e->routed);
        FL_CHECK_ALLOC(e->routed, st, fail);
    }
    FL_TRY_GOTO(init_disk(e, &sc), st, fail);
    const size_t lrows = (size_t)e->max_logits * (e->world_rank == 0 ? e->dp : 1);
    e->logits = malloc(lrows * mc->vocab_size * sizeof(float));
    e->picks = malloc(lrows * sizeof(int32_t));
    FL_CHECK_ALLOC(e->picks, st, fail);
    e->sample_ws = malloc(fl_sampler_workspace_size(mc->vocab_size));
    e->smp_rows = malloc(lrows * sizeof *e->smp_rows);
    e->smp_hist_lo = calloc((size_t)e->dp + 1, sizeof *e->smp_hist_lo);
    FL_CHECK_ALLOC(e->smp_rows, st, fail);
    FL_CHECK_ALLOC(e->smp_hist_lo, st, fail);
    e->updated = calloc((size_t)e->dp * (cfg->max_num_seqs + 1), sizeof *e->updated);
    FL_CHECK_ALLOC(e->logits, st, fail);
    FL_CHECK_ALLOC(e->sample_ws, st, fail);
    e->host_row = malloc((size_t)mc->vocab_size * sizeof(float));
    e->seen = calloc((size_t)mc->vocab_size, 1);
    FL_CHECK_ALLOC(e->host_row, st, fail);
    FL_CHECK_ALLOC(e->seen, st, fail);
    FL_CHECK_ALLOC(e->updated, st, fail);
    for (int i = 0; i < mc->n_eos; i++) e->eos[e->n_eos++] = mc->eos_token_ids[i];
    for (int i = 0; i < cfg->n_extra_eos && e->n_eos < (int)(sizeof e->eos / sizeof e->eos[0]); i++)
        if (cfg->extra_eos[i] >= 0) e->eos[e->n_eos++] = cfg->extra_eos[i];
    cfg->extra_eos = NULL;
    cfg->n_extra_eos = 0;
    if (cfg->verbose) log_memory(e, mem0, mem1, mem2);
    *out = e;
    return FL_OK;
fail:
    fl_engine_free(e);
    return st;
}

void fl_engine_free(fl_engine *e) {
    if (!e) return;
    fl_forward_free(e->fwd);
    fl_kv_swap_free(&e->swap);
    fl_kv_disk_close(&e->disk);
    fl_kv_cache_free(&e->kv);
    for (int r = 0; e->sched && r < e->dp; r++) fl_scheduler_free(&e->sched[r]);
    for (int r = 0; e->routed && r < e->dp; r++) fl_route_set_free(&e->routed[r]);
    free(e->routed);
    for (int r = 0; e->plans && r < e->dp; r++) fl_step_plan_free(&e->plans[r]);
    free(e->sched);
    free(e->plans);
    free(e->wire);
    free(e->dp_hdr);
    free(e->gv_counts);
    free(e->gv_displs);
    free(e->logits);
    free(e->picks);
    free(e->sample_ws);
    free(e->host_row);
    free(e->seen);
    free(e->smp_rows);
    free(e->smp_hist);
    free(e->smp_hist_lo);
    free(e->updated);
    free(e);
}

int fl_engine_max_model_len(const fl_engine *e) { return e->cfg.max_model_len; }

/* Tokens a replica holds or will hold: its running and waiting sequences'. */
static int64_t replica_load(const fl_scheduler *s) {
    int64_t n = 0;
    for (int i = 0; i < s->n_running; i++) n += s->running[i]->n_tokens;
    for (int i = 0; i < s->w_len; i++) n += s->waiting[(s->w_head + i) % s->w_cap]->n_tokens;
    return n;
}

int fl_engine_pick_replica(fl_scheduler *sched, const fl_route_set *routed, int dp, fl_seq *q) {
    if (dp <= 1) return 0;
    const int n = fl_scheduler_prompt_hashes(&sched[0], q);
    int best = 0;
    int64_t best_score = 0;
    for (int r = 0; r < dp; r++) {
        int shared = fl_scheduler_cached_prefix(&sched[r], q, n);
        const int queued = routed ? fl_route_set_leading(&routed[r], q->hashes, n) : 0;
        if (queued > shared) shared = queued;
        const int64_t score = replica_load(&sched[r]) + q->n_tokens -
                              (int64_t)FL_ROUTE_PREFIX_WEIGHT * shared * sched[r].cfg.block_size;
        if (r == 0 || score < best_score) best = r, best_score = score;
    }
    return best;
}

fl_status fl_engine_add(fl_engine *e, fl_gen *g) {
    g->t_added = fl_engine_now();
    g->n_routed = 0;
    g->replica = fl_engine_pick_replica(e->sched, e->routed, e->dp, &g->seq);
    FL_TRY(fl_scheduler_add(&e->sched[g->replica], &g->seq));
    if (e->routed && g->seq.n_hashes > 0 &&
        fl_route_set_add(&e->routed[g->replica], g->seq.hashes, g->seq.n_hashes) == FL_OK)
        g->n_routed = g->seq.n_hashes; /* without memory it only does not attract others */
    return FL_OK;
}

bool fl_engine_has_work(const fl_engine *e) {
    for (int r = 0; r < e->dp; r++)
        if (fl_scheduler_has_work(&e->sched[r])) return true;
    return false;
}

void fl_engine_finish(fl_engine *e, fl_gen *g, fl_finish_reason r) {
    if (g->seq.state == FL_SEQ_FINISHED) return;
    fl_scheduler_finish(&e->sched[g->replica < e->dp ? g->replica : 0], &g->seq);
    if (g->n_routed > 0 && e->routed && g->replica < e->dp)
        fl_route_set_remove(&e->routed[g->replica], g->seq.hashes, g->n_routed);
    g->n_routed = 0;
    g->finish = r;
    g->t_finished = fl_engine_now();
}

static bool is_eos(const fl_engine *e, int32_t t) {
    for (int i = 0; i < e->n_eos; i++)
        if (e->eos[i] == t) return true;
    return false;
}

/* fl_seq is the first member of fl_gen, so the scheduler's pointers map back. */
static fl_gen *gen_of(fl_seq *s) { return (fl_gen *)s; }

bool fl_engine_is_leader(const fl_engine *e) {
    if (e->dp > 1) return e->world_rank == 0;
    return !e->cfg.comm || fl_comm_rank(e->cfg.comm) == 0;
}

enum { PLAN_RUN = 0, PLAN_STOP = 1 };
#define DP_MAGIC 0x44504c4e /* "DPLN" */

/* Rank 0 sends the plan it is about to run (header, then body) so every rank
 * runs the same step: no rank decides anything on its own (docs/engine.md).
 * The plan is host data: it goes over MPI even when the communicator's
 * collectives are NCCL's. */
static fl_status share_plan(fl_engine *e, int cmd) {
    if (!e->cfg.comm) return FL_OK;
    fl_step_plan *p = &e->plans[0];
    p->buf[6] = cmd;
    FL_TRY(fl_comm_broadcast_host(e->cfg.comm, p->buf, FL_PLAN_HEADER, 0, FL_COMM_I32));
    if (cmd == PLAN_STOP) return FL_OK;
    return fl_comm_broadcast_host(e->cfg.comm, p->buf + FL_PLAN_HEADER,
                                  fl_step_plan_words(p) - FL_PLAN_HEADER, 0, FL_COMM_I32);
}

static fl_status grow_wire(fl_engine *e, size_t words) {
    if (words <= e->wire_cap) return FL_OK;
    int32_t *w = realloc(e->wire, words * sizeof *w);
    if (!w) return FL_ERR(FL_ERR_OOM, "out of memory for %zu plan words", words);
    e->wire = w;
    e->wire_cap = words;
    return FL_OK;
}

/* dp > 1, rank 0: one broadcast of the header (the command and each
 * replica's plan length), one of all plans concatenated. */
/* dp > 1, sampled steps: after each replica's plan its rows' sampling,
 * [n_hist][n_logits fl_sample_row][n_hist history ids], in words. */
#define ROW_WORDS (sizeof(fl_sample_row) / sizeof(int32_t))
static size_t sampling_words(int n_logits, size_t n_hist) { return 1 + (size_t)n_logits * ROW_WORDS + n_hist; }

static fl_status share_plans_dp(fl_engine *e, int cmd) {
    int32_t *h = e->dp_hdr;
    size_t total = 0;
    h[0] = DP_MAGIC;
    h[1] = cmd;
    const bool sampled = cmd == PLAN_RUN && fl_step_plan_output(&e->plans[0]) == FL_PLAN_SAMPLED;
    for (int r = 0; r < e->dp; r++) {
        size_t w = cmd == PLAN_RUN ? fl_step_plan_words(&e->plans[r]) : 0;
        if (sampled) w += sampling_words(e->plans[r].n_logits, e->smp_hist_lo[r + 1] - e->smp_hist_lo[r]);
        if (w > (size_t)1 << 30) return FL_ERR(FL_ERR_INTERNAL, "step plan of %zu words", w);
        h[2 + r] = (int32_t)w;
        total += w;
    }
    FL_MPI_CHECK(MPI_Bcast(h, 2 + e->dp, MPI_INT32_T, 0, e->cfg.world));
    if (cmd == PLAN_STOP) return FL_OK;
    if (total > INT32_MAX) return FL_ERR(FL_ERR_INTERNAL, "step plans of %zu words", total);
    FL_TRY(grow_wire(e, total));
    size_t off = 0;
    for (int r = 0; r < e->dp; r++) {
        const size_t pw = fl_step_plan_words(&e->plans[r]);
        memcpy(e->wire + off, e->plans[r].buf, pw * sizeof(int32_t));
        if (sampled) { /* [n_hist][rows][hist] after the plan */
            const size_t nh = e->smp_hist_lo[r + 1] - e->smp_hist_lo[r];
            int32_t *w = e->wire + off + pw;
            w[0] = (int32_t)nh;
            memcpy(w + 1, e->smp_rows + (size_t)r * e->max_logits,
                   (size_t)e->plans[r].n_logits * sizeof(fl_sample_row));
            memcpy(w + 1 + (size_t)e->plans[r].n_logits * ROW_WORDS, e->smp_hist + e->smp_hist_lo[r],
                   nh * sizeof(int32_t));
        }
        off += (size_t)h[2 + r];
    }
    FL_MPI_CHECK(MPI_Bcast(e->wire, (int)total, MPI_INT32_T, 0, e->cfg.world));
    return FL_OK;
}

/* dp > 1: every replica's tp rank 0 sends its plan's logits rows to rank 0,
 * which receives them replica after replica into buf (its own replica's rows
 * are already at the start: MPI_IN_PLACE). */
static fl_status gather_rows_dp(fl_engine *e, void *buf, int V, MPI_Datatype type) {
    if (e->world_rank == 0) {
        int off = 0;
        for (int r = 0; r < e->dp * e->tp; r++) e->gv_counts[r] = 0;
        for (int r = 0; r < e->dp; r++) e->gv_counts[r * e->tp] = e->plans[r].n_logits * V;
        for (int r = 0; r < e->dp * e->tp; r++) {
            if (e->gv_counts[r] > INT32_MAX - off)
                return FL_ERR(FL_ERR_INTERNAL, "the logits of %d replicas exceed one MPI_Gatherv "
                              "(lower max_num_seqs)", e->dp);
            e->gv_displs[r] = off;
            off += e->gv_counts[r];
        }
        FL_MPI_CHECK(MPI_Gatherv(MPI_IN_PLACE, 0, type, buf, e->gv_counts, e->gv_displs, type, 0,
                                 e->cfg.world));
        return FL_OK;
    }
    int cnt = e->tp_rank == 0 ? e->plans[0].n_logits * V : 0;
    FL_MPI_CHECK(MPI_Gatherv(buf, cnt, type, NULL, NULL, NULL, type, 0, e->cfg.world));
    return FL_OK;
}

/* The step's output rows to rank 0: logits, or on a greedy step one token
 * per row (every replica runs the same kind of step). */
static fl_status gather_logits_dp(fl_engine *e, float *logits, int32_t *picks) {
    if (fl_step_plan_picks(&e->plans[0])) return gather_rows_dp(e, picks, 1, MPI_INT32_T);
    return gather_rows_dp(e, logits, e->m->cfg.vocab_size, MPI_FLOAT);
}

/* Rank 0: sends this step's plans, runs its own, and (dp > 1) collects every
 * replica's logits (greedy steps: tokens) into logits (picks). */
/* One rank's part of a plan: its KV block moves (blocks to disk, swaps,
 * blocks from disk: kv_disk.h says why in this order), then the forward. */
static fl_status run_own(fl_engine *e, const fl_step_plan *p, float *logits, int32_t *picks) {
    if ((p->n_persist || p->n_disk_in) && !e->has_disk)
        return FL_ERR(FL_ERR_INTERNAL, "step plan: disk moves and no disk tier");
    if (p->n_persist) FL_TRY(fl_kv_disk_persist(&e->disk, &e->kv, p));
    if (p->n_swap_out || p->n_swap_in) FL_TRY(fl_kv_swap_run(&e->swap, &e->kv, p));
    if (p->n_disk_in) FL_TRY(fl_kv_disk_load(&e->disk, &e->kv, p));
    return fl_forward_run(e->fwd, p, logits, picks);
}

static fl_status run_plans(fl_engine *e, float *logits, int32_t *picks) {
    if (e->dp == 1) {
        FL_TRY(share_plan(e, PLAN_RUN));
        return run_own(e, &e->plans[0], logits, picks);
    }
    FL_TRY(share_plans_dp(e, PLAN_RUN));
    FL_TRY(run_own(e, &e->plans[0], logits, picks));
    return gather_logits_dp(e, logits, picks);
}

static fl_status follow_dp(fl_engine *e) {
    int32_t *h = e->dp_hdr;
    fl_step_plan *p = &e->plans[0];
    for (;;) {
        FL_MPI_CHECK(MPI_Bcast(h, 2 + e->dp, MPI_INT32_T, 0, e->cfg.world));
        if (h[0] != DP_MAGIC || (h[1] != PLAN_RUN && h[1] != PLAN_STOP))
            return FL_ERR(FL_ERR_INTERNAL, "step plans: bad header (%d, %d)", h[0], h[1]);
        if (h[1] == PLAN_STOP) return FL_OK;
        size_t total = 0, off = 0;
        for (int r = 0; r < e->dp; r++) {
            if (h[2 + r] < FL_PLAN_HEADER)
                return FL_ERR(FL_ERR_INTERNAL, "step plans: replica %d plan of %d words", r, h[2 + r]);
            if (r < e->dp_rank) off += (size_t)h[2 + r];
            total += (size_t)h[2 + r];
        }
        if (total > INT32_MAX) return FL_ERR(FL_ERR_INTERNAL, "step plans of %zu words", total);
        FL_TRY(grow_wire(e, total));
        FL_MPI_CHECK(MPI_Bcast(e->wire, (int)total, MPI_INT32_T, 0, e->cfg.world));
        FL_TRY(fl_step_plan_from_header(p, e->wire + off));
        const size_t pw = fl_step_plan_words(p);
        const int32_t *smp = e->wire + off + pw; /* a sampled step's rows, after the plan */
        const bool sampled = e->wire[off + 7] == FL_PLAN_SAMPLED && (size_t)h[2 + e->dp_rank] > pw;
        const size_t want = pw + (sampled ? sampling_words(p->n_logits, (size_t)smp[0]) : 0);
        if (want != (size_t)h[2 + e->dp_rank] || (sampled && (smp[0] < 0 || p->n_logits > e->max_logits)))
            return FL_ERR(FL_ERR_INTERNAL, "step plans: replica %d plan has %zu words, header says %d",
                          e->dp_rank, want, h[2 + e->dp_rank]);
        memcpy(p->buf, e->wire + off, pw * sizeof(int32_t));
        if (sampled && e->tp_rank == 0) {
            /* copied out: the wire's words do not align the rows' doubles */
            memcpy(e->smp_rows, smp + 1, (size_t)p->n_logits * sizeof(fl_sample_row));
            fl_forward_set_sampling(e->fwd, e->smp_rows, p->n_logits, smp + 1 + (size_t)p->n_logits * ROW_WORDS,
                                    (size_t)smp[0]);
        }
        float *out = e->tp_rank == 0 ? e->logits : NULL;
        int32_t *picks = e->tp_rank == 0 ? e->picks : NULL;
        FL_TRY(run_own(e, p, out, picks));
        FL_TRY(gather_logits_dp(e, out, picks));
    }
}

fl_status fl_engine_follow(fl_engine *e) {
    if (fl_engine_is_leader(e)) return FL_OK;
    if (e->dp > 1) return follow_dp(e);
    if (!e->cfg.comm) return FL_OK;
    int32_t hdr[FL_PLAN_HEADER];
    fl_step_plan *p = &e->plans[0];
    for (;;) {
        FL_TRY(fl_comm_broadcast_host(e->cfg.comm, hdr, FL_PLAN_HEADER, 0, FL_COMM_I32));
        if (hdr[6] == PLAN_STOP) return FL_OK;
        FL_TRY(fl_step_plan_from_header(p, hdr));
        fl_step_plan_set_output(p, hdr[7]);
        FL_TRY(fl_comm_broadcast_host(e->cfg.comm, p->buf + FL_PLAN_HEADER,
                                 fl_step_plan_words(p) - FL_PLAN_HEADER, 0, FL_COMM_I32));
        FL_TRY(run_own(e, p, NULL, NULL));
    }
}

fl_status fl_engine_release_followers(fl_engine *e) {
    if (!fl_engine_is_leader(e)) return FL_OK;
    if (e->has_disk) { /* every replica's last step's blocks: their K/V exist now */
        int any = 0;
        for (int r = 0; r < e->dp; r++) {
            int n = 0;
            FL_TRY(fl_scheduler_flush_persist(&e->sched[r], &e->plans[r], &n));
            fl_step_plan_set_output(&e->plans[r], FL_PLAN_LOGITS);
            any += n;
        }
        if (any > 0) FL_TRY(run_plans(e, e->logits, e->picks));
    }
    if (e->dp > 1) return share_plans_dp(e, PLAN_STOP);
    if (!e->cfg.comm) return FL_OK;
    FL_TRY(fl_step_plan_resize(&e->plans[0], 0, 0, 0, 0, 1));
    return share_plan(e, PLAN_STOP);
}

/* A step sampled on the devices: each logit row's parameters and the one
 * draw its sequence's rng gives per sampled token (what the host sampler
 * would draw), the penalised rows' histories concatenated, for every
 * replica (rows follow each plan's logit rows: the step's sampling
 * sequences in order). Replica 0's go to rank 0's forward; the others'
 * travel with their plans (share_plans_dp). */
static fl_status sampling_rows(fl_engine *e) {
    size_t nh = 0;
    for (int r = 0; r < e->dp; r++)
        for (int i = 0; i < e->sched[r].n_step; i++) {
            fl_seq *s = e->sched[r].step[i];
            if (s->step_sample && gen_of(s)->sp.repetition_penalty != 1.0f) nh += (size_t)s->n_tokens;
        }
    if (nh > e->smp_hist_cap) {
        size_t cap = e->smp_hist_cap ? e->smp_hist_cap : 4096;
        while (cap < nh) cap *= 2;
        int32_t *h = realloc(e->smp_hist, cap * sizeof *h);
        if (!h) return FL_ERR(FL_ERR_OOM, "out of memory for %zu history tokens", nh);
        e->smp_hist = h, e->smp_hist_cap = cap;
    }
    nh = 0;
    for (int r = 0; r < e->dp; r++) {
        fl_scheduler *sc = &e->sched[r];
        fl_sample_row *rows = e->smp_rows + (size_t)r * e->max_logits;
        const size_t lo = nh;
        int n = 0;
        e->smp_hist_lo[r] = lo;
        for (int i = 0; i < sc->n_step; i++) {
            fl_seq *s = sc->step[i];
            if (!s->step_sample) continue;
            if (n >= e->max_logits) return FL_ERR(FL_ERR_INTERNAL, "more sampled rows than %d", e->max_logits);
            fl_gen *g = gen_of(s);
            const fl_sampling_params *sp = &g->sp;
            fl_sample_row *row = &rows[n++];
            *row = (fl_sample_row){
                .u = sp->temperature > 0.0f ? fl_rng_uniform(&g->rng) : 0.0,
                .temperature = sp->temperature, .top_p = sp->top_p, .min_p = sp->min_p,
                .penalty = sp->repetition_penalty, .top_k = sp->top_k,
            };
            if (sp->repetition_penalty != 1.0f) {
                row->hist_lo = (int32_t)(nh - lo), row->hist_n = s->n_tokens;
                memcpy(e->smp_hist + nh, s->tokens, (size_t)s->n_tokens * sizeof(int32_t));
                nh += (size_t)s->n_tokens;
            }
        }
        if (n != e->plans[r].n_logits)
            return FL_ERR(FL_ERR_INTERNAL, "replica %d: %d sampled rows for %d logit rows", r, n,
                          e->plans[r].n_logits);
    }
    e->smp_hist_lo[e->dp] = nh;
    fl_forward_set_sampling(e->fwd, e->smp_rows, e->plans[0].n_logits, e->smp_hist, e->smp_hist_lo[1]);
    return FL_OK;
}

/* Does sampling g's next token need its logits on rank 0's host? */
static bool needs_host(const fl_gen *g) {
    return g->want_logprobs || g->presence_penalty != 0.0f || g->frequency_penalty != 0.0f ||
           fl_gen_n_generated(g) < g->min_tokens;
}

/* g's next token from its raw logits row on the host: repetition, presence
 * and frequency penalties (vLLM's order), the min_tokens EOS mask, then the
 * sampler; the log-probabilities are those of the raw row. */
static fl_status sample_host(fl_engine *e, fl_gen *g, const float *row, int32_t *tok) {
    const int V = e->m->cfg.vocab_size;
    fl_seq *s = &g->seq;
    const int32_t *gen = s->tokens + s->n_prompt;
    const size_t n_gen = (size_t)fl_gen_n_generated(g);
    fl_sampling_params sp = g->sp;
    memcpy(e->host_row, row, (size_t)V * sizeof(float));
    if (sp.repetition_penalty != 1.0f) { /* applied here so the other penalties follow it */
        for (int j = 0; j < s->n_tokens; j++)
            if (s->tokens[j] >= 0 && s->tokens[j] < V)
                e->host_row[s->tokens[j]] = fl_sampler_penalize(row[s->tokens[j]], sp.repetition_penalty);
        sp.repetition_penalty = 1.0f;
    }
    FL_TRY(fl_sampler_penalize_counts(e->host_row, V, gen, n_gen, g->presence_penalty,
                                      g->frequency_penalty, e->seen));
    if ((int)n_gen < g->min_tokens) fl_sampler_mask_ids(e->host_row, V, e->eos, e->n_eos);
    FL_TRY(fl_sampler_sample(&sp, e->host_row, V, NULL, 0, &g->rng, e->sample_ws, tok));
    if (!g->want_logprobs) return FL_OK;
    if (n_gen >= g->lp_cap) {
        size_t cap = g->lp_cap ? 2 * g->lp_cap : 16;
        fl_token_logprob *lp = realloc(g->lp, cap * sizeof *lp);
        if (!lp) return FL_ERR(FL_ERR_OOM, "out of memory for %zu token logprobs", cap);
        g->lp = lp, g->lp_cap = cap;
    }
    fl_token_logprob *t = &g->lp[n_gen];
    t->n_top = g->top_logprobs < V ? g->top_logprobs : V;
    return fl_sampler_logprobs(row, V, *tok, t->n_top, &t->logprob, t->top_ids, t->top_lps);
}

fl_status fl_engine_step(fl_engine *e, fl_gen ***updated, int *n_updated) {
    *n_updated = 0;
    *updated = e->updated;
    bool any = false;
    for (int r = 0; r < e->dp; r++) {
        fl_scheduler *sc = &e->sched[r];
        FL_TRY(fl_scheduler_schedule(sc, &e->plans[r]));
        /* a plan of moves alone still runs: freed device blocks must be copied out before reuse */
        const fl_step_plan *p = &e->plans[r];
        if (p->n_tokens > 0 || p->n_swap_out > 0 || p->n_swap_in > 0 || p->n_persist > 0 || p->n_disk_in > 0)
            any = true;
        if (p->n_tokens == 0 && sc->w_len > 0) {
            /* Nothing fits: the head of the queue can never run in this cache. */
            fl_gen *g = gen_of(sc->waiting[sc->w_head]);
            snprintf(g->error, sizeof g->error, "request needs more KV cache than is available");
            fl_engine_finish(e, g, FL_FINISH_ERROR);
            e->updated[(*n_updated)++] = g;
        }
    }
    int64_t running = 0, used = 0;
    for (int r = 0; r < e->dp; r++) {
        const fl_kv_blocks *kb = &e->sched[r].blocks;
        running += e->sched[r].n_running;
        used += kb->n_blocks - fl_kv_blocks_n_available(kb); /* referenced by a block table */
    }
    if (running > e->stats.peak_running) e->stats.peak_running = running;
    if (used > e->stats.peak_kv_blocks_used) e->stats.peak_kv_blocks_used = used;
    if (!any) return FL_OK;
    /* Greedy step when no sampled row needs its logits on the host. */
    bool greedy = e->cfg.greedy_on_device;
    for (int r = 0; r < e->dp && greedy; r++)
        for (int i = 0; i < e->sched[r].n_step && greedy; i++) {
            fl_seq *s = e->sched[r].step[i];
            const fl_sampling_params *sp = &gen_of(s)->sp;
            if (s->step_sample && (sp->temperature != 0 || sp->repetition_penalty != 1)) greedy = false;
        }
    bool host = false; /* a row needs the OpenAI options applied on the host */
    for (int r = 0; r < e->dp && !host; r++)
        for (int i = 0; i < e->sched[r].n_step && !host; i++)
            host = e->sched[r].step[i]->step_sample && needs_host(gen_of(e->sched[r].step[i]));
    greedy = greedy && !host;
    int output = greedy ? FL_PLAN_GREEDY : FL_PLAN_LOGITS;
    if (!greedy && !host && e->cfg.sample_on_device && fl_forward_can_sample(e->fwd)) {
        FL_TRY(sampling_rows(e));
        output = FL_PLAN_SAMPLED;
    }
    for (int r = 0; r < e->dp; r++) fl_step_plan_set_output(&e->plans[r], output);
    double t0 = fl_engine_now();
    FL_TRY(run_plans(e, e->logits, e->picks));
    const double dt = fl_engine_now() - t0;
    e->stats.forward_seconds += dt;
    /* the cost model's prefill rate: the best rows per second of a step */
    for (int r = 0; r < e->dp && dt > 0; r++) {
        const double rate = e->plans[r].n_tokens / dt;
        if (rate > e->sched[r].prefill_tok_per_s) e->sched[r].prefill_tok_per_s = rate;
    }
    e->stats.steps++;
    e->stats.greedy_steps += greedy;
    e->stats.sampled_steps += output == FL_PLAN_SAMPLED;
    e->stats.preemptions = e->stats.swap_preemptions = 0;
    e->stats.swap_out_bytes = e->stats.swap_in_bytes = 0;
    const int64_t block_bytes = (int64_t)fl_kv_swap_block_bytes(&e->kv) * e->tp; /* every rank's shard */
    const int V = e->m->cfg.vocab_size;
    int lg = 0;
    bool prompt_rows = false;
    for (int r = 0; r < e->dp; r++) {
        fl_scheduler *sc = &e->sched[r];
        fl_scheduler_step_done(sc);
        e->stats.preemptions += sc->n_preemptions;
        e->stats.swap_preemptions += sc->n_swap_preemptions;
        e->stats.swap_out_bytes += sc->blocks_swapped_out * block_bytes;
        e->stats.swap_in_bytes += sc->blocks_swapped_in * block_bytes;
        for (int i = 0; i < sc->n_step; i++) {
            fl_seq *s = sc->step[i];
            if (s->step_rows == 1 && s->n_computed > s->n_prompt) {
                e->stats.decode_tokens++;
            } else {
                e->stats.prefill_tokens += s->step_rows;
                prompt_rows = true;
            }
        }
        /* Sample after the loop above: finishing mutates the scheduler's lists,
         * but sched.step stays valid for this step. Replica r's logits follow
         * those of replicas 0..r-1 (gather_logits_dp). */
        for (int i = 0; i < sc->n_step; i++) {
            fl_seq *s = sc->step[i];
            if (!s->step_sample) continue;
            fl_gen *g = gen_of(s);
            int32_t tok;
            if (output != FL_PLAN_LOGITS) {
                tok = e->picks[lg++];
            } else {
                const float *row = e->logits + (size_t)lg++ * V;
                if (e->cfg.on_logits) e->cfg.on_logits(e->cfg.on_logits_ctx, g, row, V);
                if (needs_host(g))
                    FL_TRY(sample_host(e, g, row, &tok));
                else
                    FL_TRY(fl_sampler_sample(&g->sp, row, V, s->tokens, s->n_tokens, &g->rng, e->sample_ws,
                                             &tok));
            }
            FL_TRY(fl_seq_append(s, tok));
            if (g->t_first_token == 0) g->t_first_token = fl_engine_now();
            e->updated[(*n_updated)++] = g;
            if (!g->ignore_eos && is_eos(e, tok))
                fl_engine_finish(e, g, FL_FINISH_STOP);
            else if (fl_gen_n_generated(g) >= g->max_new_tokens || s->n_tokens >= e->cfg.max_model_len)
                fl_engine_finish(e, g, FL_FINISH_LENGTH);
        }
    }
    if (prompt_rows) {
        e->stats.prefill_steps++;
        e->stats.prefill_forward_seconds += dt;
    }
    return FL_OK;
}

/* With dp > 1 the prompt runs on replica 0 (rank 0's own) while the other
 * replicas run empty plans, so every rank takes part in each step's
 * exchanges. */
fl_status fl_engine_prompt_logits(fl_engine *e, const int32_t *ids, int n, float *out) {
    if (fl_engine_has_work(e))
        return FL_ERR(FL_ERR_INTERNAL, "prompt_logits needs an idle engine");
    if (n < 1 || n > e->cfg.max_model_len)
        return FL_ERR(FL_ERR_INVALID_ARG, "prompt of %d tokens; this engine takes 1..%d", n,
                      e->cfg.max_model_len);
    fl_status st = FL_OK;
    fl_seq s;
    FL_TRY(fl_seq_init(&s, -1, ids, n));
    const int V = e->m->cfg.vocab_size, bs = e->cfg.block_size, nb = (n + bs - 1) / bs;
    fl_step_plan *p = &e->plans[0];
    s.blocks = malloc((size_t)nb * sizeof(int32_t));
    FL_CHECK_ALLOC(s.blocks, st, done);
    for (; s.n_blocks < nb; s.n_blocks++) {
        s.blocks[s.n_blocks] = fl_kv_blocks_alloc(&e->sched[0].blocks);
        if (s.blocks[s.n_blocks] < 0) {
            st = FL_ERR(FL_ERR_INVALID_ARG, "prompt of %d tokens does not fit the KV cache", n);
            goto done;
        }
    }
    for (int r = 1; r < e->dp; r++)
        FL_TRY_GOTO(fl_step_plan_resize(&e->plans[r], 0, 0, 1, 0, bs), st, done);
    /* Chunks small enough for the rows and the logits buffers, every row projected. */
    int chunk = e->cfg.max_num_batched_tokens < e->max_logits ? e->cfg.max_num_batched_tokens
                                                              : e->max_logits;
    for (int lo = 0; lo < n; lo += chunk) {
        int cnt = n - lo < chunk ? n - lo : chunk;
        FL_TRY_GOTO(fl_step_plan_resize(p, cnt, 1, nb, cnt, bs), st, done);
        memcpy(p->block_tables, s.blocks, (size_t)nb * sizeof(int32_t));
        p->q_start[0] = 0;
        p->q_start[1] = cnt;
        p->ctx_len[0] = lo + cnt;
        p->rope_len[0] = n;
        for (int j = 0; j < cnt; j++) {
            int pos = lo + j;
            p->tokens[j] = ids[pos];
            p->positions[j] = pos;
            p->slots[j] = s.blocks[pos / bs] * bs + pos % bs;
            p->logit_rows[j] = j;
        }
        FL_TRY_GOTO(run_plans(e, out + (size_t)lo * V, NULL), st, done);
    }
done:
    fl_kv_blocks_release(&e->sched[0].blocks, s.blocks, s.n_blocks);
    fl_seq_free(&s);
    return st;
}

void fl_engine_reset_peaks(fl_engine *e) {
    e->stats.peak_running = 0;
    e->stats.peak_kv_blocks_used = 0;
}

void fl_engine_get_stats(const fl_engine *e, fl_engine_stats *s) {
    *s = e->stats;
    s->prompt_tokens = s->cached_prompt_tokens = s->kv_blocks = 0;
    s->disk_hit_blocks = s->disk_hit_tokens = 0;
    s->kv_disk = e->has_disk;
    s->running = s->waiting = s->kv_blocks_used = 0;
    s->swap_blocks = s->swap_blocks_used = 0;
    for (int r = 0; r < e->dp; r++) {
        s->kv_blocks += e->sched[r].blocks.n_blocks;
        s->prompt_tokens += e->sched[r].prompt_tokens;
        s->cached_prompt_tokens += e->sched[r].cached_prompt_tokens;
        s->disk_hit_blocks += e->sched[r].disk_hit_blocks;
        s->disk_hit_tokens += e->sched[r].disk_hit_blocks * e->sched[r].cfg.block_size;
        const fl_scheduler *sc = &e->sched[r];
        s->running += sc->n_running;
        s->waiting += sc->w_len;
        s->kv_blocks_used += sc->blocks.n_blocks - fl_kv_blocks_n_available(&sc->blocks);
        /* blocks freed this step (host_pending) are free again from the next */
        s->swap_blocks += sc->cfg.n_host_blocks;
        s->swap_blocks_used += sc->cfg.n_host_blocks - sc->n_host_free - sc->n_host_pending;
    }
}
