/*
 * test_cuda_kv_int8.c — the int8 and fp8 KV caches on the CUDA backend
 * (--kv-cache-dtype int8 | fp8; records in kernels/backend.h,
 * kv_int8_head_dim, e4m3 codes with kv_fp8_codes; each test runs for both)
 * against the CPU backend on the same numbers:
 *  - the store ops: kv_store writes the same record bytes as the CPU's
 *    kv_store from the same bf16 values (codes, scales, untouched padding
 *    rows), at head_dim 64, 80 and 128; rope_kv_store (rotate, then
 *    quantize) writes the records of its own rotated k and of v;
 *  - attention over records the CPU made, uploaded as they are: decode on
 *    the split decode kernel (head_dim 64 / 128; contexts 1 .. 4097, batches
 *    1 / 3 / 19 with padding sequences, GQA groups 1, 4, 7, 9 and 32,
 *    forced split counts 1 and 7), prefill on the tensor-core kernel (111 rows, a
 *    chunked prefill, two query rows a sequence) and the rest on the SIMT
 *    kernel (head_dim 80, a forced SIMT prefill); per output row max |cuda -
 *    cpu| / max |cpu| within 1e-2 (the codes are widened to bf16 times their
 *    scale, 2^-9 relative, and P is rounded to bf16, as for a bf16 cache);
 *  - speed: Llama-3-8B decode shapes (32 / 8 heads, head_dim 128) at batch
 *    64 and 256, context 1024, int8 against bf16 on the same problem sizes,
 *    with the K/V bytes each reads and the device copy rate measured in the
 *    same run (printed, not asserted).
 * Without a GPU (CI) every test skips after saying why.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "tests/test_gpu.h"
#ifdef FL_HAVE_CUDA
#include "kernels/cuda/cuda_attention.h"
#endif

#define BS 16

/* The second pass runs everything over fp8 records (e4m3 codes,
 * kv_fp8_codes): the same layout, other codes. */
static bool g_fp8;
#define TOL 1e-2

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void set_policy(int kernel, int splits) {
#ifdef FL_HAVE_CUDA
    fl_cuda_attention_set_policy((fl_cuda_attn_kernel)kernel, splits, 0);
#else
    (void)kernel;
    (void)splits;
#endif
}

/* Host int8 records of n_slots slots from f32 k / v rows (kv_dim wide),
 * made by the CPU backend's store op. */
static void cpu_records(fl_backend *cpu, const float *k, const float *v, int n_slots, int kv_dim, int hd,
                        uint8_t **k8, uint8_t **v8) {
    const size_t rb = fl_kv_int8_record_bytes(kv_dim, hd);
    *k8 = calloc((size_t)n_slots, rb);
    *v8 = calloc((size_t)n_slots, rb);
    assert_non_null(*k8);
    assert_non_null(*v8);
    int32_t *sl = malloc(sizeof(int32_t) * (size_t)n_slots);
    for (int i = 0; i < n_slots; i++) sl[i] = i;
    cpu->kv_int8_head_dim = hd, cpu->kv_fp8_codes = g_fp8 && cpu->kv_int8_head_dim > 0;
    OK(cpu->ops->kv_store(cpu, k, v, n_slots, kv_dim, kv_dim, sl, *k8, *v8));
    cpu->kv_int8_head_dim = 0, cpu->kv_fp8_codes = false;
    free(sl);
}

