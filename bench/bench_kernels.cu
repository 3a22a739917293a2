/*
 * bench_kernels.cu — microbenchmarks of the CUDA backend's matmul kernels
 * against the copy-bandwidth ceiling measured in the same run.
 *
 *   bench_kernels [--json PATH] [--sweep | --sweep-only | --sweep-small | --bulk | --bulk16 | --moe | --glu]
 *                 [--one OUT IN N] [--shape OUTxIN ...] [--l2-resident] [--tune NAME=VALUE ...]
 *                 [--tune-list]
 *
 * --l2-resident: the W4 timings on one copy of each weight (from L2 where it
 * fits) instead of copies rotated through HBM.
 * --tune NAME=VALUE (repeatable): a tuning override of the CUDA backend
 * (kernels/cuda/cuda_tune.h; e.g. --tune w4_gemv=bulk --tune
 * w4_bulk_warps=24), set before the backend starts; --tune-list prints them
 * with their values and exits.
 * --full: every --shape at every batch and mode of section 3.
 * --shape (repeatable): section 3 on these shapes (batch 1 and 16) instead of
 * Llama-3-8B's, and nothing after it (e.g. --shape 3584x18944 for Qwen2-7B's
 * down projection).
 * --one: three launches of the default W4 route on one shape, nothing else
 * (for Nsight Compute: ncu ... bench_kernels --one 14336 4096 1).
 *
 * 1. Ceiling: cudaMemcpyAsync device-to-device of 2 GiB, median of 20;
 *    bandwidth counts bytes read + written (PERF.md's convention).
 * 2. (--sweep) W4 GEMV variants side by side: the old tensor-core GEMV,
 *    the new one's default configuration (twice: first and last, the
 *    spread of one version) and forced configurations (tiles per block T,
 *    warps per block, register ring depth R, L2 prefetch distance pf, x
 *    prefetched into L1) on the Llama-3-8B MLP shapes at batch 1 and 16
 *    (defaults also at 2, 4, 8), group 64, and the other Llama-3-8B shapes
 *    (qkv 6144, o 4096, fused gate+up 28672, lm_head 128256; 1024 as a
 *    small one). Each variant's output is first checked against the old
 *    kernel's on the same inputs (max |diff| / max |ref| < 1e-2, outputs
 *    poisoned with NaN first); failures make the exit code 2.
 * 3. W4 (group 128) matmul through the backend's op table, Llama-3-8B MLP
 *    shapes 4096x14336 and 14336x4096 (out x in), batch 1, 8, 16, 64, 2048
 *    (GEMV launches up to 32 tokens where x fits shared memory, else the
 *    tiled GEMM); bf16 (its GEMV, and cuBLAS) at batch 1 and 16; FP8 (W8A8,
 *    the quantization kernel included: as dispatched, cuBLASLt only, and
 *    the FP8 GEMV forced up to 16 tokens) at 1, 8 and 16. Weights are
 *    random (never zeros) and rotate over enough copies to exceed the 60 MB
 *    L2, so every launch reads its weights from HBM. Each sample times 20
 *    launches between CUDA events; the median of 15 samples is reported.
 *    Effective bandwidth = (weight bytes incl. scales + x + y) / time.
 * 4. Paged attention, GQA 32/8, head_dim 128: decode at batch 1 x 4096 /
 *    16384 / 32768, 8 x 4096 and 64 x 2048 cached tokens (K + V bytes
 *    read / time),
 *    prefill of 2048 tokens (causal TFLOP/s); each with the automatic
 *    kernel choice, with single-buffered K/V tiles ("_1stage") and forced
 *    onto the SIMT kernel ("_simt").
 * 5. (--moe, or by default) Routed experts' W4 GEMV (moe_matmul) on the
 *    Mixtral and Qwen3-30B-A3B expert shapes at 1, 16 and 64 tokens,
 *    against one plain GEMV per active expert (see bench_moe).
 * 6. (--glu, alone) gate_up_silu against matmul, matmul, silu_mul (see
 *    bench_glu), with the register ring's and the bulk-copy kernel's forced
 *    DUAL configurations. --sweep-small: section 2 on the attention
 *    projections only. --bulk: section 2 for the bulk-copy GEMV
 *    (cuda_gemv_bulk.cu), every variant x warps a block, on the dense
 *    shapes of Llama-3-8B and Qwen3-30B-A3B.
 * Prints one line per case, a one-line summary last, and writes JSON.
 */
#include <algorithm>
#include <array>
#include <initializer_list>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include <cuda_runtime.h>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_test_hooks.h"
#include "kernels/cuda/cuda_tune.h"
#include "runtime/load/quant.h"

#define CK(call)                                                                          \
    do {                                                                                  \
        cudaError_t e_ = (call);                                                          \
        if (e_ != cudaSuccess) {                                                          \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            return 1;                                                                     \
        }                                                                                 \
    } while (0)
