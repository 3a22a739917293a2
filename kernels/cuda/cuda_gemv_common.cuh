/*
 * cuda_gemv_common.cuh — device helpers shared by the two W4 GEMV kernels
 * of the packed layout (cuda_gemv.cu: codes through a register ring;
 * cuda_gemv_bulk.cu: codes through a shared-memory ring fed by bulk copies):
 * the mma, the code decode, the x fragment load, the gated MLP epilogue,
 * and the bulk kernel's launcher (called by cuda_gemv.cu's dispatch).
 */
#ifndef FL_CUDA_GEMV_COMMON_CUH
#define FL_CUDA_GEMV_COMMON_CUH

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_norm.cuh"

static __device__ __forceinline__ void gv_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* The decode of a code word, FL_W4_DENORM (a compile-time switch, A/B by
 * two builds). 0: the codes enter the mma as bf16 128 + code,
 * ((w >> 4 m) & 0x000F000F) | 0x43004300 for m = 0..3: 3 shifts and 4 LOP3
 * a word, since bf16 has 7 mantissa bits and each nibble must be shifted
 * to the bottom. 1 (default: up to 8 tokens, NT 1) and 2 (16 tokens too):
 * as bf16 denormals. The bit patterns 0..255 (exponent field 0 or 1) are
 * the values p x 2^-133, linear across the exponent bit, so a byte holds
 * two codes that need no shift: w & 0x000F000F is code x 2^-133 (A fragment
 * rows g), w & 0x00F000F0 is 16 code x 2^-133 (rows g + 8: their scale
 * takes the 16), and the same of w >> 8: 1 shift and 4 LOP3. The products
 * with x would be fp32 denormals, so x enters scaled by 2^64 (exact: one
 * bf16 multiply a register; finite for |x| < 2^63) and gv_apply_group
 * undoes both factors in the scale (2^69, 2^65) and the bias (2^-64). No
 * 128 offset either: the dot product is of the codes themselves, so the
 * fp32 sums lose none of the ~4 bits that s c + (b - 128 s) sum x cancels.
 * Needs the tensor cores to take bf16 denormal inputs unflushed:
 * test_cuda_ops' W4 cases check the kernels against the CPU backend. */
#ifndef FL_W4_DENORM
#define FL_W4_DENORM 1
#endif
template <int NT>
static __host__ __device__ constexpr bool gv_denorm(void) { return FL_W4_DENORM >= (NT == 1 ? 1 : 2); }

/* x fragment of one lane for one 64-column block: 16 bf16 x[tok][64 kb +
 * 16 t4 .. + 15] (the packed layout's k permutation makes them contiguous;
 * x is 16-byte aligned, the launcher checks); DN: times 2^64. Plain
 * coherent loads: under PDL the previous kernel wrote x, and these come
 * after griddepcontrol.wait (a plain load cannot be hoisted above that
 * asm's memory clobber). x stays in L1 for the block's other warps. */
template <bool DN>
static __device__ __forceinline__ void gv_load_x(const bf16 *p, uint32_t (&f)[8]) {
    const uint4 a = ((const uint4 *)p)[0], b = ((const uint4 *)p)[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
    if (DN) {
        const __nv_bfloat162 k = __halves2bfloat162(__ushort_as_bfloat16(0x5F80), __ushort_as_bfloat16(0x5F80));
#pragma unroll
        for (int i = 0; i < 8; i++) { /* times 2^64 */
            const __nv_bfloat162 v = __hmul2(*(const __nv_bfloat162 *)&f[i], k);
            f[i] = *(const uint32_t *)&v;
        }
    }
}

/* (a & mask) | magic in one LOP3: with mask 0x000F000F and magic 0x43004300
 * the bf16 pair {128 + nibble 0, 128 + nibble 4} of a. In PTX with both
 * constants in registers, since LOP3 takes one immediate and the compiler
 * would otherwise split it into two instructions. */
static __device__ __forceinline__ uint32_t gv_code_pair(uint32_t a, uint32_t mask, uint32_t magic) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(mask), "r"(magic));
    return r;
}

