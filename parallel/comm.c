/*
 * comm.c — the dispatcher of the collectives API: argument checks shared by
 * both implementations, all_gather/reduce_scatter displacements, the
 * host-side count exchange, and the registry of live communicators that
 * fl_par_abort uses to abort NCCL work before MPI_Abort.
 *
 * all_reduce / all_gather / reduce_scatter / broadcast calls whose total
 * size is zero return at once: that size is the same on every rank, so every
 * rank skips together, and the implementations never see an empty
 * collective (nor the NULL buffers comm.h allows for it). all_to_all_v
 * cannot know that the others are empty; the implementations skip empty
 * parts themselves.
 */
#include "parallel/comm.h"

#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "core/option.h"
#include "parallel/check.h"
#include "parallel/comm_impl.h"

static pthread_mutex_t g_live_lock = PTHREAD_MUTEX_INITIALIZER;
static fl_comm *g_live;

size_t fl_comm_dtype_size(fl_comm_dtype dt) {
    switch (dt) {
    case FL_COMM_F32: return 4;
    case FL_COMM_BF16: return 2;
    case FL_COMM_I32: return 4;
    case FL_COMM_DTYPE_COUNT: break;
    }
    return 0;
}

const char *fl_comm_dtype_name(fl_comm_dtype dt) {
    switch (dt) {
    case FL_COMM_F32: return "f32";
    case FL_COMM_BF16: return "bf16";
    case FL_COMM_I32: return "i32";
    case FL_COMM_DTYPE_COUNT: break;
    }
    return "invalid";
}

const char *fl_comm_backend_name(fl_comm_backend b) {
    return b == FL_COMM_BACKEND_NCCL ? "nccl" : b == FL_COMM_BACKEND_MPI ? "mpi" : "invalid";
}

fl_status fl_comm_alloc(MPI_Comm comm, fl_comm_backend backend, fl_comm **out) {
    fl_status st = FL_OK;
    *out = NULL;
    fl_comm *c = calloc(1, sizeof *c);
    FL_CHECK_ALLOC(c, st, fail);
    c->mpi = MPI_COMM_NULL;
    c->backend = backend;
    FL_MPI_CHECK_GOTO(MPI_Comm_dup(comm, &c->mpi), st, fail);
    FL_MPI_CHECK_GOTO(MPI_Comm_set_errhandler(c->mpi, MPI_ERRORS_RETURN), st, fail);
    FL_MPI_CHECK_GOTO(MPI_Comm_rank(c->mpi, &c->rank), st, fail);
    FL_MPI_CHECK_GOTO(MPI_Comm_size(c->mpi, &c->size), st, fail);
    c->displs = calloc((size_t)c->size, sizeof *c->displs);
    FL_CHECK_ALLOC(c->displs, st, fail);
    *out = c;
    return FL_OK;
fail:
    if (c) {
        if (c->mpi != MPI_COMM_NULL) MPI_Comm_free(&c->mpi);
        free(c->displs);
        free(c);
    }
    return st;
}

void fl_comm_register(fl_comm *c) {
    pthread_mutex_lock(&g_live_lock);
    c->next_live = g_live;
    g_live = c;
    pthread_mutex_unlock(&g_live_lock);
}

static void unregister(fl_comm *c) {
    pthread_mutex_lock(&g_live_lock);
    for (fl_comm **p = &g_live; *p; p = &(*p)->next_live)
        if (*p == c) {
            *p = c->next_live;
            break;
        }
    pthread_mutex_unlock(&g_live_lock);
}

void fl_comm_abort_all(void) {
    /* trylock: the abort path must not wait on a thread that may be the one
     * in trouble; a comm being created right now is simply skipped. */
    if (pthread_mutex_trylock(&g_live_lock) != 0) return;
    for (fl_comm *c = g_live; c; c = c->next_live)
        if (c->ops && c->ops->abort) c->ops->abort(c);
    pthread_mutex_unlock(&g_live_lock);
}

void fl_comm_free(fl_comm *c) {
    if (!c) return;
    unregister(c);
    if (c->ops && c->ops->destroy) c->ops->destroy(c);
    if (c->mpi != MPI_COMM_NULL) MPI_Comm_free(&c->mpi);
    free(c->displs);
    free(c);
}

int fl_comm_rank(const fl_comm *c) { return c->rank; }
int fl_comm_size(const fl_comm *c) { return c->size; }
fl_comm_backend fl_comm_backend_of(const fl_comm *c) { return c->backend; }
void *fl_comm_stream(const fl_comm *c) { return c->stream; }

