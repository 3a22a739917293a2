/*
 * cuda_sample.cu — sample_rows: the token the host sampler
 * (runtime/sampler.c, fl_sampler_sample_u) picks, computed where the logits
 * are, so a sampled decode step brings 8 bytes per row to the host instead
 * of the vocabulary and the filters run off the host's single core.
 *
 * The same function, not only the same distribution: for the same logits,
 * parameters and draw u the token is the host's, except where float/double
 * rounding of a sum lands within ~1e-15 of a boundary (the cumulative
 * masses are summed in a different order) or an expf differs from glibc's
 * in its last bits (~1e-7). One block of 1024 threads a row, three kernels:
 *
 *  1. prep: the repetition penalty through a bitmask of the row's history
 *     in shared memory, the max, the first NaN and the argmax (greedy rows
 *     end here), then the scaled scores s = x / T of the candidates (within
 *     60 of the top, as on the host), -inf for the rest.
 *  2. fast: top-k by a radix select of the k-th score (no sort); top-p over
 *     the top 16384 candidates, compacted and bitonic-sorted in shared
 *     memory by (score descending, id ascending), when they hold top_p of
 *     the mass; min-p a threshold on w = exp(s - top). The survivors'
 *     weights are laid out by id and the draw walks them in id order, as
 *     the host does.
 *  3. sorted, only for the rows the fast kernel could not cut (a nucleus of
 *     more than 16384, or a run of equal weights running past them): a
 *     stable radix sort of the scores (CUB: a few rows one at a time over
 *     the whole device, more rows segmented), then the same cut over the
 *     whole row. The host learns which rows from one read.
 *
 * Cost at batch 1 on a 128k vocabulary: ~170 us with top-k 50 + top-p 0.9,
 * ~90 us with temperature alone, ~950 us for a flat nucleus that takes the
 * sort (H200, bench/results/2026-12-01-h200-sample). The workspace holds
 * the scores and ids twice (the sort is out of place) and CUB's temporary
 * storage: ~16 bytes a logit and a few MB.
 */
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>
#include <limits.h>

#include "kernels/cuda/cuda_common.cuh"

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
/* The penalty bitmask lives in dynamic shared memory, within the 48 KB a
 * block has without opting in (the prep kernel's own use is < 1 KB). */
#define SAMPLE_MAX_VOCAB (47 * 1024 * 8)

/* What prep leaves for the draw, per row. */
struct sample_state {
    float top;  /* the top scaled score (0 in the T -> 0 limit) */
    int nc;     /* candidates */
    int done;   /* out already written (greedy, NaN, all -inf) */
    int sort;   /* the fast path could not cut this row: the sorted path does */
};

/* Workspace layout for n rows of d: four [n d] arrays, the segment offsets,
 * the states, then CUB's storage. */
struct sample_ws {
    float *keys, *sorted;   /* scores by id; sorted descending per row (keys is reused for the
                               weights by id once sorted) */
    int32_t *ids, *sorted_ids;
    int32_t *offs;          /* [n + 1] */
    sample_state *st;       /* [n] */
    void *cub;
    size_t cub_bytes;
};

static size_t align256(size_t v) { return (v + 255) & ~(size_t)255; }

/* CUB's storage for either sort: all rows segmented, or one row at a time
 * over the whole device (a few rows to sort: CUB's segmented sort gives a
 * segment one block, ~0.8 ms for 128k keys). */
static size_t cub_bytes(int n, int d) {
    static int last_n = -1, last_d = -1; /* every call asks for the same sizes: ask CUB once */
    static size_t last;
    if (n == last_n && d == last_d) return last;
    size_t seg = 0, one = 0;
    cub::DeviceSegmentedRadixSort::SortPairsDescending((void *)NULL, seg, (const float *)NULL, (float *)NULL,
                                                       (const int32_t *)NULL, (int32_t *)NULL, n * d, n,
                                                       (const int32_t *)NULL, (const int32_t *)NULL);
    cub::DeviceRadixSort::SortPairsDescending((void *)NULL, one, (const float *)NULL, (float *)NULL,
                                              (const int32_t *)NULL, (int32_t *)NULL, d);
    last_n = n, last_d = d, last = seg > one ? seg : one;
    return last;
}

