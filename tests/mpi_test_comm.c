/*
 * mpi_test_comm.c — every collective of parallel/comm.h, run under mpirun
 * with 2, 3 and 4 ranks, for f32, bf16 and int32, with uneven counts and
 * zero-length parts (including this rank's own), checked on every rank
 * against the result computed locally from the formula every rank used to
 * fill its buffers. The values are small integers (and halves) so that
 * every sum is exact in all three dtypes and the checks can demand equality.
 *
 * Runs on the MPI communicator (host buffers); FL_TEST_COMM=nccl runs the
 * same checks on the NCCL one (device buffers) on a GPU machine.
 */
#include "mpi_harness.h"

#include "core/tensor.h"

static const fl_comm_dtype k_dtypes[] = {FL_COMM_F32, FL_COMM_BF16, FL_COMM_I32};
#define N_DTYPES 3

/* Element i of rank r's contribution: exact in bf16 (|v| <= 256, integer or
 * half) and in sums over up to 4 ranks. */
static double val(fl_comm_dtype dt, int r, size_t i) {
    double v = (double)((r * 7 + (int)i * 3) % 23 - 11);
    if (dt == FL_COMM_F32) v += 0.5 * (r % 2);
    if (dt == FL_COMM_I32) v += 100000.0 * r; /* int32 takes big values */
    return v;
}

static void store(fl_comm_dtype dt, void *buf, size_t i, double v) {
    switch (dt) {
    case FL_COMM_F32: ((float *)buf)[i] = (float)v; break;
    case FL_COMM_BF16: ((uint16_t *)buf)[i] = fl_f32_to_bf16((float)v); break;
    default: ((int32_t *)buf)[i] = (int32_t)v; break;
    }
}

static double load(fl_comm_dtype dt, const void *buf, size_t i) {
    switch (dt) {
    case FL_COMM_F32: return ((const float *)buf)[i];
    case FL_COMM_BF16: return fl_bf16_to_f32(((const uint16_t *)buf)[i]);
    default: return ((const int32_t *)buf)[i];
    }
}

static void *host(size_t n, fl_comm_dtype dt) {
    void *p = calloc(n ? n : 1, fl_comm_dtype_size(dt));
    assert_non_null(p);
    return p;
}

#define EXPECT_EQ(got, want, what, ...)                                                    \
    do {                                                                                   \
        double g_ = (got), w_ = (want);                                                    \
        if (g_ != w_)                                                                      \
            fail_msg("rank %d: " what ": got %g, expected %g", g_rank, __VA_ARGS__, g_, w_); \
    } while (0)

#define OK(call)                                                                           \
    do {                                                                                   \
        fl_status st_ = (call);                                                            \
        if (st_ != FL_OK)                                                                  \
            fail_msg("rank %d: %s: %s: %s", g_rank, #call, fl_status_str(st_), fl_error_msg()); \
    } while (0)

static fl_comm *g_comm;

static int group_setup(void **state) {
    g_comm = test_comm_new(MPI_COMM_WORLD);
    return g_comm ? 0 : -1;
}

static int group_teardown(void **state) {
    fl_comm_free(g_comm);
    return 0;
}

static void test_basics(void **state) {
    assert_int_equal(fl_comm_rank(g_comm), g_rank);
    assert_int_equal(fl_comm_size(g_comm), g_size);
    if (use_nccl()) {
        assert_int_equal(fl_comm_backend_of(g_comm), FL_COMM_BACKEND_NCCL);
        assert_non_null(fl_comm_stream(g_comm));
    } else {
        assert_int_equal(fl_comm_backend_of(g_comm), FL_COMM_BACKEND_MPI);
        assert_null(fl_comm_stream(g_comm));
    }
    OK(fl_comm_barrier(g_comm));
    OK(fl_comm_sync(g_comm));
    MPI_TEST_DONE();
}

static void test_all_reduce(void **state) {
    /* 8200: several blocks and a tail of the one-shot p2p all-reduce
     * (FL_P2P_AR=1 on GPUs); 40000 bf16 values: above its default 64 KB,
     * back to NCCL */
    const size_t counts[] = {0, 1, 37, 1000, 8200, 40000};
    for (int d = 0; d < N_DTYPES; d++) {
        fl_comm_dtype dt = k_dtypes[d];
        size_t es = fl_comm_dtype_size(dt);
        for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++) {
            size_t n = counts[k];
            for (int in_place = 0; in_place < 2; in_place++) {
                void *h = host(n, dt), *out = host(n, dt);
                for (size_t i = 0; i < n; i++) store(dt, h, i, val(dt, g_rank, i));
                void *s = tbuf_new(n * es), *r = in_place ? s : tbuf_new(n * es);
                tbuf_put(s, h, n * es);
                OK(fl_comm_all_reduce_sum(g_comm, s, r, n, dt));
                OK(fl_comm_sync(g_comm));
                tbuf_get(out, r, n * es);
                for (size_t i = 0; i < n; i++) {
                    double want = 0;
                    for (int q = 0; q < g_size; q++) want += val(dt, q, i);
                    EXPECT_EQ(load(dt, out, i), want, "all_reduce %s n %zu in_place %d [%zu]",
                              fl_comm_dtype_name(dt), n, in_place, i);
                }
                if (!in_place) tbuf_free(r);
                tbuf_free(s);
                free(h);
                free(out);
            }
        }
    }
    MPI_TEST_DONE();
}