fl_status fl_comm_use_stream(fl_comm *c, void *stream) {
    if (!c) return FL_ERR(FL_ERR_INVALID_ARG, "use_stream: communicator is NULL");
    if (!c->ops->use_stream || c->own_stream) return FL_OK;
    if (!stream) return FL_ERR(FL_ERR_INVALID_ARG, "use_stream: stream is NULL");
    return c->ops->use_stream(c, stream);
}

/* --- argument checks ------------------------------------------------------ */

static fl_status check_common(const fl_comm *c, fl_comm_dtype dt, const char *op) {
    if (!c) return FL_ERR(FL_ERR_INVALID_ARG, "%s: communicator is NULL", op);
    if ((unsigned)dt >= FL_COMM_DTYPE_COUNT)
        return FL_ERR(FL_ERR_INVALID_ARG, "%s: invalid dtype %d", op, (int)dt);
    return FL_OK;
}

static fl_status check_buf(const void *p, size_t count, const char *op, const char *what) {
    if (count > 0 && !p)
        return FL_ERR(FL_ERR_INVALID_ARG, "%s: %s is NULL but its count is %zu", op, what, count);
    return FL_OK;
}

/* total = sum(counts), displs = exclusive prefix sums; refuses overflow of
 * the element count in bytes. */
static fl_status prefix(fl_comm *c, const size_t *counts, fl_comm_dtype dt, size_t *total,
                        const char *op) {
    if (!counts) return FL_ERR(FL_ERR_INVALID_ARG, "%s: counts is NULL", op);
    size_t t = 0, es = fl_comm_dtype_size(dt);
    for (int r = 0; r < c->size; r++) {
        c->displs[r] = t;
        if (counts[r] > (SIZE_MAX / es) - t)
            return FL_ERR(FL_ERR_INVALID_ARG, "%s: counts overflow at rank %d (%zu)", op, r,
                          counts[r]);
        t += counts[r];
    }
    *total = t;
    return FL_OK;
}

fl_status fl_comm_all_reduce_sum(fl_comm *c, const void *send, void *recv, size_t count,
                                 fl_comm_dtype dt) {
    FL_TRY(check_common(c, dt, "all_reduce_sum"));
    FL_TRY(check_buf(send, count, "all_reduce_sum", "send"));
    FL_TRY(check_buf(recv, count, "all_reduce_sum", "recv"));
    if (count == 0) return FL_OK; /* same on every rank: nothing to do anywhere */
    return c->ops->all_reduce_sum(c, send, recv, count, dt);
}

fl_status fl_comm_all_gather(fl_comm *c, const void *send, void *recv, const size_t *counts,
                             fl_comm_dtype dt) {
    size_t total = 0;
    FL_TRY(check_common(c, dt, "all_gather"));
    FL_TRY(prefix(c, counts, dt, &total, "all_gather"));
    FL_TRY(check_buf(send, counts[c->rank], "all_gather", "send"));
    FL_TRY(check_buf(recv, total, "all_gather", "recv"));
    if (total == 0) return FL_OK;
    return c->ops->all_gather(c, send, recv, counts, c->displs, total, dt);
}

fl_status fl_comm_reduce_scatter(fl_comm *c, const void *send, void *recv, const size_t *counts,
                                 fl_comm_dtype dt) {
    size_t total = 0;
    FL_TRY(check_common(c, dt, "reduce_scatter"));
    FL_TRY(prefix(c, counts, dt, &total, "reduce_scatter"));
    FL_TRY(check_buf(send, total, "reduce_scatter", "send"));
    FL_TRY(check_buf(recv, counts[c->rank], "reduce_scatter", "recv"));
    if (total == 0) return FL_OK;
    return c->ops->reduce_scatter(c, send, recv, counts, c->displs, total, dt);
}

fl_status fl_comm_all_to_all_v(fl_comm *c, const void *send, const size_t *send_counts,
                               const size_t *send_displs, void *recv, const size_t *recv_counts,
                               const size_t *recv_displs, fl_comm_dtype dt) {
    FL_TRY(check_common(c, dt, "all_to_all_v"));
    if (!send_counts || !send_displs || !recv_counts || !recv_displs)
        return FL_ERR(FL_ERR_INVALID_ARG, "all_to_all_v: a counts or displacements array is NULL");
    for (int r = 0; r < c->size; r++) {
        FL_TRY(check_buf(send, send_counts[r], "all_to_all_v", "send"));
        FL_TRY(check_buf(recv, recv_counts[r], "all_to_all_v", "recv"));
        if (send_displs[r] > SIZE_MAX / 4 - send_counts[r] ||
            recv_displs[r] > SIZE_MAX / 4 - recv_counts[r])
            return FL_ERR(FL_ERR_INVALID_ARG, "all_to_all_v: displacement overflow at rank %d",
                          r);
    }
    return c->ops->all_to_all_v(c, send, send_counts, send_displs, recv, recv_counts,
                                recv_displs, dt);
}