/* One code word (8 codes) to the A fragment of one mma (FL_W4_DENORM). */
template <bool DN>
static __device__ __forceinline__ void gv_decode(uint32_t w, uint32_t (&a)[4]) {
    if (DN) {
        const uint32_t h = w >> 8;
        a[0] = w & 0x000F000Fu, a[1] = w & 0x00F000F0u, a[2] = h & 0x000F000Fu, a[3] = h & 0x00F000F0u;
    } else {
        const uint32_t mask = 0x000F000Fu, magic = 0x43004300u;
#pragma unroll
        for (int m = 0; m < 4; m++) a[m] = gv_code_pair(w >> (4 * m), mask, magic);
    }
}

/* One scale group applied to a tile's accumulated dot products, with {s, b}
 * of rows g and g + 8 as half2 in ss and cs the group's sum of x for tokens
 * 2 t4 and 2 t4 + 1 (cs[nt][0..1]). !DN: the codes entered the mma as
 * 128 + code, so acc += s c + (b - 128 s) cs. DN: as code x 2^-133 (rows
 * g + 8: 16 code x 2^-133) against x 2^64, so acc += 2^69 s c + 2^-64 b cs
 * (rows g + 8: 2^65 s). */
template <int NT, bool DN>
static __device__ __forceinline__ void gv_apply_group(float (&acc)[NT][4], const float (&c)[NT][4],
                                                      const float (&cs)[NT][4], uint2 ss) {
    const float2 f0 = __half22float2(*(const __half2 *)&ss.x); /* row g: scale, bias */
    const float2 f1 = __half22float2(*(const __half2 *)&ss.y); /* row g + 8 */
    const float s0 = DN ? f0.x * 0x1p69f : f0.x, s1 = DN ? f1.x * 0x1p65f : f1.x;
    const float o0 = DN ? f0.y * 0x1p-64f : fmaf(-128.0f, f0.x, f0.y);
    const float o1 = DN ? f1.y * 0x1p-64f : fmaf(-128.0f, f1.x, f1.y);
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        acc[nt][0] = fmaf(s0, c[nt][0], fmaf(o0, cs[nt][0], acc[nt][0]));
        acc[nt][1] = fmaf(s0, c[nt][1], fmaf(o0, cs[nt][1], acc[nt][1]));
        acc[nt][2] = fmaf(s1, c[nt][2], fmaf(o1, cs[nt][0], acc[nt][2]));
        acc[nt][3] = fmaf(s1, c[nt][3], fmaf(o1, cs[nt][1], acc[nt][3]));
    }
}

/* The gated MLP's activation from the gate and up dot products, each first
 * rounded to bf16 as the unfused path stores them, then silu_mul_kernel's
 * arithmetic (cuda_ops.cu): the fused result differs from matmul, matmul,
 * silu_mul only where the warps' split of K (the configuration) does. */
static __device__ __forceinline__ float gv_glu(float g, float u) {
    const float gv = bf2f(f2bf(g));
    return gv / (1.0f + expf(-gv)) * bf2f(f2bf(u));
}

/* One lane's share of a 16-row x 8-token output tile (mma.m16n8k16's C
 * fragment: v.x, v.y row `row` of tokens tok, tok + 1; v.z, v.w row + 8),
 * plus bias, rounded to bf16 into y[tok, :]; tokens from n on are skipped.
 * The epilogue store of the bulk W4 and the bf16 GEMV (the register ring's
 * routed mode writes through a pair list instead). */
