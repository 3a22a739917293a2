/*
 * quantize_resume.h — what lets an interrupted `flotilla quantize` run
 * continue after its last finished layer (docs/quantize.md "Resuming").
 *
 * While a run is unfinished its output folder holds, beside the
 * model.safetensors being filled:
 *   .flotilla-quantize.json   the run's identity (fl_batch_ident, as
 *                             `flotilla generate` keeps beside its output:
 *                             model folder and its size, the calibration
 *                             file's path, size and hash, the options that
 *                             change the output), written before anything else;
 *   .flotilla-quantize.state  the number of layers finished and the hidden
 *                             states after the last of them (the next
 *                             layer's calibration input, f32 [n, d]),
 *                             replaced atomically after each layer once the
 *                             layer's tensors are synced to model.safetensors.
 * A layer's output depends only on the float checkpoint and that input, so
 * the file a resumed run completes is byte for byte the file of a run that
 * was never interrupted. Both files are removed when the run completes.
 *
 * The handle also holds an exclusive lock on the folder (flock), so two runs
 * never fill one output.
 */
#ifndef FL_QUANTIZE_RESUME_H
#define FL_QUANTIZE_RESUME_H

#include <stdint.h>

#include "core/status.h"
#include "runtime/engine/batch_state.h"

typedef struct fl_qresume fl_qresume;

/* Opens the run state of output folder dir (which exists) for a run with
 * identity id over n_layers layers and n calibration tokens of width d.
 * - no identity file: a new run (a stale state file is removed, the
 *   identity written), *done = 0;
 * - an identity of another run: FL_ERR_INVALID_ARG saying what differs,
 *   nothing changed;
 * - the same run: *done = the layers it finished (0 without a state file)
 *   and, when > 0, h[n * d] receives the hidden states after them.
 * A damaged state file, or one for other sizes, is FL_ERR_FORMAT. */
fl_status fl_qresume_open(const char *dir, const fl_batch_ident *id, int n_layers, int64_t n, int64_t d, float *h,
                          int *done, fl_qresume **out);

/* Records that `done` layers are finished and h[n * d] is the next layer's
 * input. The caller has synced the layers' tensors first. */
fl_status fl_qresume_commit(fl_qresume *r, int done, const float *h);

/* The run completed: removes the state files (and temporary ones a kill
 * left while one was being replaced). */
fl_status fl_qresume_finish(fl_qresume *r);

/* Releases the lock and frees r (the files stay). NULL is a no-op. */
void fl_qresume_free(fl_qresume *r);

#endif /* FL_QUANTIZE_RESUME_H */