static void test_store(void **state) {
    (void)state;
    NEED_GPU();
    fl_backend *cpu;
    OK(fl_backend_cpu_init(&cpu));
    static const int shapes[][2] = {{3, 128}, {8, 64}, {3, 80}, {1, 256}};
    for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++) {
        const int n_kv = shapes[c][0], hd = shapes[c][1], kv_dim = n_kv * hd, n_tok = 5, n_slots = 9;
        const size_t rb = fl_kv_int8_record_bytes(kv_dim, hd);
        float *k = rand_bf16((size_t)n_tok * kv_dim, 3.0f), *v = rand_bf16((size_t)n_tok * kv_dim, 1.0f);
        for (int j = 0; j < hd; j++) k[kv_dim + j] = 0.0f; /* token 1, head 0: all zero (scale 0) */
        const int32_t slots[5] = {4, 0, -1, 8, 2};     /* a padding row is skipped */
        uint8_t *ck = calloc(n_slots, rb), *cv = calloc(n_slots, rb);
        cpu->kv_int8_head_dim = hd, cpu->kv_fp8_codes = g_fp8 && cpu->kv_int8_head_dim > 0;
        OK(cpu->ops->kv_store(cpu, k, v, n_tok, kv_dim, kv_dim, slots, ck, cv));
        cpu->kv_int8_head_dim = 0, cpu->kv_fp8_codes = false;
        void *dk = dev_act(k, (size_t)n_tok * kv_dim), *dv = dev_act(v, (size_t)n_tok * kv_dim);
        void *dsl = dev_raw(slots, sizeof slots), *dck = dev_alloc(n_slots * rb), *dcv = dev_alloc(n_slots * rb);
        OK(g_be->ops->memset0(g_be, dck, n_slots * rb));
        OK(g_be->ops->memset0(g_be, dcv, n_slots * rb));
        g_be->kv_int8_head_dim = hd, g_be->kv_fp8_codes = g_fp8 && g_be->kv_int8_head_dim > 0;
        const fl_status st = g_be->ops->kv_store(g_be, dk, dv, n_tok, kv_dim, kv_dim, dsl, dck, dcv);
        g_be->kv_int8_head_dim = 0, g_be->kv_fp8_codes = false;
        OK(st);
        uint8_t *gk = malloc(n_slots * rb), *gv = malloc(n_slots * rb);
        OK(g_be->ops->download(g_be, gk, dck, n_slots * rb));
        OK(g_be->ops->download(g_be, gv, dcv, n_slots * rb));
        size_t diff = 0;
        for (size_t i = 0; i < n_slots * rb; i++) diff += (gk[i] != ck[i]) + (gv[i] != cv[i]);
        printf("  kv_store %d x %d: %zu of %zu record bytes differ from the CPU's\n", n_kv, hd, diff, 2 * n_slots * rb);
        assert_int_equal(diff, 0);
        free(k), free(v), free(ck), free(cv), free(gk), free(gv);
        dev_free(dk), dev_free(dv), dev_free(dsl), dev_free(dck), dev_free(dcv);
    }

    /* rope_kv_store: k rotated in place, then its records and v's as the
     * CPU store makes them from those rotated bf16 values */
    const int n_heads = 8, n_kv = 2, hd = 128, kv_dim = n_kv * hd, n_tok = 3, qd = n_heads * hd;
    const int stride = qd + 2 * kv_dim, half = hd / 2;
    const size_t rb = fl_kv_int8_record_bytes(kv_dim, hd);
    float *y = rand_bf16((size_t)n_tok * stride, 2.0f);
    float *cs = malloc(sizeof(float) * n_tok * half), *sn = malloc(sizeof(float) * n_tok * half);
    for (int i = 0; i < n_tok * half; i++) cs[i] = cosf(0.37f * i), sn[i] = sinf(0.37f * i);
    const int32_t slots[3] = {1, -1, 0};
    void *dy = dev_act(y, (size_t)n_tok * stride), *dcs = dev_raw(cs, sizeof(float) * n_tok * half);
    void *dsn = dev_raw(sn, sizeof(float) * n_tok * half), *dsl = dev_raw(slots, sizeof slots);
    void *dck = dev_alloc(2 * rb), *dcv = dev_alloc(2 * rb);
    OK(g_be->ops->memset0(g_be, dck, 2 * rb));
    OK(g_be->ops->memset0(g_be, dcv, 2 * rb));
    g_be->kv_int8_head_dim = hd, g_be->kv_fp8_codes = g_fp8 && g_be->kv_int8_head_dim > 0;
    const fl_status st = g_be->ops->rope_kv_store(g_be, dy, (uint16_t *)dy + qd, (uint16_t *)dy + qd + kv_dim, n_tok,
                                                  n_heads, n_kv, hd, stride, stride, dcs, dsn, hd, false, dsl, dck,
                                                  dcv);
    g_be->kv_int8_head_dim = 0, g_be->kv_fp8_codes = false;
    OK(st);
    float *yr = get_act(dy, (size_t)n_tok * stride); /* q and k rotated */
    uint8_t *ck = calloc(2, rb), *cv = calloc(2, rb), *gk = malloc(2 * rb), *gv = malloc(2 * rb);
    cpu->kv_int8_head_dim = hd, cpu->kv_fp8_codes = g_fp8 && cpu->kv_int8_head_dim > 0;
    OK(cpu->ops->kv_store(cpu, yr + qd, yr + qd + kv_dim, n_tok, kv_dim, stride, slots, ck, cv));
    cpu->kv_int8_head_dim = 0, cpu->kv_fp8_codes = false;
    OK(g_be->ops->download(g_be, gk, dck, 2 * rb));
    OK(g_be->ops->download(g_be, gv, dcv, 2 * rb));
    assert_memory_equal(gk, ck, 2 * rb);
    assert_memory_equal(gv, cv, 2 * rb);
    int rotated = 0; /* the rotation happened (k differs from its input somewhere) */
    for (int j = 0; j < kv_dim; j++) rotated += yr[qd + j] != y[qd + j];
    assert_true(rotated > 0);
    printf("  rope_kv_store %d/%d x %d: records equal to the CPU store of the rotated k and of v\n", n_heads, n_kv, hd);
    free(y), free(cs), free(sn), free(yr), free(ck), free(cv), free(gk), free(gv);
    dev_free(dy), dev_free(dcs), dev_free(dsn), dev_free(dsl), dev_free(dck), dev_free(dcv);
    fl_backend_free(cpu);
}

