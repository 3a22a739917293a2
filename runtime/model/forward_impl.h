/*
 * forward_impl.h — the body of fl_forward, shared by the files of the
 * forward pass (forward.c: attention, MLA, the layer loop, logits;
 * forward_moe.c: expert routing and the MoE block). Not a public header.
 */
#ifndef FL_FORWARD_IMPL_H
#define FL_FORWARD_IMPL_H

#include "kernels/layer.h"
#include "runtime/model/forward.h"

struct fl_forward {
    fl_model *m;
    fl_comm *comm;       /* NULL: whole model on this rank */
    fl_comm_dtype comm_dt;
    bool comm_inline;   /* NCCL enqueues on the backend's stream: no host syncs */
    fl_kv_cache *kv;
    fl_forward_limits lim;
    fl_forward_config cfg;
    int rot_dim;
    int inter_max;
    float attn_scale;    /* softmax scale */
    /* device activations */
    void *x, *h, *q, *k, *v, *attn, *o, *gate, *up, *act, *router, *moe_in, *moe_out, *moe_acc,
        *sgate, *head_in, *logits, *ckv, *qa, *lat;
    /* device tables */
    int32_t *d_plan;
    void *layer_ws; /* decode_layer's workspace (FL_DECODE_LAYER_WS_BYTES), when the backend has it */
    fl_layer_desc *layers; /* [n_layers]: the model's layers for kernels/layer.h and decode_layer */
    bool layer_op;  /* decode steps run the backend's decode_layer (FL_DECODE_LAYER) */
    float *d_cos, *d_sin;
    int32_t *d_moe_ids, *d_moe_idx;
    float *d_moe_w, *d_moe_wsorted;
    /* host scratch */
    float *h_cos, *h_sin;
    int32_t *h_moe_ids, *h_moe_idx;
    float *h_moe_w, *h_moe_wsorted;
    int *h_counts;
    float *h_logits_local, *h_logits_all; /* [max_logits, local vocab], [max_logits, vocab] */
    void *d_logits_all;                    /* [max_logits, vocab] device (NCCL gather) */
    size_t *gather_counts;                 /* [group size] */
    float *d_pick, *d_pick_all;            /* greedy steps: [max_logits, 2] (value, id) of this rank's
                                              vocabulary, [group][max_logits, 2] (NCCL gather) */
    float *h_pick;                         /* [group][max_logits, 2] host */
    /* sampled steps (forward_pick.c), allocated at the first one */
    fl_sample_row *d_smp_rows;             /* [max_logits] */
    int32_t *d_smp_hist, *d_smp_out;       /* [smp_hist_cap], [max_logits, 2] */
    int32_t *h_smp_out;                    /* [max_logits, 2] host */
    void *d_smp_ws;                        /* sample_rows_ws(max_logits, vocab) bytes */
    void *d_smp_x;                         /* tensor parallelism: [max_logits, vocab] activations,
                                              the gathered rows in id order */
    float *h_smp_x;                        /* the same on the host (MPI) */
    size_t smp_hist_cap;
    int smp_can;                           /* fl_forward_can_sample's answer; -1: not asked yet */
    const fl_sample_row *smp_rows;         /* the next sampled plan's rows (host, the caller's) */
    const int32_t *smp_hist;
    int smp_n;
    size_t smp_n_hist;
    struct fl_moe_a2a *a2a;                /* dp > 1: the MoE all-to-all exchange (forward_moe.c),
                                              NULL: every rank holds every token (dp = 1) */
    struct fl_fwd_graph *graph;            /* decode-step graphs and timer (forward_graph.c) */
    struct fl_moe_dev *moe_dev;            /* experts routed on the device (forward_moe_dev.c),
                                              NULL: routed on the host */
    unsigned skip;                         /* FL_DIAG_SKIP (forward_skip.h): ops left out, timing only */
    bool moe_count;                        /* this step's MoE layers count their experts
                                              (fl_forward_moe_expert_reads: decode steps) */
};

/* Sums a [n] activation buffer across the group (row-parallel layers). */
fl_status fl_forward_reduce(fl_forward *f, void *buf, size_t n);
/* Dense SiLU-gated MLP: out[n, hidden] = down(silu(gate(x)) * up(x)). */
fl_status fl_forward_mlp(fl_forward *f, const fl_mlp_weights *w, const void *x, int n, void *out);
/* Routed experts (+ shared experts) for n rows of the normed input f->h,
 * reduced over the group into f->moe_acc (the caller adds it to the
 * residual, fused with the next norm). With next_norm (may be NULL) it may
 * do that add and norm itself (f->x += the sum, f->h = rmsnorm(f->x) *
 * next_norm, fused with the experts' combine where no reduction sits
 * between them: moe_combine_add_rmsnorm) and then sets *normed. */
