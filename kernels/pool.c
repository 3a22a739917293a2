/*
 * pool.c — the host thread pool (pool.h): N-1 workers plus the caller,
 * woken by a generation counter. Waiting (a worker for the next loop, the
 * caller for the workers) spins on the word for a short while (a worker
 * then yields its core between looks for a while more), then sleeps on it
 * with a futex; the side that changes the word issues the futex wake
 * only when someone is asleep, so back-to-back loops make no system call.
 */
#define _GNU_SOURCE
#include "kernels/pool.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "core/option.h"

/* How long a waiter spins before it sleeps: about the gap between two
 * matmuls of a decode step (a norm or a rope on one token). Longer spins
 * lost on a busy 2-core machine: 100 us and 20 us decoded at 2 threads
 * slower than 5 us (and than OpenMP's passive policy), as a spinning thread
 * uses up the CPU share the scheduler would give it when it has work. */
#define SPIN_NS 5000
/* Then a worker yields the core between looks for up to YIELD_NS before it
 * sleeps: on an idle machine a futex wake per matmul (150 a decode step)
 * cost 2-3 % at 2 threads; on a busy one sched_yield hands the core to
 * whoever wants it, so this spends nobody's share. */
#define YIELD_NS 1000000

typedef struct pool {
    int n;                      /* threads, the caller included */
    pthread_t *workers;         /* [n - 1] */
    _Atomic uint32_t gen;       /* bumped once per loop (and to stop) */
    _Atomic uint32_t pending;   /* workers not done with the current loop */
    _Atomic int sleepers;       /* workers asleep on gen */
    _Atomic int caller_asleep;  /* the caller is asleep on pending */
    _Atomic int64_t next;       /* dynamic loops: the first unclaimed index */
    _Atomic bool stop;
    fl_pool_task fn;            /* the current loop, written before gen moves */
    void *ctx;
    int64_t len, chunk;
} pool;

typedef struct worker_arg {
    pool *p;
    int thread;
} worker_arg;

static pool *g_pool;
static int g_threads;                  /* fl_pool_set_threads; 0: not set */
static atomic_flag g_busy = ATOMIC_FLAG_INIT; /* held while a loop runs or the pool changes */
static bool g_atexit;

static void cpu_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void futex_wait(_Atomic uint32_t *word, uint32_t expected) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *word, int n) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}

/* Spins until *word != old or SPIN_NS pass, then yields the core between
 * looks until YIELD_NS pass; true if it changed. */
static bool spin_while(_Atomic uint32_t *word, uint32_t old) {
    const int64_t t0 = now_ns();
    for (int i = 1;; i++) {
        if (atomic_load_explicit(word, memory_order_acquire) != old) return true;
        cpu_pause();
        if (!(i & 63) && now_ns() - t0 > SPIN_NS) break;
    }
    for (;;) {
        if (atomic_load_explicit(word, memory_order_acquire) != old) return true;
        if (now_ns() - t0 > YIELD_NS) return false;
        sched_yield();
    }
}

/* Thread `t`'s share of the current loop. */
static void run_share(pool *p, int t) {
    const int64_t len = p->len;
    if (p->chunk <= 0) {
        const int64_t per = (len + p->n - 1) / p->n, lo = (int64_t)t * per;
        if (lo < len) p->fn(p->ctx, lo, lo + per < len ? lo + per : len, t);
        return;
    }
    for (;;) {
        const int64_t lo = atomic_fetch_add_explicit(&p->next, p->chunk, memory_order_relaxed);
        if (lo >= len) return;
        p->fn(p->ctx, lo, lo + p->chunk < len ? lo + p->chunk : len, t);
    }
}

static void *worker_main(void *arg) {
    pool *p = ((worker_arg *)arg)->p;
    const int t = ((worker_arg *)arg)->thread;
    free(arg);
    uint32_t seen = 0;
    for (;;) {
        if (!spin_while(&p->gen, seen)) {
            /* seq_cst pairs with the caller's bump then sleepers load: either
             * it sees this sleeper and wakes it, or the load below sees the bump */
            atomic_fetch_add(&p->sleepers, 1);
            while (atomic_load(&p->gen) == seen) futex_wait(&p->gen, seen);
            atomic_fetch_sub(&p->sleepers, 1);
        }
        seen = atomic_load_explicit(&p->gen, memory_order_acquire);
        if (atomic_load(&p->stop)) return NULL;
        run_share(p, t);
        if (atomic_fetch_sub(&p->pending, 1) == 1 && atomic_load(&p->caller_asleep)) futex_wake(&p->pending, 1);
    }
}

/* Wakes the workers: the fields of the loop (or stop) are already written. */
static void publish(pool *p) {
    atomic_store(&p->pending, (uint32_t)(p->n - 1));
    atomic_fetch_add(&p->gen, 1);
    if (atomic_load(&p->sleepers) > 0) futex_wake(&p->gen, INT_MAX);
}