/* One attention problem over int8 records: scattered block tables, the
 * records made by the CPU store, the CPU attention as reference. */
typedef struct prob {
    int n_heads, n_kv, hd, n_seqs, n_rows, max_q, max_ctx, max_blocks, q_stride;
    int32_t *q_start, *ctx_len, *bt;
    float *q, *ref;
    uint8_t *k8, *v8;
    size_t n_slots, rb;
    void *dq, *dk, *dv, *dqs, *dctx, *dbt, *dout;
} prob;

static void prob_init(prob *p, fl_backend *cpu, int n_heads, int n_kv, int hd, int n_seqs, const int *ctx,
                      const int *nq) {
    memset(p, 0, sizeof *p);
    p->n_heads = n_heads, p->n_kv = n_kv, p->hd = hd, p->n_seqs = n_seqs;
    p->q_stride = n_heads * hd;
    p->q_start = malloc(sizeof(int32_t) * (n_seqs + 1));
    p->ctx_len = malloc(sizeof(int32_t) * n_seqs);
    p->q_start[0] = 0;
    for (int s = 0; s < n_seqs; s++) {
        p->q_start[s + 1] = p->q_start[s] + nq[s];
        p->ctx_len[s] = ctx[s];
        p->max_q = nq[s] > p->max_q ? nq[s] : p->max_q;
        p->max_ctx = ctx[s] > p->max_ctx ? ctx[s] : p->max_ctx;
        const int nb = (ctx[s] + BS - 1) / BS;
        p->max_blocks = nb > p->max_blocks ? nb : p->max_blocks;
    }
    if (p->max_blocks == 0) p->max_blocks = 1;
    p->n_rows = p->q_start[n_seqs];
    const int n_blocks = n_seqs * p->max_blocks + 3;
    int32_t *perm = rand_perm(n_blocks);
    p->bt = malloc(sizeof(int32_t) * (size_t)n_seqs * p->max_blocks);
    memcpy(p->bt, perm, sizeof(int32_t) * (size_t)n_seqs * p->max_blocks);
    free(perm);
    const int kv_dim = n_kv * hd;
    p->n_slots = (size_t)n_blocks * BS;
    p->rb = fl_kv_int8_record_bytes(kv_dim, hd);
    float *k = rand_bf16(p->n_slots * kv_dim, 1.0f), *v = rand_bf16(p->n_slots * kv_dim, 1.0f);
    cpu_records(cpu, k, v, (int)p->n_slots, kv_dim, hd, &p->k8, &p->v8);
    free(k), free(v);
    const int rows = p->n_rows > 0 ? p->n_rows : 1;
    p->q = rand_bf16((size_t)rows * p->q_stride, 2.0f);
    p->ref = malloc(sizeof(float) * (size_t)rows * n_heads * hd);
    fl_attn_meta m = {.n_seqs = n_seqs, .q_start = p->q_start, .ctx_len = p->ctx_len, .block_tables = p->bt,
                      .max_blocks = p->max_blocks, .block_size = BS, .max_ctx_len = p->max_ctx, .max_q_len = p->max_q};
    cpu->kv_int8_head_dim = hd, cpu->kv_fp8_codes = g_fp8 && cpu->kv_int8_head_dim > 0;
    OK(cpu->ops->attention(cpu, p->q, p->q_stride, &m, n_heads, n_kv, hd, 1.0f / sqrtf((float)hd), p->k8, p->v8,
                           p->ref));
    cpu->kv_int8_head_dim = 0, cpu->kv_fp8_codes = false;
    p->dq = dev_act(p->q, (size_t)rows * p->q_stride);
    p->dk = dev_raw(p->k8, p->n_slots * p->rb);
    p->dv = dev_raw(p->v8, p->n_slots * p->rb);
    p->dqs = dev_raw(p->q_start, sizeof(int32_t) * (n_seqs + 1));
    p->dctx = dev_raw(p->ctx_len, sizeof(int32_t) * n_seqs);
    p->dbt = dev_raw(p->bt, sizeof(int32_t) * (size_t)n_seqs * p->max_blocks);
    p->dout = dev_alloc(2 * (size_t)rows * n_heads * hd);
}

