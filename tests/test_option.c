/*
 * test_option.c — the option registry (core/option.h): defaults, the
 * environment read once, malformed values refused by name, overrides, and
 * the listing naming every option.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/option.h"

static void test_env_read_and_override(void **state) {
    (void)state;
    /* set before the registry's first use: it reads the environment once */
    setenv("FL_SLURM_TEMPLATE", "/tmp/my.sbatch.in", 1);
    assert_int_equal(fl_opt_init(), FL_OK);
    assert_true(fl_opt_is_set(FL_OPT_SLURM_TEMPLATE));
    assert_string_equal(fl_opt_str(FL_OPT_SLURM_TEMPLATE), "/tmp/my.sbatch.in");
    setenv("FL_SLURM_TEMPLATE", "/elsewhere", 1); /* read once: no change */
    assert_string_equal(fl_opt_str(FL_OPT_SLURM_TEMPLATE), "/tmp/my.sbatch.in");
    assert_int_equal(fl_opt_override(FL_OPT_SLURM_TEMPLATE, "/x"), FL_OK);
    assert_string_equal(fl_opt_str(FL_OPT_SLURM_TEMPLATE), "/x");
    assert_int_equal(fl_opt_override(FL_OPT_SLURM_TEMPLATE, NULL), FL_OK); /* back to default */
    assert_false(fl_opt_is_set(FL_OPT_SLURM_TEMPLATE));
    assert_null(fl_opt_str(FL_OPT_SLURM_TEMPLATE));
}

/* Every BOOL/INT option's default parses and an override of the wrong form
 * is refused with the variable's name in the message. */
static void test_kinds_and_bad_values(void **state) {
    (void)state;
    for (int i = 0; i < FL_OPT_COUNT; i++) {
        assert_non_null(fl_opt_env(i));
        assert_true(strncmp(fl_opt_env(i), "FL_", 3) == 0);
        assert_true(strlen(fl_opt_doc(i)) > 10);
        const char *d = fl_opt_default(i);
        if (d) assert_int_equal(fl_opt_override(i, d), FL_OK);
        assert_int_equal(fl_opt_override(i, NULL), FL_OK);
    }
    for (int i = 0; i < FL_OPT_COUNT; i++) {
        fl_status st = fl_opt_override(i, "not-a-number");
        /* STR options take any text; BOOL/INT refuse it */
        if (st != FL_OK) assert_non_null(strstr(fl_error_msg(), fl_opt_env(i)));
        fl_opt_override(i, NULL);
    }
}

static void test_listing_names_every_option(void **state) {
    (void)state;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_non_null(f);
    fl_opt_print(f);
    fclose(f);
    for (int i = 0; i < FL_OPT_COUNT; i++) {
        assert_non_null(strstr(buf, fl_opt_env(i)));
        assert_non_null(strstr(buf, fl_opt_doc(i)));
    }
    free(buf);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_env_read_and_override),
        cmocka_unit_test(test_kinds_and_bad_values),
        cmocka_unit_test(test_listing_names_every_option),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