/* Per-rank counts of one pattern; several patterns include zeros, also on
 * rank 0 and on the last rank. */
static size_t pattern(int p, int r) {
    switch (p) {
    case 0: return (size_t)((r * 5 + 3) % 4);     /* 3,0,1,2 */
    case 1: return (size_t)((r * 2 + 1) % 3);     /* 1,0,2,1 */
    case 2: return r == g_size - 1 ? 0 : 5;       /* last rank empty */
    case 3: return 7;                             /* equal counts */
    default: return 0;                            /* all empty */
    }
}
#define N_PATTERNS 5

static void test_all_gather(void **state) {
    size_t *counts = calloc((size_t)g_size, sizeof *counts);
    assert_non_null(counts);
    for (int d = 0; d < N_DTYPES; d++) {
        fl_comm_dtype dt = k_dtypes[d];
        size_t es = fl_comm_dtype_size(dt);
        for (int p = 0; p < N_PATTERNS; p++) {
            size_t total = 0;
            for (int r = 0; r < g_size; r++) total += counts[r] = pattern(p, r);
            size_t mine = counts[g_rank];
            void *h = host(mine, dt), *out = host(total, dt);
            for (size_t i = 0; i < mine; i++) store(dt, h, i, val(dt, g_rank, i));
            void *s = tbuf_new(mine * es), *r = tbuf_new(total * es);
            tbuf_put(s, h, mine * es);
            OK(fl_comm_all_gather(g_comm, s, r, counts, dt));
            OK(fl_comm_sync(g_comm));
            tbuf_get(out, r, total * es);
            size_t off = 0;
            for (int q = 0; q < g_size; q++)
                for (size_t i = 0; i < counts[q]; i++, off++)
                    EXPECT_EQ(load(dt, out, off), val(dt, q, i),
                              "all_gather %s pattern %d from rank %d [%zu]",
                              fl_comm_dtype_name(dt), p, q, i);
            tbuf_free(s);
            tbuf_free(r);
            free(h);
            free(out);
        }
    }
    free(counts);
    MPI_TEST_DONE();
}

static void test_reduce_scatter(void **state) {
    size_t *counts = calloc((size_t)g_size, sizeof *counts);
    assert_non_null(counts);
    for (int d = 0; d < N_DTYPES; d++) {
        fl_comm_dtype dt = k_dtypes[d];
        size_t es = fl_comm_dtype_size(dt);
        for (int p = 0; p < N_PATTERNS; p++) {
            size_t total = 0, off = 0;
            for (int r = 0; r < g_size; r++) {
                counts[r] = pattern(p, r);
                if (r < g_rank) off += counts[r];
                total += counts[r];
            }
            size_t mine = counts[g_rank];
            void *h = host(total, dt), *out = host(mine, dt);
            for (size_t i = 0; i < total; i++) store(dt, h, i, val(dt, g_rank, i));
            void *s = tbuf_new(total * es), *r = tbuf_new(mine * es);
            tbuf_put(s, h, total * es);
            OK(fl_comm_reduce_scatter(g_comm, s, r, counts, dt));
            OK(fl_comm_sync(g_comm));
            tbuf_get(out, r, mine * es);
            for (size_t i = 0; i < mine; i++) {
                double want = 0;
                for (int q = 0; q < g_size; q++) want += val(dt, q, off + i);
                EXPECT_EQ(load(dt, out, i), want, "reduce_scatter %s pattern %d [%zu]",
                          fl_comm_dtype_name(dt), p, i);
            }
            tbuf_free(s);
            tbuf_free(r);
            free(h);
            free(out);
        }
    }
    free(counts);
    MPI_TEST_DONE();
}

