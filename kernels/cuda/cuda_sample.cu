/*
 * cuda_sample.cu — sample_rows: the token the host sampler
 * (core/sampler.c, fl_sampler_sample_u) picks, computed where the logits
 * are, so a sampled decode step brings 8 bytes per row to the host instead
 * of the vocabulary and the filters run off the host's single core.
 *
 * The same function, not only the same distribution: for the same logits,
 * parameters and draw u the token is the host's, except where float/double
 * rounding of a sum lands within ~1e-15 of a boundary (the cumulative
 * masses are summed in a different order) or an expf differs from glibc's
 * in its last bits (~1e-7).
 *
 * sample_kernel: a row over a cluster of C blocks of 1024 threads (C up to
 * 8, fewer when n rows x C would pass one wave or a block would get under
 * 4096 ids), each block a contiguous slice of the ids, the few reductions
 * through distributed shared memory:
 *  1. the repetition penalty through a bitmask of the history in shared
 *     memory, the max, the first NaN and the argmax (greedy rows end here);
 *  2. the scaled scores s = x / T of the candidates (within 60 of the top,
 *     as on the host), -inf for the rest, to the workspace;
 *  3. top-k by a radix select of the k-th score (no sort);
 *  4. top-p over the top 16384 candidates, gathered in rank 0's shared
 *     memory and bitonic-sorted by (score descending, id ascending), when
 *     they hold top_p of the mass; min-p a threshold on w = exp(s - top);
 *     the kept ones sorted by id and drawn in id order, as the host does.
 *     Without top-p the weights are thresholds and the draw runs over the
 *     cluster's slices in id order.
 * Then, only for the rows it could not cut (a nucleus of more than 16384, or
 * a run of equal weights running past them): a stable radix sort of the
 * scores (CUB: a few rows one at a time over the whole device, more rows
 * segmented), and sample_sorted_kernel's same cut over the whole row. The
 * host learns which rows from one read.
 *
 * A row spans several blocks because one block a row (the first version,
 * three kernels) measured about twice as slow on a 128k vocabulary, its
 * passes latency-bound on one SM. The workspace holds the
 * scores and ids twice (the sort is out of place) and CUB's temporary
 * storage: ~16 bytes a logit and a few MB.
 */
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>
#include <limits.h>

#include <algorithm>
#include <cooperative_groups.h>

#include "kernels/cuda/cuda_bulk.cuh"
#include "kernels/cuda/cuda_common.cuh"

namespace cg = cooperative_groups;

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
/* The penalty bitmask of a block's slice lives in dynamic shared memory
 * after the 128 KB of candidates: at most 47 KB (C = 1). */
#define SAMPLE_MAX_VOCAB (47 * 1024 * 8)

/* What sample_kernel leaves for the sorted path, per row. */
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

static bool sample_fits(fl_cuda *c, int d);

extern "C" size_t fl_cuda_sample_rows_ws(fl_backend *b, int n, int d) {
    if (n <= 0 || d <= 0 || d > SAMPLE_MAX_VOCAB || (int64_t)n * d > INT_MAX / 2 || !sample_fits(cuda_impl(b), d))
        return 0;
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

/* --- the cut ------------------------------------------------------- */

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

/* Whether sorted position p (< max(bounds[1], bounds[3])) survives
 * cut_bounds' cut: the first bounds[1], but in the run [a, b) of equal
 * weights only its q = kept - a lowest ids (the host keeps those). */
template <typename FI>
static __device__ bool cut_keeps(FI I, const int *bounds, int p) {
    const int kept = bounds[1], a = bounds[2], b = bounds[3];
    if (p < a || p >= b) return p < kept;
    int rank = 0;
    for (int o = a; o < b; o++) rank += I(o) < I(p);
    return rank < kept - a;
}

/* Writes the kept weights of cut_bounds' cut into keys by id (zeroed by
 * the caller). */
template <typename FS, typename FI>
static __device__ void cut_scatter(FS S, FI I, float top, float *keys, const int *bounds) {
    for (int p = threadIdx.x; p < max(bounds[1], bounds[3]); p += SAMPLE_THREADS)
        if (cut_keeps(I, bounds, p)) keys[I(p)] = weight_of(S(p), top);
    __syncthreads();
}

/* --- the cluster: a row over C blocks ------------------------------------------
 * One row takes a cluster of C blocks (C = 1..8: 8 for a 128k vocabulary at
 * batch 1), block r of it the ids [r S, (r + 1) S), S = ceil(d / C). A
 * block's passes over its slice are then short (16k ids at C = 8: 16 a
 * thread), and the cluster's few reductions go through distributed shared
 * memory. One block a row (the first version) ran every pass on one SM,
 * latency-bound: 170-190 us a row of 128k with top-k + top-p. Built without
 * sm_90 code (no clusters), C is 1 and the same code runs one block a row. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define SAMPLE_CLUSTERS 1
#else
#define SAMPLE_CLUSTERS 0
#endif

struct clu {
#if SAMPLE_CLUSTERS
    cg::cluster_group g = cg::this_cluster();
    __device__ int size() const { return (int)g.num_blocks(); }
    __device__ int rank() const { return (int)g.block_rank(); }
    /* a cluster barrier: also a block barrier, and it orders shared-memory
     * writes before it with reads after it across the cluster */
    __device__ void sync() { g.sync(); }
    template <typename T> __device__ T *at(T *p, int r) { return g.map_shared_rank(p, (unsigned)r); }
#else
    __device__ int size() const { return 1; }
    __device__ int rank() const { return 0; }
    __device__ void sync() { __syncthreads(); }
    template <typename T> __device__ T *at(T *p, int r) { (void)r; return p; }
#endif
};