fl_status fl_forward_moe(fl_forward *f, const fl_layer_weights *w, int n, const fl_tensor *next_norm, bool *normed);

/* dp > 1 (replicas hold different tokens): switches the MoE layers to the
 * all-to-all dispatch/combine of the routed tokens over ep_comm (this rank's
 * expert-parallel group; backend memory like f->comm) and sizes its buffers.
 * The model must hold whole experts (shard ex_size 1). Called by the engine
 * right after fl_forward_init; ep_comm stays the caller's. */
fl_status fl_forward_moe_enable_a2a(fl_forward *f, fl_comm *ep_comm);
/* A step with no tokens for this replica: with the all-to-all exchange on,
 * joins every MoE layer's exchange (serving the other replicas' tokens routed
 * to this rank's experts); otherwise nothing. */
fl_status fl_forward_moe_idle(fl_forward *f);
/* Frees what fl_forward_moe_enable_a2a allocated (from fl_forward_free). */
void fl_forward_moe_free(fl_forward *f);

/* Adds one MoE layer of the current step to fl_forward_moe_expert_reads
 * (when f->moe_count): `distinct` local experts read, or -1 when the path
 * cannot tell without a sync. */
void fl_forward_moe_count_experts(const fl_forward *f, int distinct);
/* The router's top-k rules for this model (moe_topk's fl_moe_route). */
fl_moe_route fl_forward_moe_route(const fl_model_config *c);
/* Device-routed experts (forward_moe_dev.c). init decides whether the
 * backend and the model allow it (FL_MOE_DEVICE, FL_MOE_DEVICE_MAX_N) and
 * uploads the expert tables; covers: whether a step of n rows takes it;
 * experts: the routed experts of layer w for n rows of f->h written into
 * f->moe_acc (combine false: left in the experts' rows for the fused
 * combine below), with no host sync. */
fl_status fl_forward_moe_dev_init(fl_forward *f);
void fl_forward_moe_dev_free(fl_forward *f);
bool fl_forward_moe_dev_covers(const fl_forward *f, int n);
int fl_forward_moe_dev_max_n(const fl_forward *f);
fl_status fl_forward_moe_dev_experts(fl_forward *f, const fl_layer_weights *w, int n, bool combine);
/* The combine left out by fl_forward_moe_dev_experts(..., false), fused
 * with the shared experts' sum extra (NULL: none), the residual add into
 * f->x and the next norm into f->h. */
/* The device path's expert counts of the step just run: replayed marks a
 * graph replay (its layers ran here without the body); collect, after the
 * step's sync, counts the distinct experts of each layer's grouping into
 * fl_forward_moe_expert_reads where they can be read (forward_moe.h). */
void fl_forward_moe_dev_replayed(fl_forward *f);
fl_status fl_forward_moe_dev_collect(fl_forward *f);
fl_status fl_forward_moe_dev_combine_norm(fl_forward *f, int n, const void *extra, const fl_tensor *norm);

/* Rank r's share of the vocabulary: ids [lo, lo + n). */
void fl_forward_vocab_shard(const fl_forward *f, int r, int *lo, int *n);
/* The collective half of gathering the logit rows over f->comm: every
 * rank's [rows][its vocabulary] block, rank after rank, lands in
 * f->h_logits_all (MPI, host f32) or f->d_logits_all (NCCL, activations);
 * every rank of the group calls it. */
fl_status fl_forward_gather_shards(fl_forward *f, int rows);
/* The gathered shards in f->h_logits_all laid out as dst[rows, vocab]. */
void fl_forward_shards_to_rows(const fl_forward *f, int rows, float *dst);

/* Greedy steps (forward_pick.c): buffers sized at init, freed with f. */
fl_status fl_forward_pick_init(fl_forward *f);
void fl_forward_pick_free(fl_forward *f);
/* The argmax token of each of the rows projected to logits (f->logits, this
 * rank's vocabulary shard), taken across the group; ids (host) may be NULL
 * on ranks that do not sample. Collective over f->comm. */
fl_status fl_forward_pick_greedy(fl_forward *f, int rows, int32_t *ids);
/* The sampled token of each row, by the backend's sample_rows over the rows
 * fl_forward_set_sampling gave; collective over f->comm (the shards'
 * gather), ids NULL on the ranks that do not sample. */
fl_status fl_forward_pick_sampled(fl_forward *f, int rows, int32_t *ids);

#endif /* FL_FORWARD_IMPL_H */
