/*
 * quantize_input.h — what `flotilla quantize` reads before its first layer,
 * alike on every rank: the options, the float model's description, the
 * calibration text cut into samples, how the samples are split over the
 * ranks (quantize_share.h) and the run's identity (quantize_resume.h).
 */
#ifndef FL_QUANTIZE_INPUT_H
#define FL_QUANTIZE_INPUT_H

#include <stdbool.h>
#include <stdint.h>

#include "core/status.h"
#include "launcher/quantize_output.h"
#include "launcher/quantize_share.h"
#include "parallel/comm.h"
#include "runtime/engine/batch_state.h"
#include "runtime/load/checkpoint.h"
#include "runtime/tok/tokenizer.h"

typedef struct fl_qopts {
    const char *model, *calib, *output;
    long group, n_samples, seq_len;
    bool awq; /* false: --method rtn, plain group quantization (s = 1, no clipping) */
    fl_qformat format;
    long clip_tokens; /* the clipping search's sample of tokens, at most (FL_TEST_QUANTIZE_CLIP_TOKENS) */
    bool cuda;        /* --backend cuda: the matmuls on the GPU (another run: its numbers differ) */
} fl_qopts;

/* The calibration tokens cut into blocks (samples). */
typedef struct fl_qcalib {
    int32_t *ids;
    int *len;
    int n_blk;
    int64_t n;
} fl_qcalib;

/* What every rank reads alike: the model, its tokenizer, the calibration
 * blocks and their split over the ranks, the run's identity. */
typedef struct fl_qinput {
    fl_ckpt *ck;
    fl_tokenizer *tok;
    fl_model_config cfg;
    fl_qcalib c;
    fl_qshare sh;
    fl_batch_ident id;
} fl_qinput;

/* Opens o->model, checks it is a dense float llama / qwen2 whose shapes
 * take o's group and format, tokenizes o->calib into at most o->n_samples
 * blocks of o->seq_len tokens, splits them over comm's ranks (NULL: one
 * rank) and fills the run's identity. Communicates nothing. On failure in
 * may hold part of it: fl_qinput_free it. */
fl_status fl_qinput_read(const fl_qopts *o, fl_comm *comm, fl_qinput *in);
void fl_qinput_free(fl_qinput *in);

/* Collective over comm (NULL: returns st). st is this rank's
 * fl_qinput_read. Every rank reads the same files with the same options, so a failure in
 * fl_qinput_read is (almost always) every rank's: the lowest failing rank
 * prints it, the ranks leave together, and *reported says it is printed.
 * One that failed alone is reported by it the same way, not left hanging.
 * Then the ranks compare a fingerprint of their tokens and options, so
 * that no two ranks cut other samples and pair mismatched collectives. */
fl_status fl_qinput_agree(fl_comm *comm, const fl_qopts *o, const fl_qinput *in, fl_status st, bool *reported);

#endif /* FL_QUANTIZE_INPUT_H */