/* Thread 0 of every block puts v in its slot; after the barrier every
 * thread combines the C slots in rank order, so every block of the cluster
 * gets the same value bit for bit. Each exchange needs a slot of its own: a
 * block may rewrite a slot only once every block has read it, which the
 * barrier of the next exchange guarantees. */
template <typename T, typename F>
static __device__ T cluster_all(clu &cl, T *slot, T v, F f) {
    if (threadIdx.x == 0) *slot = v;
    cl.sync();
    T acc = *cl.at(slot, 0);
    for (int q = 1; q < cl.size(); q++) acc = f(acc, *cl.at(slot, q));
    return acc;
}

/* Calls f(j, ld(j), ok) for the ids j of [lo, hi) this thread owns (lane
 * offsets of its warp's bases, lo + 32 w + U T k), U at a time with the U
 * loads of a batch issued before any f: f may store to global memory, and
 * the compiler would not hoist a load above a store it cannot prove apart,
 * which leaves one load in flight a thread. The loop is warp-uniform, so f
 * may be warp-collective; ok is false for the lanes past hi (ld is not
 * called for them). */
#define SAMPLE_U 4
template <typename L, typename F>
static __device__ __forceinline__ void slice_for(int lo, int hi, L ld, F f) {
    const int lane = threadIdx.x & 31;
    for (int base = lo + (threadIdx.x & ~31); base < hi; base += SAMPLE_U * SAMPLE_THREADS) {
        float v[SAMPLE_U];
#pragma unroll
        for (int u = 0; u < SAMPLE_U; u++) {
            const int j = base + lane + u * SAMPLE_THREADS;
            v[u] = j < hi ? ld(j) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < SAMPLE_U; u++) {
            const int j = base + lane + u * SAMPLE_THREADS;
            f(j, v[u], j < hi);
        }
    }
}

/* The k-th largest score of the row over the cluster's slices (1 <= k <=
 * the candidates), by a radix select over the order-preserving keys, a byte
 * a round: each block counts its slice (warp-aggregated: LLM scores share
 * a few exponents, so in the first round a warp's 32 keys mostly fall in
 * one or two bins and plain shared-memory atomics would serialize on them:
 * the warp's first few distinct bins go by ballot, one atomic each), then every block adds the
 * C histograms. *above gets how many scores are larger and *ties how many
 * equal it. hist: two buffers used in turn (see cluster_all). Every thread
 * of the cluster calls it. */