static __device__ __forceinline__ void gv_store_frag(bf16 *y, int rows, int row, int tok, int n, float4 v,
                                                     const void *bias, int bias_f32,
                                                     const int32_t *orow = NULL) {
    if (tok < n) { /* orow: the output row of each token (routed pairs), NULL: the token's own */
        const float b0 = bias ? vec_load(bias, bias_f32, row) : 0.0f;
        const float b8 = bias ? vec_load(bias, bias_f32, row + 8) : 0.0f;
        const size_t o0 = orow ? (size_t)orow[tok] : (size_t)tok;
        y[o0 * rows + row] = f2bf(v.x + b0);
        y[o0 * rows + row + 8] = f2bf(v.z + b8);
        if (tok + 1 < n) {
            const size_t o1 = orow ? (size_t)orow[tok + 1] : (size_t)tok + 1;
            y[o1 * rows + row] = f2bf(v.y + b0);
            y[o1 * rows + row + 8] = f2bf(v.w + b8);
        }
    }
}

/* --- the bulk-copy GEMV (cuda_gemv_bulk.cu), launched by cuda_gemv.cu's
 * gv_plain when its rule or the w4_gemv override selects it ---------------- */
#define GVB_MAX_KS 16 /* warps (column slices) a block at most */
/* The q|k|v projection's rope epilogue (matmul_rope_kv): y's rows are
 * [q heads | k heads | v heads] of hd each; q and k rotated by halves over the
 * whole head (rot_dim = hd), k and v also stored into the cache slots. The
 * block's two tiles are hd / 32 tiles apart, so row i of a head and its
 * partner i + hd / 2 are in the same thread's accumulators; the kernel's
 * rope epilogue runs when that stride is above 1, so hd >= 64 (the
 * launcher refuses hd 32, whose partner tile is the adjacent one). */
typedef struct gv_rope {
    const float *cos, *sin; /* [n, hd / 2]; cos NULL: the plain epilogue */
    const int32_t *slots;   /* [n] cache slot of each token, < 0: padding (not stored) */
    bf16 *kc, *vc;          /* [slots, kvd] */
    int qd, kvd, hd;        /* q rows, k rows (= v rows), head_dim (a multiple of 32, >= 64) */
} gv_rope;

/* The rope epilogue's store of one token's rows ra and its rotation partner
 * ra + hd / 2 from their dot products a, b (cuda_gemv_bulk.cu's rope
 * mode): what matmul then rope_kv_store write,
 * y = bf16(dot + bias), then rope_pair on q and k rows, and the k and v
 * rows also into the token's cache slot (none for slot < 0). */
static __device__ __forceinline__ void gv_rope_store(const gv_rope &rope, bf16 *y, int rows, int tok, int ra,
                                                     float a, float b, const void *bias, int bias_f32) {
    const int half = rope.hd >> 1, rb = ra + half;
    bf16 ya = f2bf(a + (bias ? vec_load(bias, bias_f32, ra) : 0.0f));
    bf16 yb = f2bf(b + (bias ? vec_load(bias, bias_f32, rb) : 0.0f));
    if (ra < rope.qd + rope.kvd) { /* q or k: rotate (ra % hd < half by the pairing) */
        const int p = ra % rope.hd;
        rope_pair(bf2f(ya), bf2f(yb), rope.cos[(size_t)tok * half + p], rope.sin[(size_t)tok * half + p], ya, yb);
    }
    y[(size_t)tok * rows + ra] = ya;
    y[(size_t)tok * rows + rb] = yb;
    const int slot = ra >= rope.qd ? rope.slots[tok] : -1;
    if (slot >= 0) {
        const bool isk = ra < rope.qd + rope.kvd;
        bf16 *cache = (isk ? rope.kc : rope.vc) + (size_t)slot * rope.kvd;
        const int j = ra - rope.qd - (isk ? 0 : rope.kvd);
        cache[j] = ya;
        cache[j + half] = yb;
    }
}