static sample_ws ws_layout(void *base, int n, int d) {
    sample_ws w;
    char *p = (char *)base;
    const size_t arr = align256((size_t)n * d * 4);
    w.keys = (float *)p, p += arr;
    w.sorted = (float *)p, p += arr;
    w.ids = (int32_t *)p, p += arr;
    w.sorted_ids = (int32_t *)p, p += arr;
    w.offs = (int32_t *)p, p += align256((size_t)(n + 1) * 4);
    w.st = (sample_state *)p, p += align256((size_t)n * sizeof(sample_state));
    w.cub = p;
    w.cub_bytes = cub_bytes(n, d);
    return w;
}

extern "C" size_t fl_cuda_sample_rows_ws(fl_backend *b, int n, int d) {
    (void)b;
    if (n <= 0 || d <= 0 || d > SAMPLE_MAX_VOCAB || (int64_t)n * d > INT_MAX / 2) return 0;
    const size_t arr = align256((size_t)n * d * 4);
    return 4 * arr + align256((size_t)(n + 1) * 4) + align256((size_t)n * sizeof(sample_state)) +
           cub_bytes(n, d) + 256;
}

/* --- block reductions (1024 threads) -------------------------------------- */

static __device__ __forceinline__ void argmax_take(float &bv, int &bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) bv = v, bi = i;
}

/* Inclusive prefix of v over the warp's lanes. */
static __device__ __forceinline__ double warp_incl_scan(double v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const double t = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += t;
    }
    return v;
}

/* Exclusive prefix of v over the block's threads in thread order, and the
 * total; every thread calls it. sh: 33 doubles of shared memory. */
static __device__ double block_excl_scan(double v, double *total, double *sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const double inc = warp_incl_scan(v);
    double exc = __shfl_up_sync(0xffffffffu, inc, 1);
    if (lane == 0) exc = 0.0;
    __syncthreads(); /* sh may still be read by a previous call */
    if (lane == 31) sh[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        const double wi = warp_incl_scan(sh[lane]);
        double we = __shfl_up_sync(0xffffffffu, wi, 1);
        if (lane == 0) we = 0.0;
        sh[lane] = we; /* exclusive prefix of the warps */
        if (lane == 31) sh[32] = wi;
    }
    __syncthreads();
    *total = sh[32];
    return sh[warp] + exc;
}

static __device__ int block_sum_int(int v, int *sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = __reduce_add_sync(0xffffffffu, v);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int t = __reduce_add_sync(0xffffffffu, sh[lane]);
        if (lane == 0) sh[32] = t;
    }
    __syncthreads();
    return sh[32];
}

static __device__ int block_min_int(int v, int *sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = (int)__reduce_min_sync(0xffffffffu, (unsigned)v); /* v >= 0 */
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int t = (int)__reduce_min_sync(0xffffffffu, (unsigned)sh[lane]);
        if (lane == 0) sh[32] = t;
    }
    __syncthreads();
    return sh[32];
}

static __device__ __forceinline__ float penalize(float v, float p) { return v > 0.0f ? v / p : v * p; }

/* The host's weight expf(s - top). CUDA's expf is within 2 ulp of the
 * exact value, glibc's within 0.502: a weight can differ in its last bits,
 * which moves a draw or a cut only when it falls within ~1e-7 of a
 * boundary. (Double exp rounded to float would agree more often, but cost
 * 45 us a row of 128k on one SM, as much as the rest of the draw.) */
static __device__ __forceinline__ float weight_of(float s, float top) { return expf(s - top); }

/* --- 1. prep ----------------------------------------------------------------- */

