/*
 * status.h — the one error model of flotilla.
 *
 * Every fallible function returns an fl_status. The function that first sees
 * a failure records a human-readable message (what failed, naming the file,
 * tensor, key or line involved) with FL_ERR(); callers propagate the status
 * unchanged with FL_TRY / FL_TRY_GOTO. The message lives in thread-local
 * storage, so it is the message of the last error on the calling thread.
 *
 * Library code never exits the process: the launcher turns a fatal status
 * into a clean job abort (see launcher/).
 */
#ifndef FL_STATUS_H
#define FL_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fl_status {
    FL_OK = 0,
    FL_ERR_INVALID_ARG,  /* the caller's or the user's arguments are wrong */
    FL_ERR_IO,           /* open/read/write/mmap failed */
    FL_ERR_FORMAT,       /* a file's contents are malformed */
    FL_ERR_NOT_FOUND,    /* a named tensor, key or file is missing */
    FL_ERR_UNSUPPORTED,  /* valid input we do not handle (yet) */
    FL_ERR_OOM,          /* allocation failed */
    FL_ERR_CUDA,
    FL_ERR_CUBLAS,
    FL_ERR_NCCL,
    FL_ERR_MPI,
    FL_ERR_HWLOC,
    FL_ERR_SYSTEM,       /* other system call failure (errno recorded) */
    FL_ERR_INTERNAL,     /* a bug: an invariant did not hold */
    FL_STATUS_COUNT
} fl_status;

/* Short constant name of a status ("FL_ERR_FORMAT"). Never NULL. */
const char *fl_status_str(fl_status st);

/* Records a formatted message for st, prefixed by nothing: the message should
 * read as one sentence a user can act on. Returns st so it can be returned
 * directly. file/line are kept for --verbose diagnostics. */
fl_status fl_error_set(fl_status st, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* The message of the last error recorded on this thread ("" when none). */
const char *fl_error_msg(void);
/* "file:line" of the last error recorded on this thread. */
const char *fl_error_where(void);
/* Forget the last error (tests use this between cases). */
void fl_error_clear(void);

#define FL_ERR(st, ...) fl_error_set((st), __FILE__, __LINE__, __VA_ARGS__)

/* Propagate a failure from a call that already recorded its message. */
#define FL_TRY(call)                                                   \
    do {                                                               \
        fl_status fl_try_st_ = (call);                                 \
        if (fl_try_st_ != FL_OK) return fl_try_st_;                    \
    } while (0)

/* Same, for functions with one cleanup path: stores the status in `st`. */
#define FL_TRY_GOTO(call, st, label)                                   \
    do {                                                               \
        (st) = (call);                                                 \
        if ((st) != FL_OK) goto label;                                 \
    } while (0)

/* Allocation check: records FL_ERR_OOM naming the expression. */
#define FL_CHECK_ALLOC(ptr, st, label)                                 \
    do {                                                               \
        if ((ptr) == NULL) {                                           \
            (st) = FL_ERR(FL_ERR_OOM, "out of memory allocating %s", #ptr); \
            goto label;                                                \
        }                                                              \
    } while (0)

/* Asserts are for bugs: print expected vs actual, then abort. */
#define FL_ASSERT(cond)                                                \
    do {                                                               \
        if (!(cond)) fl_assert_fail(#cond, __FILE__, __LINE__);        \
    } while (0)
void fl_assert_fail(const char *expr, const char *file, int line) __attribute__((noreturn));

#ifdef __cplusplus
}
#endif
#endif /* FL_STATUS_H */