/* The deferred norm (kernels/backend.h's fl_rms_defer), producer side
 * (matmul_add_rms): the GEMV's epilogue adds y into the residual x in
 * place, writes h = x * w, and each block its partial sums of x's squares,
 * ss[tok * spad + blockIdx.x] (spad: the grid's blocks rounded up to 4).
 * x NULL: the plain store. cnt (NULL: off; rms_final_on): a zeroed
 * counter; the grid's last block adds the partials up (gv_resid_final) and
 * leaves one total a token, ss[tok * 4], so each consumer block reads n
 * floats instead of adding n x blocks. */
typedef struct gv_resid {
    bf16 *x, *h;   /* [n, rows] */
    const void *w; /* [rows] norm weight */
    int wf32;
    float *ss;
    int spad;
    int *cnt;
} gv_resid;

/* Consumer side (gate_up_silu, matmul_rope_kv): the GEMV read h, so its dot
 * products are scaled by each token's 1 / sqrt(sum ss / in + eps), the
 * partials (slots a token, spad apart) prefetched into L1 after the wait
 * (gv_rmsd_prefetch) and summed in the epilogue. ss NULL: none. */
typedef struct gv_rmsd {
    const float *ss;
    int slots, spad;
    float eps;
} gv_rmsd;

/* A thread's first epilogue item (rows row, row + 8; tokens tok, tok + 1)
 * loaded early, so the epilogue does not wait on them: the norm weight
 * before griddepcontrol.wait (it never changes), the residual right after
 * it (the previous kernels write it). */
typedef struct gv_resid_pre {
    float w0, w8;
    uint32_t x0, x1; /* bf16 pairs {row, row + 8} of tokens tok, tok + 1 */
} gv_resid_pre;

static __device__ __forceinline__ void gv_resid_pre_w(const gv_resid &rs, int row, gv_resid_pre &p) {
    p.w0 = vec_load(rs.w, rs.wf32, row);
    p.w8 = vec_load(rs.w, rs.wf32, row + 8);
}

static __device__ __forceinline__ uint32_t gv_pack2(bf16 a, bf16 b) {
    return (uint32_t)__bfloat16_as_ushort(a) | ((uint32_t)__bfloat16_as_ushort(b) << 16);
}

static __device__ __forceinline__ void gv_resid_pre_x(const gv_resid &rs, int rows, int row, int tok, int n,
                                                      gv_resid_pre &p) {
    p.x0 = p.x1 = 0;
    if (tok < n) p.x0 = gv_pack2(rs.x[(size_t)tok * rows + row], rs.x[(size_t)tok * rows + row + 8]);
    if (tok + 1 < n) p.x1 = gv_pack2(rs.x[(size_t)(tok + 1) * rows + row], rs.x[(size_t)(tok + 1) * rows + row + 8]);
}

/* One residual value x (as loaded) plus the GEMV's v: y = bf16(v + b) as
 * matmul stores it, x + y rounded as add_rmsnorm stores it, h = bf16(x w);
 * returns the stored x squared. */
static __device__ __forceinline__ float gv_resid_one(const gv_resid &rs, size_t o, float x, float w, float v,
                                                     float b) {
    const bf16 xn = f2bf(x + bf2f(f2bf(v + b)));
    rs.x[o] = xn;
    const float xf = bf2f(xn);
    rs.h[o] = f2bf(xf * w);
    return xf * xf;
}

/* gv_store_frag's residual form for one lane's C fragment (rows row,
 * row + 8; tokens tok, tok + 1; pre: its weight and residual when
 * have_pre, loaded early), then the squares of the warp's 16 rows summed per
 * token over the lanes (a fixed butterfly) and stored by lanes 0..3 into
 * sq[tok], sq[tok + 1] (sq: the tile's [16] floats). Every lane of the
 * warp calls it. */