static __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_prep_kernel(const bf16 *x, int n, int d, const fl_sample_row *rows, const int32_t *hist,
                       sample_ws w, int32_t *out) {
    pdl_enter(); /* before any global access: see launch_pdl */
    extern __shared__ uint32_t mask[]; /* [(d + 31) / 32] when the row has a penalty */
    __shared__ float sv[SAMPLE_WARPS];
    __shared__ int si[SAMPLE_WARPS], snan[SAMPLE_WARPS], sh[33];
    const int i = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const fl_sample_row r = rows[i];
    const bf16 *row = x + (int64_t)i * d;
    float *keys = w.keys + (int64_t)i * d;
    int32_t *ids = w.ids + (int64_t)i * d;
    if (i == 0 && tid == 0) w.offs[n] = n * d;
    if (tid == 0) w.offs[i] = i * d;

    const bool pen = r.penalty != 1.0f && r.hist_n > 0;
    if (pen) {
        const int words = (d + 31) / 32;
        for (int k = tid; k < words; k += SAMPLE_THREADS) mask[k] = 0;
        __syncthreads();
        for (int k = tid; k < r.hist_n; k += SAMPLE_THREADS) {
            const int id = hist[r.hist_lo + k];
            if (id >= 0 && id < d) atomicOr(&mask[id >> 5], 1u << (id & 31));
        }
        __syncthreads();
    }
#define SAMPLE_LOAD(j) (pen && (mask[(j) >> 5] >> ((j) & 31) & 1) ? penalize(bf2f(row[j]), r.penalty) : bf2f(row[j]))

    /* the max (lowest id on ties) and the first NaN */
    float bv = -INFINITY;
    int bi = INT_MAX, nan_at = INT_MAX;
    for (int j = tid; j < d; j += SAMPLE_THREADS) {
        const float v = SAMPLE_LOAD(j);
        if (v != v) nan_at = min(nan_at, j);
        argmax_take(bv, bi, v, j);
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        nan_at = min(nan_at, __shfl_xor_sync(0xffffffffu, nan_at, o));
        argmax_take(bv, bi, ov, oi);
    }
    if (lane == 0) sv[warp] = bv, si[warp] = bi, snan[warp] = nan_at;
    __syncthreads();
    if (warp == 0) {
        bv = sv[lane], bi = si[lane], nan_at = snan[lane];
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            nan_at = min(nan_at, __shfl_xor_sync(0xffffffffu, nan_at, o));
            argmax_take(bv, bi, ov, oi);
        }
        if (lane == 0) sv[0] = bv, si[0] = bi == INT_MAX ? 0 : bi, snan[0] = nan_at;
    }
    __syncthreads();
    const float m = sv[0];
    const bool greedy = !(r.temperature > 0.0f);
    if (snan[0] != INT_MAX || greedy || m == -INFINITY) {
        if (tid == 0) {
            if (snan[0] != INT_MAX) out[2 * i] = snan[0], out[2 * i + 1] = 1;
            else if (greedy) out[2 * i] = si[0], out[2 * i + 1] = 0;
            else out[2 * i] = 0, out[2 * i + 1] = 2;
            w.st[i] = sample_state{0.0f, 0, 1, 0};
        }
        for (int j = tid; j < d; j += SAMPLE_THREADS) keys[j] = -INFINITY, ids[j] = j;
        return;
    }

    /* The candidates and their scaled scores, exactly as the host: within
     * 60 of m / T, or the ties at m when m / T overflows (the T -> 0 limit). */
    const float T = r.temperature, mt = m / T, cut = mt - 60.0f;
    const bool t0 = !isfinite(mt);
    int nc = 0;
    for (int j = tid; j < d; j += SAMPLE_THREADS) {
        const float v = SAMPLE_LOAD(j);
        float s = -INFINITY;
        if (t0) {
            if (v == m) s = 0.0f;
        } else {
            const float sc = v / T;
            if (sc >= cut) s = sc + 0.0f; /* +0.0 for -0.0: one key for equal scores */
        }
        nc += s != -INFINITY;
        keys[j] = s;
        ids[j] = j;
    }
#undef SAMPLE_LOAD
    nc = block_sum_int(nc, sh);
    if (tid == 0) w.st[i] = sample_state{t0 ? 0.0f : mt, nc, 0, 0};
}

/* --- 2. cut and draw ------------------------------------------------------- */

/* The first p in [lo, hi) with pred(p) true, pred monotone (false...true);
 * hi when none. One thread. */
