/*
 * gguf_kquant.c — bit-exact f32 decoding of ggml's K-quant and IQ4 blocks
 * (layouts and arithmetic in gguf_kquant.h). Written for clarity: element i
 * of a block is decoded from the byte and bit position ggml packs it at,
 * which keeps each layout visible in one place. Runs at load time only.
 */
#include "core/gguf_kquant.h"

#include <string.h>

#include "core/status.h"

static float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return fl_f16_to_f32(h);
}

/* ggml's kvalues_iq4nl: the 16 non-uniform levels of IQ4_NL / IQ4_XS. */
static const int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

int fl_kquant_block(fl_dtype dt, int64_t *elems, size_t *bytes) {
    int64_t e = FL_QK_K;
    size_t b;
    switch (dt) {
    case FL_DTYPE_Q2_K: b = 16 + 64 + 2 + 2; break;        /* scales[16], qs[64], d, dmin */
    case FL_DTYPE_Q3_K: b = 32 + 64 + 12 + 2; break;       /* hmask[32], qs[64], scales[12], d */
    case FL_DTYPE_Q4_K: b = 2 + 2 + 12 + 128; break;       /* d, dmin, scales[12], qs[128] */
    case FL_DTYPE_Q5_K: b = 2 + 2 + 12 + 32 + 128; break;  /* d, dmin, scales[12], qh[32], qs[128] */
    case FL_DTYPE_Q6_K: b = 128 + 64 + 16 + 2; break;      /* ql[128], qh[64], scales[16], d */
    case FL_DTYPE_Q8_K: b = 4 + 256 + 2 * 16; break;       /* f32 d, qs[256], i16 bsums[16] */
    case FL_DTYPE_IQ4_NL: e = 32, b = 2 + 16; break;       /* d, qs[16] */
    case FL_DTYPE_IQ4_XS: b = 2 + 2 + 4 + 128; break;      /* d, scales_h, scales_l[4], qs[128] */
    default: return 0;
    }
    if (elems) *elems = e;
    if (bytes) *bytes = b;
    return 1;
}

void fl_kquant_scale_min_k4(const uint8_t *s, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4));
        *m = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* The 2-bit field of element i (0..255) in Q2_K/Q3_K qs[64]: elements
 * 128h + 32j + l sit at bits 2j of byte 32h + l. */
static unsigned q2_at(const uint8_t *qs, int i) {
    return (qs[32 * (i / 128) + i % 32] >> (2 * ((i % 128) / 32))) & 3u;
}

/* The low nibble of element i in Q4_K/Q5_K qs[128]: elements 64c + 32h + l
 * sit at bits 4h of byte 32c + l. */
static unsigned q4_at(const uint8_t *qs, int i) {
    return (qs[32 * (i / 64) + i % 32] >> (4 * ((i % 64) / 32))) & 15u;
}

static void block_q2_k(const uint8_t *p, float *y) {
    const uint8_t *sc = p, *qs = p + 16;
    float d = f16_at(p + 80), dmin = f16_at(p + 82);
    for (int s = 0; s < 16; s++) {
        float dl = d * (float)(sc[s] & 15), ml = dmin * (float)(sc[s] >> 4);
        for (int i = 16 * s; i < 16 * s + 16; i++) y[i] = dl * (float)q2_at(qs, i) - ml;
    }
}

static void block_q3_k(const uint8_t *p, float *y) {
    const uint8_t *hmask = p, *qs = p + 32, *sc = p + 96;
    float d = f16_at(p + 108);
    for (int s = 0; s < 16; s++) {
        /* low 4 bits: nibble s/8 of byte s%8; high 2 bits: bits 2(s/4) of byte 8 + s%4 */
        int lo = (sc[s % 8] >> (4 * (s / 8))) & 15, hi = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
        float dl = d * (float)((lo | (hi << 4)) - 32);
        for (int i = 16 * s; i < 16 * s + 16; i++) {
            /* a clear hmask bit subtracts 4 */
            int h = (hmask[i % 32] >> (i / 32)) & 1;
            y[i] = dl * (float)((int)q2_at(qs, i) - (h ? 0 : 4));
        }
    }
}