#define FK(call)                                                                          \
    do {                                                                                  \
        fl_status s_ = (call);                                                            \
        if (s_ != FL_OK) {                                                                \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, fl_error_msg()); \
            return 1;                                                                     \
        }                                                                                 \
    } while (0)

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static uint32_t rnd32(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

struct result {
    char name[96];
    double us, gbs, pct;
    double err; /* variants: max |y - y_old| / max |y_old| (-1: not checked) */
    double tflops; /* attention prefill only (section 4); other entries leave it unset */
};

typedef std::array<int, 6> gcfg; /* {kernel, T, warps, R, pf, xpf}: fl_cuda_w4_gemv_tune's arguments */

/* Section 4: one attention case (GQA 32/8, head_dim 128, block 16),
 * median of 10 launches between events under the given kernel policy. */
static int bench_attention(fl_backend *be, cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1, double ceil_gbs,
                           int n_seqs, int ctx, int n_q, fl_cuda_attn_kernel pol, int stages,
                           std::vector<result> &res) {
    const int H = 32, KVH = 8, D = 128, bs = 16, nb = ctx / bs;
    const size_t kv_elems = (size_t)n_seqs * ctx * KVH * D, n_rows = (size_t)n_seqs * n_q;
    void *dk, *dv, *dq, *dout, *dqs, *dctx, *dbt;
    FK(be->ops->alloc(be, kv_elems * 2, &dk));
    FK(be->ops->alloc(be, kv_elems * 2, &dv));
    CK(cudaMemsetAsync(dk, 0x3c, kv_elems * 2, st));
    CK(cudaMemsetAsync(dv, 0x3c, kv_elems * 2, st));
    std::vector<float> hq(n_rows * H * D);
    for (size_t i = 0; i < hq.size(); i++) hq[i] = (float)((int)(rnd32() % 2001) - 1000) * 1e-3f;
    FK(be->ops->alloc(be, hq.size() * 2, &dq));
    FK(be->ops->alloc(be, hq.size() * 2, &dout));
    FK(be->ops->upload_act(be, dq, hq.data(), hq.size()));
    std::vector<int32_t> qs(n_seqs + 1), cl(n_seqs), bt((size_t)n_seqs * nb);
    for (int i = 0; i <= n_seqs; i++) qs[i] = i * n_q;
    for (int i = 0; i < n_seqs; i++) cl[i] = ctx;
    for (size_t i = 0; i < bt.size(); i++) bt[i] = (int32_t)((i * 7919) % bt.size()); /* scattered */
    FK(be->ops->alloc(be, qs.size() * 4, &dqs));
    FK(be->ops->alloc(be, cl.size() * 4, &dctx));
    FK(be->ops->alloc(be, bt.size() * 4, &dbt));
    FK(be->ops->upload(be, dqs, qs.data(), qs.size() * 4));
    FK(be->ops->upload(be, dctx, cl.data(), cl.size() * 4));
    FK(be->ops->upload(be, dbt, bt.data(), bt.size() * 4));
    fl_attn_meta m = {n_seqs, (const int32_t *)dqs, (const int32_t *)dctx, (const int32_t *)dbt, nb, bs, ctx, n_q};
    fl_cuda_attention_set_policy(pol, 0, stages);
    for (int i = 0; i < 3; i++) FK(be->ops->attention(be, dq, H * D, &m, H, KVH, D, 0.088f, dk, dv, dout));
    std::vector<double> t;
    for (int sample = 0; sample < 10; sample++) {
        CK(cudaEventRecord(e0, st));
        FK(be->ops->attention(be, dq, H * D, &m, H, KVH, D, 0.088f, dk, dv, dout));
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms * 1e-3);
    }
    fl_cuda_attention_set_policy(FL_CUDA_ATTN_AUTO, 0, 0);
    const double sec = median(t), bytes = 2.0 * kv_elems * 2;
    result r = {};
    const char *pn = pol == FL_CUDA_ATTN_SIMT ? "simt" : stages == 1 ? "auto, 1 K/V stage" : "auto";
    const char *suffix = pol == FL_CUDA_ATTN_SIMT ? "_simt" : stages == 1 ? "_1stage" : "";
    if (n_q == 1) {
        /* the PR-era name for the auto 8 x 4096 case, so result files compare */
        snprintf(r.name, sizeof r.name, "attn_decode_%dx%d_gqa32-8_d128%s", n_seqs, ctx, suffix);
        r.us = sec * 1e6;
        r.gbs = bytes / sec / 1e9;
        r.pct = 100.0 * r.gbs / ceil_gbs;
        printf("%-36s %9.2f us  %8.1f GB/s  %5.1f %% of copy ceiling  [%s]\n", r.name, r.us, r.gbs, r.pct, pn);
    } else {
        double vis = 0; /* visible (query, position) pairs of one head */
        for (int i = 0; i < n_q; i++) vis += ctx - n_q + i + 1;
        r.tflops = 4.0 * H * D * vis * n_seqs / sec * 1e-12;
        snprintf(r.name, sizeof r.name, "attn_prefill_%dx%d_h32-8_d128%s", n_seqs, n_q, suffix);
        r.us = sec * 1e6;
        r.gbs = bytes / sec / 1e9;
        r.pct = 100.0 * r.gbs / ceil_gbs;
        printf("%-36s %9.2f us  %8.1f TFLOP/s (causal)  [%s]\n", r.name, r.us, r.tflops, pn);
    }
    res.push_back(r);
    void *bufs[] = {dk, dv, dq, dout, dqs, dctx, dbt};
    for (void *p : bufs) be->ops->free(be, p);
    return 0;
}

/* How many device copies of a weight the W4 timings rotate over: enough to
 * exceed the L2 four times (every launch reads its weights from HBM), or,
 * with --l2-resident, one (a weight that fits stays in L2 between launches:
 * what the kernel does when its bytes come from L2). */
static bool g_l2_resident;
static int weight_copies(double wbytes) {
    if (g_l2_resident) return 1;
    return (int)std::max(2.0, 4 * 60e6 / wbytes + 1);
}

/* Random W4 weight [out, in] uploaded weight_copies times (rotated). */
static int make_w4_copies(fl_backend *be, int out, int in, int group, std::vector<fl_tensor> &dw, double *wbytes) {
    fl_tensor hw;
    FK(fl_quant_w4_alloc(out, in, group, &hw));
    uint32_t *codes = (uint32_t *)hw.data;
    for (size_t i = 0; i < (size_t)out * in / 8; i++) codes[i] = rnd32();
    for (size_t g = 0; g < (size_t)out * (in / group); g++) {
        hw.scales[g] = 0.001f + (rnd32() % 1000) * 1e-5f;
        hw.bias[g] = -8.0f * hw.scales[g];
    }
    *wbytes = (double)out * in / 2 + (double)out * (in / group) * 4;
    const int copies = weight_copies(*wbytes);
    dw.resize(copies);
    for (int c = 0; c < copies; c++) FK(be->ops->upload_weight(be, &hw, &dw[c]));
    fl_tensor_free(&hw);
    return 0;
}

/* Median time of one matmul launch (15 samples of `reps` back-to-back
 * launches between events, rotating over the weight copies). */
static int time_matmul(fl_backend *be, cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1, const void *dx, int n,
                       const std::vector<fl_tensor> &ws, void *dy, int reps, double *sec) {
    const size_t nc = ws.size();
    for (int i = 0; i < 10; i++) FK(be->ops->matmul(be, dx, n, &ws[i % nc], NULL, dy));
    std::vector<double> t;
    for (int sample = 0; sample < 15; sample++) {
        CK(cudaEventRecord(e0, st));
        for (int i = 0; i < reps; i++) FK(be->ops->matmul(be, dx, n, &ws[(sample * reps + i) % nc], NULL, dy));
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms * 1e-3 / reps);
    }
    *sec = median(t);
    return 0;
}

/* A plain streaming read of n16 16-byte words (a weight copy's codes):
 * every thread 8 loads in flight, grid-stride over 4 blocks of 512 an SM.
 * What one launch of this many bytes reads at, launched the way the GEMVs
 * are: the achievable rate at this size, beside the 2 GiB copy ceiling. */
static __global__ void read_probe_kernel(const uint4 *p, size_t n16, unsigned *out) {
    uint32_t acc = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 7 * stride < n16; i += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = __ldg(p + i + k * stride);
#pragma unroll
        for (int k = 0; k < 8; k++) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    }
    for (; i < n16; i += stride) {
        const uint4 v = __ldg(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc; /* keeps the loads */
}

/* Median time of one read_probe launch over the copies' codes (as time_matmul). */
static int time_read_probe(cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1, const std::vector<fl_tensor> &ws,
                           size_t bytes, unsigned *dout, double *sec) {
    int dev = 0, n_sm = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev));
    const size_t nc = ws.size(), n16 = bytes / 16;
    auto launch = [&](size_t i) {
        read_probe_kernel<<<n_sm * 4, 512, 0, st>>>((const uint4 *)ws[i % nc].data, n16, dout);
    };
    for (int i = 0; i < 10; i++) launch(i);
    CK(cudaGetLastError());
    std::vector<double> t;
    for (int sample = 0; sample < 15; sample++) {
        CK(cudaEventRecord(e0, st));
        for (int i = 0; i < 20; i++) launch(sample * 20 + i);
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms * 1e-3 / 20);
    }
    *sec = median(t);
    return 0;
}