template <typename P>
static __device__ int first_true(int lo, int hi, P pred) {
    while (lo < hi) {
        const int mid = lo + (hi - lo) / 2;
        if (pred(mid)) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

/* Order-preserving uint of a float (larger float, larger uint). */
static __device__ __forceinline__ uint32_t f2ord(float f) {
    const uint32_t b = __float_as_uint(f);
    return b & 0x80000000u ? ~b : b | 0x80000000u;
}
static __device__ __forceinline__ float ord2f(uint32_t o) {
    return __uint_as_float(o & 0x80000000u ? o & 0x7fffffffu : ~o);
}

/* The k-th largest score of the row (1 <= k <= the candidates), by a radix
 * select over the order-preserving keys, a byte a round; *above gets how
 * many scores are larger and *ties how many equal it. Every thread calls it. */
static __device__ float kth_largest(const float *keys, int d, int k, int *above, int *ties, int *hist,
                                    int *sel) {
    const int tid = threadIdx.x, lane = tid & 31;
    uint32_t prefix = 0, pmask = 0;
    int rem = k, gt = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = tid; b < 256; b += SAMPLE_THREADS) hist[b] = 0;
        __syncthreads();
        for (int j = tid; j < d; j += SAMPLE_THREADS) {
            const uint32_t o = f2ord(keys[j]);
            if ((o & pmask) == prefix) atomicAdd(&hist[(o >> shift) & 255], 1);
        }
        __syncthreads();
        if (tid < 32) {
            /* lane l holds bins 255 - 8 l down to 248 - 8 l: the k-th from the top */
            int c[8], sum = 0;
            for (int q = 0; q < 8; q++) c[q] = hist[255 - 8 * lane - q], sum += c[q];
            int inc = sum;
            for (int o = 1; o < 32; o <<= 1) {
                const int t = __shfl_up_sync(0xffffffffu, inc, o);
                if (lane >= o) inc += t;
            }
            const int exc = inc - sum;
            if (exc < rem && rem <= inc) {
                int acc = exc, q = 0;
                while (acc + c[q] < rem) acc += c[q++];
                sel[0] = 255 - 8 * lane - q, sel[1] = acc, sel[2] = c[q];
            }
        }
        __syncthreads();
        const int b = sel[0];
        rem -= sel[1];
        gt += sel[1];
        prefix |= (uint32_t)b << shift;
        pmask |= 255u << shift;
        if (shift == 0) *ties = sel[2];
        __syncthreads();
    }
    *above = gt;
    return ord2f(prefix);
}

/* The top-p and min-p cut over n sorted candidates (score S(p)
 * descending, id I(p) ascending among equal scores), z the mass of every
 * survivor of top-k: bounds[1] = the kept prefix, [bounds[2], bounds[3]) a
 * run of equal weights but different scores that the cut falls in (its
 * lowest ids are kept; empty when there is none). The binary searches rely
 * on expf being monotone, which CUDA's is. */
template <typename FS>
static __device__ void cut_bounds(FS S, int n, float top, double z, const fl_sample_row &r, double *shd, int *sh,
                                  int *bounds) {
    const int tid = threadIdx.x;
    const int C = (n + SAMPLE_THREADS - 1) / SAMPLE_THREADS, p0 = tid * C, p1 = min(n, p0 + C);
    double loc = 0.0, tot = 0.0;
    for (int p = p0; p < p1; p++) loc += weight_of(S(p), top);
    const double pre = block_excl_scan(loc, &tot, shd);
    const double target = r.top_p < 1.0f ? (double)r.top_p * z : INFINITY;
    int mine = INT_MAX;
    double e = pre;
    for (int p = p0; p < p1; p++) {
        if (e >= target) {
            mine = p;
            break;
        }
        e += weight_of(S(p), top);
    }
    int cut = block_min_int(mine, sh);
    cut = cut == INT_MAX ? n : cut;
    if (tid == 0) {
        /* min-p: weights are non-increasing along S, so a threshold is a prefix */
        const float mp = r.min_p;
        const int kp = mp > 0.0f ? first_true(1, n, [&](int p) { return weight_of(S(p), top) < mp; }) : n;
        /* The cut inside a run of equal weights whose scores differ (sorted
         * by score here, by weight then id on the host): [a, b). */
        int a = cut, b = cut;
        if (cut < n && kp > cut) {
            const float tau = weight_of(S(cut - 1), top);
            if (weight_of(S(cut), top) == tau) {
                a = first_true(0, cut, [&](int p) { return weight_of(S(p), top) == tau; });
                b = first_true(cut, n, [&](int p) { return weight_of(S(p), top) < tau; });
                /* one score all through: the sort left its ids ascending */
                if (S(a) == S(b - 1)) a = b = cut;
            }
        }
        bounds[1] = min(cut, kp), bounds[2] = a, bounds[3] = b;
        bounds[0] = cut; /* for the caller's check */
    }
    __syncthreads();
}

/* Writes the kept weights of cut_bounds' cut into keys by id (zeroed by
 * the caller). */
