/*
 * forward_skip.h — FL_DIAG_SKIP: ops of the layer loop left out of every
 * step, to time what each costs on the critical path ("time variants that
 * leave one stage out and take differences"). The outputs are wrong with any
 * op skipped: a timing instrument, never a mode to serve with.
 */
#ifndef FL_FORWARD_SKIP_H
#define FL_FORWARD_SKIP_H

#include "core/status.h"

enum {
    FL_SKIP_NORM_ATTN = 1u << 0, /* the residual add + RMSNorm before attention */
    FL_SKIP_QKV = 1u << 1,       /* q|k|v projection, RoPE, K/V store */
    FL_SKIP_ATTN = 1u << 2,      /* attention itself */
    FL_SKIP_O = 1u << 3,         /* output projection */
    FL_SKIP_NORM_MLP = 1u << 4,  /* the residual add + RMSNorm before the MLP */
    FL_SKIP_GATE_UP = 1u << 5,   /* dense MLP gate|up (+ SiLU) */
    FL_SKIP_DOWN = 1u << 6,      /* dense MLP down projection */
    FL_SKIP_HEAD = 1u << 7,      /* final norm and lm_head */
};

/* Parses a comma-separated list of norm_attn, qkv, attn, o, norm_mlp,
 * gate_up, down, head (NULL, "" or "none": nothing) into *mask; an unknown name is
 * an error naming it. */
fl_status fl_forward_skip_parse(const char *spec, unsigned *mask);

#endif
