/*
 * test_kv_disk.c — the disk tier's block files (runtime/engine/kv_disk.h):
 * an encoded file decodes to what was written; a torn (short, or one byte
 * changed) or foreign (other magic, fingerprint, geometry, rank, name) file
 * is refused with a message saying why; fl_kv_disk_open on a folder keeps
 * the good files, reports the others and deletes nothing; the index matches
 * hash, parent hash and tokens, and notes blocks once; a block persisted
 * from a CPU cache reads back into another block bit for bit, through a
 * temporary file of its writer's own (a leftover of that name is stepped
 * around, and none is left behind); a dead writer's temporary file is
 * deleted when the folder is opened.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <dirent.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "kernels/backend.h"
#include "runtime/engine/kv_disk.h"

static const fl_kv_disk_geom G = {.fingerprint = 0x1234abcd5678ef01ull, .block_size = 5, .n_layers = 3,
                                  .layer_bytes = 40, .tp_rank = 1};
static const int32_t TOK[5] = {7, 11, 13, 17, 19};

/* A file image of G for block hash with a payload of counting bytes. */
static char *image(const fl_kv_disk_geom *g, uint64_t hash) {
    const size_t n = fl_kv_disk_file_bytes(g);
    char *b = malloc(n);
    assert_non_null(b);
    unsigned char *pay = fl_kv_disk_payload(g, b);
    for (size_t i = 0; i < 2 * (size_t)g->n_layers * g->layer_bytes; i++) pay[i] = (unsigned char)(i * 7 + 1);
    fl_kv_disk_encode(g, hash, 99, TOK, b);
    return b;
}

static void refused(const fl_kv_disk_geom *g, const char *b, size_t n, const uint64_t *want, const char *why) {
    uint64_t h, p;
    const int32_t *t;
    assert_int_equal(fl_kv_disk_decode(g, b, n, want, &h, &p, &t), FL_ERR_FORMAT);
    if (!strstr(fl_error_msg(), why)) fail_msg("message '%s' lacks '%s'", fl_error_msg(), why);
}

static void test_round_trip(void **state) {
    (void)state;
    const size_t n = fl_kv_disk_file_bytes(&G);
    assert_true(n > 2 * 3 * 40 + 5 * 4);
    char *b = image(&G, 42);
    uint64_t h = 0, p = 0, want = 42;
    const int32_t *t = NULL;
    assert_int_equal(fl_kv_disk_decode(&G, b, n, &want, &h, &p, &t), FL_OK);
    assert_true(h == 42 && p == 99);
    assert_memory_equal(t, TOK, sizeof TOK);
    assert_int_equal(((unsigned char *)fl_kv_disk_payload(&G, b))[10], (unsigned char)71);
    free(b);
}

static void test_torn(void **state) {
    (void)state;
    const size_t n = fl_kv_disk_file_bytes(&G);
    char *b = image(&G, 42);
    refused(&G, b, n - 1, NULL, "torn");
    refused(&G, b, 20, NULL, "torn");
    refused(&G, b, 4, NULL, "no magic");
    b[n / 2] ^= 1; /* one payload bit */
    refused(&G, b, n, NULL, "checksum");
    b[n / 2] ^= 1;
    b[70] ^= 1; /* a token id */
    refused(&G, b, n, NULL, "checksum");
    free(b);
}

static void test_foreign(void **state) {
    (void)state;
    const size_t n = fl_kv_disk_file_bytes(&G);
    char *b = image(&G, 42);
    uint64_t other = 43;
    refused(&G, b, n, &other, "its name says");
    fl_kv_disk_geom g = G;
    g.fingerprint ^= 1;
    refused(&g, b, n, NULL, "another cache");
    g = G, g.tp_rank = 0;
    refused(&g, b, n, NULL, "geometry");
    g = G, g.layer_bytes = 48;
    refused(&g, b, n, NULL, "geometry");
    g = G, g.n_layers = 2;
    refused(&g, b, n, NULL, "geometry");
    b[0] ^= 0x20;
    refused(&G, b, n, NULL, "not a flotilla KV block file");
    free(b);
}

static void put(const char *path, const void *b, size_t n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(b, 1, n, f), n);
    fclose(f);
}

static void test_open_folder(void **state) {
    (void)state;
    char root[] = "/tmp/fl_kv_disk_XXXXXX", dir[128], path[256];
    assert_non_null(mkdtemp(root));
    snprintf(dir, sizeof dir, "%s/%016llx", root, (unsigned long long)G.fingerprint);
    assert_int_equal(mkdir(dir, 0777), 0);
    const size_t n = fl_kv_disk_file_bytes(&G);
    char *b = image(&G, 0xaa);
    snprintf(path, sizeof path, "%s/00000000000000aa.r1", dir); /* good */
    put(path, b, n);
    snprintf(path, sizeof path, "%s/00000000000000aa.r0", dir); /* another rank's: not read */
    put(path, "x", 1);
    snprintf(path, sizeof path, "%s/00000000000000bb.r1", dir); /* torn */
    put(path, b, n / 2);
    snprintf(path, sizeof path, "%s/00000000000000cc.r1", dir); /* another block's contents */
    put(path, b, n);
    snprintf(path, sizeof path, "%s/notes.txt", dir);
    put(path, "hello", 5);
    fl_kv_disk d;
    assert_int_equal(fl_kv_disk_open(root, &G, NULL, 0, &d), FL_OK);
    assert_int_equal(fl_kv_disk_n_loadable(&d), 1);
    assert_true(fl_kv_disk_find(&d, 0xaa, 99, TOK));
    int32_t tok2[5] = {7, 11, 13, 17, 20};
    assert_false(fl_kv_disk_find(&d, 0xaa, 98, TOK));  /* another parent */
    assert_false(fl_kv_disk_find(&d, 0xaa, 99, tok2)); /* other tokens */
    assert_false(fl_kv_disk_find(&d, 0xbb, 99, TOK));  /* the torn one */
    /* noting: once per hash; noted blocks are not readable in this job */
    assert_false(fl_kv_disk_note(&d, 0xaa, 99, TOK));
    assert_true(fl_kv_disk_note(&d, 0xdd, 99, TOK));
    assert_false(fl_kv_disk_note(&d, 0xdd, 99, TOK));
    assert_false(fl_kv_disk_find(&d, 0xdd, 99, TOK));
    for (int i = 0; i < 1000; i++) assert_true(fl_kv_disk_note(&d, 0x1000 + (uint64_t)i, 0, TOK)); /* grows */
    assert_true(fl_kv_disk_find(&d, 0xaa, 99, TOK));
    fl_kv_disk_close(&d);
    fl_kv_disk_close(&d); /* a zeroed one: no-op */
    /* nothing was deleted */
    snprintf(path, sizeof path, "%s/00000000000000bb.r1", dir);
    assert_int_equal(access(path, F_OK), 0);
    free(b);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", root);
    assert_int_equal(system(cmd), 0);
}