static __device__ float cluster_kth(clu &cl, const float *keys, int lo, int hi, int k, int *above, int *ties,
                                    int (*hist)[256], int *htot, int *sel) {
    const int tid = threadIdx.x, lane = tid & 31;
    uint32_t prefix = 0, pmask = 0;
    int rem = k, gt = 0;
    for (int shift = 24, q = 0; shift >= 0; shift -= 8, q++) {
        int *h = hist[q & 1];
        if (tid < 256) h[tid] = 0;
        __syncthreads();
        slice_for(lo, hi, [&](int j) { return keys[j]; }, [&](int j, float s, bool ok) {
            (void)j;
            const uint32_t o = f2ord(s);
            const bool in = ok && (o & pmask) == prefix;
            const int bin = (int)((o >> shift) & 255);
            /* the warp's first few distinct bins by ballot, one atomic each;
             * the rest (spread bins: rare conflicts) one atomic a lane */
            unsigned todo = __ballot_sync(0xffffffffu, in);
            for (int t = 0; t < 3 && todo; t++) {
                const int leader = __ffs(todo) - 1;
                const int bl = __shfl_sync(0xffffffffu, bin, leader);
                const unsigned same = __ballot_sync(0xffffffffu, in && bin == bl);
                if (lane == leader) atomicAdd(&h[bl], __popc(same));
                todo &= ~same;
            }
            if (todo >> lane & 1) atomicAdd(&h[bin], 1);
        });
        cl.sync();
        if (tid < 256) {
            int s = 0;
            for (int r = 0; r < cl.size(); r++) s += cl.at(h, r)[tid];
            htot[tid] = s;
        }
        __syncthreads();
        if (tid < 32) {
            /* lane l holds bins 255 - 8 l down to 248 - 8 l: the k-th from the top */
            int c[8], sum = 0;
            for (int b = 0; b < 8; b++) c[b] = htot[255 - 8 * lane - b], sum += c[b];
            int inc = sum;
            for (int o = 1; o < 32; o <<= 1) {
                const int t = __shfl_up_sync(0xffffffffu, inc, o);
                if (lane >= o) inc += t;
            }
            const int exc = inc - sum;
            if (exc < rem && rem <= inc) {
                int acc = exc, b = 0;
                while (acc + c[b] < rem) acc += c[b++];
                sel[0] = 255 - 8 * lane - b, sel[1] = acc, sel[2] = c[b];
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

/* --- the draw ----------------------------------------------------------------
 * The host walks the survivors in id order, summing their weights, and
 * takes the first whose running sum passes u z. Here warps take contiguous
 * ranges of ids (32 a step, coalesced), a range's mass is scanned warp,
 * block, cluster, and the one warp whose interval holds u z walks its range
 * again with a warp scan a step. */
#define SAMPLE_WARP_IDS(n) ((((n) + SAMPLE_THREADS - 1) / SAMPLE_THREADS) * 32)

struct walk_smem {
    double wtot[32], wpre[33]; /* the warps' masses; their exclusive prefix, [32] the block's */
    int wlast[32];             /* each warp's last survivor (-1: none) */
};

/* Pass 1 over [lo, hi) with weights W(j) (0: not a survivor); returns the
 * block's last survivor (-1: none). Every thread of the block calls it. */
template <typename FW>
static __device__ int range_mass(FW W, int lo, int hi, walk_smem &ws) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, cw = SAMPLE_WARP_IDS(hi - lo);
    const int wl = lo + warp * cw, wh = min(hi, wl + cw);
    double m = 0.0;
    int last = -1;
    for (int base = wl + lane; base < wh; base += 32 * SAMPLE_U) { /* the loads of a batch first */
        float wt[SAMPLE_U];
#pragma unroll
        for (int u = 0; u < SAMPLE_U; u++) wt[u] = base + 32 * u < wh ? W(base + 32 * u) : 0.0f;
#pragma unroll
        for (int u = 0; u < SAMPLE_U; u++)
            if (wt[u] > 0.0f) m += wt[u], last = base + 32 * u;
    }
    for (int o = 16; o > 0; o >>= 1) m += __shfl_xor_sync(0xffffffffu, m, o);
    last = __reduce_max_sync(0xffffffffu, (unsigned)(last + 1)) - 1;
    __syncthreads(); /* ws may still be read by a previous call */
    if (lane == 0) ws.wtot[warp] = m, ws.wlast[warp] = last;
    __syncthreads();
    if (warp == 0) {
        const double v = ws.wtot[lane], inc = warp_incl_scan(v);
        double exc = __shfl_up_sync(0xffffffffu, inc, 1);
        if (lane == 0) exc = 0.0;
        ws.wpre[lane] = exc;
        if (lane == 31) ws.wpre[32] = inc;
    }
    __syncthreads();
    return (int)__reduce_max_sync(0xffffffffu, (unsigned)(ws.wlast[lane] + 1)) - 1;
}

/* The warp whose interval [off + wpre[w], off + wpre[w + 1]) holds uz walks
 * its range and returns (on every lane) the first id at which the running
 * mass passes uz, or its last survivor where rounding left the walk short;
 * other warps return INT_MAX. The lane found has a positive weight: its
 * running sum passed uz where the previous one had not. */
template <typename FW>
static __device__ int range_walk(FW W, int lo, int hi, double off, double uz, const walk_smem &ws) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, cw = SAMPLE_WARP_IDS(hi - lo);
    const int wl = lo + warp * cw, wh = min(hi, wl + cw);
    double acc = off + ws.wpre[warp];
    if (!(ws.wlast[warp] >= 0 && acc <= uz && uz < off + ws.wpre[warp + 1])) return INT_MAX;
    for (int base = wl; base < wh; base += 32) {
        const int j = base + lane;
        const float wt = j < wh ? W(j) : 0.0f;
        const double inc = warp_incl_scan((double)wt);
        const unsigned hit = __ballot_sync(0xffffffffu, uz < acc + inc);
        if (hit) return base + __ffs(hit) - 1;
        acc += __shfl_sync(0xffffffffu, inc, 31);
    }
    return ws.wlast[warp];
}

/* The draw over [0, n) by one block: out = {I(the pick), 0}. */
template <typename FW, typename FI>
static __device__ void block_draw(FW W, FI I, int n, double u, walk_smem &ws, int *pick, int32_t *out) {
    if (threadIdx.x == 0) *pick = INT_MAX;
    const int last = range_mass(W, 0, n, ws);
    const int tok = range_walk(W, 0, n, 0.0, u * ws.wpre[32], ws);
    if ((threadIdx.x & 31) == 0 && tok != INT_MAX) atomicMin(pick, tok);
    __syncthreads();
    if (threadIdx.x == 0) out[0] = I(*pick != INT_MAX ? *pick : max(last, 0)), out[1] = 0;
}

/* Sorts a[0, np) ascending (np a power of two), by the block. */
static __device__ void block_bitonic(unsigned long long *a, int np) {
    for (int k = 2; k <= np; k <<= 1)
        for (int jj = k >> 1; jj > 0; jj >>= 1) {
            for (int p = threadIdx.x; p < np; p += SAMPLE_THREADS) {
                const int q = p ^ jj;
                if (q > p) {
                    const unsigned long long x = a[p], y = a[q];
                    if ((x > y) == ((p & k) == 0)) a[p] = y, a[q] = x;
                }
            }
            __syncthreads();
        }
}

/* Candidates the fast path sorts in (dynamic) shared memory: 128 KB of
 * keys. A top-p nucleus of real LLM logits is mostly far smaller; larger
 * ones (flat distributions) take the full sort. */
#define SAMPLE_CAP 16384

struct sample_smem {
    walk_smem ws;
    double shd[33];
    int sh[33], bounds[4], sel[3], pick, cnt;
    int hist[2][256], htot[256];
    float sv[SAMPLE_WARPS];
    int si[SAMPLE_WARPS], snan[SAMPLE_WARPS];
    /* the cluster's exchange slots, one per exchange (cluster_all) */
    struct mx { float v; int i, nan; } xmax;
    int xnc;
    struct d2 { double a, b; } xz;
    struct tl { double tot; int last; } xtl;
};

/* --- the kernel --------------------------------------------------------------
 * Row blockIdx.y, cluster rank blockIdx.x:
 *  1. the penalty's bits for the slice in shared memory; the max, the first
 *     NaN, the argmax (greedy, NaN and all -inf rows end here);
 *  2. the scaled scores s = x / T of the candidates (within 60 of the top,
 *     as on the host; -inf for the rest) to keys (the sorted path's input);
 *  3. top-k: the k-th score by a radix select (no sort);
 *  4a. top-p: when the top SAMPLE_CAP candidates hold top_p of the mass,
 *     they are gathered in rank 0's shared memory, sorted by (score
 *     descending, id ascending), cut (top-p, min-p), the kept ones sorted by
 *     id and drawn there; else the row is left to the sorted path;
 *  4b. no top-p: weights by id in place (top-k and min-p thresholds), drawn
 *     across the cluster. */
static __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_kernel(const bf16 *x, int d, const fl_sample_row *rows, const int32_t *hist, sample_ws w,
                  int32_t *out) {
    __shared__ sample_smem sm;
    extern __shared__ __align__(16) unsigned long long sk[]; /* [SAMPLE_CAP] (rank 0's), then the mask */
    clu cl;
    const int C = cl.size(), rank = cl.rank();
    const int i = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int span = (d + C - 1) / C, lo = min(d, rank * span), hi = min(d, lo + span);
    uint32_t *mask = (uint32_t *)(sk + SAMPLE_CAP);
    if (tid == 0) sm.cnt = 0, sm.pick = INT_MAX; /* read by other blocks only after a cluster barrier */
    pdl_enter(); /* before any global access: see launch_pdl */
    const fl_sample_row r = rows[i];
    const bf16 *row = x + (int64_t)i * d;
    float *keys = w.keys + (int64_t)i * d;

    const bool pen = r.penalty != 1.0f && r.hist_n > 0;
    if (pen) {
        for (int k = tid; k < (hi - lo + 31) / 32; k += SAMPLE_THREADS) mask[k] = 0;
        __syncthreads();
        for (int k = tid; k < r.hist_n; k += SAMPLE_THREADS) {
            const int id = hist[r.hist_lo + k];
            if (id >= lo && id < hi) atomicOr(&mask[(id - lo) >> 5], 1u << ((id - lo) & 31));
        }
        __syncthreads();
    }
#define SAMPLE_LOAD(j)                                                                                   \
    (pen && (mask[((j) - lo) >> 5] >> (((j) - lo) & 31) & 1) ? penalize(bf2f(row[j]), r.penalty)       \
                                                             : bf2f(row[j]))

    /* 1. the max (lowest id on ties) and the first NaN */
    float bv = -INFINITY;
    int bi = INT_MAX, nan_at = INT_MAX;
    auto ldv = [&](int j) { return SAMPLE_LOAD(j); };
    slice_for(lo, hi, ldv, [&](int j, float v, bool ok) {
        if (!ok) return;
        if (v != v) nan_at = min(nan_at, j);
        argmax_take(bv, bi, v, j);
    });
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        nan_at = min(nan_at, __shfl_xor_sync(0xffffffffu, nan_at, o));
        argmax_take(bv, bi, ov, oi);
    }
    if (lane == 0) sm.sv[warp] = bv, sm.si[warp] = bi, sm.snan[warp] = nan_at;
    __syncthreads();
    if (warp == 0) {
        bv = sm.sv[lane], bi = sm.si[lane], nan_at = sm.snan[lane];
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            nan_at = min(nan_at, __shfl_xor_sync(0xffffffffu, nan_at, o));
            argmax_take(bv, bi, ov, oi);
        }
    }
    using mx = sample_smem::mx;
    const mx g = cluster_all(cl, &sm.xmax, mx{bv, bi, nan_at}, [](mx a, mx b) {
        argmax_take(a.v, a.i, b.v, b.i);
        a.nan = min(a.nan, b.nan);
        return a;
    });
    const float m = g.v;
    const bool greedy = !(r.temperature > 0.0f);
    if (g.nan != INT_MAX || greedy || m == -INFINITY) {
        if (rank == 0 && tid == 0) {
            if (g.nan != INT_MAX) out[2 * i] = g.nan, out[2 * i + 1] = 1;
            else if (greedy) out[2 * i] = g.i == INT_MAX ? 0 : g.i, out[2 * i + 1] = 0;
            else out[2 * i] = 0, out[2 * i + 1] = 2;
            w.st[i] = sample_state{0.0f, 0, 1, 0};
        }
        cl.sync(); /* no block leaves while another may still read its slot */
        return;
    }

    /* 2. the candidates and their scaled scores, exactly as the host: within
     * 60 of m / T, or the ties at m when m / T overflows (the T -> 0 limit) */
    const float T = r.temperature, mt = m / T, cut = mt - 60.0f;
    const bool t0 = !isfinite(mt);
    int nc = 0;
    slice_for(lo, hi, ldv, [&](int j, float v, bool ok) {
        if (!ok) return;
        float s = -INFINITY;
        if (t0) {
            if (v == m) s = 0.0f;
        } else {
            const float sc = v / T;
            if (sc >= cut) s = sc + 0.0f; /* +0.0 for -0.0: one key for equal scores */
        }
        nc += s != -INFINITY;
        keys[j] = s;
    });
#undef SAMPLE_LOAD
    nc = block_sum_int(nc, sm.sh); /* also orders this block's keys before its reads below */
    nc = cluster_all(cl, &sm.xnc, nc, [](int a, int b) { return a + b; });
    const float top = t0 ? 0.0f : mt;
    if (rank == 0 && tid == 0) w.st[i] = sample_state{top, nc, 0, 0};

    /* 3. top-k: the k-th score; the survivors are the scores >= it */
    float kth = -INFINITY;
    int n_k = nc;
    if (r.top_k > 0 && r.top_k < nc) {
        int above, ties;
        kth = cluster_kth(cl, keys, lo, hi, r.top_k, &above, &ties, sm.hist, sm.htot, sm.sel);
        n_k = above + ties;
    }

    if (!(r.top_p < 1.0f)) {
        /* 4b. no cut by mass: top-k and min-p are thresholds on the weight */
        const float mp = r.min_p;
        auto W = [&](int j) {
            const float s = keys[j];
            const float wt = s == -INFINITY || s < kth ? 0.0f : weight_of(s, top);
            return wt < mp ? 0.0f : wt;
        };
        const int last = range_mass(W, lo, hi, sm.ws);
        using tl = sample_smem::tl;
        /* the blocks before this one (its offset) and all of them, in rank order */
        if (tid == 0) sm.xtl = tl{sm.ws.wpre[32], last};
        cl.sync();
        double off = 0.0, z = 0.0;
        int last_all = -1;
        for (int q = 0; q < C; q++) {
            const tl t = *cl.at(&sm.xtl, q);
            if (q == rank) off = z;
            z += t.tot;
            last_all = max(last_all, t.last);
        }
        const int tok = range_walk(W, lo, hi, off, r.u * z, sm.ws);
        if (lane == 0 && tok != INT_MAX) atomicMin(cl.at(&sm.pick, 0), tok);
        cl.sync();
        if (rank == 0 && tid == 0) out[2 * i] = sm.pick != INT_MAX ? sm.pick : max(last_all, 0), out[2 * i + 1] = 0;
        return;
    }

    /* 4a. top-p: the set to sort is the survivors, or the top SAMPLE_CAP of
     * them if those hold top_p of the mass */
    float lo_s = kth;
    int n_u = n_k;
    if (n_k > SAMPLE_CAP) {
        int above, ties;
        lo_s = cluster_kth(cl, keys, lo, hi, SAMPLE_CAP, &above, &ties, sm.hist, sm.htot, sm.sel);
        n_u = above + ties;
    }
    double mz = 0.0, mu = 0.0;
    auto ldk = [&](int j) { return keys[j]; };
    slice_for(lo, hi, ldk, [&](int j, float s, bool ok) {
        (void)j;
        if (ok && s >= kth && s != -INFINITY) {
            const float wt = weight_of(s, top);
            mz += wt;
            if (s >= lo_s) mu += wt;
        }
    });
    double bz, bzu;
    block_excl_scan(mz, &bz, sm.shd);
    block_excl_scan(mu, &bzu, sm.shd);
    using d2 = sample_smem::d2;
    const d2 zz = cluster_all(cl, &sm.xz, d2{bz, bzu}, [](d2 a, d2 b) { return d2{a.a + b.a, a.b + b.b}; });
    const double z = zz.a;
    if (n_u > SAMPLE_CAP || (n_u < n_k && zz.b < (double)r.top_p * z)) {
        if (rank == 0 && tid == 0) w.st[i].sort = 1; /* too many: the sorted path */
        cl.sync();
        return;
    }
    /* gather the n_u candidates in rank 0 as (score descending, id
     * ascending) keys: a warp's ballot, one atomic a warp */
    {
        unsigned long long *sk0 = cl.at(sk, 0);
        int *cnt0 = cl.at(&sm.cnt, 0);
        slice_for(lo, hi, ldk, [&](int j, float s, bool ok) {
            const bool in = ok && s >= lo_s && s != -INFINITY;
            const unsigned bal = __ballot_sync(0xffffffffu, in);
            if (!bal) return;
            int at = 0;
            if (lane == 0) at = atomicAdd(cnt0, __popc(bal));
            at = __shfl_sync(0xffffffffu, at, 0);
            if (in) sk0[at + __popc(bal & ((1u << lane) - 1))] = (unsigned long long)~f2ord(s) << 32 | (uint32_t)j;
        });
    }
    cl.sync();
    if (rank != 0) return; /* the rest is rank 0's, in its own shared memory */
    int np = 1;
    while (np < n_u) np <<= 1;
    for (int p = n_u + tid; p < np; p += SAMPLE_THREADS) sk[p] = ~0ull;
    __syncthreads();
    block_bitonic(sk, np);
    auto S = [&](int p) { return ord2f(~(uint32_t)(sk[p] >> 32)); };
    cut_bounds(S, n_u, top, z, r, sm.shd, sm.sh, sm.bounds);
    /* The top SAMPLE_CAP were chosen by score, the host's ties are by
     * weight: when they do not hold every survivor, a cut at their end or in
     * a run of equal weights that reaches it may need tokens below them. The
     * sorted path has them all. */
    const int cutp = sm.bounds[0], kept = sm.bounds[1], end = max(kept, sm.bounds[3]);
    if (n_u < n_k && (cutp >= n_u || (kept == cutp && weight_of(S(n_u - 1), top) == weight_of(S(cutp - 1), top)))) {
        if (tid == 0) w.st[i].sort = 1;
        return;
    }
    /* The kept ones (cut_keeps): dropped entries get an all-ones score word
     * (the ids the run's ranks read stay), then every entry becomes (id,
     * weight) or ~0, sorted by id: the survivors in the host's order, first. */
    for (int p = tid; p < end; p += SAMPLE_THREADS)
        if (!cut_keeps([&](int o) { return (uint32_t)sk[o]; }, sm.bounds, p)) sk[p] |= 0xffffffff00000000ull;
    __syncthreads();
    int np2 = 1;
    while (np2 < end) np2 <<= 1;
    int nk = 0;
    for (int p = tid; p < np2; p += SAMPLE_THREADS) {
        const unsigned long long e = sk[p];
        if (p >= end || (uint32_t)(e >> 32) == 0xffffffffu) {
            sk[p] = ~0ull;
        } else {
            const float wt = weight_of(ord2f(~(uint32_t)(e >> 32)), top);
            sk[p] = (unsigned long long)(uint32_t)e << 32 | __float_as_uint(wt);
            nk++;
        }
    }
    nk = block_sum_int(nk, sm.sh);
    block_bitonic(sk, np2);
    block_draw([&](int p) { return __uint_as_float((uint32_t)sk[p]); }, [&](int p) { return (int32_t)(sk[p] >> 32); },
               nk, r.u, sm.ws, &sm.pick, out + 2 * i);
}

