/*
 * test_kv_int8.c — the int8 and fp8 KV caches of the CPU backend
 * (--kv-cache-dtype int8 | fp8; the same records, int8 or e4m3 codes): the
 * store op's records (codes and per-head scales), attention over
 * them against attention over the f32 cache on awkward shapes, the logits
 * of every GQA golden fixture with int8 against f32 KV (worst error per
 * fixture printed, bounded by a stated tolerance), greedy agreement on the
 * demo model, and the refusals (MLA on a backend without int8 MLA records;
 * a cache that is not whole heads). MLA records are two "heads" of half a
 * record each (the latent's first half; its second half and the rotary
 * key), each with its own scale.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "runtime/engine/engine.h"
#include "tests/test_util.h"

/* Worst |logit(int8) - logit(f32)| over a fixture's prompt, relative to the
 * largest |logit(f32)| of the same row: 5 %. Measured worst 2.8 %
 * (llama_tied_rope3; the fixtures' random weights make near-uniform
 * attention and small logits, the hard case); the quantization step is
 * absmax / 127 per head and token. The argmax must agree everywhere. */
#define LOGIT_REL_TOL 0.05

/* One run of each test per record kind. fp8 (e4m3, 3 mantissa bits) rounds
 * each value to 1/16 of its size, int8 to 1/254 of the head's absmax: its
 * tolerances are wider. Measured fp8 on the fixtures without experts: worst
 * 12.9 % (llama_tied_rope3), argmax flips only at near-ties; the demo model
 * 10.5 %. */
typedef struct kvq {
    fl_kv_dtype d;
    bool fp8;
    const char *name;
    double logit_tol, demo_tol;
} kvq;
static const kvq INT8 = {FL_KV_DTYPE_INT8, false, "int8", LOGIT_REL_TOL, 0.10};
static const kvq FP8 = {FL_KV_DTYPE_FP8, true, "fp8", 0.15, 0.20};
/* not a quantized record: the 16-bit cache under f32 activations (demo only) */
static const kvq BF16 = {FL_KV_DTYPE_BF16, false, "bf16", 0, 0.02};

/* a record's code as a value (the scale apart) */
static float code_value(const kvq *k, uint8_t c) { return k->fp8 ? fl_f8e4m3_to_f32(c) : (float)(int8_t)c; }

static uint64_t rs = 0x1234567;
static float frand(void) {
    rs = rs * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rs >> 40) * (1.0 / 16777216.0)) * 2 - 1;
}

static void test_store_records(void **state) {
    const kvq *kq = *state;
    fl_backend *be;
    assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
    const int heads = 3, hd = 10, kv_dim = heads * hd, slots = 5; /* kv_dim 30: padded to 32 */
    const size_t rb = fl_kv_int8_record_bytes(kv_dim, hd);
    assert_int_equal(rb, 48); /* 32 values + 3 scales, padded to 16 bytes */
    uint8_t *kc = calloc(slots, rb), *vc = calloc(slots, rb);
    float k[2][30], v[2][30];
    for (int t = 0; t < 2; t++)
        for (int i = 0; i < kv_dim; i++) k[t][i] = 3 * frand(), v[t][i] = frand();
    k[1][hd] = -7.0f; /* head 1's absmax, negative */
    be->kv_int8_head_dim = hd;
    be->kv_fp8_codes = kq->fp8;
    const int32_t sl[2] = {3, -1}; /* a padding row is skipped */
    assert_int_equal(be->ops->kv_store(be, k, v, 2, kv_dim, kv_dim, sl, kc, vc), FL_OK);
    const uint8_t *q = kc + 3 * rb;
    const float *sc = (const float *)(kc + 3 * rb + 32);
    for (int h = 0; h < heads; h++) {
        float mx = 0;
        for (int j = 0; j < hd; j++) mx = fmaxf(mx, fabsf(k[0][h * hd + j]));
        assert_float_equal(sc[h], mx / (kq->fp8 ? 448.0f : 127.0f), 1e-7);
        for (int j = 0; j < hd; j++) {
            const float x = k[0][h * hd + j], got = code_value(kq, q[h * hd + j]) * sc[h];
            if (kq->fp8) { /* e4m3 of x / scale: half a step of 2^-3 relative, or of the subnormals' 2^-9 */
                assert_int_equal(q[h * hd + j], fl_f32_to_f8e4m3(x * (1.0f / sc[h])));
                assert_true(fabsf(got - x) <= fabsf(x) * 0x1p-4f + sc[h] * 0x1p-10f + 1e-6f);
            } else {
                assert_true(fabsf(got - x) <= sc[h] * 0.5f + 1e-6f);
            }
        }
    }
    for (size_t i = 0; i < rb; i++) assert_int_equal(kc[1 * rb + i], 0); /* slot 1 untouched */
    free(kc);
    free(vc);
    be->kv_int8_head_dim = 0;
    be->kv_fp8_codes = false;
    fl_backend_free(be);
}