static int count_entries(const char *dir) {
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

static void test_persist_load(void **state) {
    (void)state;
    char root[] = "/tmp/fl_kv_disk_XXXXXX", dir[128], path[512], host[64] = "host";
    assert_non_null(mkdtemp(root));
    fl_backend *be = NULL;
    assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
    fl_kv_cache kv;
    /* f32 records of kv_dim 2: one block of one layer is G.layer_bytes */
    assert_int_equal(fl_kv_cache_init(be, G.n_layers, 4, G.block_size, 2, &kv), FL_OK);
    const size_t lb = G.layer_bytes;
    for (int l = 0; l < G.n_layers; l++)
        for (size_t i = 0; i < lb; i++) {
            ((unsigned char *)kv.k[l])[2 * lb + i] = (unsigned char)(l * 31 + i);
            ((unsigned char *)kv.v[l])[2 * lb + i] = (unsigned char)(l * 17 + 3 * i + 1);
        }
    /* temporary files: one of a live writer with this process's id (it
     * stays, and this writer steps around its name), one of a writer that
     * is gone (opening the folder deletes it) */
    snprintf(dir, sizeof dir, "%s/%016llx", root, (unsigned long long)G.fingerprint);
    assert_int_equal(mkdir(dir, 0777), 0);
    (void)gethostname(host, sizeof host - 1);
    host[sizeof host - 1] = 0;
    const pid_t dead = fork();
    if (dead == 0) _exit(0);
    assert_true(dead > 0);
    assert_int_equal(waitpid(dead, NULL, 0), dead);
    char orphan[512];
    snprintf(orphan, sizeof orphan, "%s/00000000000000ee.r1.tmp.%s.%ld.0", dir, host, (long)dead);
    put(orphan, "dead", 4);
    snprintf(path, sizeof path, "%s/00000000000000ee.r1.tmp.%s.%ld.0", dir, host, (long)getpid());
    put(path, "left", 4);
    fl_kv_disk d;
    assert_int_equal(fl_kv_disk_open(root, &G, NULL, 0, &d), FL_OK);
    assert_int_equal(access(orphan, F_OK), -1);
    assert_int_equal(access(path, F_OK), 0);
    fl_step_plan p;
    memset(&p, 0, sizeof p);
    assert_int_equal(fl_step_plan_resize(&p, 0, 0, 1, 0, G.block_size), FL_OK);
    assert_int_equal(fl_step_plan_set_swaps(&p, 0, 0), FL_OK);
    assert_int_equal(fl_step_plan_set_disk(&p, 1, 1), FL_OK);
    p.persist[0] = 2; /* block 2 is 0xee, parent 99 */
    fl_plan_put_u64(p.persist + 1, 0xee);
    fl_plan_put_u64(p.persist + 3, 99);
    memcpy(p.persist + 5, TOK, sizeof TOK);
    assert_int_equal(fl_kv_disk_persist(&d, &kv, &p), FL_OK);
    assert_int_equal(d.n_write_errors, 0);
    assert_int_equal(count_entries(dir), 2); /* the block and the leftover */
    snprintf(path, sizeof path, "%s/00000000000000ee.r1", dir);
    assert_int_equal(access(path, F_OK), 0);
    p.disk_in[0] = 3; /* read it into block 3 */
    fl_plan_put_u64(p.disk_in + 1, 0xee);
    assert_int_equal(fl_kv_disk_load(&d, &kv, &p), FL_OK);
    for (int l = 0; l < G.n_layers; l++) {
        assert_memory_equal((char *)kv.k[l] + 3 * lb, (char *)kv.k[l] + 2 * lb, lb);
        assert_memory_equal((char *)kv.v[l] + 3 * lb, (char *)kv.v[l] + 2 * lb, lb);
    }
    /* a block nobody wrote fails the load, naming its file */
    fl_plan_put_u64(p.disk_in + 1, 0xef);
    assert_int_equal(fl_kv_disk_load(&d, &kv, &p), FL_ERR_IO);
    assert_non_null(strstr(fl_error_msg(), "00000000000000ef.r1"));
    fl_step_plan_free(&p);
    fl_kv_disk_close(&d);
    fl_kv_cache_free(&kv);
    fl_backend_free(be);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", root);
    assert_int_equal(system(cmd), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_torn),
        cmocka_unit_test(test_foreign),
        cmocka_unit_test(test_open_folder),
        cmocka_unit_test(test_persist_load),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