/* The ids the sort carries and the segments' offsets, only before a sort. */
static __global__ void sample_ids_kernel(int n, int d, int32_t *ids, int32_t *offs) {
    pdl_enter();
    int32_t *row = ids + (int64_t)blockIdx.y * d;
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < d; j += gridDim.x * blockDim.x) row[j] = j;
    if (blockIdx.x == 0 && blockIdx.y == 0)
        for (int k = threadIdx.x; k <= n; k += blockDim.x) offs[k] = k * d;
}

struct draw_smem {
    walk_smem ws;
    double shd[33];
    int sh[33], bounds[4], pick;
};

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
    block_draw([&](int j) { return keys[j]; }, [](int j) { return (int32_t)j; }, d, r.u, sm.ws, &sm.pick,
               out + 2 * i);
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

/* The sample_cluster override (1, 2, 4, 8; for A/B runs and tests); else
 * (0, -1): the rule. */
static int valid_cluster(long c) { return c == 1 || c == 2 || c == 4 || c == 8 ? (int)c : 0; }

static size_t sample_smem_bytes(int d, int C) {
    return SAMPLE_CAP * sizeof(unsigned long long) + (size_t)((d + C - 1) / C + 31) / 32 * 4;
}

/* sample_kernel's static shared memory (asked once). */
static size_t sample_static_smem(void) {
    static size_t v = (size_t)-1;
    if (v == (size_t)-1) {
        cudaFuncAttributes fa;
        v = cudaFuncGetAttributes(&fa, sample_kernel) == cudaSuccess ? fa.sharedSizeBytes : 0;
        if (!v) (void)cudaGetLastError();
    }
    return v;
}