/* Attention over int8 (fp8) records vs over the f32 cache holding the same
 * (dequantized) values: equal up to f32 rounding, so the op reads the
 * records right; vs the original values: within the quantization error. */
static void test_attention(void **state) {
    const kvq *kq = *state;
    fl_backend *be;
    assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
    const int n_heads = 6, n_kv = 2, hd = 40, kv_dim = n_kv * hd, bs = 3, n_seqs = 2, max_blocks = 19;
    const int ctx[2] = {55, 19}, nq[2] = {5, 19}, n_slots = 48 * bs;
    const size_t rb = fl_kv_int8_record_bytes(kv_dim, hd);
    float *kf = calloc((size_t)n_slots * kv_dim, 4), *vf = calloc((size_t)n_slots * kv_dim, 4);
    float *kd = calloc((size_t)n_slots * kv_dim, 4), *vd = calloc((size_t)n_slots * kv_dim, 4);
    uint8_t *k8 = calloc(n_slots, rb), *v8 = calloc(n_slots, rb);
    int32_t bt[2 * 19], qs[3] = {0, nq[0], nq[0] + nq[1]}, cl[2] = {ctx[0], ctx[1]};
    for (int i = 0; i < 2 * max_blocks; i++) bt[i] = (i * 7 + 3) % 48; /* scattered blocks, distinct per sequence */
    for (int s = 0; s < n_seqs; s++)
        for (int t = 0; t < ctx[s]; t++) {
            const int32_t slot = bt[s * max_blocks + t / bs] * bs + t % bs;
            float k[80], v[80];
            for (int i = 0; i < kv_dim; i++) k[i] = 2 * frand(), v[i] = frand();
            memcpy(kf + (size_t)slot * kv_dim, k, sizeof k);
            memcpy(vf + (size_t)slot * kv_dim, v, sizeof v);
            be->kv_int8_head_dim = hd;
            be->kv_fp8_codes = kq->fp8;
            assert_int_equal(be->ops->kv_store(be, k, v, 1, kv_dim, kv_dim, &slot, k8, v8), FL_OK);
            for (int h = 0; h < n_kv; h++) { /* the dequantized copy, for the reference */
                const uint8_t *kc = k8 + slot * rb, *vc = v8 + slot * rb;
                const float ks = ((const float *)(k8 + slot * rb + kv_dim))[h];
                const float vs = ((const float *)(v8 + slot * rb + kv_dim))[h];
                for (int j = 0; j < hd; j++) {
                    kd[(size_t)slot * kv_dim + h * hd + j] = ks * code_value(kq, kc[h * hd + j]);
                    vd[(size_t)slot * kv_dim + h * hd + j] = vs * code_value(kq, vc[h * hd + j]);
                }
            }
            be->kv_int8_head_dim = 0;
            be->kv_fp8_codes = false;
        }
    const int rows = nq[0] + nq[1];
    float *q = malloc(sizeof(float) * rows * n_heads * hd);
    for (int i = 0; i < rows * n_heads * hd; i++) q[i] = frand();
    fl_attn_meta m = {.n_seqs = n_seqs, .q_start = qs, .ctx_len = cl, .block_tables = bt, .max_blocks = max_blocks,
                      .block_size = bs, .max_ctx_len = 55, .max_q_len = 19};
    const size_t on = (size_t)rows * n_heads * hd;
    float *o8 = malloc(on * 4), *od = malloc(on * 4), *of = malloc(on * 4);
    const float scale = 1.0f / sqrtf((float)hd);
    assert_int_equal(be->ops->attention(be, q, n_heads * hd, &m, n_heads, n_kv, hd, scale, kf, vf, of), FL_OK);
    assert_int_equal(be->ops->attention(be, q, n_heads * hd, &m, n_heads, n_kv, hd, scale, kd, vd, od), FL_OK);
    be->kv_int8_head_dim = hd;
    be->kv_fp8_codes = kq->fp8;
    assert_int_equal(be->ops->attention(be, q, n_heads * hd, &m, n_heads, n_kv, hd, scale, k8, v8, o8), FL_OK);
    be->kv_int8_head_dim = 0;
    be->kv_fp8_codes = false;
    double e_same = 0, e_orig = 0;
    for (size_t i = 0; i < on; i++) {
        e_same = fmax(e_same, fabs(o8[i] - od[i]));
        e_orig = fmax(e_orig, fabs(o8[i] - of[i]));
    }
    printf("  attention %s records vs dequantized f32: %.2e; vs the original values: %.2e\n", kq->name, e_same,
           e_orig);
    assert_true(e_same < 1e-5);
    /* values in [-1, 1]: an int8 step is <= 1/127, an e4m3 one <= 1/8 of the value */
    assert_true(e_orig < (kq->fp8 ? 0.05 : 0.02));
    free(kf), free(vf), free(kd), free(vd), free(k8), free(v8), free(q), free(o8), free(od), free(of);
    fl_backend_free(be);
}

