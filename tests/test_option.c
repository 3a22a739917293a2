/*
 * test_option.c — the option registry (core/option.h): defaults, the
 * environment read once, malformed values refused by name (all of them
 * counted), choices by name or index, overrides, the listing naming every
 * option, and the table of external variables.
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
#include "parallel/comm.h"
#include "runtime/engine/engine.h"
#include "runtime/model/forward_moe.h"

static void test_env_read_and_override(void **state) {
    (void)state;
    /* set before the registry's first use: it reads the environment once */
    setenv("FL_SLURM_TEMPLATE", "/tmp/my.sbatch.in", 1);
    setenv("FL_STEP_TIMING", "maybe", 1);     /* malformed: named, the default kept */
    setenv("FL_MOE_MICRO_BATCHES", "3x", 1);  /* malformed too: counted */
    setenv("FL_MOE_OVERLAP", "Serial", 1);    /* a choice by name, any case */
    setenv("FL_FUSE", "2", 1);                /* a choice by index */
    setenv("FL_CUDA_GRAPHS", "", 1);          /* empty: unset */
    setenv("FL_P2P_AR", "on", 1);
    setenv("FL_GREEDY_ON_DEVICE", "0", 1);
    /* the config structs' defaults are the declared ones, whatever the
     * environment says */
    fl_engine_config ec;
    fl_engine_config_default(&ec);
    assert_true(ec.greedy_on_device);
    assert_false(ec.fwd.step_timing);
    assert_int_equal(ec.fwd.moe_overlap, FL_MOE_OVERLAP_OFF);
    fl_comm_config cc;
    fl_comm_config_default(&cc);
    assert_false(cc.p2p_allreduce);
    assert_int_equal(cc.p2p_allreduce_max_bytes, 65536);
    assert_int_equal(fl_opt_init(), FL_ERR_INVALID_ARG);
    assert_non_null(strstr(fl_error_msg(), "FL_STEP_TIMING=maybe"));
    assert_non_null(strstr(fl_error_msg(), "1 more malformed"));
    assert_int_equal(fl_opt_init(), FL_ERR_INVALID_ARG); /* the same status again */
    assert_false(fl_opt_is_set(FL_OPT_STEP_TIMING));
    assert_false(fl_opt_bool(FL_OPT_STEP_TIMING));
    assert_int_equal(fl_opt_int(FL_OPT_MOE_MICRO_BATCHES), 2);
    fl_opt_info info;
    fl_opt_info_get(FL_OPT_MOE_MICRO_BATCHES, &info);
    assert_true(info.invalid);
    assert_false(info.from_env);
    assert_string_equal(info.env_text, "3x");
    assert_int_equal(fl_opt_int(FL_OPT_MOE_OVERLAP), 2);
    assert_string_equal(fl_opt_str(FL_OPT_MOE_OVERLAP), "serial");
    assert_int_equal(fl_opt_num(FL_OPT_MOE_OVERLAP), 2);
    assert_string_equal(fl_opt_str(FL_OPT_FUSE), "qkv");
    assert_false(fl_opt_is_set(FL_OPT_CUDA_GRAPHS));
    assert_true(fl_opt_bool(FL_OPT_CUDA_GRAPHS));
    assert_true(fl_opt_bool(FL_OPT_P2P_AR));
    assert_false(fl_opt_bool(FL_OPT_GREEDY_ON_DEVICE));
    fl_engine_config_default(&ec); /* still the declared default */
    assert_true(ec.greedy_on_device);
    assert_false(fl_opt_default_bool(FL_OPT_P2P_AR)); /* the declared default, not the environment */
    assert_int_equal(fl_opt_default_int(FL_OPT_MOE_OVERLAP), 0);
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

/* Flags and config keys parse as their variable would. */
static void test_parse(void **state) {
    (void)state;
    long v = -1;
    assert_true(fl_opt_parse(FL_OPT_CUDA_GRAPHS, "off", &v));
    assert_int_equal(v, 0);
    assert_true(fl_opt_parse(FL_OPT_CUDA_GRAPHS, "YES", &v));
    assert_int_equal(v, 1);
    assert_false(fl_opt_parse(FL_OPT_CUDA_GRAPHS, "maybe", &v));
    assert_true(fl_opt_parse(FL_OPT_MOE_OVERLAP, "alternate", &v));
    assert_int_equal(v, 3);
    assert_true(fl_opt_parse(FL_OPT_MOE_OVERLAP, "1", &v));
    assert_int_equal(v, 1);
    assert_false(fl_opt_parse(FL_OPT_MOE_OVERLAP, "4", &v)); /* no fifth choice */
    assert_false(fl_opt_parse(FL_OPT_MOE_OVERLAP, "of", &v));
    assert_false(fl_opt_parse(FL_OPT_MOE_MICRO_BATCHES, "", &v));
    assert_true(fl_opt_parse(FL_OPT_MOE_MICRO_BATCHES, "-7", &v));
    assert_int_equal(v, -7);
}

/* Launcher variables are read live, and only those in the table. */
static void test_external(void **state) {
    (void)state;
    assert_true(fl_opt_external_count() >= 13);
    for (int i = 0; i < fl_opt_external_count(); i++) {
        assert_non_null(fl_opt_external_name(i));
        assert_true(strlen(fl_opt_external_doc(i)) > 10);
    }
    assert_null(fl_opt_external_name(fl_opt_external_count()));
    setenv("SLURM_LOCALID", "3", 1);
    assert_string_equal(fl_opt_external("SLURM_LOCALID"), "3");
    unsetenv("SLURM_LOCALID");
    assert_null(fl_opt_external("SLURM_LOCALID"));
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
    /* the malformed variable of the first test is shown as such */
    assert_non_null(strstr(buf, "FL_STEP_TIMING=maybe does not parse"));
    free(buf);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_env_read_and_override),
        cmocka_unit_test(test_kinds_and_bad_values),
        cmocka_unit_test(test_parse),
        cmocka_unit_test(test_external),
        cmocka_unit_test(test_listing_names_every_option),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