/* Whether a row of d fits a block's shared memory on this device at one
 * block a row (the largest slice): else sample_rows_ws says 0 and the
 * engine keeps the logits route (a device with less than ~150 KB a block). */
static bool sample_fits(fl_cuda *c, int d) {
    const size_t st = sample_static_smem();
    return st > 0 && sample_smem_bytes(d, 1) + st <= c->smem_optin;
}

/* Blocks a row: the largest cluster (8, 4, 2) of which n fit on the device
 * at once (cudaOccupancyMaxActiveClusters: a cluster's blocks share a GPC
 * and each takes an SM's 128 KB of candidates, so 16 clusters of 8 may not
 * fit 132 SMs), each block at least 4096 ids; else one block a row. 1
 * without sm_90 code (no clusters). */
static int cluster_size(fl_cuda *c, int n, int d) {
    if (!fl_cuda_bulk_device_ok(c)) return 1;
    static int fit_d = -1, fit[9];
    if (fit_d != d) { /* one vocabulary a process: asked once */
        for (int C = 2; C <= 8; C <<= 1) {
            cudaLaunchConfig_t cfg = {};
            cudaLaunchAttribute attr;
            attr.id = cudaLaunchAttributeClusterDimension;
            attr.val.clusterDim.x = (unsigned)C, attr.val.clusterDim.y = 1, attr.val.clusterDim.z = 1;
            cfg.gridDim = dim3((unsigned)C);
            cfg.blockDim = dim3(SAMPLE_THREADS);
            cfg.dynamicSmemBytes = sample_smem_bytes(d, C);
            cfg.attrs = &attr;
            cfg.numAttrs = 1;
            if (cudaOccupancyMaxActiveClusters(&fit[C], (const void *)sample_kernel, &cfg) != cudaSuccess) {
                (void)cudaGetLastError();
                fit[C] = 0;
            }
        }
        fit_d = d;
    }
    if (valid_cluster(fl_cuda_tune(FL_CUDA_TUNE_SAMPLE_CLUSTER))) { /* forced, but only to a size the device holds */
        int C = valid_cluster(fl_cuda_tune(FL_CUDA_TUNE_SAMPLE_CLUSTER));
        while (C > 1 && fit[C] < 1) C >>= 1;
        return C;
    }
    for (int C = 8; C > 1; C >>= 1)
        if (d / C >= 4096 && n <= fit[C]) return C;
    return 1;
}