/* The prompt's logits through an engine with the given KV dtype. */
static float *prompt_logits(fl_model *m, const int32_t *ids, int T, fl_kv_dtype d) {
    fl_engine_config ec;
    fl_engine_config_default(&ec);
    ec.kv_cache_bytes = 4 << 20;
    ec.max_model_len = 256; /* past max_position_embeddings: the scaled-RoPE fixtures' prompts are */
    ec.kv_dtype = d;
    ec.max_num_seqs = 4;
    fl_engine *e;
    if (fl_engine_init(m, &ec, &e) != FL_OK) fail_msg("%s", fl_error_msg());
    float *out = malloc(sizeof(float) * (size_t)T * m->cfg.vocab_size);
    if (fl_engine_prompt_logits(e, ids, T, out) != FL_OK) fail_msg("%s", fl_error_msg());
    fl_engine_free(e);
    return out;
}

static void test_golden_logits(void **state) {
    const kvq *kq = *state;
    static const char *fx[] = {"llama", "llama_awq", "llama_dynamic", "llama_linear", "llama_tied_rope3",
                               "llama_yarn", "mixtral", "qwen2", "qwen2_moe", "qwen3_moe", "deepseek_v2",
                               "deepseek_v2_lite"};
    double worst_all = 0;
    for (size_t i = 0; i < sizeof fx / sizeof fx[0]; i++) {
        fl_test_golden g;
        fl_test_golden_load(FL_TEST_DATA "/golden/", fx[i], NULL, 1, &g);
        fl_ckpt *ck;
        fl_backend *be;
        fl_model *m;
        assert_int_equal(fl_ckpt_open(g.dir, &ck), FL_OK);
        assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
        if (fl_model_load(ck, be, NULL, &m) != FL_OK) fail_msg("%s: %s", fx[i], fl_error_msg());
        float *a = prompt_logits(m, g.prompt, g.T, FL_KV_DTYPE_F32);
        float *b = prompt_logits(m, g.prompt, g.T, kq->d);
        double worst = 0, worst_abs = 0;
        int argmax_same = 0, ties = 0;
        for (int t = 0; t < g.T; t++) {
            const float *ra = a + (size_t)t * g.V, *rb = b + (size_t)t * g.V;
            double mx = 0, d = 0;
            int ia = 0, ib = 0;
            for (int v = 0; v < g.V; v++) {
                mx = fmax(mx, fabs(ra[v]));
                d = fmax(d, fabs(ra[v] - rb[v]));
                if (ra[v] > ra[ia]) ia = v;
                if (rb[v] > rb[ib]) ib = v;
            }
            worst = fmax(worst, d / mx);
            worst_abs = fmax(worst_abs, d);
            argmax_same += ia == ib;
            /* a flip is allowed only at a near-tie: the f32 row's top two
             * within twice the row's error (the random fixtures' flat rows) */
            if (ia != ib) {
                assert_true(ra[ia] - ra[ib] <= 2 * d);
                ties++;
            }
        }
        printf("  %-17s %s vs f32 KV: worst |dlogit| %.2e (%.2e of the row's max |logit|), argmax equal at "
               "%d/%d positions (the others near-ties)\n", fx[i], kq->name, worst_abs, worst, argmax_same, g.T);
        /* fp8, MoE: a token routed to another expert at a router near-tie
         * moves a row far more than the cache's error (test_decode_steps
         * --kv fp8 finds those rows by their margins); reported here */
        const bool routed = kq->fp8 && m->cfg.n_experts > 0;
        if (!routed) worst_all = fmax(worst_all, worst);
        if (!kq->fp8) assert_int_equal(ties, 0); /* int8: no flip at all */
        free(a);
        free(b);
        fl_model_free(m);
        fl_backend_free(be);
        fl_ckpt_free(ck);
        fl_test_golden_free(&g);
    }
    printf("  worst over the fixtures (%s%s): %.2e (tolerance %.2f)\n", kq->name, kq->fp8 ? ", without experts" : "",
           worst_all, kq->logit_tol);
    assert_true(worst_all <= kq->logit_tol);
}