static __device__ __forceinline__ void gv_resid_frag(const gv_resid &rs, int rows, int row, int tok, int n,
                                                     float4 v, const void *bias, int bias_f32, float *sq,
                                                     const gv_resid_pre &pre, bool have_pre) {
    float q0 = 0.0f, q1 = 0.0f;
    if (tok < n) {
        gv_resid_pre p;
        if (have_pre) {
            p = pre;
        } else {
            gv_resid_pre_w(rs, row, p);
            gv_resid_pre_x(rs, rows, row, tok, n, p);
        }
        const float b0 = bias ? vec_load(bias, bias_f32, row) : 0.0f;
        const float b8 = bias ? vec_load(bias, bias_f32, row + 8) : 0.0f;
        const size_t o = (size_t)tok * rows + row;
        q0 = gv_resid_one(rs, o, __uint_as_float(p.x0 << 16), p.w0, v.x, b0) +
             gv_resid_one(rs, o + 8, __uint_as_float(p.x0 & 0xFFFF0000u), p.w8, v.z, b8);
        if (tok + 1 < n)
            q1 = gv_resid_one(rs, o + rows, __uint_as_float(p.x1 << 16), p.w0, v.y, b0) +
                 gv_resid_one(rs, o + rows + 8, __uint_as_float(p.x1 & 0xFFFF0000u), p.w8, v.w, b8);
    }
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
        q0 += __shfl_xor_sync(0xffffffffu, q0, o);
        q1 += __shfl_xor_sync(0xffffffffu, q1, o);
    }
    if ((threadIdx.x & 31) < 4) sq[tok] = q0, sq[tok + 1] = q1;
}

/* rs.cnt set: the block that counts last (the partials' stores fenced
 * before the count, the threadFenceReduction pattern) adds every token's
 * gridDim.x partials in gv_rmsd_inv's order, so the consumers' 1 / rms has
 * the bits it had from all the partials, and stores the totals at
 * ss[tok * 4] (the spad of one slot) once it has read them all; then puts
 * the counter back to 0 for the next launch (graph replays included).
 * Every thread of the block calls it. */
static __device__ __forceinline__ void gv_resid_final(const gv_resid &rs, int n) {
    __shared__ int last;
    __shared__ float tot[16];
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(rs.cnt, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int nwarp = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int tok = warp; tok < n; tok += nwarp) {
        const float *parts = rs.ss + (size_t)tok * rs.spad;
        float s = 0.0f;
        for (int i = lane; i < (int)gridDim.x; i += 32) s += __ldcg(parts + i);
        s = warp_sum(s);
        if (lane == 0) tot[tok] = s;
    }
    __syncthreads();
    if ((int)threadIdx.x < n) rs.ss[(size_t)threadIdx.x * 4] = tot[threadIdx.x];
    if (threadIdx.x == 0) *rs.cnt = 0;
}

/* The block's partial per token: the tiles' sums (sq[tt][16], H tiles)
 * added in tile order; ends the epilogue (every thread calls it). */
static __device__ __forceinline__ void gv_resid_block(const gv_resid &rs, const float (*sq)[16], int H, int n) {
    __syncthreads();
    if ((int)threadIdx.x < n) {
        float s = 0.0f;
        for (int tt = 0; tt < H; tt++) s += sq[tt][threadIdx.x];
        rs.ss[(size_t)threadIdx.x * rs.spad + blockIdx.x] = s;
        if (rs.cnt) __threadfence();
    }
    if (rs.cnt) gv_resid_final(rs, n);
}

/* The kernels' form of a backend fl_rms_defer (NULL: none). */
static inline gv_rmsd gv_rmsd_of(const fl_rms_defer *rd) {
    return rd ? gv_rmsd{rd->ss, rd->slots, (rd->slots + 3) & ~3, rd->eps} : gv_rmsd{NULL, 0, 0, 0.0f};
}

/* The partials of n tokens requested into L1 (one 128-byte line a thread),
 * so the epilogue's sums hit it. */
static __device__ __forceinline__ void gv_rmsd_prefetch(const gv_rmsd &rd, int n) {
    const int lines = (n * rd.spad + 31) / 32;
    for (int i = threadIdx.x; i < lines; i += blockDim.x)
        asm volatile("prefetch.global.L1 [%0];" ::"l"(rd.ss + (size_t)i * 32));
}