/* W4 GEMV variants side by side on one shape: the old kernel (first: the
 * reference), the new kernel's default (first and last: the spread of two
 * runs of one version) and the given forced configurations, at the given
 * batches, each validated against the old kernel on the same inputs. */
static int sweep_gemv(fl_backend *be, cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1, double ceil_gbs, int out,
                      int in, int group, const std::vector<int> &batches, const std::vector<gcfg> &forced,
                      std::vector<result> &res, int *fails) {
    std::vector<fl_tensor> dw;
    double wbytes;
    if (make_w4_copies(be, out, in, group, dw, &wbytes)) return 1;
    const int max_n = 16;
    std::vector<float> hx((size_t)max_n * in);
    for (size_t i = 0; i < hx.size(); i++) hx[i] = (float)((int)(rnd32() % 2001) - 1000) * 1e-3f;
    void *dx, *dy;
    FK(be->ops->alloc(be, (size_t)max_n * in * 2, &dx));
    FK(be->ops->alloc(be, (size_t)max_n * out * 2, &dy));
    FK(be->ops->upload_act(be, dx, hx.data(), hx.size()));
    std::vector<float> ref((size_t)max_n * out), got((size_t)max_n * out);
    {
        /* the read probe on the same codes first: this size's achievable rate */
        double sec;
        const size_t cbytes = (size_t)out * in / 2;
        if (time_read_probe(st, e0, e1, dw, cbytes, (unsigned *)dy, &sec)) return 1;
        result r = {};
        snprintf(r.name, sizeof r.name, "read_probe_%dx%d", out, in);
        r.us = sec * 1e6;
        r.gbs = cbytes / sec / 1e9;
        r.pct = 100.0 * r.gbs / ceil_gbs;
        printf("%-48s %8.2f us %7.1f GB/s %5.1f %%  (codes only, no math)\n", r.name, r.us, r.gbs, r.pct);
        res.push_back(r);
    }
    std::vector<gcfg> cfgs = {{2, 0, 0, 0, -1, -1}, {0, 0, 0, 0, -1, -1}};
    cfgs.insert(cfgs.end(), forced.begin(), forced.end());
    cfgs.push_back({0, 0, 0, 0, -1, -1});
    for (int n : batches) {
        for (auto &cf : cfgs) {
            fl_cuda_w4_gemv_tune(cf[0], cf[1], cf[2], cf[3], cf[4], cf[5]);
            CK(cudaMemsetAsync(dy, 0xff, (size_t)max_n * out * 2, st)); /* NaN: unwritten outputs show */
            FK(be->ops->matmul(be, dx, n, &dw[0], NULL, dy));
            FK(be->ops->download_act(be, cf[0] == 2 ? ref.data() : got.data(), dy, (size_t)n * out));
            double err = -1;
            if (cf[0] != 2) {
                double md = 0, mr = 0;
                for (size_t i = 0; i < (size_t)n * out; i++) {
                    const double d = fabs((double)got[i] - ref[i]);
                    md = d == d ? std::max(md, d) : INFINITY;
                    mr = std::max(mr, fabs((double)ref[i]));
                }
                err = mr > 0 ? md / mr : INFINITY;
                if (!(err < 1e-2) && cf[0] != 4) ++*fails; /* probes (kernel 4) skip the math */
            }
            double sec;
            if (time_matmul(be, st, e0, e1, dx, n, dw, dy, 20, &sec)) return 1;
            const double bytes = wbytes + (double)n * in * 2 + (double)n * out * 2;
            result r;
            int lc[5];
            fl_cuda_w4_gemv_last(lc);
            if (cf[0] == 2) snprintf(r.name, sizeof r.name, "old_g%d_%dx%d_n%d", group, out, in, n);
            else if (lc[0] < 0) /* the bulk-copy kernel: {-variant, warps} */
                snprintf(r.name, sizeof r.name, "%s_bulk_v%d_w%d_g%d_%dx%d_n%d", cf[0] == 4 ? "probe" : cf[0] ? "cfg" : "auto",
                         -lc[0], lc[1], group, out, in, n);
            else
                snprintf(r.name, sizeof r.name, "%s_T%d_w%d_R%d_pf%d_x%d_g%d_%dx%d_n%d", cf[0] ? "cfg" : "auto", lc[0],
                         lc[1], lc[2], lc[3], lc[4], group, out, in, n);
            r.us = sec * 1e6;
            r.gbs = bytes / sec / 1e9;
            r.pct = 100.0 * r.gbs / ceil_gbs;
            r.err = err;
            printf("%-48s %8.2f us %7.1f GB/s %5.1f %%  err %.1e%s\n", r.name, r.us, r.gbs, r.pct, err,
                   err >= 1e-2 ? "  FAIL" : "");
            res.push_back(r);
        }
    }
    fl_cuda_w4_gemv_tune(0, 0, 0, 0, -1, -1);
    for (auto &w : dw) be->ops->free_weight(be, &w);
    be->ops->free(be, dx);
    be->ops->free(be, dy);
    return 0;
}

/* 6. (--glu) The gated MLP's gate, up and SiLU: gate_up_silu (one W4 GEMV
 * pass, DUAL) against matmul (gate), matmul (up), silu_mul (stacked
 * weights: one matmul of [2 d, in], then silu_mul), at 1 and 16 tokens,
 * plus forced DUAL configurations (T gate+up tiles a step, warps). Bytes =
 * both weights with scales + x + out. The fused output is checked against
 * the three ops' (max |diff| / max |ref| < 1e-2). */