static void test_refusals(void **state) {
    (void)state;
    fl_ckpt *ck;
    fl_backend *be;
    fl_model *m;
    assert_int_equal(fl_ckpt_open(FL_TEST_DATA "/golden/deepseek_v2_lite", &ck), FL_OK);
    assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
    assert_int_equal(fl_model_load(ck, be, NULL, &m), FL_OK);
    fl_engine_config ec;
    fl_engine_config_default(&ec);
    ec.kv_cache_bytes = 1 << 20;
    ec.kv_dtype = FL_KV_DTYPE_INT8;
    fl_engine *e = NULL;
    /* a backend whose MLA attention does not read int8 records */
    const fl_backend_ops *ops = be->ops;
    fl_backend_ops no_mla = *ops;
    no_mla.kv_int8_mla = false;
    be->ops = &no_mla;
    assert_int_equal(fl_engine_init(m, &ec, &e), FL_ERR_UNSUPPORTED);
    assert_non_null(strstr(fl_error_msg(), "MLA"));
    /* a backend without fp8 records */
    fl_backend_ops no_fp8 = *ops;
    no_fp8.kv_fp8 = false;
    be->ops = &no_fp8;
    ec.kv_dtype = FL_KV_DTYPE_FP8;
    assert_int_equal(fl_engine_init(m, &ec, &e), FL_ERR_UNSUPPORTED);
    assert_non_null(strstr(fl_error_msg(), "--kv-cache-dtype fp8 is not implemented on the cpu backend"));
    /* a backend of f32 activations without a bf16 cache */
    fl_backend_ops no_bf16 = *ops;
    no_bf16.kv_bf16 = false;
    be->ops = &no_bf16;
    ec.kv_dtype = FL_KV_DTYPE_BF16;
    assert_int_equal(fl_engine_init(m, &ec, &e), FL_ERR_UNSUPPORTED);
    assert_non_null(strstr(fl_error_msg(), "keeps its KV cache in f32"));
    be->ops = ops;
    fl_model_free(m);
    fl_kv_cache kv;
    assert_int_equal(fl_kv_cache_init_int8(be, 2, 4, 16, 30, 7, &kv), FL_ERR_UNSUPPORTED); /* not whole heads */
    fl_backend_free(be);
    fl_ckpt_free(ck);
}