static fl_attn_meta prob_meta(const prob *p) {
    fl_attn_meta m = {.n_seqs = p->n_seqs, .q_start = p->dqs, .ctx_len = p->dctx, .block_tables = p->dbt,
                      .max_blocks = p->max_blocks, .block_size = BS, .max_ctx_len = p->max_ctx, .max_q_len = p->max_q};
    return m;
}

static void prob_free(prob *p) {
    void *dev[] = {p->dq, p->dk, p->dv, p->dqs, p->dctx, p->dbt, p->dout};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) dev_free(dev[i]);
    free(p->q_start), free(p->ctx_len), free(p->bt), free(p->q), free(p->ref), free(p->k8), free(p->v8);
}

static double check(prob *p, const char *what) {
    const size_t n_out = (size_t)p->n_rows * p->n_heads * p->hd;
    const fl_attn_meta m = prob_meta(p);
    poison_act(p->dout, n_out);
    g_be->kv_int8_head_dim = p->hd, g_be->kv_fp8_codes = g_fp8 && g_be->kv_int8_head_dim > 0;
    const fl_status st = g_be->ops->attention(g_be, p->dq, p->q_stride, &m, p->n_heads, p->n_kv, p->hd,
                                              1.0f / sqrtf((float)p->hd), p->dk, p->dv, p->dout);
    g_be->kv_int8_head_dim = 0, g_be->kv_fp8_codes = false;
    OK(st);
    float *got = get_act(p->dout, n_out);
    const double e = row_err(got, p->ref, (size_t)p->n_rows * p->n_heads, (size_t)p->hd, what);
    free(got);
    printf("  %-64s err %.2e\n", what, e);
    return e;
}

static int g_kernel; /* the kernel policy of the next case (0: automatic, 1: SIMT) */
static void run_case(fl_backend *cpu, const char *tag, int n_heads, int n_kv, int hd, int n_seqs, const int *ctx,
                     const int *nq, const int *splits) {
    prob p;
    prob_init(&p, cpu, n_heads, n_kv, hd, n_seqs, ctx, nq);
    for (int k = 0; k == 0 || (splits && splits[k - 1] >= 0 && splits[k] >= 0); k++) {
        const int S = splits ? splits[k] : 0;
        set_policy(g_kernel, S);
        char what[160];
        snprintf(what, sizeof what, "%s %d/%d hd%d seqs=%d rows=%d ctx<=%d%s%.0d", tag, n_heads, n_kv, hd, n_seqs,
                 p.n_rows, p.max_ctx, S ? " splits=" : "", S);
        const double e = check(&p, what);
        set_policy(0, 0);
        g_kernel = 0;
        if (!(e <= TOL)) fail_msg("%s: error %.3e > %.1e", what, e, TOL);
    }
    prob_free(&p);
}