static int bench_glu(fl_backend *be, cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1, double ceil_gbs,
                     std::vector<result> &res, int *fails) {
    struct shape { const char *name; int d, in; bool stacked; };
    static const shape shapes[] = {{"llama", 14336, 4096, false}, {"ds_lite_shared", 2816, 2048, true},
                                   {"ds_lite_dense", 10944, 2048, false}, {"qwen2_7b", 18944, 3584, false}};
    /* {kernel, T, warps} (fl_cuda_w4_gemv_tune): the register ring's forced
     * DUAL configurations, then the bulk kernel's (T = variant, 0 auto) */
    static const int forced[][3] = {{1, 2, 2}, {1, 2, 4}, {1, 2, 8}, {1, 4, 4}, {1, 4, 8}, {3, 0, 0},
                                    {3, 4, 0}, {3, 2, 1}, {3, 2, 2}, {3, 2, 3}, {3, 2, 4}, {3, 4, 2},
                                    {3, 7, 2}, {3, 7, 4}, {3, 7, 8}, {3, 8, 2}, {3, 8, 4}, {3, 8, 8},
                                    {3, 10, 2}, {3, 10, 4}};
    for (const shape &sh : shapes) {
        std::vector<fl_tensor> wg, wu;
        double wb;
        if (make_w4_copies(be, sh.stacked ? 2 * sh.d : sh.d, sh.in, 128, wg, &wb)) return 1;
        if (!sh.stacked && make_w4_copies(be, sh.d, sh.in, 128, wu, &wb)) return 1;
        const double wbytes = sh.stacked ? wb : 2 * wb;
        const int max_n = 16, d = sh.d;
        std::vector<float> hx((size_t)max_n * sh.in);
        for (size_t i = 0; i < hx.size(); i++) hx[i] = (float)((int)(rnd32() % 2001) - 1000) * 1e-3f;
        void *dx, *dy, *dgu;
        FK(be->ops->alloc(be, (size_t)max_n * sh.in * 2, &dx));
        FK(be->ops->alloc(be, (size_t)max_n * d * 2, &dy));
        FK(be->ops->alloc(be, (size_t)max_n * d * 4, &dgu)); /* gate | up */
        FK(be->ops->upload_act(be, dx, hx.data(), hx.size()));
        const size_t nc = wg.size();
        for (int n : {1, 16}) {
            auto apart = [&](int i) -> int {
                const fl_tensor *g = &wg[i % nc];
                if (sh.stacked) {
                    FK(be->ops->matmul(be, dx, n, g, NULL, dgu));
                    FK(be->ops->silu_mul(be, dgu, (char *)dgu + (size_t)d * 2, n, d, 2 * d, dy));
                } else {
                    FK(be->ops->matmul(be, dx, n, g, NULL, dgu));
                    FK(be->ops->matmul(be, dx, n, &wu[i % nc], NULL, (char *)dgu + (size_t)n * d * 2));
                    FK(be->ops->silu_mul(be, dgu, (char *)dgu + (size_t)n * d * 2, n, d, d, dy));
                }
                return 0;
            };
            auto fused = [&](int i) -> int {
                FK(fl_cuda_gate_up_silu(be, dx, n, &wg[i % nc], sh.stacked ? NULL : &wu[i % nc], dy, NULL));
                return 0;
            };
            /* reference output: the three ops on copy 0 */
            std::vector<float> ref((size_t)n * d), got((size_t)n * d);
            if (apart(0)) return 1;
            FK(be->ops->download_act(be, ref.data(), dy, (size_t)n * d));
            for (int v = -1; v < (int)(sizeof forced / sizeof forced[0]); v++) {
                fl_cuda_w4_gemv_tune(v < 0 ? 0 : forced[v][0], v < 0 ? 0 : forced[v][1], v < 0 ? 0 : forced[v][2], 0,
                                     -1, -1);
                CK(cudaMemsetAsync(dy, 0xff, (size_t)max_n * d * 2, st));
                if (fused(0)) return 1;
                FK(be->ops->download_act(be, got.data(), dy, (size_t)n * d));
                double md = 0, mr = 0;
                for (size_t i = 0; i < got.size(); i++) {
                    const double df = fabs((double)got[i] - ref[i]);
                    md = df == df ? std::max(md, df) : INFINITY;
                    mr = std::max(mr, fabs((double)ref[i]));
                }
                const double err = mr > 0 ? md / mr : INFINITY;
                if (!(err < 1e-2)) ++*fails;
                for (int mode = 0; mode < (v < 0 ? 2 : 1); mode++) { /* fused; then (defaults only) apart */
                    for (int i = 0; i < 10; i++)
                        if ((mode ? apart(i) : fused(i))) return 1;
                    std::vector<double> t;
                    for (int sample = 0; sample < 15; sample++) {
                        CK(cudaEventRecord(e0, st));
                        for (int i = 0; i < 20; i++)
                            if ((mode ? apart(sample * 20 + i) : fused(sample * 20 + i))) return 1;
                        CK(cudaEventRecord(e1, st));
                        CK(cudaEventSynchronize(e1));
                        float ms;
                        CK(cudaEventElapsedTime(&ms, e0, e1));
                        t.push_back(ms * 1e-3 / 20);
                    }
                    const double sec = median(t), bytes = wbytes + (double)n * sh.in * 2 + (double)n * d * 2;
                    result r;
                    int lc[5];
                    fl_cuda_w4_gemv_last(lc);
                    if (mode) snprintf(r.name, sizeof r.name, "glu_%s_apart_n%d", sh.name, n);
                    else if (lc[0] < 0)
                        snprintf(r.name, sizeof r.name, "glu_%s_%s_bulk_v%d_w%d_n%d", sh.name, v < 0 ? "auto" : "cfg",
                                 -lc[0], lc[1], n);
                    else snprintf(r.name, sizeof r.name, "glu_%s_%s_T%d_w%d_n%d", sh.name, v < 0 ? "auto" : "cfg",
                                  lc[0], lc[1], n);
                    r.us = sec * 1e6;
                    r.gbs = bytes / sec / 1e9;
                    r.pct = 100.0 * r.gbs / ceil_gbs;
                    r.err = mode ? 0 : err;
                    printf("%-44s %8.2f us %7.1f GB/s %5.1f %%  err %.1e%s\n", r.name, r.us, r.gbs, r.pct, r.err,
                           r.err >= 1e-2 ? "  FAIL" : "");
                    res.push_back(r);
                }
            }
            fl_cuda_w4_gemv_tune(0, 0, 0, 0, -1, -1);
        }
        for (auto &w : wg) be->ops->free_weight(be, &w);
        for (auto &w : wu) be->ops->free_weight(be, &w);
        be->ops->free(be, dx);
        be->ops->free(be, dy);
        be->ops->free(be, dgu);
    }
    return 0;
}

/* 5. Routed experts (moe_matmul, packed W4 group 128): E experts of one
 * shape (distinct device copies), NR random top-k routings of n tokens
 * grouped once (moe_group) into NR lists, then launches cycling over the
 * lists so the active experts change every launch (Qwen3's 8 active of 128
 * would otherwise stay in L2). Bytes = the active experts' weights and
 * scales, averaged over the routings. Side by side: the register ring's
 * routed kernel with the next item's L2 prefetch off and on (pf 0 and 2
 * of fl_cuda_w4_gemv_tune; off in the product: measured slower on small
 * experts), the bulk-copy kernel's routed mode (tune kernel 3; sm_90+,
 * else it repeats the ring), and the host path's
 * launches (one plain GEMV per active expert with its token count, without
 * the host sync). */