/* Rank `from` sends this many elements to rank `to`: 0..3, zero for some
 * pairs (sometimes the rank itself). */
static size_t a2a_count(int from, int to) { return (size_t)((from + 2 * to + 1) % 4); }
/* Element k of the part from → to: < 256, exact in bf16. */
static double a2a_val(int from, int to, size_t k) { return from * 64 + to * 8 + (double)k; }

static void test_all_to_all_v(void **state) {
    const double sentinel = -77;
    size_t n = (size_t)g_size;
    size_t *sc = calloc(n, sizeof *sc), *sd = calloc(n, sizeof *sd), *rc = calloc(n, sizeof *rc),
           *rd = calloc(n, sizeof *rd);
    assert_true(sc && sd && rc && rd);
    for (int d = 0; d < N_DTYPES; d++) {
        fl_comm_dtype dt = k_dtypes[d];
        size_t es = fl_comm_dtype_size(dt);
        /* send parts in reverse rank order with a 1-element gap between
         * them; receive parts in rank order with 2-element gaps */
        size_t stot = 0;
        for (int j = g_size - 1; j >= 0; j--) {
            sc[j] = a2a_count(g_rank, j);
            sd[j] = stot;
            stot += sc[j] + 1;
        }
        OK(fl_comm_exchange_counts(g_comm, sc, rc));
        size_t rtot = 0;
        for (int j = 0; j < g_size; j++) {
            EXPECT_EQ((double)rc[j], (double)a2a_count(j, g_rank), "exchanged count from rank %d",
                      j);
            rd[j] = rtot + 2;
            rtot += rc[j] + 2;
        }
        void *hs = host(stot, dt), *hr = host(rtot, dt);
        for (size_t i = 0; i < stot; i++) store(dt, hs, i, sentinel);
        for (size_t i = 0; i < rtot; i++) store(dt, hr, i, sentinel);
        for (int j = 0; j < g_size; j++)
            for (size_t k = 0; k < sc[j]; k++) store(dt, hs, sd[j] + k, a2a_val(g_rank, j, k));
        void *s = tbuf_new(stot * es), *r = tbuf_new(rtot * es);
        tbuf_put(s, hs, stot * es);
        tbuf_put(r, hr, rtot * es);
        OK(fl_comm_all_to_all_v(g_comm, s, sc, sd, r, rc, rd, dt));
        OK(fl_comm_sync(g_comm));
        tbuf_get(hr, r, rtot * es);
        size_t pos = 0;
        for (int j = 0; j < g_size; j++) {
            for (; pos < rd[j]; pos++)
                EXPECT_EQ(load(dt, hr, pos), sentinel, "all_to_all_v %s gap at %zu",
                          fl_comm_dtype_name(dt), pos);
            for (size_t k = 0; k < rc[j]; k++, pos++)
                EXPECT_EQ(load(dt, hr, pos), a2a_val(j, g_rank, k),
                          "all_to_all_v %s from rank %d [%zu]", fl_comm_dtype_name(dt), j, k);
        }
        tbuf_free(s);
        tbuf_free(r);
        free(hs);
        free(hr);
    }
    free(sc);
    free(sd);
    free(rc);
    free(rd);
    MPI_TEST_DONE();
}

static void test_broadcast(void **state) {
    const size_t counts[] = {0, 13};
    int roots[2] = {0, g_size - 1};
    for (int d = 0; d < N_DTYPES; d++) {
        fl_comm_dtype dt = k_dtypes[d];
        size_t es = fl_comm_dtype_size(dt);
        for (int k = 0; k < 2; k++)
            for (int ri = 0; ri < 2; ri++) {
                size_t n = counts[k];
                int root = roots[ri];
                void *h = host(n, dt);
                for (size_t i = 0; i < n; i++) store(dt, h, i, val(dt, g_rank, i));
                void *b = tbuf_new(n * es);
                tbuf_put(b, h, n * es);
                OK(fl_comm_broadcast(g_comm, b, n, root, dt));
                OK(fl_comm_sync(g_comm));
                tbuf_get(h, b, n * es);
                for (size_t i = 0; i < n; i++)
                    EXPECT_EQ(load(dt, h, i), val(dt, root, i), "broadcast %s root %d [%zu]",
                              fl_comm_dtype_name(dt), root, i);
                tbuf_free(b);
                free(h);
            }
    }
    MPI_TEST_DONE();
}

/* The host broadcast takes host memory with either implementation (the
 * step plan travels this way; an NCCL broadcast of a host pointer faults). */