fl_status fl_comm_exchange_counts(fl_comm *c, const size_t *send_counts, size_t *recv_counts) {
    if (!c || !send_counts || !recv_counts)
        return FL_ERR(FL_ERR_INVALID_ARG, "exchange_counts: NULL argument");
    /* size_t is not an MPI type of its own; exchange as uint64. */
    fl_status st = FL_OK;
    uint64_t *s = malloc(2 * (size_t)c->size * sizeof *s);
    FL_CHECK_ALLOC(s, st, fail);
    for (int r = 0; r < c->size; r++) s[r] = send_counts[r];
    FL_MPI_CHECK_GOTO(MPI_Alltoall(s, 1, MPI_UINT64_T, s + c->size, 1, MPI_UINT64_T, c->mpi), st,
                      fail);
    for (int r = 0; r < c->size; r++) recv_counts[r] = (size_t)s[c->size + r];
fail:
    free(s);
    return st;
}

static fl_status check_broadcast(fl_comm *c, const void *buf, size_t count, int root,
                                 fl_comm_dtype dt, const char *what) {
    FL_TRY(check_common(c, dt, what));
    FL_TRY(check_buf(buf, count, what, "buf"));
    if (root < 0 || root >= c->size)
        return FL_ERR(FL_ERR_INVALID_ARG, "%s: root %d is not a rank of a group of %d", what, root,
                      c->size);
    return FL_OK;
}

fl_status fl_comm_broadcast(fl_comm *c, void *buf, size_t count, int root, fl_comm_dtype dt) {
    FL_TRY(check_broadcast(c, buf, count, root, dt, "broadcast"));
    if (count == 0) return FL_OK;
    return c->ops->broadcast(c, buf, count, root, dt);
}

fl_status fl_comm_broadcast_host(fl_comm *c, void *buf, size_t count, int root, fl_comm_dtype dt) {
    FL_TRY(check_broadcast(c, buf, count, root, dt, "broadcast_host"));
    size_t bytes = count * fl_comm_dtype_size(dt);
    if (bytes > INT_MAX)
        return FL_ERR(FL_ERR_INVALID_ARG, "broadcast_host: %zu bytes exceed MPI's int count", bytes);
    if (count == 0) return FL_OK;
    FL_MPI_CHECK(MPI_Bcast(buf, (int)bytes, MPI_BYTE, root, c->mpi));
    return FL_OK;
}

fl_status fl_comm_agree(fl_comm *c, bool ok, bool *all_ok) {
    if (!c) return FL_ERR(FL_ERR_INVALID_ARG, "agree: communicator is NULL");
    int mine = ok, all = 0;
    FL_MPI_CHECK(MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, c->mpi));
    *all_ok = all != 0;
    return FL_OK;
}

fl_status fl_comm_agree_min(fl_comm *c, int mine, int *least) {
    if (!c) return FL_ERR(FL_ERR_INVALID_ARG, "agree_min: communicator is NULL");
    FL_MPI_CHECK(MPI_Allreduce(&mine, least, 1, MPI_INT, MPI_MIN, c->mpi));
    return FL_OK;
}

fl_status fl_comm_agree_each(fl_comm *c, int32_t *flags, size_t n) {
    if (!c) return FL_ERR(FL_ERR_INVALID_ARG, "agree_each: communicator is NULL");
    if (n > INT32_MAX) return FL_ERR(FL_ERR_INVALID_ARG, "agree_each: %zu flags", n);
    if (n) FL_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, flags, (int)n, MPI_INT32_T, MPI_MIN, c->mpi));
    return FL_OK;
}

fl_status fl_comm_barrier(fl_comm *c) {
    if (!c) return FL_ERR(FL_ERR_INVALID_ARG, "barrier: communicator is NULL");
    return c->ops->barrier(c);
}

fl_status fl_comm_sync(fl_comm *c) {
    if (!c) return FL_ERR(FL_ERR_INVALID_ARG, "sync: communicator is NULL");
    return c->ops->sync(c);
}

void fl_comm_config_default(fl_comm_config *c) {
    *c = (fl_comm_config){
        .own_stream = fl_opt_default_bool(FL_OPT_NCCL_OWN_STREAM),
        .p2p_allreduce = fl_opt_default_bool(FL_OPT_P2P_AR),
        .p2p_allreduce_max_bytes = fl_opt_default_int(FL_OPT_P2P_AR_MAX_BYTES),
    };
}