static int bench_moe(fl_backend *be, cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1, double ceil_gbs,
                     std::vector<result> &res) {
    struct shape { const char *name; int E, k, rows, in; };
    static const shape shapes[] = {{"mixtral_gate", 8, 2, 14336, 4096}, {"mixtral_down", 8, 2, 4096, 14336},
                                   {"qwen3_gate_up", 128, 8, 768, 2048}, {"qwen3_down", 128, 8, 2048, 768}};
    const int NR = 8, reps = 16;
    for (const shape &s : shapes) {
        std::vector<fl_tensor> dw;
        double wbytes;
        if (make_w4_copies(be, s.rows, s.in, 128, dw, &wbytes)) return 1;
        const size_t owned = dw.size();
        while ((int)dw.size() < s.E) dw.push_back(dw[dw.size() % 2]); /* aliases only when E > copies */
        fl_tensor *dtab;
        FK(be->ops->alloc(be, sizeof(fl_tensor) * s.E, (void **)&dtab));
        FK(be->ops->upload(be, dtab, dw.data(), sizeof(fl_tensor) * s.E));
        for (int n : {1, 16, 64}) {
            const int P = n * s.k;
            void *dx, *dy;
            FK(be->ops->alloc(be, (size_t)n * s.in * 2, &dx));
            FK(be->ops->alloc(be, (size_t)P * s.rows * 2, &dy));
            CK(cudaMemsetAsync(dx, 0x3c, (size_t)n * s.in * 2, st));
            std::vector<int32_t *> lists(NR);
            std::vector<std::vector<int>> counts(NR, std::vector<int>(s.E, 0));
            double active = 0;
            for (int r = 0; r < NR; r++) {
                std::vector<int32_t> ids(P);
                for (int i = 0; i < n; i++)
                    for (int j = 0; j < s.k; j++) {
                        int e;
                        bool dup;
                        do {
                            e = (int)(rnd32() % s.E);
                            dup = false;
                            for (int t = 0; t < j; t++) dup |= ids[i * s.k + t] == e;
                        } while (dup);
                        ids[i * s.k + j] = e;
                        counts[r][e]++;
                    }
                for (int e = 0; e < s.E; e++) active += counts[r][e] > 0;
                int32_t *dids;
                FK(be->ops->alloc(be, sizeof(int32_t) * P, (void **)&dids));
                FK(be->ops->alloc(be, sizeof(int32_t) * (s.E + 1 + P), (void **)&lists[r]));
                FK(be->ops->upload(be, dids, ids.data(), sizeof(int32_t) * P));
                FK(be->ops->moe_group(be, dids, n, s.k, 0, s.E, lists[r]));
                FK(be->ops->sync(be));
                be->ops->free(be, dids);
            }
            active /= NR;
            const double bytes = active * wbytes;
            for (int mode = 0; mode < 4; mode++) { /* 0, 1: ring, next-item prefetch off / on; 2: bulk; 3: per expert */
                if (mode < 2) fl_cuda_w4_gemv_tune(1, 0, 0, 0, mode ? 2 : 0, -1);
                if (mode == 2) fl_cuda_w4_gemv_tune(3, 0, 0, 0, -1, -1);
                if (mode == 3) fl_cuda_w4_gemv_tune(0, 0, 0, 0, -1, -1);
                auto launch = [&](int r) -> int {
                    if (mode < 3) {
                        FK(be->ops->moe_matmul(be, dx, 0, n, s.k, lists[r], s.E, dtab, &dw[0], dy));
                        return 0;
                    }
                    for (int e = 0; e < s.E; e++)
                        if (counts[r][e]) FK(be->ops->matmul(be, dx, counts[r][e], &dw[e], NULL, dy));
                    return 0;
                };
                for (int r = 0; r < NR; r++)
                    if (launch(r)) return 1;
                std::vector<double> t;
                for (int sample = 0; sample < 10; sample++) {
                    CK(cudaEventRecord(e0, st));
                    for (int i = 0; i < reps; i++)
                        if (launch((sample * reps + i) % NR)) return 1;
                    CK(cudaEventRecord(e1, st));
                    CK(cudaEventSynchronize(e1));
                    float ms;
                    CK(cudaEventElapsedTime(&ms, e0, e1));
                    t.push_back(ms * 1e-3 / reps);
                }
                result rr;
                static const char *mn[] = {"routed", "routed_pf", "routed_bulk", "per_expert"};
                snprintf(rr.name, sizeof rr.name, "moe_%s_%s_n%d", s.name, mn[mode], n);
                rr.us = median(t) * 1e6;
                rr.gbs = bytes / median(t) / 1e9;
                rr.pct = 100.0 * rr.gbs / ceil_gbs;
                rr.err = -1;
                printf("%-36s %9.2f us  %8.1f GB/s  %5.1f %% of copy ceiling (%.1f experts active)\n", rr.name,
                       rr.us, rr.gbs, rr.pct, active);
                res.push_back(rr);
            }
            fl_cuda_w4_gemv_tune(0, 0, 0, 0, -1, -1);
            for (int r = 0; r < NR; r++) be->ops->free(be, lists[r]);
            be->ops->free(be, dx);
            be->ops->free(be, dy);
        }
        be->ops->free(be, dtab);
        for (size_t c = 0; c < owned; c++) be->ops->free_weight(be, &dw[c]);
    }
    return 0;
}