static void test_broadcast_host(void **state) {
    for (int root = 0; root < g_size; root += g_size > 1 ? g_size - 1 : 1) {
        int32_t buf[37];
        for (int i = 0; i < 37; i++) buf[i] = g_rank * 1000 + i;
        OK(fl_comm_broadcast_host(g_comm, buf, 37, root, FL_COMM_I32));
        for (int i = 0; i < 37; i++)
            EXPECT_EQ(buf[i], root * 1000 + i, "broadcast_host root %d [%d]", root, i);
        OK(fl_comm_broadcast_host(g_comm, NULL, 0, root, FL_COMM_I32));
    }
    int32_t one = 0;
    assert_int_not_equal(fl_comm_broadcast_host(g_comm, &one, 1, g_size, FL_COMM_I32), FL_OK);
    MPI_TEST_DONE();
}

/* Host-side agreement: a flag true on every rank but one, and the group's
 * smallest number (what ranks must share, e.g. the decode-graph buckets). */
static void test_agree(void **state) {
    bool all = true;
    OK(fl_comm_agree(g_comm, g_rank != g_size - 1 || g_size == 1, &all));
    EXPECT_EQ(all, g_size == 1, "agree with rank %d saying no", g_size - 1);
    OK(fl_comm_agree(g_comm, true, &all));
    EXPECT_EQ(all, true, "agree with all %d ranks saying yes", g_size);
    int least = -1;
    OK(fl_comm_agree_min(g_comm, 100 - 7 * g_rank, &least));
    EXPECT_EQ(least, 100 - 7 * (g_size - 1), "agree_min over %d ranks", g_size);
    assert_int_not_equal(fl_comm_agree_min(NULL, 1, &least), FL_OK);
    MPI_TEST_DONE();
}

/* Bad arguments are refused locally, before any communication, with a
 * message naming the call. */
static void test_bad_args(void **state) {
    size_t *counts = calloc((size_t)g_size, sizeof *counts);
    assert_non_null(counts);
    float x[4] = {0};
    fl_error_clear();
    assert_int_equal(fl_comm_all_reduce_sum(g_comm, NULL, x, 4, FL_COMM_F32), FL_ERR_INVALID_ARG);
    assert_non_null(strstr(fl_error_msg(), "all_reduce_sum"));
    assert_int_equal(fl_comm_all_reduce_sum(g_comm, x, x, 4, (fl_comm_dtype)9),
                     FL_ERR_INVALID_ARG);
    assert_int_equal(fl_comm_all_reduce_sum(NULL, x, x, 4, FL_COMM_F32), FL_ERR_INVALID_ARG);
    assert_int_equal(fl_comm_broadcast(g_comm, x, 4, g_size, FL_COMM_F32), FL_ERR_INVALID_ARG);
    assert_non_null(strstr(fl_error_msg(), "root"));
    assert_int_equal(fl_comm_broadcast(g_comm, x, 4, -1, FL_COMM_F32), FL_ERR_INVALID_ARG);
    assert_int_equal(fl_comm_all_gather(g_comm, x, x, NULL, FL_COMM_F32), FL_ERR_INVALID_ARG);
    counts[g_rank] = 3;
    assert_int_equal(fl_comm_all_gather(g_comm, NULL, x, counts, FL_COMM_F32),
                     FL_ERR_INVALID_ARG);
    assert_int_equal(fl_comm_reduce_scatter(g_comm, x, NULL, counts, FL_COMM_F32),
                     FL_ERR_INVALID_ARG);
    counts[0] = SIZE_MAX / 2;
    assert_int_equal(fl_comm_all_gather(g_comm, x, x, counts, FL_COMM_F32), FL_ERR_INVALID_ARG);
    assert_int_equal(fl_comm_all_to_all_v(g_comm, x, NULL, counts, x, counts, counts, FL_COMM_F32),
                     FL_ERR_INVALID_ARG);
    assert_int_equal(fl_comm_exchange_counts(g_comm, NULL, counts), FL_ERR_INVALID_ARG);
    assert_int_equal(fl_comm_barrier(NULL), FL_ERR_INVALID_ARG);
    fl_comm_free(NULL); /* no-op */
    free(counts);
    /* the communicator still works after refused calls */
    OK(fl_comm_barrier(g_comm));
    MPI_TEST_DONE();
}