template <typename FS, typename FI>
static __device__ void cut_scatter(FS S, FI I, float top, float *keys, const int *bounds) {
    const int tid = threadIdx.x;
    const int kept = bounds[1], a = bounds[2], b = bounds[3], q = kept - a;
    for (int p = tid; p < max(kept, b); p += SAMPLE_THREADS) {
        bool keep = p < kept;
        if (p >= a && p < b) { /* the q lowest ids of the run */
            int rank = 0;
            for (int o = a; o < b; o++) rank += I(o) < I(p);
            keep = rank < q;
        }
        if (keep) keys[I(p)] = weight_of(S(p), top);
    }
    __syncthreads();
}

/* The draw in id order over keys (weights by id, 0: not kept): chunks of
 * ids per thread, their masses scanned in thread order; the thread whose
 * interval of the scan holds u * z walks its chunk as the host walks the
 * whole list. */
static __device__ void draw_by_id(const float *keys, int d, double u, int32_t *out, double *shd, int *sh,
                                  double *spre, int *pick) {
    const int tid = threadIdx.x;
    const int C = (d + SAMPLE_THREADS - 1) / SAMPLE_THREADS, j0 = tid * C, j1 = min(d, j0 + C);
    double loc = 0.0, z = 0.0;
    int last = -1;
    for (int j = j0; j < j1; j++)
        if (keys[j] > 0.0f) loc += keys[j], last = j;
    const double pre = block_excl_scan(loc, &z, shd);
    spre[tid] = pre;
    if (tid == 0) spre[SAMPLE_THREADS] = z, *pick = INT_MAX;
    /* the last survivor of all, for a draw that rounding left at the top */
    const int last_all = INT_MAX - block_min_int(INT_MAX - max(last, 0), sh);
    const double uz = u * z;
    if (last >= 0 && spre[tid] <= uz && uz < spre[tid + 1]) {
        int tok = last;
        double acc = pre;
        for (int j = j0; j < j1; j++) {
            if (!(keys[j] > 0.0f)) continue;
            acc += keys[j];
            if (uz < acc) {
                tok = j;
                break;
            }
        }
        atomicMin(pick, tok); /* one thread but where the scan's rounding overlaps intervals */
    }
    __syncthreads();
    if (tid == 0) out[0] = *pick != INT_MAX ? *pick : last_all, out[1] = 0;
}

/* Candidates the fast path sorts in (dynamic) shared memory: 128 KB of
 * keys. A top-p nucleus of real LLM logits is mostly far smaller; larger
 * ones (flat distributions) take the full sort. */
#define SAMPLE_CAP 16384

struct draw_smem {
    double shd[33];
    double spre[SAMPLE_THREADS + 1];
    int sh[33], bounds[4], hist[256], sel[3], pick, cnt;
};

/* Every row prep did not finish: top-k by a radix select (no sort); top-p
 * on the top candidates sorted in shared memory when at most SAMPLE_CAP of
 * them hold top_p of the mass (else the row is left to the sorted path);
 * min-p; the draw. */
