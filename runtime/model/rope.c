/*
 * rope.c — RoPE frequency tables (see rope.h). Each variant follows the
 * formula of transformers' modeling_rope_utils.py; the comments name the
 * function it mirrors.
 */
#include "runtime/model/rope.h"

#include <math.h>
#include <stddef.h>

int fl_rope_dim(const fl_model_config *cfg) {
    /* MLA rotates only the qk_rope_head_dim part of q and the shared k_pe
     * (transformers sets DeepSeek's head_dim to it for the RoPE functions). */
    if (cfg->arch == FL_ARCH_DEEPSEEK_V2) return cfg->mla.qk_rope_head_dim & ~1;
    float f = cfg->rope.partial_rotary_factor > 0 ? cfg->rope.partial_rotary_factor : 1.0f;
    int d = (int)(cfg->head_dim * f);
    return d & ~1;
}

static double yarn_mscale_k(double scale, double k) { return scale <= 1 ? 1.0 : 0.1 * k * log(scale) + 1.0; }
static double yarn_mscale(double scale) { return yarn_mscale_k(scale, 1.0); }

static double yarn_corr_dim(double n_rot, int dim, double base, double max_pos) {
    return (dim * log(max_pos / (n_rot * 2 * M_PI))) / (2 * log(base));
}

void fl_rope_inv_freq(const fl_model_config *cfg, int seq_len, double *inv, double *mscale) {
    const fl_rope_config *r = &cfg->rope;
    const int dim = fl_rope_dim(cfg), half = dim / 2;
    double base = r->theta > 0 ? r->theta : 10000.0;
    *mscale = 1.0;
    if (r->kind == FL_ROPE_DYNAMIC) {
        /* _compute_dynamic_ntk_parameters: seq_len = max(seq_len, max_pos) */
        double maxp = cfg->max_position_embeddings;
        double sl = seq_len > maxp ? seq_len : maxp;
        base *= pow(r->factor * sl / maxp - (r->factor - 1), (double)dim / (dim - 2));
    }
    for (int i = 0; i < half; i++) inv[i] = 1.0 / pow(base, (2.0 * i) / dim);
    switch (r->kind) {
    case FL_ROPE_LINEAR:
        for (int i = 0; i < half; i++) inv[i] /= r->factor;
        break;
    case FL_ROPE_LLAMA3: { /* _compute_llama3_parameters */
        double old = r->original_max_pos;
        double low_wl = old / r->low_freq_factor, high_wl = old / r->high_freq_factor;
        for (int i = 0; i < half; i++) {
            double wl = 2 * M_PI / inv[i];
            double f = wl > low_wl ? inv[i] / r->factor : inv[i];
            if (!(wl < high_wl) && !(wl > low_wl)) {
                double smooth = (old / wl - r->low_freq_factor) /
                                (r->high_freq_factor - r->low_freq_factor);
                f = (1 - smooth) * f / r->factor + smooth * f;
            }
            inv[i] = f;
        }
        break;
    }
    case FL_ROPE_YARN: { /* _compute_yarn_parameters */
        double bf = r->beta_fast > 0 ? r->beta_fast : 32, bs = r->beta_slow > 0 ? r->beta_slow : 1;
        double omax = r->original_max_pos > 0 ? r->original_max_pos : cfg->max_position_embeddings;
        double lo = floor(yarn_corr_dim(bf, dim, base, omax));
        double hi = ceil(yarn_corr_dim(bs, dim, base, omax));
        if (lo < 0) lo = 0;
        if (hi > dim - 1) hi = dim - 1;
        if (lo == hi) hi += 0.001;
        for (int i = 0; i < half; i++) {
            double ramp = (i - lo) / (hi - lo);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            double extra = 1 - ramp; /* extrapolation weight */
            inv[i] = inv[i] / r->factor * (1 - extra) + inv[i] * extra;
        }
        /* DeepSeek configs give mscale and mscale_all_dim (both non-zero):
         * the factor is their ratio (transformers' get_mscale). */
        if (r->attention_factor > 0)
            *mscale = r->attention_factor;
        else if (r->mscale != 0 && r->mscale_all_dim != 0)
            *mscale = yarn_mscale_k(r->factor, r->mscale) / yarn_mscale_k(r->factor, r->mscale_all_dim);
        else
            *mscale = yarn_mscale(r->factor);
        break;
    }
    default:
        break;
    }
}

void fl_rope_fill(const fl_model_config *cfg, const float *freq_factors, int seq_len,
                  const int32_t *pos, int n, float *cos_out, float *sin_out) {
    const int half = fl_rope_dim(cfg) / 2;
    double inv[1024], ms;
    FL_ASSERT(half <= 1024);
    fl_rope_inv_freq(cfg, seq_len, inv, &ms);
    if (freq_factors)
        for (int i = 0; i < half; i++) inv[i] /= freq_factors[i];
    for (int t = 0; t < n; t++)
        for (int i = 0; i < half; i++) {
            /* transformers forms the angle in float32; doing the same keeps
             * long-context angles bit-close to the reference. */
            float ang = (float)inv[i] * (float)pos[t];
            cos_out[(size_t)t * half + i] = (float)(cos((double)ang) * ms);
            sin_out[(size_t)t * half + i] = (float)(sin((double)ang) * ms);
        }
}