static void test_attention(void **state) {
    (void)state;
    NEED_GPU();
    fl_backend *cpu;
    OK(fl_backend_cpu_init(&cpu));
    static const int one[19] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    static const int ctxs[] = {1, 17, 128, 129, 500, 4097};
    for (size_t i = 0; i < sizeof ctxs / sizeof ctxs[0]; i++)
        run_case(cpu, "decode b1", 32, 8, 128, 1, &ctxs[i], one, NULL);
    static const int split_list[] = {1, 7, -1};
    run_case(cpu, "decode b1 forced", 32, 8, 128, 1, &ctxs[5], one, split_list);
    const int c3[3] = {300, 0, 129}, nq3[3] = {1, 0, 1};
    run_case(cpu, "decode b3 (padding)", 32, 8, 128, 3, c3, nq3, NULL);
    int c19[19];
    for (int s = 0; s < 19; s++) c19[s] = 1 + (s * 977) % 1500;
    run_case(cpu, "decode b19", 32, 8, 128, 19, c19, one, NULL);
    run_case(cpu, "decode b19 hd64", 8, 8, 64, 19, c19, one, NULL);
    run_case(cpu, "decode b19 hd64 group 4", 32, 8, 64, 19, c19, one, NULL);
    const int c2[2] = {700, 33};
    run_case(cpu, "decode group 7", 28, 4, 128, 2, c2, one, NULL);
    run_case(cpu, "decode MQA", 32, 1, 128, 2, c2, one, NULL);
    /* 9 heads a KV head: slices of 5 and 4 (quantized records: 8 heads a block) */
    run_case(cpu, "decode group 9", 36, 4, 128, 2, c2, one, NULL);
    run_case(cpu, "decode group 9 forced", 36, 4, 128, 1, &ctxs[5], one, split_list);
    run_case(cpu, "decode hd80 (simt)", 16, 4, 80, 3, c3, nq3, NULL);
    const int cp[1] = {111}, np[1] = {111};
    run_case(cpu, "prefill 111", 32, 8, 128, 1, cp, np, NULL);
    run_case(cpu, "prefill 111 hd64", 8, 2, 64, 1, cp, np, NULL);
    const int cc[2] = {300, 90}, nc[2] = {50, 90};
    run_case(cpu, "chunked prefill", 28, 4, 128, 2, cc, nc, NULL);
    const int c2q[3] = {2, 600, 0}, n2q[3] = {2, 2, 0};
    run_case(cpu, "two rows a sequence", 32, 8, 128, 3, c2q, n2q, NULL);
    g_kernel = 1; /* FL_CUDA_ATTN_SIMT */
    run_case(cpu, "prefill 111 (forced simt)", 32, 8, 128, 1, cp, np, NULL);
    g_kernel = 1;
    run_case(cpu, "decode b19 (forced simt)", 32, 8, 128, 19, c19, one, NULL);
    fl_backend_free(cpu);
}

/* Seconds per call, mean of reps synced back to back (one warm-up). */
static double time_attn(void *dq, int q_stride, const fl_attn_meta *m, void *dk, void *dv, void *dout, int hd_i8,
                        int reps) {
    g_be->kv_int8_head_dim = hd_i8, g_be->kv_fp8_codes = g_fp8 && g_be->kv_int8_head_dim > 0;
    OK(g_be->ops->attention(g_be, dq, q_stride, m, 32, 8, 128, 0.088f, dk, dv, dout));
    OK(g_be->ops->sync(g_be));
    const double t0 = now_s();
    for (int r = 0; r < reps; r++) OK(g_be->ops->attention(g_be, dq, q_stride, m, 32, 8, 128, 0.088f, dk, dv, dout));
    OK(g_be->ops->sync(g_be));
    g_be->kv_int8_head_dim = 0, g_be->kv_fp8_codes = false;
    return (now_s() - t0) / reps;
}

