/*
 * bench_fp8.cu — what FP8 weights would give a large-batch step's GEMMs on
 * this GPU, measured before any FP8 compute path is built: cuBLASLt
 * e4m3 x e4m3 -> bf16 GEMMs at the Llama-3-8B shapes and 128..8192 tokens,
 * with the scale layouts FP8 checkpoints need, next to bf16 cublasGemmEx on
 * the same shapes:
 *   - tensor: one f32 scale for the weight and one for the activations;
 *   - row:    a scale per weight row and per token (OUTER_VEC_32F), what
 *             compressed-tensors' FP8 "dynamic" checkpoints hold;
 *   - block:  a scale per 128 x 128 weight block and per token x 128
 *             columns (BLK128x128_32F / VEC128_32F), DeepSeek's layout;
 * each also with fast accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM). A
 * mode cuBLASLt's heuristic offers no algorithm for is reported as such.
 * (The per-token quantization in front of each GEMM is the product's
 * kernel now, kernels/cuda/cuda_fp8.cu; flotilla bench times it in place.)
 * Values do not change tensor-core timing, so every buffer holds one
 * constant. It sized the FP8 lever before --quantize fp8 existed and keeps
 * comparing the scale layouts.
 *
 *   bench_fp8 [--shape OUTxIN ...] [--tokens N ...]
 */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "bench_fp8: %s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#define BK(x)                                                                       \
    do {                                                                            \
        cublasStatus_t s_ = (x);                                                    \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                          \
            fprintf(stderr, "bench_fp8: %s:%d: cuBLAS status %d\n", __FILE__, __LINE__, (int)s_); \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

static const size_t WS_BYTES = (size_t)32 << 20; /* cuBLAS' Hopper default */

static __global__ void fill_f32(float *p, size_t n, float v) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = v;
}

struct timer {
    cudaEvent_t a, b;
    timer() {
        CK(cudaEventCreate(&a));
        CK(cudaEventCreate(&b));
    }
    template <class F>
    double us(F f, int reps) { /* median of 5 samples of reps calls, after a warmup */
        for (int i = 0; i < 3; i++) f();
        std::vector<float> t;
        for (int s = 0; s < 5; s++) {
            CK(cudaEventRecord(a));
            for (int i = 0; i < reps; i++) f();
            CK(cudaEventRecord(b));
            CK(cudaEventSynchronize(b));
            float ms;
            CK(cudaEventElapsedTime(&ms, a, b));
            t.push_back(ms * 1e3f / reps);
        }
        std::sort(t.begin(), t.end());
        return t[2];
    }
};

enum { M_TENSOR, M_ROW, M_BLOCK, M_COUNT };
static const char *mode_name[M_COUNT] = {"tensor", "row", "block"};

