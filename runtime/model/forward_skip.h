/*
 * forward_skip.h — FL_DIAG_SKIP: ops of the layer loop left out of every
 * step, to time what each costs on the critical path ("time variants that
 * leave one stage out and take differences"). The outputs are wrong with any
 * op skipped: a timing instrument, never a mode to serve with.
 */
#ifndef FL_FORWARD_SKIP_H
#define FL_FORWARD_SKIP_H

#include "core/status.h"
#include "kernels/backend.h"

/* The stages: FL_SKIP_* in kernels/backend.h (fl_layer_step.skip). */

/* Parses a comma-separated list of norm_attn, qkv, attn, o, norm_mlp,
 * gate_up, down, head (NULL, "" or "none": nothing) into *mask; an unknown name is
 * an error naming it. */
fl_status fl_forward_skip_parse(const char *spec, unsigned *mask);

#endif
