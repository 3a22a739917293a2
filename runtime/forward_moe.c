/*
 * forward_moe.c — the Mixture-of-Experts block of the forward pass.
 *
 * Generic path for every backend: the router's top-k is brought to the host
 * (softmax top-k for Mixtral/Qwen, DeepSeek's greedy or group-limited
 * routing with its scaling), the routed (token, expert) pairs are sorted by
 * expert, and each of this rank's active experts runs one MLP over exactly
 * its tokens (gather -> MLP -> weighted scatter-add). Only active experts'
 * weights are read. A backend with a fused grouped GEMM can replace this
 * without touching the rest of the pass.
 */
#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/forward_impl.h"

/* DeepSeek-V2 routing on the host, as DeepseekV2TopkRouter: p = softmax of
 * the router logits (f32); group_limited_greedy keeps the topk_group groups
 * with the largest max-p (others' p set to 0); top-k of p (ties: lower id);
 * weights p * routed_scaling_factor, or p renormalized to sum 1 when
 * norm_topk_prob and k > 1 (DeepSeek's modeling code; see model_config.c). */
static fl_status deepseek_route(const fl_model_config *c, const float *logits, int n, int32_t *ids,
                                float *weights) {
    const int E = c->n_experts, K = c->n_experts_per_tok, G = c->n_group > 0 ? c->n_group : 1;
    const int per = E / G;
    if (E > 1024 || E % G || K > E)
        return FL_ERR(FL_ERR_INTERNAL, "deepseek routing: %d experts, %d groups, top-%d", E, G, K);
    float p[1024], gs[1024];
    for (int i = 0; i < n; i++) {
        const float *l = logits + (int64_t)i * E;
        float mx = -FLT_MAX;
        for (int e = 0; e < E; e++) mx = l[e] > mx ? l[e] : mx;
        float sum = 0;
        for (int e = 0; e < E; e++) sum += p[e] = expf(l[e] - mx);
        for (int e = 0; e < E; e++) p[e] /= sum;
        if (c->topk_method == FL_TOPK_GROUP_LIMITED && c->topk_group < G) {
            for (int g = 0; g < G; g++) {
                gs[g] = -1;
                for (int e = g * per; e < (g + 1) * per; e++) gs[g] = p[e] > gs[g] ? p[e] : gs[g];
            }
            bool keep[1024] = {false};
            for (int j = 0; j < c->topk_group; j++) {
                int best = -1;
                for (int g = 0; g < G; g++)
                    if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
                keep[best] = true;
            }
            for (int e = 0; e < E; e++)
                if (!keep[e / per]) p[e] = 0;
        }
        float wsum = 0;
        for (int j = 0; j < K; j++) {
            int best = -1;
            for (int e = 0; e < E; e++)
                if (p[e] >= 0 && (best < 0 || p[e] > p[best])) best = e;
            ids[(int64_t)i * K + j] = best;
            weights[(int64_t)i * K + j] = p[best];
            wsum += p[best];
            p[best] = -1; /* taken */
        }
        const bool renorm = c->norm_topk_prob && K > 1;
        for (int j = 0; j < K; j++)
            weights[(int64_t)i * K + j] =
                renorm ? weights[(int64_t)i * K + j] / (wsum + 1e-20f)
                       : weights[(int64_t)i * K + j] * c->routed_scaling_factor;
    }
    return FL_OK;
}

/* Routed experts (+ shared expert) for n rows of normed input f->h; the
 * result is added into the residual f->x. */
fl_status fl_forward_moe(fl_forward *f, const fl_layer_weights *w, int n) {
    fl_backend *be = f->m->be;
    const fl_model_config *c = &f->m->cfg;
    const int E = c->n_experts, K = c->n_experts_per_tok, H = c->hidden_size;
    const int e_lo = f->m->dims.expert_lo, n_local = f->m->dims.n_experts;
    const bool renorm = c->arch == FL_ARCH_MIXTRAL || c->norm_topk_prob;
    FL_TRY(be->ops->matmul(be, f->h, n, &w->router, NULL, f->router));
    if (c->arch == FL_ARCH_DEEPSEEK_V2) {
        FL_TRY(be->ops->download_act(be, f->h_router, f->router, (size_t)n * E));
        FL_TRY(deepseek_route(c, f->h_router, n, f->h_moe_ids, f->h_moe_w));
    } else {
        FL_TRY(be->ops->moe_topk(be, f->router, n, E, K, renorm, f->d_moe_ids, f->d_moe_w));
        FL_TRY(be->ops->download(be, f->h_moe_ids, f->d_moe_ids, (size_t)n * K * 4));
        FL_TRY(be->ops->download(be, f->h_moe_w, f->d_moe_w, (size_t)n * K * 4));
    }
    /* Counting sort of (token, expert) pairs by expert. */
    int *cnt = f->h_counts;
    memset(cnt, 0, ((size_t)E + 1) * sizeof(int));
    for (int i = 0; i < n * K; i++) {
        int e = f->h_moe_ids[i];
        if (e < 0 || e >= E) return FL_ERR(FL_ERR_INTERNAL, "router picked expert %d of %d", e, E);
        cnt[e + 1]++;
    }
    for (int e = 0; e < E; e++) cnt[e + 1] += cnt[e];
    for (int i = 0; i < n * K; i++) {
        int e = f->h_moe_ids[i], at = cnt[e]++;
        f->h_moe_idx[at] = i / K;
        f->h_moe_wsorted[at] = f->h_moe_w[i];
    }
    /* cnt[e] is now the end of expert e's range; its start is cnt[e-1]. */
    FL_TRY(be->ops->upload(be, f->d_moe_idx, f->h_moe_idx, (size_t)n * K * 4));
    FL_TRY(be->ops->upload(be, f->d_moe_wsorted, f->h_moe_wsorted, (size_t)n * K * 4));
    FL_TRY(be->ops->memset0(be, f->moe_acc, fl_backend_act_bytes(be, (size_t)n * H)));
    /* This rank runs its own experts only; the reduction below adds the rest. */
    for (int e = e_lo; e < e_lo + n_local; e++) {
        int lo = e ? cnt[e - 1] : 0, ne = cnt[e] - lo;
        if (ne == 0) continue;
        FL_TRY(be->ops->gather_rows(be, f->h, f->d_moe_idx + lo, ne, H, f->moe_in));
        FL_TRY(fl_forward_mlp(f, &w->experts[e - e_lo], f->moe_in, ne, f->moe_out));
        FL_TRY(be->ops->scatter_add_rows(be, f->moe_acc, f->moe_out, f->d_moe_idx + lo,
                                         f->d_moe_wsorted + lo, ne, H));
    }
    if (w->has_shared) {
        FL_TRY(fl_forward_mlp(f, &w->shared, f->h, n, f->moe_out));
        if (w->shared_gate.data) { /* Qwen2-MoE gates its shared expert; DeepSeek does not */
            FL_TRY(be->ops->matmul(be, f->h, n, &w->shared_gate, NULL, f->sgate));
            FL_TRY(be->ops->sigmoid_scale_rows(be, f->moe_out, f->sgate, n, H));
        }
        FL_TRY(be->ops->add(be, f->moe_acc, f->moe_out, (size_t)n * H));
    }
    FL_TRY(fl_forward_reduce(f, f->moe_acc, (size_t)n * H));
    return be->ops->add(be, f->x, f->moe_acc, (size_t)n * H);
}