static const char *demo_path(void) {
    const char *p = getenv("FL_DEMO_GGUF");
    if (p && *p) return p;
    return FL_TEST_DATA "/../models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

static int greedy(fl_model *m, const int32_t *ids, int T, int n, fl_kv_dtype d, int32_t *out) {
    fl_engine_config ec;
    fl_engine_config_default(&ec);
    ec.kv_cache_bytes = 32 << 20;
    ec.max_model_len = 512;
    ec.max_num_seqs = 4;
    ec.kv_dtype = d;
    fl_engine *e;
    assert_int_equal(fl_engine_init(m, &ec, &e), FL_OK);
    fl_gen g;
    assert_int_equal(fl_gen_init(&g, 0, ids, T, NULL, n), FL_OK);
    assert_int_equal(fl_engine_add(e, &g), FL_OK);
    while (fl_engine_has_work(e)) {
        fl_gen **up;
        int nu;
        assert_int_equal(fl_engine_step(e, &up, &nu), FL_OK);
    }
    const int got = fl_gen_n_generated(&g);
    memcpy(out, g.seq.tokens + T, sizeof(int32_t) * (size_t)got);
    fl_gen_free(&g);
    fl_engine_free(e);
    return got;
}

static void test_demo_greedy(void **state) {
    const kvq *kq = *state;
    const char *path = demo_path();
    if (access(path, R_OK) != 0) fail_msg("demo model not found at %s (scripts/fetch_demo_model.sh)", path);
    char *txt = fl_test_slurp(FL_TEST_DATA "/golden/smollm2_gguf.json", NULL);
    cJSON *j = cJSON_Parse(txt);
    int T;
    int32_t *ids = fl_test_int_array(cJSON_GetObjectItem(j, "prompt_ids"), &T);
    fl_ckpt *ck;
    fl_backend *be;
    fl_model *m;
    assert_int_equal(fl_ckpt_open(path, &ck), FL_OK);
    assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
    assert_int_equal(fl_model_load(ck, be, NULL, &m), FL_OK);
    enum { N = 48 };
    int32_t a[N], b[N];
    const int na = greedy(m, ids, T, N, FL_KV_DTYPE_F32, a), nb = greedy(m, ids, T, N, kq->d, b);
    int same = 0;
    while (same < na && same < nb && a[same] == b[same]) same++;
    float *la = prompt_logits(m, ids, T, FL_KV_DTYPE_F32), *lb = prompt_logits(m, ids, T, kq->d);
    double worst = 0;
    int am = 0;
    const int V = m->cfg.vocab_size;
    for (int t = 0; t < T; t++) {
        double mx = 0, d = 0;
        int ia = 0, ib = 0;
        for (int v = 0; v < V; v++) {
            const size_t i = (size_t)t * V + v;
            mx = fmax(mx, fabs(la[i]));
            d = fmax(d, fabs(la[i] - lb[i]));
            if (la[i] > la[(size_t)t * V + ia]) ia = v;
            if (lb[i] > lb[(size_t)t * V + ib]) ib = v;
        }
        worst = fmax(worst, d / mx);
        am += ia == ib;
    }
    free(la);
    free(lb);
    printf("  demo model prompt (%d tokens): %s vs f32 KV worst |dlogit| %.2e of the row's max, argmax equal "
           "at %d/%d positions\n", T, kq->name, worst, am, T);
    /* a trained model's keys have outlier channels, which a per-head scale
     * spreads over the head: measured 6.1 %, bounded at 10 %; a bf16 cache
     * rounds each value to 8 bits of mantissa: 0.9 %, bounded at 2 % */
    assert_true(worst <= kq->demo_tol);
    assert_true(am >= T - 2);
    printf("  demo model greedy: %s KV agrees with f32 KV on the first %d of %d tokens\n", kq->name, same, na);
    /* int8: the first tokens follow a prompt whose K/V differ by < 1 %;
     * fp8's differ by up to 6 %, enough to flip the first token's near-tie
     * in some builds (the prompt rows above are its bound): printed only */
    if (!kq->fp8) assert_true(same >= (na < 8 ? na : 8));
    fl_model_free(m);
    fl_backend_free(be);
    fl_ckpt_free(ck);
    free(ids);
    cJSON_Delete(j);
    free(txt);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_prestate(test_store_records, (void *)&INT8),
        cmocka_unit_test_prestate(test_store_records, (void *)&FP8),
        cmocka_unit_test_prestate(test_attention, (void *)&INT8),
        cmocka_unit_test_prestate(test_attention, (void *)&FP8),
        cmocka_unit_test_prestate(test_golden_logits, (void *)&INT8),
        cmocka_unit_test_prestate(test_golden_logits, (void *)&FP8),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test_prestate(test_demo_greedy, (void *)&INT8),
        cmocka_unit_test_prestate(test_demo_greedy, (void *)&FP8),
        cmocka_unit_test_prestate(test_demo_greedy, (void *)&BF16),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