/* Zero-length calls with NULL buffers, as comm.h allows. */
static void test_zero_length_null(void **state) {
    size_t *z = calloc((size_t)g_size, sizeof *z);
    assert_non_null(z);
    for (int d = 0; d < N_DTYPES; d++) {
        fl_comm_dtype dt = k_dtypes[d];
        OK(fl_comm_all_reduce_sum(g_comm, NULL, NULL, 0, dt));
        OK(fl_comm_all_gather(g_comm, NULL, NULL, z, dt));
        OK(fl_comm_reduce_scatter(g_comm, NULL, NULL, z, dt));
        OK(fl_comm_all_to_all_v(g_comm, NULL, z, z, NULL, z, z, dt));
        OK(fl_comm_broadcast(g_comm, NULL, 0, 0, dt));
    }
    OK(fl_comm_sync(g_comm));
    free(z);
    MPI_TEST_DONE();
}

/* Communicators over sub-groups (odd/even ranks): collectives stay inside
 * the group. */
static void test_sub_communicator(void **state) {
    MPI_Comm half;
    assert_int_equal(MPI_Comm_split(MPI_COMM_WORLD, g_rank % 2, g_rank, &half), MPI_SUCCESS);
    fl_comm *c = test_comm_new(half);
    int32_t h = g_rank, out = -1;
    void *b = tbuf_new(4);
    tbuf_put(b, &h, 4);
    OK(fl_comm_all_reduce_sum(c, b, b, 1, FL_COMM_I32));
    OK(fl_comm_sync(c));
    tbuf_get(&out, b, 4);
    int want = 0;
    for (int q = g_rank % 2; q < g_size; q += 2) want += q;
    EXPECT_EQ(out, want, "sum of world ranks in parity group %d", g_rank % 2);
    tbuf_free(b);
    fl_comm_free(c);
    MPI_Comm_free(&half);
    MPI_TEST_DONE();
}

/* Creating an NCCL communicator is collective: when one rank cannot set up
 * its GPU (here the last rank asks for device 9999; on a machine without a
 * GPU every rank fails) every rank must return an error, none may wait in
 * ncclCommInitRank. Without NCCL in the build: FL_ERR_UNSUPPORTED. */
static void test_nccl_init_failure_is_collective(void **state) {
    fl_comm *c = (fl_comm *)1;
    int dev = g_rank == g_size - 1 ? 9999 : 0;
    fl_error_clear();
    fl_status st = fl_comm_init_nccl(MPI_COMM_WORLD, dev, NULL, &c);
    assert_null(c);
#ifdef FL_HAVE_NCCL
    if (g_rank == g_size - 1) {
        if (st != FL_ERR_CUDA) fail_msg("rank %d: %s: %s", g_rank, fl_status_str(st), fl_error_msg());
        assert_non_null(strstr(fl_error_msg(), "cudaSetDevice"));
    } else if (st != FL_ERR_CUDA && st != FL_ERR_NCCL) {
        fail_msg("rank %d: %s: %s", g_rank, fl_status_str(st), fl_error_msg());
    }
#else
    assert_int_equal(st, FL_ERR_UNSUPPORTED);
    assert_non_null(strstr(fl_error_msg(), "without CUDA"));
#endif
    /* nobody is stuck: all ranks meet here */
    assert_int_equal(MPI_Barrier(MPI_COMM_WORLD), MPI_SUCCESS);
    MPI_TEST_DONE();
}

/* FL_TEST_FAIL_RANK=r: rank r fails here, before the collective the others
 * enter; the harness must end the job instead of hanging. */
static void test_failure_propagates(void **state) {
    mpi_injected_failure();
    int32_t one = 1, n = 0;
    MPI_Allreduce(&one, &n, 1, MPI_INT32_T, MPI_SUM, MPI_COMM_WORLD);
    assert_int_equal(n, g_size);
    MPI_TEST_DONE();
}

int main(int argc, char **argv) {
    const struct CMUnitTest tests[] = {
        MPI_TEST(test_basics),          MPI_TEST(test_all_reduce),
        MPI_TEST(test_all_gather),      MPI_TEST(test_reduce_scatter),
        MPI_TEST(test_all_to_all_v),    MPI_TEST(test_broadcast),
        MPI_TEST(test_broadcast_host),  MPI_TEST(test_agree),
        MPI_TEST(test_bad_args),        MPI_TEST(test_sub_communicator),
        MPI_TEST(test_nccl_init_failure_is_collective), MPI_TEST(test_zero_length_null),
        MPI_TEST(test_failure_propagates),
    };
    /* the communicator is made once per rank, around the whole group */
    return mpi_run_tests_fixture(&argc, &argv, "mpi_test_comm", tests,
                                 sizeof tests / sizeof tests[0], group_setup, group_teardown);
}