/* 1 / rms of a token from its partials (slots floats): lanes add every
 * 32nd, then the warp's butterfly, so every block (and the fallback
 * kernel) gets the same value. Every lane of the warp calls it. */
static __device__ __forceinline__ float gv_rmsd_inv(const float *parts, int slots, int in, float eps) {
    float s = 0.0f;
    for (int i = threadIdx.x & 31; i < slots; i += 32) s += parts[i];
    return norm_inv(warp_sum(s), in, eps); /* add_rmsnorm's 1 / rms */
}

/* A consumer's epilogue, after its sums are reduced: 1 / rms of each of the
 * n tokens into sinv[16] (warp w takes tokens w, w + nwarp, ...), then a
 * barrier. Every thread of the block calls it. */
static __device__ __forceinline__ void gv_rmsd_block(const gv_rmsd &rd, int n, int in, float *sinv) {
    const int nwarp = blockDim.x >> 5, warp = threadIdx.x >> 5;
    if (rd.slots == 1) { /* totals (gv_resid_final): a thread a token, the same bits as the warp's sum */
        if ((int)threadIdx.x < n) sinv[threadIdx.x] = norm_inv(rd.ss[threadIdx.x * rd.spad], in, rd.eps);
        __syncthreads();
        return;
    }
    for (int tok = warp; tok < n; tok += nwarp) {
        const float inv = gv_rmsd_inv(rd.ss + tok * rd.spad, rd.slots, in, rd.eps);
        if ((threadIdx.x & 31) == 0) sinv[tok] = inv;
    }
    __syncthreads();
}

/* One C fragment scaled: tokens tok (v.x, v.z) and tok + 1 (v.y, v.w). */
static __device__ __forceinline__ void gv_rmsd_scale(const float *sinv, int n, int tok, float4 &v) {
    const float s0 = sinv[min(tok, n - 1)], s1 = sinv[min(tok + 1, n - 1)];
    v.x *= s0, v.z *= s0, v.y *= s1, v.w *= s1;
}

/* Routed experts (moe_matmul, moe_gate_up_silu: cuda_moe.cu), the routed
 * mode of both W4 GEMVs (cuda_gemv.cu's register ring and cuda_gemv_bulk.cu's
 * bulk copies, each launcher choosing its own grid): with table != NULL the work
 * items are (local expert j, chunk of 8 NT of its pairs) for the experts
 * that have pairs (list: moe_group's layout, list[j] .. list[j + 1] index
 * list[n_local + 1 + ...]), enumerated in expert order; block (x, y) computes
 * tiles x of items y, y + gridDim.y, ... one after the other, with the
 * weights of table[j]. Row i of a pair p is x[x_per_pair ? p : p / k], its
 * output y[p, :]. Why items in a loop rather than a block row per expert:
 * a grid of (tiles x all local experts) was mostly blocks of idle experts and
 * several waves for the active ones (measured on the H200: Mixtral w4 batch
 * 16 took 7.9 ms a step against 6.5 with the host routing); the launcher
 * picks gridDim.y so the grid stays one wave (1 for Mixtral's 14336-row
 * experts, up to the active count for Qwen3's 768-row ones). The list is
 * the previous kernel's output, so the routed kernel waits
 * (griddepcontrol.wait) before its first weight request. */
typedef struct gv_route {
    const fl_tensor *table;
    const fl_tensor *table2; /* DUAL: the up experts (table: the gate experts), or NULL: */
    int up_tile0;            /* DUAL, table2 NULL: table holds gate|up, up from this tile */
    const int32_t *list;
    int n_local, k, x_per_pair;
    int next_pf; /* block steps of the block's next item requested into L2
                    when an item starts (0: off, the product's value: it
                    measured slower on small experts; bench_kernels' sweep
                    sets it; 0 in DUAL mode, whose tiles this prefetch does
                    not map; the ring kernel only) */
} gv_route;