/* Returns once every worker is done with the current loop (pending is 0). */
static void wait_workers(pool *p) {
    const int64_t t0 = now_ns();
    for (int i = 1; atomic_load_explicit(&p->pending, memory_order_acquire); i++) {
        cpu_pause();
        if ((i & 63) || now_ns() - t0 <= SPIN_NS) continue;
        /* seq_cst pairs with the last worker's decrement then caller_asleep load */
        atomic_store(&p->caller_asleep, 1);
        uint32_t v;
        while ((v = atomic_load(&p->pending)) != 0) futex_wait(&p->pending, v);
        atomic_store(&p->caller_asleep, 0);
        return;
    }
}

/* Stops and joins the first `started` workers, then frees the pool. */
static void pool_free(pool *p, int started) {
    atomic_store(&p->stop, true);
    publish(p);
    for (int i = 0; i < started; i++) pthread_join(p->workers[i], NULL);
    free(p->workers);
    free(p);
}

/* The thread count of a new pool (pool.h, "Threads"). */
static fl_status choose_threads(int *out) {
    if (g_threads > 0) {
        *out = g_threads;
        return FL_OK;
    }
    const char *env = fl_opt_external("OMP_NUM_THREADS");
    if (env && *env) {
        /* OpenMP allows a list (one count per nesting level): the first is ours */
        char *end;
        errno = 0;
        const long v = strtol(env, &end, 10);
        if (errno || end == env || (*end && *end != ',') || v < 1 || v > 4096)
            return FL_ERR(FL_ERR_INVALID_ARG, "OMP_NUM_THREADS='%s' is not a thread count (1..4096)", env);
        *out = (int)v;
        return FL_OK;
    }
    cpu_set_t set;
    int n = 0;
    if (!sched_getaffinity(0, sizeof set, &set)) n = CPU_COUNT(&set);
    if (n < 1) n = (int)sysconf(_SC_NPROCESSORS_ONLN);
    *out = n < 1 ? 1 : n > 4096 ? 4096 : n;
    return FL_OK;
}

static fl_status pool_start(pool **out) {
    int n = 1; /* set by choose_threads on success; GCC -O3 cannot see that */
    FL_TRY(choose_threads(&n));
    pool *p = calloc(1, sizeof *p);
    if (!p) return FL_ERR(FL_ERR_OOM, "thread pool: out of memory");
    p->n = n;
    p->workers = calloc((size_t)(n > 1 ? n - 1 : 1), sizeof *p->workers);
    if (!p->workers) {
        free(p);
        return FL_ERR(FL_ERR_OOM, "thread pool: out of memory for %d threads", n);
    }
    /* workers take no signals: they stay with the threads that handle them */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = 0, started = 0;
    for (; started < n - 1; started++) {
        worker_arg *a = malloc(sizeof *a);
        if (!a) {
            rc = ENOMEM;
            break;
        }
        a->p = p, a->thread = started + 1;
        rc = pthread_create(&p->workers[started], NULL, worker_main, a);
        if (rc) {
            free(a);
            break;
        }
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc) {
        pool_free(p, started);
        return FL_ERR(FL_ERR_SYSTEM, "thread pool: pthread_create of worker %d of %d failed: %s (use --threads "
                      "to ask for fewer)", started + 1, n - 1, strerror(rc));
    }
    if (!g_atexit) g_atexit = atexit(fl_pool_shutdown) == 0;
    *out = p;
    return FL_OK;
}

fl_status fl_pool_for(int64_t n, int64_t chunk, fl_pool_task fn, void *ctx) {
    if (n <= 0) return FL_OK;
    if (n == 1 || atomic_flag_test_and_set_explicit(&g_busy, memory_order_acquire)) {
        fn(ctx, 0, n, 0); /* one index, or nested / concurrent: serially here */
        return FL_OK;
    }
    fl_status st = FL_OK;
    if (!g_pool) st = pool_start(&g_pool);
    if (st == FL_OK && g_pool->n == 1) {
        fn(ctx, 0, n, 0);
    } else if (st == FL_OK) {
        pool *p = g_pool;
        p->fn = fn, p->ctx = ctx, p->len = n, p->chunk = chunk;
        atomic_store_explicit(&p->next, 0, memory_order_relaxed);
        publish(p);
        run_share(p, 0);
        wait_workers(p);
    }
    atomic_flag_clear_explicit(&g_busy, memory_order_release);
    return st;
}

int fl_pool_threads(void) {
    if (g_pool) return g_pool->n;
    int n = 1;
    if (choose_threads(&n) != FL_OK) return 1;
    return n;
}

fl_status fl_pool_set_threads(int n) {
    if (n < 1 || n > 4096) return FL_ERR(FL_ERR_INVALID_ARG, "thread pool: %d threads (expected 1..4096)", n);
    if (g_pool && g_pool->n != n) fl_pool_shutdown();
    g_threads = n;
    return FL_OK;
}

void fl_pool_shutdown(void) {
    if (atomic_flag_test_and_set_explicit(&g_busy, memory_order_acquire)) return; /* a loop is running */
    if (g_pool) pool_free(g_pool, g_pool->n - 1);
    g_pool = NULL;
    atomic_flag_clear_explicit(&g_busy, memory_order_release);
}
