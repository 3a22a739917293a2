/*
 * cmd_plan.c — `flotilla plan`: each rank's memory for a model and layout,
 * predicted from the checkpoint's headers (or a bench preset's config) with
 * no weight read and no device needed (runtime/engine/mem_plan.h): weights
 * by kind as the backend holds them, KV bytes per token and block, the
 * workspaces at the token budget, the KV capacity the budget leaves, and
 * the host swap pool (--swap-space) the engine would make next to it.
 * Exits 1 with the numbers when the weights do not fit.
 */
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "launcher/cli.h"
#include "parallel/groups.h"
#include "runtime/engine/mem_plan.h"
#include "runtime/load/synth.h"

static cJSON *plan_json(const fl_mem_plan *p, int rank, const fl_shard *sh) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "rank", rank);
    cJSON_AddNumberToObject(o, "tp_rank", sh->tp_rank);
    cJSON_AddNumberToObject(o, "ep_rank", sh->ep_rank);
    cJSON *w = cJSON_AddObjectToObject(o, "weight_bytes");
    for (int k = 0; k < FL_MEM_W_KINDS; k++) cJSON_AddNumberToObject(w, fl_mem_weight_kind_name(k), (double)p->weights[k]);
    cJSON_AddNumberToObject(w, "total", (double)p->weights_total);
    cJSON_AddNumberToObject(w, "used_in_place", (double)p->weights_aliased);
    cJSON_AddNumberToObject(o, "checkpoint_pages_read_bytes", (double)p->file_pages);
    cJSON_AddStringToObject(o, "kv_cache_dtype", fl_kv_dtype_name(p->kv_dtype));
    cJSON_AddNumberToObject(o, "kv_heads", p->kv_heads);
    cJSON_AddNumberToObject(o, "head_dim", p->head_dim);
    cJSON_AddNumberToObject(o, "kv_bytes_per_token", (double)p->kv_token_bytes);
    cJSON_AddNumberToObject(o, "kv_bytes_per_block", (double)p->kv_block_bytes);
    cJSON_AddNumberToObject(o, "w4_scratch_bytes", (double)p->w4_scratch);
    cJSON_AddNumberToObject(o, "workspace_bytes", (double)p->workspace);
    cJSON_AddNumberToObject(o, "host_scratch_bytes", (double)p->host_scratch);
    cJSON_AddNumberToObject(o, "logits_bytes", (double)p->logits);
    cJSON_AddNumberToObject(o, "cuda_graph_bytes_estimate", (double)p->graph_estimate);
    cJSON_AddNumberToObject(o, "nccl_bytes_estimate", (double)p->comm_estimate);
    cJSON_AddNumberToObject(o, "budget_bytes", (double)p->budget);
    cJSON_AddNumberToObject(o, "kv_blocks", (double)p->kv_blocks);
    cJSON_AddNumberToObject(o, "kv_tokens", (double)p->kv_tokens);
    cJSON_AddNumberToObject(o, "kv_sequences", p->kv_seqs);
    cJSON_AddNumberToObject(o, "max_model_len", p->max_model_len);
    cJSON_AddBoolToObject(o, "kv_blocks_capped", p->kv_capped);
    cJSON_AddNumberToObject(o, "swap_pool_blocks", (double)p->swap_blocks);
    cJSON_AddNumberToObject(o, "swap_pool_tokens", (double)p->swap_tokens);
    cJSON_AddNumberToObject(o, "swap_pool_bytes", (double)p->swap_bytes);
    if (p->swap_blocks > 0)
        cJSON_AddStringToObject(o, "swap_pool_memory", p->backend == FL_MEM_BACKEND_CPU ? "host, lazy" : "pinned host");
    if (p->backend == FL_MEM_BACKEND_CPU) cJSON_AddNumberToObject(o, "host_bytes_with_full_swap_pool", (double)p->host_total);
    return o;
}