static __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_fast_kernel(int d, const fl_sample_row *rows, sample_ws w, int32_t *out) {
    __shared__ draw_smem sm;
    extern __shared__ unsigned long long sk[]; /* [SAMPLE_CAP] when a row has top-p */
    pdl_enter();
    const int i = blockIdx.x, tid = threadIdx.x;
    const sample_state st = w.st[i];
    if (st.done) return;
    const fl_sample_row r = rows[i];
    float *keys = w.keys + (int64_t)i * d; /* scores by id, then weights by id */
    const float top = st.top;
    const int nc = st.nc;
    /* top-k: the k-th score; the survivors are the scores >= it */
    float kth = -INFINITY;
    int n_k = nc;
    if (r.top_k > 0 && r.top_k < nc) {
        int above, ties;
        kth = kth_largest(keys, d, r.top_k, &above, &ties, sm.hist, sm.sel);
        n_k = above + ties;
    }
    if (r.top_p < 1.0f) {
        /* the set to sort: the survivors, or the top SAMPLE_CAP of them if
         * those hold top_p of the mass */
        float lo = kth;
        int n_u = n_k;
        if (n_k > SAMPLE_CAP) {
            int above, ties;
            lo = kth_largest(keys, d, SAMPLE_CAP, &above, &ties, sm.hist, sm.sel);
            n_u = above + ties;
        }
        double mz = 0.0, mu = 0.0;
        for (int j = tid; j < d; j += SAMPLE_THREADS) {
            const float s = keys[j];
            if (s >= kth && s != -INFINITY) {
                const float wt = weight_of(s, top);
                mz += wt;
                if (s >= lo) mu += wt;
            }
        }
        double z, zu;
        block_excl_scan(mz, &z, sm.shd);
        block_excl_scan(mu, &zu, sm.shd);
        if (n_u > SAMPLE_CAP || (n_u < n_k && zu < (double)r.top_p * z)) {
            if (tid == 0) w.st[i].sort = 1; /* too many: the sorted path */
            return;
        }
        /* compact the n_u candidates as (score descending, id ascending) keys */
        if (tid == 0) sm.cnt = 0;
        __syncthreads();
        for (int j = tid; j < d; j += SAMPLE_THREADS) {
            const float s = keys[j];
            if (s >= lo && s != -INFINITY) {
                const int at = atomicAdd(&sm.cnt, 1);
                sk[at] = (unsigned long long)~f2ord(s) << 32 | (uint32_t)j;
            }
        }
        __syncthreads();
        int np = 1;
        while (np < n_u) np <<= 1;
        for (int p = n_u + tid; p < np; p += SAMPLE_THREADS) sk[p] = ~0ull;
        __syncthreads();
        for (int k = 2; k <= np; k <<= 1)
            for (int jj = k >> 1; jj > 0; jj >>= 1) {
                for (int p = tid; p < np; p += SAMPLE_THREADS) {
                    const int q = p ^ jj;
                    if (q > p) {
                        const unsigned long long a = sk[p], b = sk[q];
                        if ((a > b) == ((p & k) == 0)) sk[p] = b, sk[q] = a;
                    }
                }
                __syncthreads();
            }
        auto S = [&](int p) { return ord2f(~(uint32_t)(sk[p] >> 32)); };
        cut_bounds(S, n_u, top, z, r, sm.shd, sm.sh, sm.bounds);
        /* The top SAMPLE_CAP were chosen by score, the host's ties are by
         * weight: when they do not hold every survivor, a cut at their end
         * or in a run of equal weights that reaches it may need tokens below
         * them. The sorted path has them all. */
        const int cut = sm.bounds[0];
        if (n_u < n_k && (cut >= n_u || (sm.bounds[1] == cut && weight_of(S(n_u - 1), top) ==
                                                                    weight_of(S(cut - 1), top)))) {
            if (tid == 0) w.st[i].sort = 1;
            return;
        }
        for (int j = tid; j < d; j += SAMPLE_THREADS) keys[j] = 0.0f;
        __syncthreads();
        cut_scatter(S, [&](int p) { return (int32_t)(uint32_t)sk[p]; }, top, keys, sm.bounds);
    } else {
        /* no cut by mass: weights in place, top-k and min-p as thresholds */
        const float mp = r.min_p;
        for (int j = tid; j < d; j += SAMPLE_THREADS) {
            const float s = keys[j];
            float wt = s == -INFINITY || s < kth ? 0.0f : weight_of(s, top);
            if (wt < mp) wt = 0.0f;
            keys[j] = wt;
        }
        __syncthreads();
    }
    draw_by_id(keys, d, r.u, out + 2 * i, sm.shd, sm.sh, sm.spre, &sm.pick);
}

/* The rows the fast path left (st.sort): the survivors of top-k are the
 * first ones of the row sorted by the CUB sort; the same cut over them. */
static __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_sorted_kernel(int d, const fl_sample_row *rows, sample_ws w, int32_t *out) {
    __shared__ draw_smem sm;
    pdl_enter();
    const int i = blockIdx.x, tid = threadIdx.x;
    const sample_state st = w.st[i];
    if (st.done || !st.sort) return;
    const fl_sample_row r = rows[i];
    float *keys = w.keys + (int64_t)i * d;
    const float *S = w.sorted + (int64_t)i * d;
    const int32_t *I = w.sorted_ids + (int64_t)i * d;
    int K = st.nc;
    if (r.top_k > 0 && r.top_k < st.nc && tid == 0) {
        const float kth = S[r.top_k - 1];
        K = first_true(r.top_k, st.nc, [&](int p) { return S[p] < kth; });
    }
    if (tid == 0) sm.bounds[0] = K;
    __syncthreads();
    K = sm.bounds[0];
    double loc = 0.0, z = 0.0;
    for (int p = tid; p < K; p += SAMPLE_THREADS) loc += weight_of(S[p], st.top);
    block_excl_scan(loc, &z, sm.shd);
    for (int j = tid; j < d; j += SAMPLE_THREADS) keys[j] = 0.0f;
    cut_bounds([&](int p) { return S[p]; }, K, st.top, z, r, sm.shd, sm.sh, sm.bounds);
    cut_scatter([&](int p) { return S[p]; }, [&](int p) { return I[p]; }, st.top, keys, sm.bounds);
    draw_by_id(keys, d, r.u, out + 2 * i, sm.shd, sm.sh, sm.spre, &sm.pick);
}