static void block_q45_k(const uint8_t *p, int five, float *y) {
    float d = f16_at(p), dmin = f16_at(p + 2);
    const uint8_t *scales = p + 4, *qh = p + 16, *qs = p + (five ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        fl_kquant_scale_min_k4(scales, j, &sc, &m);
        float d1 = d * (float)sc, m1 = dmin * (float)m;
        for (int i = 32 * j; i < 32 * j + 32; i++) {
            unsigned q = q4_at(qs, i);
            if (five) q |= ((qh[i % 32] >> (i / 32)) & 1u) << 4;
            y[i] = d1 * (float)q - m1;
        }
    }
}

static void block_q6_k(const uint8_t *p, float *y) {
    const uint8_t *ql = p, *qh = p + 128;
    const int8_t *sc = (const int8_t *)(p + 192);
    float d = f16_at(p + 208);
    for (int s = 0; s < 16; s++) {
        float dl = d * (float)sc[s];
        for (int i = 16 * s; i < 16 * s + 16; i++) {
            int h = i / 128, r = i % 128;
            /* elements 128h + 64k + l: nibble k of ql[64h + l];
             * elements 128h + 32k + l: bits 2k of qh[32h + l] */
            int lo = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 15;
            int hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
            y[i] = dl * (float)((lo | (hi << 4)) - 32);
        }
    }
}

static void block_q8_k(const uint8_t *p, float *y) {
    float d;
    memcpy(&d, p, 4);
    const int8_t *qs = (const int8_t *)(p + 4);
    for (int i = 0; i < FL_QK_K; i++) y[i] = d * (float)qs[i];
}

static void block_iq4_nl(const uint8_t *p, float *y) {
    float d = f16_at(p);
    for (int i = 0; i < 32; i++) y[i] = d * (float)IQ4_LEVELS[(p[2 + i % 16] >> (4 * (i / 16))) & 15];
}

static void block_iq4_xs(const uint8_t *p, float *y) {
    float d = f16_at(p);
    uint16_t sh;
    memcpy(&sh, p + 2, 2);
    const uint8_t *sl = p + 4, *qs = p + 8;
    for (int j = 0; j < 8; j++) {
        int lo = (sl[j / 2] >> (4 * (j % 2))) & 15, hi = (sh >> (2 * j)) & 3;
        float dl = d * (float)((lo | (hi << 4)) - 32);
        for (int r = 0; r < 32; r++)
            y[32 * j + r] = dl * (float)IQ4_LEVELS[(qs[16 * j + r % 16] >> (4 * (r / 16))) & 15];
    }
}

void fl_kquant_row_f32(fl_dtype dt, const uint8_t *src, int64_t n, float *out) {
    int64_t be;
    size_t bb;
    FL_ASSERT(fl_kquant_block(dt, &be, &bb) && n % be == 0);
    for (int64_t b = 0; b < n / be; b++) {
        const uint8_t *p = src + (size_t)b * bb;
        float *y = out + b * be;
        switch (dt) {
        case FL_DTYPE_Q2_K: block_q2_k(p, y); break;
        case FL_DTYPE_Q3_K: block_q3_k(p, y); break;
        case FL_DTYPE_Q4_K: block_q45_k(p, 0, y); break;
        case FL_DTYPE_Q5_K: block_q45_k(p, 1, y); break;
        case FL_DTYPE_Q6_K: block_q6_k(p, y); break;
        case FL_DTYPE_Q8_K: block_q8_k(p, y); break;
        case FL_DTYPE_IQ4_NL: block_iq4_nl(p, y); break;
        default: block_iq4_xs(p, y); break;
        }
    }
}
