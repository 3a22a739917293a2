/*
 * replay_main.c — runs a fuzz target's LLVMFuzzerTestOneInput on files,
 * without libFuzzer, so every seed and every input that once crashed a
 * parser is a regression test of the normal (gcc, sanitizer) build.
 *
 *   fuzz_<name>_replay DIR_OR_FILE...
 *
 * A folder's files are replayed in name order (hidden files skipped); a
 * folder that does not exist counts as empty (a target may have no crash on
 * record), but replaying nothing at all fails: a test must test something.
 * A crash or sanitizer report ends the process, naming the file first.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int replay_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "replay: cannot open %s: %s\n", path, strerror(errno));
        return -1;
    }
    size_t cap = 4096, n = 0;
    uint8_t *buf = malloc(cap);
    for (;;) {
        if (!buf) {
            fclose(f);
            fprintf(stderr, "replay: out of memory reading %s\n", path);
            return -1;
        }
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap) break;
        uint8_t *nb = realloc(buf, cap * 2);
        if (!nb) free(buf);
        buf = nb;
        cap *= 2;
    }
    int err = ferror(f);
    fclose(f);
    if (err) {
        free(buf);
        fprintf(stderr, "replay: read error on %s\n", path);
        return -1;
    }
    /* the name first, so a crash report says which input it was */
    fprintf(stderr, "replay: %s (%zu bytes)\n", path, n);
    /* an exact-size copy, so a read past the end hits ASan's redzone as it
     * would under libFuzzer */
    uint8_t *exact = malloc(n ? n : 1);
    if (!exact) {
        free(buf);
        return -1;
    }
    memcpy(exact, buf, n);
    free(buf);
    LLVMFuzzerTestOneInput(exact, n);
    free(exact);
    return 0;
}

static int by_name(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int replay_dir(const char *dir, long *count) {
    DIR *d = opendir(dir);
    if (!d) {
        if (errno == ENOENT) {
            fprintf(stderr, "replay: %s does not exist (nothing to replay there)\n", dir);
            return 0;
        }
        fprintf(stderr, "replay: cannot open %s: %s\n", dir, strerror(errno));
        return -1;
    }
    char **names = NULL;
    size_t n = 0;
    struct dirent *e;
    int rc = 0;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char **nn = realloc(names, (n + 1) * sizeof *nn);
        char *path = NULL;
        if (!nn || asprintf(&path, "%s/%s", dir, e->d_name) < 0) {
            if (nn) names = nn;
            rc = -1;
            break;
        }
        names = nn;
        names[n++] = path;
    }
    closedir(d);
    qsort(names, n, sizeof *names, by_name);
    for (size_t i = 0; i < n; i++) {
        struct stat st;
        if (rc == 0 && stat(names[i], &st) == 0 && S_ISREG(st.st_mode)) {
            rc = replay_file(names[i]);
            if (rc == 0) (*count)++;
        }
        free(names[i]);
    }
    free(names);
    return rc;
}

int main(int argc, char **argv) {
    long count = 0;
    for (int i = 1; i < argc; i++) {
        struct stat st;
        int rc;
        if (stat(argv[i], &st) == 0 && S_ISREG(st.st_mode)) {
            rc = replay_file(argv[i]);
            if (rc == 0) count++;
        } else {
            rc = replay_dir(argv[i], &count);
        }
        if (rc != 0) return 1;
    }
    if (count == 0) {
        fprintf(stderr, "replay: no input files found: nothing was tested\n");
        return 1;
    }
    printf("replay: %ld inputs replayed without a crash\n", count);
    return 0;
}