int fl_cmd_plan(int argc, char **argv) {
    const char *model = NULL, *tp_s = NULL, *ep_s = NULL, *dp_s = NULL, *len_s = NULL, *tok_s = NULL,
               *seqs_s = NULL, *bs_s = NULL, *kvd_s = NULL, *util_s = NULL, *budget_s = NULL, *be_s = NULL,
               *quant_s = NULL, *out_s = NULL, *help = NULL;
    const fl_cli_opt own[] = {
        {"model", true, &model, "Hugging Face folder, .gguf file, or a bench preset (llama-3-8b, ...)"},
        {"tp", true, &tp_s, "tensor-parallel ranks (default 1)"},
        {"ep", true, &ep_s, "expert-parallel ranks (default 1)"},
        {"dp", true, &dp_s, "data-parallel replicas (default 1)"},
        {"max-model-len", true, &len_s, "max prompt+completion tokens (default: the model's)"},
        {"max-batched-tokens", true, &tok_s, "tokens per step (default: the engine's for the backend)"},
        {"max-num-seqs", true, &seqs_s, "sequences per step (default 256)"},
        {"block-size", true, &bs_s, "KV block size in tokens (default 16)"},
        {"kv-cache-dtype", true, &kvd_s, "auto | f32 | bf16 | int8 | fp8 (default auto: the backend's)"},
        {"gpu-memory-utilization", true, &util_s, "CUDA: share of device memory to use (default 0.90)"},
        {"memory-budget", true, &budget_s, "BYTES (e.g. 8G) or N%: CUDA: device memory (default 80G, "
                                           "assumed); CPU: the budget (default: the engine's)"},
        {"backend", true, &be_s, "cpu | cuda (default cuda)"},
        {"quantize", true, &quant_s, "none | w4 | fp8"},
        {"output", true, &out_s, "also write the plan as JSON to this file"},
    };
    /* the KV tiers as generate declares them (launcher/cli.c) */
    fl_cli_model_opts mo = {0};
    fl_cli_opt opts[FL_CLI_MAX_OPTS];
    int n_opts = 0;
    for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) opts[n_opts++] = own[i];
    fl_cli_kv_tiers_add(&mo, opts, &n_opts);
    opts[n_opts++] = (fl_cli_opt){"help", false, &help, "show this help"};
    opts[n_opts] = (fl_cli_opt){0};
    if (fl_cli_world_rank() != 0) return 0;
    fl_status st = fl_cli_parse("plan", argc, argv, opts);
    if (st != FL_OK) return fl_cli_fail("plan", st);
    if (help) {
        fl_cli_usage(stdout, "plan", "--model M [--tp T --ep E --dp D] [options]", opts);
        printf("\nReads headers and config only. Exit status 1 when the weights do not fit the budget.\n");
        return 0;
    }
    if (!model) return fl_cli_fail("plan", FL_ERR(FL_ERR_INVALID_ARG, "--model is required"));
    fl_par_layout lay = {.tp = 1, .dp = 1, .ep = 1};
    long v = 0;
    fl_mem_plan_in in = {.block_size = 16, .max_num_seqs = 256, .backend = FL_MEM_BACKEND_CUDA};
    double util = 0.90;
    fl_ckpt *ck = NULL;
    fl_model_config cfg;
    cJSON *root = NULL;
    int rc = 0;
    if (tp_s) {
        FL_TRY_GOTO(fl_cli_int("tp", tp_s, 1, 1 << 16, &v), st, fail);
        lay.tp = (int)v;
    }
    if (ep_s) {
        FL_TRY_GOTO(fl_cli_int("ep", ep_s, 1, 1 << 16, &v), st, fail);
        lay.ep = (int)v;
    }
    if (dp_s) {
        FL_TRY_GOTO(fl_cli_int("dp", dp_s, 1, 1 << 16, &v), st, fail);
        lay.dp = (int)v;
    }
    if (len_s) {
        FL_TRY_GOTO(fl_cli_int("max-model-len", len_s, 2, 1 << 24, &v), st, fail);
        in.max_model_len = (int)v;
    }
    if (seqs_s) {
        FL_TRY_GOTO(fl_cli_int("max-num-seqs", seqs_s, 1, 4096, &v), st, fail);
        in.max_num_seqs = (int)v;
    }
    if (bs_s) {
        FL_TRY_GOTO(fl_cli_int("block-size", bs_s, 1, 1024, &v), st, fail);
        in.block_size = (int)v;
    }
    if (tok_s) {
        FL_TRY_GOTO(fl_cli_int("max-batched-tokens", tok_s, 1, 1 << 20, &v), st, fail);
        in.max_num_batched_tokens = (int)v;
    }
    if (kvd_s) FL_TRY_GOTO(fl_kv_dtype_parse(kvd_s, &in.kv_dtype), st, fail);
    fl_engine_config ec; /* the engine's defaults for the tiers */
    fl_engine_config_default(&ec);
    FL_TRY_GOTO(fl_cli_kv_tiers(&mo, &ec.swap_space_bytes, &ec.kv_offload_dir), st, fail);
    in.swap_space_bytes = ec.swap_space_bytes;
    if (util_s) FL_TRY_GOTO(fl_cli_float("gpu-memory-utilization", util_s, 0.01, 1.0, &util), st, fail);
    if (be_s && !strcmp(be_s, "cpu"))
        in.backend = FL_MEM_BACKEND_CPU;
    else if (be_s && strcmp(be_s, "cuda")) {
        st = FL_ERR(FL_ERR_INVALID_ARG, "--backend must be cpu or cuda, got '%s'", be_s);
        goto fail;
    }
    FL_TRY_GOTO(fl_cli_quant(quant_s, &in.quant), st, fail);
    const bool cuda = in.backend == FL_MEM_BACKEND_CUDA;
    if (!in.max_num_batched_tokens) in.max_num_batched_tokens = fl_mem_default_batched_tokens(in.backend);
    struct stat sb;
    if (stat(model, &sb) == 0) {
        FL_TRY_GOTO(fl_ckpt_open(model, &ck), st, fail);
        FL_TRY_GOTO(fl_ckpt_model_config(ck, &cfg), st, fail);
        in.ck = ck;
    } else {
        fl_status ps = fl_synth_preset(model, &cfg);
        if (ps != FL_OK) {
            char why[512];
            snprintf(why, sizeof why, "%s", fl_error_msg());
            st = FL_ERR(FL_ERR_NOT_FOUND, "--model %s: no such file or folder, and %s", model, why);
            goto fail;
        }
    }
    in.cfg = &cfg;
    FL_TRY_GOTO(fl_model_fp8_supported(&cfg, in.quant), st, fail); /* what loading would refuse */
    lay.world = lay.tp * lay.dp;
    fl_par_shape shape = {.n_heads = cfg.n_heads, .n_kv_heads = cfg.n_kv_heads, .n_experts = cfg.n_experts,
                          .intermediate = cfg.intermediate_size};
    FL_TRY_GOTO(fl_par_layout_check(&lay, &shape), st, fail);
    in.tp = lay.tp;
    in.dp = lay.dp;
    /* the budget */
    const char *budget_note = "";
    size_t budget = 0;
    const bool pct = budget_s && budget_s[0] && budget_s[strlen(budget_s) - 1] == '%';
    if (pct && cuda) {
        st = FL_ERR(FL_ERR_INVALID_ARG, "--memory-budget N%% is a share of host memory (CPU backend); "
                    "for CUDA give the device memory in bytes and --gpu-memory-utilization");
        goto fail;
    }
    if (budget_s) {
        FL_TRY_GOTO(fl_mem_parse_size("memory-budget", budget_s, &budget), st, fail);
        if (pct) budget_note = " (of MemAvailable)";
    } else if (cuda) {
        budget = (size_t)80 << 30;
        budget_note = " (assumed 80 GiB device: pass --memory-budget)";
    } else {
        budget = fl_mem_cpu_default_budget();
        budget_note = " (the engine's default)";
    }
    in.budget = cuda ? (size_t)(util * (double)budget) : budget;
    printf("model      %s (%s)\n", model, ck ? fl_ckpt_format(ck) : "preset");
    printf("layout     tp %d, dp %d, ep %d; backend %s; KV %s; max-batched-tokens %d, max-num-seqs %d\n", lay.tp,
           lay.dp, lay.ep, cuda ? "cuda" : "cpu", fl_kv_dtype_name(fl_kv_dtype_resolve(in.kv_dtype, in.backend)),
           in.max_num_batched_tokens, in.max_num_seqs);
    if (cuda)
        printf("budget     %.2f GiB device x %.2f = %.2f GiB%s\n", budget / 1073741824.0, util,
               in.budget / 1073741824.0, budget_note);
    else
        printf("budget     %.2f GiB%s\n", budget / 1073741824.0, budget_note);
    printf("swap space %.2f GiB per rank (--swap-space)\n", in.swap_space_bytes / 1073741824.0);
    if (ec.kv_offload_dir)
        printf("KV on disk %s: prefix-cached KV blocks are written there and read back by later jobs "
               "(files, no memory)\n", ec.kv_offload_dir);
    root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "model", model);
    cJSON_AddStringToObject(root, "backend", cuda ? "cuda" : "cpu");
    cJSON_AddNumberToObject(root, "tp", lay.tp);
    cJSON_AddNumberToObject(root, "dp", lay.dp);
    cJSON_AddNumberToObject(root, "ep", lay.ep);
    cJSON_AddNumberToObject(root, "max_num_batched_tokens", in.max_num_batched_tokens);
    cJSON_AddNumberToObject(root, "max_num_seqs", in.max_num_seqs);
    cJSON_AddNumberToObject(root, "swap_space_bytes", (double)in.swap_space_bytes);
    if (ec.kv_offload_dir) cJSON_AddStringToObject(root, "kv_offload_dir", ec.kv_offload_dir);
    cJSON *ranks = cJSON_AddArrayToObject(root, "ranks");
    const int ex_size = lay.dp > 1 ? 1 : lay.world / lay.ep;
    int64_t min_blocks = -1;
    fl_status fit = FL_OK;
    for (int r = 0; r < lay.world; r++) {
        fl_par_coords co = fl_par_coords_of(&lay, r);
        in.shard = (fl_shard){.tp_rank = co.tp_rank, .tp_size = lay.tp, .ep_rank = co.ep_rank, .ep_size = lay.ep,
                              .ex_rank = ex_size > 1 ? co.ep_group : 0, .ex_size = ex_size};
        fl_mem_plan p;
        FL_TRY_GOTO(fl_mem_plan_compute(&in, &p), st, fail);
        printf("\nrank %d (tp rank %d, ep rank %d)\n", r, co.tp_rank, co.ep_rank);
        fl_mem_plan_print(&p, "  ", stdout);
        cJSON_AddItemToArray(ranks, plan_json(&p, r, &in.shard));
        if (min_blocks < 0 || p.kv_blocks < min_blocks) min_blocks = p.kv_blocks;
        fl_status c = fl_mem_plan_check(&p);
        if (c != FL_OK && fit == FL_OK) {
            char why[512];
            snprintf(why, sizeof why, "%s", fl_error_msg());
            fit = FL_ERR(c, "rank %d: %s", r, why);
        }
    }
    cJSON_AddNumberToObject(root, "kv_blocks_min", (double)min_blocks);
    cJSON_AddBoolToObject(root, "fits", fit == FL_OK);
    if (out_s) {
        char *txt = cJSON_Print(root);
        FILE *f = txt ? fopen(out_s, "w") : NULL;
        bool ok = f && fputs(txt, f) >= 0 && fputc('\n', f) != EOF;
        if (f && fclose(f)) ok = false;
        free(txt);
        if (!ok) {
            st = FL_ERR(FL_ERR_IO, "cannot write %s", out_s);
            goto fail;
        }
    }
    if (fit != FL_OK) {
        st = fit;
        goto fail;
    }
    printf("\nthe job: %lld KV blocks per rank (the minimum over ranks)\n", (long long)min_blocks);
    goto done;
fail:
    rc = fl_cli_fail("plan", st);
done:
    cJSON_Delete(root);
    fl_ckpt_free(ck);
    return rc;
}