int main(int argc, char **argv) {
    std::vector<std::pair<int, int>> shapes;
    std::vector<int> tokens;
    for (int i = 1; i < argc; i++) {
        int o, k;
        if (!strcmp(argv[i], "--shape") && i + 1 < argc && sscanf(argv[i + 1], "%dx%d", &o, &k) == 2 && o > 0 &&
            k > 0 && o % 128 == 0 && k % 128 == 0) {
            shapes.push_back({o, k});
            i++;
        } else if (!strcmp(argv[i], "--tokens") && i + 1 < argc && atoi(argv[i + 1]) > 0 &&
                   atoi(argv[i + 1]) % 16 == 0) {
            tokens.push_back(atoi(argv[++i]));
        } else {
            fprintf(stderr, "usage: bench_fp8 [--shape OUTxIN (multiples of 128)] ... [--tokens N (a multiple of "
                            "16)] ...\n");
            return 2;
        }
    }
    if (shapes.empty()) shapes = {{14336, 4096}, {4096, 14336}, {6144, 4096}, {4096, 4096}};
    if (tokens.empty()) tokens = {128, 256, 512, 2048, 8192};
    int max_o = 0, max_k = 0, max_n = 0;
    for (auto &s : shapes) max_o = std::max(max_o, s.first), max_k = std::max(max_k, s.second);
    for (int n : tokens) max_n = std::max(max_n, n);

    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, sm_%d%d, %d SMs\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
    cublasHandle_t bh;
    cublasLtHandle_t lh;
    BK(cublasCreate(&bh));
    BK(cublasLtCreate(&lh));
    void *ws;
    CK(cudaMalloc(&ws, WS_BYTES));
    BK(cublasSetWorkspace(bh, ws, WS_BYTES));

    const size_t we = (size_t)max_o * max_k, xe = (size_t)max_n * max_k, ye = (size_t)max_n * max_o;
    void *w8, *x8, *wb, *xb, *y;
    float *sa, *sb;
    CK(cudaMalloc(&w8, we));
    CK(cudaMalloc(&x8, xe));
    CK(cudaMalloc(&wb, we * 2));
    CK(cudaMalloc(&xb, xe * 2));
    CK(cudaMalloc(&y, ye * 2));
    CK(cudaMemset(w8, 0x38, we)); /* e4m3 1.0 */
    CK(cudaMemset(x8, 0x30, xe)); /* e4m3 0.5 */
    CK(cudaMemset(wb, 0x3c, we * 2)); /* bf16 0x3c3c, about 0.011 */
    CK(cudaMemset(xb, 0x3e, xe * 2));
    /* scales: the largest of any mode (a row or token each, or a block each) */
    const size_t sae = std::max((size_t)max_o, (size_t)(max_o / 128) * (max_k / 128));
    const size_t sbe = (size_t)max_n * (max_k / 128);
    CK(cudaMalloc(&sa, sae * 4));
    CK(cudaMalloc(&sb, sbe * 4));
    fill_f32<<<256, 256>>>(sa, sae, 1.0f);
    fill_f32<<<256, 256>>>(sb, sbe, 1.0f);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());

    timer tm;
    printf("%-12s %6s %-16s %10s %10s %8s\n", "shape", "tokens", "mode", "us", "TFLOP/s", "x bf16");
    for (auto &s : shapes) {
        const int m = s.first, k = s.second;
        for (int n : tokens) {
            const double flop = 2.0 * m * n * k;
            const float one = 1.0f, zero = 0.0f;
            /* y^T [m, n] = W [m, k] x^T: column-major W^T is [k, m] (op T), x^T [k, n] (op N) */
            const double tb = tm.us(
                [&] {
                    BK(cublasGemmEx(bh, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, wb, CUDA_R_16BF, k, xb, CUDA_R_16BF,
                                    k, &zero, y, CUDA_R_16BF, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
                },
                20);
            printf("%5dx%-6d %6d %-16s %10.2f %10.1f %8.2f\n", m, k, n, "bf16", tb, flop / tb * 1e-6, 1.0);
            for (int mode = 0; mode < M_COUNT; mode++)
                for (int fast = 0; fast < 2; fast++) {
                    char name[32];
                    snprintf(name, sizeof name, "fp8 %s%s", mode_name[mode], fast ? " fast" : "");
                    cublasLtMatmulDesc_t d;
                    BK(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
                    const cublasOperation_t ta = CUBLAS_OP_T, tbo = CUBLAS_OP_N;
                    BK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
                    BK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &tbo, sizeof tbo));
                    const int8_t fa = (int8_t)fast;
                    BK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fa, sizeof fa));
                    int32_t ma = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, mb = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
                    if (mode == M_ROW) ma = mb = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
                    if (mode == M_BLOCK) {
                        ma = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
                        mb = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
                    }
                    BK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma, sizeof ma));
                    BK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb, sizeof mb));
                    const void *pa = sa, *pb = sb;
                    BK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &pa, sizeof pa));
                    BK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &pb, sizeof pb));
                    cublasLtMatrixLayout_t la, lb, lc;
                    BK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, k, m, k));
                    BK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, k, n, k));
                    BK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, m, n, m));
                    cublasLtMatmulPreference_t pref;
                    BK(cublasLtMatmulPreferenceCreate(&pref));
                    BK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &WS_BYTES,
                                                            sizeof WS_BYTES));
                    cublasLtMatmulHeuristicResult_t h;
                    int found = 0;
                    const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(lh, d, la, lb, lc, lc, pref, 1, &h, &found);
                    if (hs != CUBLAS_STATUS_SUCCESS || found == 0) {
                        printf("%5dx%-6d %6d %-16s %10s (no algorithm: status %d)\n", m, k, n, name, "-", (int)hs);
                    } else {
                        bool ok = true;
                        const double t8 = tm.us(
                            [&] {
                                const cublasStatus_t r = cublasLtMatmul(lh, d, &one, w8, la, x8, lb, &zero, y, lc, y,
                                                                        lc, &h.algo, ws, WS_BYTES, 0);
                                if (r != CUBLAS_STATUS_SUCCESS) ok = false;
                            },
                            20);
                        if (ok)
                            printf("%5dx%-6d %6d %-16s %10.2f %10.1f %8.2f\n", m, k, n, name, t8, flop / t8 * 1e-6,
                                   tb / t8);
                        else
                            printf("%5dx%-6d %6d %-16s %10s (cublasLtMatmul failed)\n", m, k, n, name, "-");
                        CK(cudaGetLastError());
                    }
                    cublasLtMatmulPreferenceDestroy(pref);
                    cublasLtMatrixLayoutDestroy(la);
                    cublasLtMatrixLayoutDestroy(lb);
                    cublasLtMatrixLayoutDestroy(lc);
                    cublasLtMatmulDescDestroy(d);
                }
        }
    }
    CK(cudaDeviceSynchronize());
    cudaFree(w8), cudaFree(x8), cudaFree(wb), cudaFree(xb), cudaFree(y), cudaFree(sa), cudaFree(sb), cudaFree(ws);
    cublasLtDestroy(lh);
    cublasDestroy(bh);
    return 0;
}