extern "C" fl_status fl_cuda_sample_rows(fl_backend *b, const void *x, int n, int d, const fl_sample_row *rows,
                                         const int32_t *hist, bool any_top_p, void *ws, int32_t *out) {
    if (n <= 0) return FL_OK;
    if (fl_cuda_sample_rows_ws(b, n, d) == 0 || n > 65535)
        return FL_ERR(FL_ERR_UNSUPPORTED, "sample_rows: %d rows of %d logits (at most %d logits a row and "
                      "shared memory for them, 65535 rows, and n d < 2^30)", n, d, SAMPLE_MAX_VOCAB);
    fl_cuda *c = cuda_impl(b);
    cudaStream_t stream = c->stream;
    const sample_ws w = ws_layout(ws, n, d);
    static bool attr_set;
    if (!attr_set) { /* before the occupancy query, which counts it; within the device's limit */
        const size_t most = c->smem_optin - sample_static_smem(), want = sample_smem_bytes(SAMPLE_MAX_VOCAB, 1);
        FL_CUDA_CHECK(cudaFuncSetAttribute(sample_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)(want < most ? want : most)));
        attr_set = true;
    }
    const int C = cluster_size(c, n, d);
    /* cluster dims even for C = 1 where the device has clusters: the kernel's cluster barriers */
    FL_TRY(launch_pdl_cluster(sample_kernel, dim3((unsigned)C, (unsigned)n), dim3(SAMPLE_THREADS),
                              sample_smem_bytes(d, C), stream, fl_cuda_bulk_device_ok(c) ? C : 0, (const bf16 *)x, d,
                              rows, hist, w, out));
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
    const dim3 igrid((unsigned)std::min((d + 255) / 256, 32), (unsigned)n);
    FL_TRY(launch_pdl(sample_ids_kernel, igrid, dim3(256), 0, stream, n, d, w.ids, w.offs));
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