static void test_speed(void **state) {
    (void)state;
    NEED_GPU();
    /* the copy rate of this device: 1 GiB device to device */
    const size_t cb = (size_t)1 << 30;
    void *a = dev_alloc(cb), *b = dev_alloc(cb);
    OK(g_be->ops->copy(g_be, b, a, cb));
    OK(g_be->ops->sync(g_be));
    double t0 = now_s();
    for (int r = 0; r < 5; r++) OK(g_be->ops->copy(g_be, b, a, cb));
    OK(g_be->ops->sync(g_be));
    const double copy_gbs = 2.0 * cb * 5 / (now_s() - t0) * 1e-9; /* read + write */
    dev_free(a), dev_free(b);
    printf("  device copy: %.0f GB/s (read + write)\n", copy_gbs);
    static const int batches[] = {64, 256};
    const int ctx = 1024, hd = 128, n_kv = 8, kv_dim = n_kv * hd;
    const size_t rb = fl_kv_int8_record_bytes(kv_dim, hd);
    for (size_t bi = 0; bi < sizeof batches / sizeof batches[0]; bi++) {
        const int B = batches[bi], nbs = ctx / BS;
        const size_t slots = (size_t)B * ctx;
        int32_t *qs = malloc(sizeof(int32_t) * (B + 1)), *cl = malloc(sizeof(int32_t) * B);
        int32_t *bt = malloc(sizeof(int32_t) * (size_t)B * nbs);
        for (int s = 0; s <= B; s++) qs[s] = s;
        for (int s = 0; s < B; s++) cl[s] = ctx;
        for (int i = 0; i < B * nbs; i++) bt[i] = i;
        float *q = rand_bf16((size_t)B * 32 * hd, 1.0f);
        void *dq = dev_act(q, (size_t)B * 32 * hd), *dout = dev_alloc((size_t)B * 32 * hd * 2);
        void *dqs = dev_raw(qs, sizeof(int32_t) * (B + 1)), *dcl = dev_raw(cl, sizeof(int32_t) * B);
        void *dbt = dev_raw(bt, sizeof(int32_t) * (size_t)B * nbs);
        const fl_attn_meta m = {.n_seqs = B, .q_start = dqs, .ctx_len = dcl, .block_tables = dbt, .max_blocks = nbs,
                                .block_size = BS, .max_ctx_len = ctx, .max_q_len = 1};
        /* bf16 cache: zeros are as fast as any values */
        void *kb = dev_alloc(slots * kv_dim * 2), *vb = dev_alloc(slots * kv_dim * 2);
        OK(g_be->ops->memset0(g_be, kb, slots * kv_dim * 2));
        OK(g_be->ops->memset0(g_be, vb, slots * kv_dim * 2));
        const double tb = time_attn(dq, 32 * hd, &m, kb, vb, dout, 0, 20);
        dev_free(kb), dev_free(vb);
        /* quantized records of random codes (no e4m3 NaN) and scales
         * 0.004-0.02: the kernel's per-step power-of-two V scale and its
         * running maxima move as they do on real data, unlike over zeros.
         * 4099 drawn records repeat (a prime, so blocks and tiles fall on
         * other records each round): drawing all of them cost seconds of
         * device time at batch 256. */
        const size_t drawn = 4099;
        uint8_t *rec = malloc(slots * rb);
        assert_non_null(rec);
        for (size_t i = 0; i < slots && i < drawn; i++) {
            uint8_t *r = rec + i * rb;
            for (size_t j = 0; j < rb; j++) r[j] = (uint8_t)(rand() % 0x7f) | (uint8_t)(rand() & 0x80);
            float *sc = (float *)(r + ((kv_dim + 3) & ~3));
            for (int h = 0; h < n_kv; h++) sc[h] = 0.004f + 0.008f * (frand() + 1.0f);
        }
        for (size_t i = drawn; i < slots; i++) memcpy(rec + i * rb, rec + (i % drawn) * rb, rb);
        void *k8 = dev_raw(rec, slots * rb), *v8 = dev_raw(rec, slots * rb);
        free(rec);
        const double t8 = time_attn(dq, 32 * hd, &m, k8, v8, dout, hd, 20);
        dev_free(k8), dev_free(v8);
        const double bytes_b = 2.0 * slots * kv_dim * 2, bytes_8 = 2.0 * slots * (kv_dim + n_kv * 4);
        printf("  decode b%d ctx %d, 32/8 hd128: bf16 %.1f us (%.0f GB/s, %.0f %% of copy), %s %.1f us (%.0f GB/s, "
               "%.0f %% of copy): %.2fx\n", B, ctx, tb * 1e6, bytes_b / tb * 1e-9, bytes_b / tb * 1e-9 / copy_gbs * 100,
               g_fp8 ? "fp8" : "int8", t8 * 1e6, bytes_8 / t8 * 1e-9, bytes_8 / t8 * 1e-9 / copy_gbs * 100, tb / t8);
        free(qs), free(cl), free(bt), free(q);
        dev_free(dq), dev_free(dout), dev_free(dqs), dev_free(dcl), dev_free(dbt);
    }
}

int main(void) {
    const struct CMUnitTest int8[] = {cmocka_unit_test(test_store), cmocka_unit_test(test_attention),
                                      cmocka_unit_test(test_speed)};
    const struct CMUnitTest fp8[] = {cmocka_unit_test(test_store), cmocka_unit_test(test_attention),
                                     cmocka_unit_test(test_speed)};
    int rc = cmocka_run_group_tests(int8, gpu_group_setup, gpu_group_teardown);
    g_fp8 = true;
    return rc | cmocka_run_group_tests(fp8, gpu_group_setup, gpu_group_teardown);
}
