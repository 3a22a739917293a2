/*
 * fuzz_config_file.c — libFuzzer target for the `--config FILE.yaml` reader
 * (launcher/config_file.c, libyaml underneath): one input is one YAML file;
 * its first byte picks the mode (plain subcommand or `flotilla slurm`,
 * which reads the slurm: section) and is not part of the YAML.
 *
 * The option table is generate's and slurm's kind: options with values and
 * flags. Any status is fine for malformed input; a crash, a sanitizer report
 * or a hang is a bug. On success every flag holds "1" or nothing and every
 * value is a NUL-terminated string; a flag given "on the command line"
 * (preset here) is never overwritten by the file.
 */
#define _GNU_SOURCE
#include "fuzz/fuzz_memfd.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "launcher/cli.h"

enum { N_OPTS = 16 };

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    bool slurm = data[0] & 1;
    char path[64];
    int fd = fuzz_memfd(data + 1, size - 1, path);
    if (fd < 0) return 0;

    static const char preset[] = "from-the-command-line";
    const char *v[N_OPTS] = {0};
    v[2] = preset; /* --output given as a flag: the file must not override it */
    const fl_cli_opt opts[N_OPTS + 1] = {
        {"model", true, &v[0], ""},          {"input", true, &v[1], ""},
        {"output", true, &v[2], ""},         {"tp", true, &v[3], ""},
        {"ep", true, &v[4], ""},             {"dp", true, &v[5], ""},
        {"max-num-seqs", true, &v[6], ""},   {"verbose", false, &v[7], ""},
        {"resume", false, &v[8], ""},        {"nodes", true, &v[9], ""},
        {"gpus-per-node", true, &v[10], ""}, {"partition", true, &v[11], ""},
        {"time", true, &v[12], ""},          {"dry-run", false, &v[13], ""},
        {"config", true, &v[14], ""},        {"help", false, &v[15], ""},
        {0},
    };
    if (fl_cli_config_load_mode(path, opts, slurm) == FL_OK) {
        if (v[2] != preset) abort();
        if (v[14] || v[15]) abort(); /* config and help are never read from a file */
        for (int i = 0; i < N_OPTS; i++) {
            if (!v[i]) continue;
            if (!opts[i].has_arg && strcmp(v[i], "1")) abort();
            (void)strlen(v[i]);
        }
    }
    fl_cli_config_values_free();
    close(fd);
    return 0;
}