/* --- host ----------------------------------------------------------------- */

extern "C" fl_status fl_cuda_copy_2d(fl_backend *b, void *dst, int dst_stride, const void *src, int src_stride,
                                     int n, int w) {
    if (n <= 0 || w <= 0) return FL_OK;
    if (dst_stride < w || src_stride < w)
        return FL_ERR(FL_ERR_INVALID_ARG, "copy_2d: strides %d, %d under the width %d", dst_stride, src_stride, w);
    FL_CUDA_CHECK(cudaMemcpy2DAsync(dst, (size_t)dst_stride * sizeof(bf16), src, (size_t)src_stride * sizeof(bf16),
                                    (size_t)w * sizeof(bf16), (size_t)n, cudaMemcpyDeviceToDevice,
                                    cuda_impl(b)->stream));
    return FL_OK;
}

extern "C" fl_status fl_cuda_sample_rows(fl_backend *b, const void *x, int n, int d, const fl_sample_row *rows,
                                         const int32_t *hist, bool any_top_p, void *ws, int32_t *out) {
    if (n <= 0) return FL_OK;
    if (fl_cuda_sample_rows_ws(b, n, d) == 0)
        return FL_ERR(FL_ERR_UNSUPPORTED, "sample_rows: %d rows of %d logits (at most %d logits a row, "
                      "and n d < 2^30)", n, d, SAMPLE_MAX_VOCAB);
    cudaStream_t stream = cuda_impl(b)->stream;
    const sample_ws w = ws_layout(ws, n, d);
    const size_t mask_bytes = (size_t)(d + 31) / 32 * 4;
    FL_TRY(launch_pdl(sample_prep_kernel, n, SAMPLE_THREADS, mask_bytes, stream, (const bf16 *)x, n, d, rows,
                      hist, w, out));
    static bool attr_set;
    if (!attr_set) {
        FL_CUDA_CHECK(cudaFuncSetAttribute(sample_fast_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)(SAMPLE_CAP * sizeof(unsigned long long))));
        attr_set = true;
    }
    FL_TRY(launch_pdl(sample_fast_kernel, n, SAMPLE_THREADS, SAMPLE_CAP * sizeof(unsigned long long), stream, d,
                      rows, w, out));
    if (!any_top_p) return FL_OK;
    /* Whether a row's top-p nucleus was too large for the fast path: a
     * flat distribution (random logits) can keep tens of thousands. */
    static_assert(sizeof(sample_state) == 16, "sample_state is four words");
    int any = 0, first[4];
    for (int lo = 0; lo < n; lo += 64) {
        sample_state h[64];
        const int cnt = n - lo < 64 ? n - lo : 64;
        FL_CUDA_CHECK(cudaMemcpyAsync(h, w.st + lo, cnt * sizeof *h, cudaMemcpyDeviceToHost, stream));
        FL_CUDA_CHECK(cudaStreamSynchronize(stream));
        for (int k = 0; k < cnt; k++)
            if (h[k].sort && !h[k].done) {
                if (any < 4) first[any] = lo + k;
                any++;
            }
    }
    if (!any) return FL_OK;
    size_t bytes = w.cub_bytes;
    if (any <= 4) { /* each row over the whole device */
        for (int k = 0; k < any; k++) {
            const size_t o = (size_t)first[k] * d;
            FL_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(w.cub, bytes, w.keys + o, w.sorted + o, w.ids + o,
                                                                    w.sorted_ids + o, d, 0, 32, stream));
            bytes = w.cub_bytes;
        }
    } else {
        FL_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
            w.cub, bytes, w.keys, w.sorted, w.ids, w.sorted_ids, n * d, n, w.offs, w.offs + 1, 0, 32, stream));
    }
    return launch_pdl(sample_sorted_kernel, n, SAMPLE_THREADS, 0, stream, d, rows, w, out);
}