/* Routed mode: from item `item` (expert j, first pair lo) on, the first item
 * block row y of a grid of gy rows takes (items are dealt round-robin over
 * the rows); j = n_local when none is left. Used for the block's own next
 * item and, ahead of it, for the L2 prefetch of the one after. */
static __device__ __forceinline__ void gv_next_item(const gv_route &rt, int per_item, int y, int gy, int &j,
                                                    int &lo, int &item) {
    for (;;) {
        while (j < rt.n_local && lo >= rt.list[j + 1]) {
            j++;
            if (j < rt.n_local) lo = rt.list[j];
        }
        if (j >= rt.n_local || item % gy == y) return;
        item++;
        lo += per_item;
    }
}

typedef struct gvb_args {
    const bf16 *x;                /* [n, in], 16-byte aligned */
    int n, in, rows;              /* n <= 16 */
    const void *codes, *scales;   /* packed W4 [rows, in] (DUAL: the gate) */
    const void *codes2, *scales2; /* DUAL: the up weight, same layout; else NULL */
    int gshift;                   /* group = 64 << gshift */
    const void *bias;             /* [rows] or NULL (not with DUAL) */
    int bias_f32;
    bf16 *y;                      /* [n, rows] */
    int probe;                    /* 1: stream the weights, skip the math (bench_kernels only) */
    gv_rope rope;                 /* cos NULL: none; else TW = 2 tiles hd / 32 apart (not with DUAL) */
    gv_resid rs;                  /* x NULL: none (producer: not with DUAL or rope) */
    gv_rmsd rd;                   /* ss NULL: none (consumer) */
    int dry;                      /* 1: decide only (cfg_out as a launch would), enqueue nothing */
    gv_route rt;                  /* table NULL: none; else routed experts (fl_cuda_w4_bulk_routed) */
} gvb_args;
/* Whether the bulk kernel runs this device and shape (sm_90+, groups 64..256). */
extern "C" bool fl_cuda_w4_bulk_takes(fl_cuda *c, int in, int group);
/* Enqueues one launch on c->stream. variant (1.., 0 auto) and ks (warps a
 * block, 0 auto) force a configuration; with need_one_wave, only when that
 * configuration holds the grid in one wave of blocks (DUAL: with at least 2
 * warps a block; the default rule of gv_plain), else nothing is enqueued.
 * cfg_out gets {variant, ks, blocks} launched, zeros when nothing was (also when
 * a->rope is set and the configuration does not stream two tiles a warp,
 * and the rows of a->rs need more partials than FL_RMS_DEFER_SLOTS). */
extern "C" fl_status fl_cuda_w4_bulk_launch(fl_cuda *c, const gvb_args *a, int variant, int ks, bool need_one_wave,
                                            int cfg_out[3]);
/* The routed experts on the bulk kernel (a->rt.table set; moe_matmul and
 * moe_gate_up_silu through fl_cuda_w4_gemv_routed): one launch for all
 * local experts; a->n the tokens (items of up to 8 pairs, 16 past 8
 * tokens), `active` the experts expected to have pairs. Grid: one expert's
 * tile groups (x) by gy item rows (the items of a row run back to back,
 * their streams joined): up to min(k, n_local) rows, 1 past one token when
 * an expert's tiles fill half a wave, fewer where one wave of blocks at
 * gvb_warps_sm (16) warps an SM would not hold them; the warps of a
 * block slice the columns as in the plain kernel. cfg_out: {variant,
 * warps a block, gy}, zeros (nothing enqueued) when gy < min_rows; a->dry:
 * decide only. */
extern "C" fl_status fl_cuda_w4_bulk_routed(fl_cuda *c, const gvb_args *a, int active, int min_rows,
                                            int cfg_out[3]);

#endif /* FL_CUDA_GEMV_COMMON_CUH */