int main(int argc, char **argv) {
    const char *json = NULL;
    bool sweep = false, sweep_only = false, moe_only = false, glu_only = false, small_only = false;
    bool bulk_only = false, bulk16_only = false;
    int one_out = 0, one_in = 0, one_n = 0; /* --one OUT IN N: 3 default launches, nothing else (profilers) */
    /* section 3's shapes {out, in}; then Llama-3-8B's k/v (1024), fused q|k|v
     * (6144) and fused gate|up (28672) at decode batches only */
    std::vector<std::array<int, 2>> shapes = {{14336, 4096}, {4096, 14336}, {1024, 4096}, {6144, 4096}, {28672, 4096}};
    int n_full = 2; /* shapes timed at every batch and mode; the others at 1 and 16 */
    bool shapes_only = false, full = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
        if (!strcmp(argv[i], "--sweep")) sweep = true;
        if (!strcmp(argv[i], "--sweep-only")) sweep = sweep_only = true;
        if (!strcmp(argv[i], "--moe")) moe_only = true;
        if (!strcmp(argv[i], "--glu")) glu_only = true;
        if (!strcmp(argv[i], "--sweep-small")) sweep = sweep_only = small_only = true;
        if (!strcmp(argv[i], "--bulk")) sweep = sweep_only = bulk_only = true;
        if (!strcmp(argv[i], "--bulk16")) sweep = sweep_only = bulk16_only = true;
        if (!strcmp(argv[i], "--shape") && i + 1 < argc) {
            int o = 0, in = 0;
            if (sscanf(argv[++i], "%dx%d", &o, &in) != 2 || o <= 0 || in <= 0 || o % 16 || in % 128) {
                fprintf(stderr, "bench_kernels: --shape %s: want OUTxIN, OUT a multiple of 16, IN of 128\n", argv[i]);
                return 1;
            }
            if (!shapes_only) shapes.clear(), n_full = 0;
            shapes.push_back({o, in});
            shapes_only = true;
        }
        if (!strcmp(argv[i], "--l2-resident")) g_l2_resident = true;
        if (!strcmp(argv[i], "--full")) full = true;
        if (!strcmp(argv[i], "--tune-list")) {
            fl_cuda_tune_print(stdout);
            return 0;
        }
        if (!strcmp(argv[i], "--tune")) {
            if (i + 1 >= argc) {
                fprintf(stderr, "bench_kernels: --tune needs NAME=VALUE (see --tune-list)\n");
                return 1;
            }
            if (fl_cuda_tune_parse(argv[++i]) != FL_OK) {
                fprintf(stderr, "bench_kernels: %s\n", fl_error_msg());
                return 1;
            }
        }
        if (!strcmp(argv[i], "--one") && i + 3 < argc) {
            one_out = atoi(argv[i + 1]);
            one_in = atoi(argv[i + 2]);
            one_n = atoi(argv[i + 3]);
            i += 3;
        }
    }
    fl_backend *be;
    FK(fl_backend_cuda_init(0, &be));
    cudaStream_t st = (cudaStream_t)fl_backend_native_stream(be);
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
    if (one_out > 0) {
        std::vector<fl_tensor> dw;
        double wbytes;
        void *dx, *dy;
        if (make_w4_copies(be, one_out, one_in, 128, dw, &wbytes)) return 1;
        FK(be->ops->alloc(be, (size_t)one_n * one_in * 2, &dx));
        FK(be->ops->alloc(be, (size_t)one_n * one_out * 2, &dy));
        CK(cudaMemsetAsync(dx, 0x3c, (size_t)one_n * one_in * 2, st));
        for (int i = 0; i < 3; i++) FK(be->ops->matmul(be, dx, one_n, &dw[i % dw.size()], NULL, dy));
        FK(be->ops->sync(be));
        printf("--one %dx%d n=%d: 3 launches done\n", one_out, one_in, one_n);
        return 0;
    }
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));

    /* 1. copy ceiling */
    const size_t cbytes = (size_t)2 << 30;
    void *src, *dst;
    CK(cudaMalloc(&src, cbytes));
    CK(cudaMalloc(&dst, cbytes));
    CK(cudaMemsetAsync(src, 0x5a, cbytes, st));
    std::vector<double> ts;
    for (int i = 0; i < 23; i++) {
        CK(cudaEventRecord(e0, st));
        CK(cudaMemcpyAsync(dst, src, cbytes, cudaMemcpyDeviceToDevice, st));
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 3) ts.push_back(ms * 1e-3);
    }
    const double ceil_gbs = 2.0 * cbytes / median(ts) / 1e9;
    printf("copy ceiling: D2D %zu MiB, median of 20: %.1f GB/s (read + write)\n", cbytes >> 20, ceil_gbs);
    CK(cudaFree(src));
    CK(cudaFree(dst));

    /* 2. W4 GEMV variants (--sweep, or --sweep-only to skip the rest) */
    std::vector<result> vres;
    int vfails = 0;
    if (sweep) {
        /* forced: {T, warps, R} bases x L2 prefetch distance x x-prefetch */
        auto grid = [](std::initializer_list<std::array<int, 3>> bases, std::initializer_list<int> pfs,
                       std::initializer_list<int> xpfs) {
            std::vector<gcfg> v;
            for (auto &b : bases)
                for (int pf : pfs)
                    for (int xp : xpfs) v.push_back({1, b[0], b[1], b[2], pf, xp});
            return v;
        };
        const std::vector<gcfg> none;
        const auto f1 = grid({{2, 4, 2}, {2, 8, 2}, {4, 8, 2}, {1, 4, 4}, {1, 8, 4}}, {0, 2, 4, 8}, {0, 1});
        const auto f2 = grid({{2, 16, 2}, {2, 8, 2}, {1, 8, 4}, {1, 16, 4}, {4, 16, 2}}, {0, 2, 4, 8}, {0, 1});
        const auto f3 = grid({{2, 4, 2}, {4, 8, 2}, {1, 4, 4}}, {0, 4}, {1});
        struct { int out, in, group; std::vector<int> ns; const std::vector<gcfg> *f; } runs[] = {
            {14336, 4096, 128, {1, 16}, &f1}, {4096, 14336, 128, {1, 16}, &f2},
            {14336, 4096, 128, {2, 4, 8}, &none}, {4096, 14336, 128, {2, 4, 8}, &none},
            {14336, 4096, 64, {1, 13}, &f3}, {1024, 4096, 128, {1, 16}, &none},
            {4096, 4096, 128, {1, 16}, &none}, {6144, 4096, 128, {1, 16}, &none},
            {28672, 4096, 128, {1, 16}, &none}, {128256, 4096, 128, {1}, &none},
        };
        /* --sweep-small: the attention projections of Llama-3-8B (o 4096, q|k|v
         * 6144) and Qwen3-30B-A3B (q 4096 x 2048, o 2048 x 4096), where a
         * launch's ramp and tail are a large part of its time */
        const auto f4 = grid({{2, 16, 2}, {2, 8, 2}, {2, 4, 2}, {1, 4, 4}, {1, 8, 4}, {1, 16, 4}, {4, 8, 2},
                              {4, 16, 2}}, {0}, {0});
        struct { int out, in, group; std::vector<int> ns; const std::vector<gcfg> *f; } small_runs[] = {
            {4096, 4096, 128, {1}, &f4}, {6144, 4096, 128, {1}, &f4}, {4096, 2048, 128, {1}, &f4},
            {2048, 4096, 128, {1}, &f4},
        };
        /* --bulk: the bulk-copy kernel (cuda_gemv_bulk.cu) against the
         * register ring on Llama-3-8B's and Qwen3-30B-A3B's dense shapes,
         * every stage shape (variant) x warps a block (0: auto) */
        std::vector<gcfg> fb;
        for (int v = 0; v <= 11; v++)
            for (int w : {0, 2, 4, 8, 16})
                if (v > 0 || w == 0) fb.push_back({3, v, w, 0, -1, -1});
        for (int v : {1, 2, 4}) /* the same streams without the math */
            for (int w : {0, 4, 8}) fb.push_back({4, v, w, 0, -1, -1});
        struct { int out, in, group; std::vector<int> ns; const std::vector<gcfg> *f; } bulk_runs[] = {
            {14336, 4096, 128, {1, 16}, &fb}, {4096, 14336, 128, {1, 16}, &fb}, {6144, 4096, 128, {1, 16}, &fb},
            {4096, 4096, 128, {1}, &fb},      {28672, 4096, 128, {1}, &fb},     {14336, 4096, 64, {1}, &fb},
            {4096, 2048, 128, {1}, &fb},      {2048, 4096, 128, {1}, &fb},
        };
        /* --bulk16: Llama-3-8B's plain GEMVs at 16 tokens (o, down, q|k|v, and
         * 14336 x 4096) on the bulk kernel's stage variants 2 (two tiles, 3
         * stages), 3 (one tile, 4 stages) and 4 (the default) x warps a
         * block, against the default route */
        std::vector<gcfg> fb16;
        for (int v : {2, 3, 4})
            for (int w : {0, 4, 8, 16}) fb16.push_back({3, v, w, 0, -1, -1});
        struct { int out, in, group; std::vector<int> ns; const std::vector<gcfg> *f; } bulk16_runs[] = {
            {4096, 4096, 128, {16}, &fb16}, {4096, 14336, 128, {16}, &fb16}, {6144, 4096, 128, {16}, &fb16},
            {14336, 4096, 128, {16}, &fb16},
        };
        if (bulk16_only) {
            for (auto &rn : bulk16_runs)
                if (sweep_gemv(be, st, e0, e1, ceil_gbs, rn.out, rn.in, rn.group, rn.ns, *rn.f, vres, &vfails))
                    return 1;
        } else if (bulk_only) {
            for (auto &rn : bulk_runs)
                if (sweep_gemv(be, st, e0, e1, ceil_gbs, rn.out, rn.in, rn.group, rn.ns, *rn.f, vres, &vfails))
                    return 1;
        } else if (small_only) {
            for (auto &rn : small_runs)
                if (sweep_gemv(be, st, e0, e1, ceil_gbs, rn.out, rn.in, rn.group, rn.ns, *rn.f, vres, &vfails))
                    return 1;
        } else {
            for (auto &rn : runs)
                if (sweep_gemv(be, st, e0, e1, ceil_gbs, rn.out, rn.in, rn.group, rn.ns, *rn.f, vres, &vfails))
                    return 1;
        }
        printf("gemv variants: %d validation failures\n", vfails);
    }

    /* 3. matmuls */
    std::vector<result> res;
    if (glu_only) {
        if (bench_glu(be, st, e0, e1, ceil_gbs, res, &vfails)) return 1;
        printf("glu: %d validation failures\n", vfails);
    }
    if (!sweep_only && !moe_only && !glu_only) {
        /* mode 0: W4 as dispatched; 1: W4 without the dequantize + cuBLAS
         * path (GEMV / tiled GEMM); 2: W4 always dequantize + cuBLAS; 3: bf16
         * weights as dispatched (the bf16 GEMV of cuda_gemv_bf16.cu up to 8
         * tokens, cuBLAS beyond: the matmul ceiling for a given batch); 4:
         * bf16 through cuBLAS always; 5: W4 on the one-pass tensor-core
         * GEMM (cuda_w4_gemm.cu) at every batch; 6: FP8 as dispatched (the
         * FP8 GEMV of cuda_gemv_fp8.cu up to 8 tokens on Hopper, cuBLASLt
         * beyond); 7: FP8 through cuBLASLt always (fp8_gemv=0); 8: the FP8
         * GEMV up to 16 tokens (fp8_gemv=1) */
        static const int runs[][2] = {{1, 0}, {8, 0}, {16, 0}, {64, 0}, {128, 0}, {256, 0}, {512, 0}, {2048, 0},
                                      {16, 2}, {64, 2}, {64, 1}, {128, 1}, {256, 1}, {2048, 1},
                                      {1, 3}, {1, 4}, {16, 3}, {16, 4}, {64, 3}, {128, 3}, {256, 3}, {512, 3},
                                      {2048, 3}, {16, 5}, {32, 5}, {64, 5}, {128, 5}, {256, 5}, {512, 5},
                                      {1, 6}, {1, 7}, {8, 6}, {8, 7}, {16, 7}, {16, 8}};
        static const char *mode_name[] = {"w4g128", "w4g128_nodeq", "w4g128_deq", "bf16", "bf16_cublas",
                                          "w4g128_mma", "fp8", "fp8_cublaslt", "fp8_gemv"};
        const long fp8_gemv_tune = fl_cuda_tune(FL_CUDA_TUNE_FP8_GEMV);
        const int max_n = 2048;
        for (int s = 0; s < (int)shapes.size(); s++) {
            const int out = shapes[s][0], in = shapes[s][1], group = 128;
            std::vector<fl_tensor> dw;
            double wbytes;
            if (make_w4_copies(be, out, in, group, dw, &wbytes)) return 1;
            const int copies = (int)dw.size();
            /* bf16 copies for the cuBLAS comparison (values need not match) */
            std::vector<uint16_t> hb((size_t)out * in);
            for (size_t i = 0; i < hb.size(); i++) hb[i] = (uint16_t)(0x3c00 | (rnd32() & 0x80ff));
            fl_tensor hbt = {};
            hbt.dtype = FL_DTYPE_BF16;
            hbt.ndim = 2;
            hbt.shape[0] = out;
            hbt.shape[1] = in;
            hbt.data = hb.data();
            const double bbytes = (double)out * in * 2;
            const int bcopies = weight_copies(bbytes);
            std::vector<fl_tensor> dbw(bcopies);
            for (int c = 0; c < bcopies; c++) FK(be->ops->upload_weight(be, &hbt, &dbw[c]));
            /* FP8 copies: random e4m3 codes (no NaN, 0x7f / 0xff), a scale a row */
            std::vector<uint8_t> hq((size_t)out * in);
            for (size_t i = 0; i < hq.size(); i++) {
                hq[i] = (uint8_t)rnd32();
                if ((hq[i] & 0x7f) == 0x7f) hq[i] ^= 1;
            }
            std::vector<float> hs((size_t)out, 1e-3f);
            fl_tensor hft = {};
            hft.dtype = FL_DTYPE_F8_E4M3;
            hft.ndim = 2;
            hft.shape[0] = out;
            hft.shape[1] = in;
            hft.data = hq.data();
            hft.scales = hs.data();
            const double fbytes = (double)out * in + (double)out * 4;
            const int fcopies = weight_copies(fbytes);
            std::vector<fl_tensor> dfw(fcopies);
            for (int c = 0; c < fcopies; c++) FK(be->ops->upload_weight(be, &hft, &dfw[c]));

            std::vector<float> hx((size_t)max_n * in);
            for (size_t i = 0; i < hx.size(); i++) hx[i] = (float)((int)(rnd32() % 2001) - 1000) * 1e-3f;
            void *dx, *dy;
            FK(be->ops->alloc(be, (size_t)max_n * in * 2, &dx));
            FK(be->ops->alloc(be, (size_t)max_n * out * 2, &dy));
            FK(be->ops->upload_act(be, dx, hx.data(), hx.size()));

            for (const auto &run : runs) {
                const int n = run[0], mode = run[1];
                if (s >= (full ? (int)shapes.size() : n_full) && !((n == 1 || n == 16) && (mode == 0 || mode >= 3)))
                    continue;
                const bool bf = mode == 3 || mode == 4, f8 = mode >= 6; /* 5: W4 on the tensor-core GEMM */
                fl_cuda_bf16_gemv_force(mode == 4 ? 0 : -1);
                fl_cuda_w4_set_dequant_min_n(be, mode == 1 || mode == 5 ? 1 << 30 : mode == 2 ? 1 : 128);
                fl_cuda_tune_set(FL_CUDA_TUNE_W4_GEMM, mode == 5 ? 1 : mode == 1 ? 0 : -1);
                fl_cuda_tune_set(FL_CUDA_TUNE_FP8_GEMV, mode == 7 ? 0 : mode == 8 ? 1 : fp8_gemv_tune);
                const int nc = f8 ? fcopies : bf ? bcopies : copies;
                const fl_tensor *ws = f8 ? dfw.data() : bf ? dbw.data() : dw.data();
                for (int i = 0; i < 10; i++) FK(be->ops->matmul(be, dx, n, &ws[i % nc], NULL, dy));
                std::vector<double> t;
                const int reps = n >= 1024 ? 2 : 20;
                for (int sample = 0; sample < 15; sample++) {
                    CK(cudaEventRecord(e0, st));
                    for (int i = 0; i < reps; i++)
                        FK(be->ops->matmul(be, dx, n, &ws[(sample * reps + i) % nc], NULL, dy));
                    CK(cudaEventRecord(e1, st));
                    CK(cudaEventSynchronize(e1));
                    float ms;
                    CK(cudaEventElapsedTime(&ms, e0, e1));
                    t.push_back(ms * 1e-3 / reps);
                }
                const double sec = median(t);
                const double bytes = (f8 ? fbytes : bf ? bbytes : wbytes) + (double)n * in * 2 + (double)n * out * 2;
                result r;
                snprintf(r.name, sizeof r.name, "%s_%dx%d_n%d", mode_name[mode], out, in, n);
                r.us = sec * 1e6;
                r.gbs = bytes / sec / 1e9;
                r.pct = 100.0 * r.gbs / ceil_gbs;
                printf("%-32s %9.2f us  %8.1f GB/s  %5.1f %% of copy ceiling  %7.1f TFLOP/s\n", r.name, r.us,
                       r.gbs, r.pct, 2.0 * n * in * out / sec / 1e12);
                res.push_back(r);
            }
            fl_cuda_w4_set_dequant_min_n(be, 128);
            fl_cuda_tune_set(FL_CUDA_TUNE_W4_GEMM, -1);
            fl_cuda_bf16_gemv_force(-1);
            fl_cuda_tune_set(FL_CUDA_TUNE_FP8_GEMV, fp8_gemv_tune);
            for (auto &w : dw) be->ops->free_weight(be, &w);
            for (auto &w : dbw) be->ops->free_weight(be, &w);
            for (auto &w : dfw) be->ops->free_weight(be, &w);
            be->ops->free(be, dx);
            be->ops->free(be, dy);
        }
    }
    /* 4. paged attention (GQA 32/8, head_dim 128, block 16, scattered block
     * tables): decode at batch 1 x 4096 / 16384 / 32768, 8 x 4096 and 64 x
     * 2048 (no split: the batch fills the GPU) cached tokens (K + V bytes
     * read / time; 8 x 4096 and 1 x 32768 are 134 MB, > L2), and a
     * 2048-token causal prefill (TFLOP/s, 4 * heads * head_dim *
     * sum of visible positions). Each under the automatic kernel choice
     * (flash-decoding split / tensor-core prefill), with single-buffered
     * K/V tiles, and forced onto the SIMT kernel (the one before the split,
     * for comparison). */
    if (!sweep_only && !moe_only && !glu_only && !shapes_only) {
        struct acase {
            int n_seqs, ctx, n_q;
        };
        static const acase cases[] = {{1, 4096, 1},  {1, 16384, 1}, {1, 32768, 1},
                                      {8, 4096, 1},  {64, 2048, 1}, {1, 2048, 2048}};
        for (const acase &ac : cases)
            for (int v = 0; v < 3; v++) /* auto, auto with single-buffered K/V tiles, SIMT */
                if (bench_attention(be, st, e0, e1, ceil_gbs, ac.n_seqs, ac.ctx, ac.n_q,
                                    v == 2 ? FL_CUDA_ATTN_SIMT : FL_CUDA_ATTN_AUTO, v == 1 ? 1 : 0, res))
                    return 1;
    }
    FK(be->ops->sync(be));

    if (!sweep_only && !glu_only && !shapes_only && bench_moe(be, st, e0, e1, ceil_gbs, res)) return 1;
    if (json) {
        FILE *f = fopen(json, "w");
        if (!f) {
            perror(json);
            return 1;
        }
        fprintf(f, "{\n  \"device\": \"%s\",\n  \"copy_ceiling_gbs\": %.1f,\n  \"kernels\": [\n", prop.name,
                ceil_gbs);
        for (size_t i = 0; i < res.size(); i++) {
            char extra[64] = "";
            if (!strncmp(res[i].name, "attn_prefill", 12))
                snprintf(extra, sizeof extra, ", \"tflops\": %.1f", res[i].tflops);
            fprintf(f, "    {\"name\": \"%s\", \"us\": %.3f, \"gbs\": %.1f, \"pct_of_ceiling\": %.1f%s}%s\n",
                    res[i].name, res[i].us, res[i].gbs, res[i].pct, extra, i + 1 < res.size() ? "," : "");
        }
        fprintf(f, "  ],\n  \"gemv_variants\": [\n");
        for (size_t i = 0; i < vres.size(); i++)
            fprintf(f, "    {\"name\": \"%s\", \"us\": %.3f, \"gbs\": %.1f, \"pct_of_ceiling\": %.1f, "
                    "\"rel_err_vs_old\": %.2e}%s\n", vres[i].name, vres[i].us, vres[i].gbs, vres[i].pct,
                    vres[i].err, i + 1 < vres.size() ? "," : "");
        fprintf(f, "  ]\n}\n");
        fclose(f);
    }
    if (res.size() >= 7 && !glu_only && !shapes_only)
        printf("summary: copy ceiling %.0f GB/s; W4 GEMV batch 1: %s %.1f%%, %s %.1f%% of ceiling\n", ceil_gbs,
               res[0].name, res[0].pct, res[6].name, res[6].pct);
    fl_backend_free(be);
    return vfails ? 2 : 0;
}
