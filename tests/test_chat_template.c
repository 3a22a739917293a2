/*
 * test_chat_template.c — renders every conversation of tests/chat/ (every fixture)
 * (jinja2 renderings of real model templates, made by
 * scripts/make_chat_fixtures.py) and compares byte for byte; cases where the
 * Jinja template raises must fail here too. Plus detection, default-system
 * extraction edge cases and the deliberate deviations from Jinja.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "runtime/tok/chat_template.h"

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        fclose(f);
        return NULL;
    }
    buf[n] = 0;
    fclose(f);
    return buf;
}

/* Prints the first differing byte, so a failure says where. */
static void assert_same(const char *fixture, const char *cname, const char *want, const char *got) {
    if (strcmp(want, got) == 0) return;
    size_t i = 0;
    while (want[i] && want[i] == got[i]) i++;
    fail_msg("%s/%s: differs at byte %zu\n  want: %s\n  got:  %s", fixture, cname, i, want + i,
             got + i);
}

static int run_fixture(const char *name, fl_chat_family want_family) {
    char path[1024];
    snprintf(path, sizeof path, "%s/chat/%s.json", FL_TEST_DATA, name);
    char *text = slurp(path);
    if (!text) fail_msg("cannot read %s", path);
    cJSON *doc = cJSON_Parse(text);
    assert_non_null(doc);
    const char *tpl = cJSON_GetObjectItem(doc, "template")->valuestring;
    const char *bos = cJSON_GetObjectItem(doc, "bos_token")->valuestring;
    assert_int_equal(fl_chat_template_detect(tpl), want_family);
    int checked = 0;
    const cJSON *c;
    cJSON_ArrayForEach(c, cJSON_GetObjectItem(doc, "cases")) {
        const char *cname = cJSON_GetObjectItem(c, "name")->valuestring;
        const cJSON *msgs = cJSON_GetObjectItem(c, "messages");
        size_t n = (size_t)cJSON_GetArraySize(msgs);
        fl_chat_message *m = calloc(n, sizeof *m);
        size_t i = 0;
        const cJSON *jm;
        cJSON_ArrayForEach(jm, msgs) {
            m[i].role = cJSON_GetObjectItem(jm, "role")->valuestring;
            m[i].content = cJSON_GetObjectItem(jm, "content")->valuestring;
            i++;
        }
        char *out = NULL;
        fl_status st = fl_chat_template_render(fl_chat_template_detect(tpl), tpl, m, n, bos, &out);
        const cJSON *expected = cJSON_GetObjectItem(c, "expected");
        if (expected) {
            if (st != FL_OK) fail_msg("%s/%s: render failed: %s", name, cname, fl_error_msg());
            assert_same(name, cname, expected->valuestring, out);
        } else {
            /* Jinja raised: so must we, naming the family. */
            if (st != FL_ERR_INVALID_ARG)
                fail_msg("%s/%s: Jinja raises (%s) but render returned %s", name, cname,
                         cJSON_GetObjectItem(c, "error")->valuestring, fl_status_str(st));
            assert_non_null(strstr(fl_error_msg(), "mistral"));
        }
        free(out);
        free(m);
        checked++;
    }
    cJSON_Delete(doc);
    free(text);
    assert_true(checked >= 5);
    return checked;
}

static void test_smollm2(void **s) { (void)s; run_fixture("smollm2", FL_CHAT_FAMILY_CHATML); }
static void test_qwen2(void **s) { (void)s; run_fixture("qwen2", FL_CHAT_FAMILY_CHATML); }
static void test_qwen25(void **s) { (void)s; run_fixture("qwen25", FL_CHAT_FAMILY_CHATML); }
static void test_llama3(void **s) { (void)s; run_fixture("llama3", FL_CHAT_FAMILY_LLAMA3); }
static void test_llama31(void **s) { (void)s; run_fixture("llama31", FL_CHAT_FAMILY_LLAMA3); }
static void test_qwen3(void **s) { (void)s; run_fixture("qwen3", FL_CHAT_FAMILY_CHATML); }
static void test_mistral_v01(void **s) {
    (void)s;
    run_fixture("mistral_v01_orig", FL_CHAT_FAMILY_MISTRAL);
}
static void test_mistral_v1(void **s) { (void)s; run_fixture("mistral_v1", FL_CHAT_FAMILY_MISTRAL); }
static void test_mistral_v03(void **s) {
    (void)s;
    run_fixture("mistral_v03", FL_CHAT_FAMILY_MISTRAL);
}

static void test_detect(void **s) {
    (void)s;
    assert_int_equal(fl_chat_template_detect(NULL), FL_CHAT_FAMILY_NONE);
    assert_int_equal(fl_chat_template_detect(""), FL_CHAT_FAMILY_NONE);
    assert_int_equal(fl_chat_template_detect("{{ messages[0].content }}"), FL_CHAT_FAMILY_NONE);
    assert_int_equal(fl_chat_template_detect("x<|im_start|>y"), FL_CHAT_FAMILY_CHATML);
    assert_int_equal(fl_chat_template_detect("<|start_header_id|>"), FL_CHAT_FAMILY_LLAMA3);
    assert_int_equal(fl_chat_template_detect("'[INST] '"), FL_CHAT_FAMILY_MISTRAL);
    assert_string_equal(fl_chat_family_name(FL_CHAT_FAMILY_LLAMA3), "llama3");
}

static void test_default_system_extraction(void **s) {
    (void)s;
    char *d = NULL;
    /* raw newline, single quotes */
    assert_int_equal(fl_chat_template_default_system(
                         "{% if x %}{{ '<|im_start|>system\nDef A<|im_end|>\n' }}{% endif %}", &d),
                     FL_OK);
    assert_string_equal(d, "Def A");
    free(d);
    /* \n escape, double quotes, escaped quote inside */
    assert_int_equal(fl_chat_template_default_system(
                         "{{- \"<|im_start|>system\\nSay \\\"hi\\\"<|im_end|>\\n\" }}", &d),
                     FL_OK);
    assert_string_equal(d, "Say \"hi\"");
    free(d);
    /* a system header followed by the user's content is not a default */
    assert_int_equal(fl_chat_template_default_system(
                         "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}",
                         &d),
                     FL_OK);
    assert_null(d);
    /* apostrophes in template text outside blocks are not string quotes */
    assert_int_equal(fl_chat_template_default_system(
                         "don't {{ '<|im_start|>system\nOK<|im_end|>' }} won't", &d),
                     FL_OK);
    assert_string_equal(d, "OK");
    free(d);
    /* literals inside {# comments #} are ignored; unterminated literal is safe */
    assert_int_equal(fl_chat_template_default_system(
                         "{# '<|im_start|>system\nNO<|im_end|>' #}{{ '<|im_start|>system\nun", &d),
                     FL_OK);
    assert_null(d);
    assert_int_equal(fl_chat_template_default_system(NULL, &d), FL_OK);
    assert_null(d);
}

static void test_no_template_and_bad_input(void **s) {
    (void)s;
    fl_chat_message m[] = {{"user", "hi"}, {"robot", "x"}};
    char *out = (char *)"sentinel";
    assert_int_equal(fl_chat_template_render(FL_CHAT_FAMILY_NONE, NULL, m, 1, NULL, &out),
                     FL_ERR_UNSUPPORTED);
    assert_null(out);
    assert_non_null(strstr(fl_error_msg(), "prompt"));
    assert_int_equal(fl_chat_template_render(FL_CHAT_FAMILY_CHATML, NULL, m, 0, NULL, &out),
                     FL_ERR_INVALID_ARG);
    assert_int_equal(fl_chat_template_render(FL_CHAT_FAMILY_CHATML, NULL, m, 2, NULL, &out),
                     FL_ERR_INVALID_ARG);
    assert_non_null(strstr(fl_error_msg(), "messages[1].role"));
    fl_chat_message sys_only[] = {{"system", "x"}};
    assert_int_equal(
        fl_chat_template_render(FL_CHAT_FAMILY_MISTRAL, NULL, sys_only, 1, "<s>", &out),
        FL_ERR_INVALID_ARG);
    /* A ChatML template that writes bos_token gets it first. */
    assert_int_equal(fl_chat_template_render(FL_CHAT_FAMILY_CHATML,
                                             "{{ bos_token }}{% for m in messages %}<|im_start|>",
                                             m, 1, "<BOS>", &out),
                     FL_OK);
    assert_string_equal(out, "<BOS><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    free(out);
    /* No template source: the family's plain form (no default system). */
    assert_int_equal(fl_chat_template_render(FL_CHAT_FAMILY_CHATML, NULL, m, 1, NULL, &out), FL_OK);
    assert_string_equal(out, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    free(out);
    /* Llama-3.2 templates date the system header with strftime_now (today,
     * "%d %b %Y" as HF's global does); 3.1 ones with a literal. */
    assert_int_equal(
        fl_chat_template_render(FL_CHAT_FAMILY_LLAMA3,
                                "{{- \"Cutting Knowledge Date: December 2023\\n\" }}"
                                "{%- set date_string = strftime_now(\"%d %b %Y\") %}<|start_header_id|>",
                                m, 1, "<|begin_of_text|>", &out),
        FL_OK);
    char today[64];
    time_t now = time(NULL);
    struct tm tm;
    localtime_r(&now, &tm);
    strftime(today, sizeof today, "Today Date: %d %b %Y\n\n<|eot_id|>", &tm);
    assert_non_null(strstr(out, today));
    assert_non_null(strstr(out, "<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday"));
    free(out);
    assert_int_equal(
        fl_chat_template_render(FL_CHAT_FAMILY_LLAMA3,
                                "{{ 'Cutting Knowledge Date: X\\n' }}{% set date_string = '01 Jan 2030' %}",
                                m, 1, "", &out),
        FL_OK);
    assert_string_equal(out, "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
                             "X\nToday Date: 01 Jan 2030\n\n<|eot_id|><|start_header_id|>user"
                             "<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant"
                             "<|end_header_id|>\n\n");
    free(out);
}

/* The original v0.1 template raises on a system message; flotilla keeps the
 * instruction by joining it to the first user turn (documented choice). */
static void test_mistral_v01_system_choice(void **s) {
    (void)s;
    char path[1024];
    snprintf(path, sizeof path, "%s/chat/mistral_v01_orig.json", FL_TEST_DATA);
    char *text = slurp(path);
    assert_non_null(text);
    cJSON *doc = cJSON_Parse(text);
    const char *tpl = cJSON_GetObjectItem(doc, "template")->valuestring;
    fl_chat_message m[] = {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello."},
                           {"user", "Bye"}};
    char *out = NULL;
    assert_int_equal(fl_chat_template_render(FL_CHAT_FAMILY_MISTRAL, tpl, m, 4, "<s>", &out), FL_OK);
    assert_string_equal(out, "<s>[INST] Be brief.\n\nHi [/INST]Hello.</s>[INST] Bye [/INST]");
    free(out);
    cJSON_Delete(doc);
    free(text);
}


/* Mutated real templates (run under FL_SANITIZE=ON): the literal scanner and
 * the renderers must never read out of bounds, whatever the source. */
static void test_fuzz_templates(void **state) {
    (void)state;
    static const char *names[] = {"smollm2", "qwen25", "qwen3", "llama31", "mistral_v03"};
    uint64_t x = 0x9E3779B97F4A7C15ULL;
    fl_chat_message m[] = {{"system", "s"}, {"user", "<think>u</think>"}, {"assistant", "a"},
                           {"user", "u2"}};
    for (size_t t = 0; t < sizeof names / sizeof names[0]; t++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/chat/%s.json", FL_TEST_DATA, names[t]);
        char *text = slurp(path);
        assert_non_null(text);
        cJSON *doc = cJSON_Parse(text);
        const char *tpl = cJSON_GetObjectItem(doc, "template")->valuestring;
        size_t n = strlen(tpl);
        char *buf = malloc(n + 1);
        for (int it = 0; it < 400; it++) {
            memcpy(buf, tpl, n + 1);
            size_t len = n;
            for (int k = 0; k < 6; k++) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                size_t at = x % len;
                if (k == 5 && (x >> 40) % 3 == 0) {
                    buf[at] = 0; /* truncate */
                    len = at ? at : 1;
                } else {
                    buf[at] = "'\"\\{}%#\nx"[(x >> 32) % 9];
                }
            }
            char *out = NULL, *def = NULL;
            fl_status st = fl_chat_template_default_system(buf, &def);
            assert_int_equal(st, FL_OK);
            free(def);
            for (size_t nm = 1; nm <= 4; nm++) {
                st = fl_chat_template_render(fl_chat_template_detect(buf), buf, m, nm, "<s>", &out);
                assert_true(st == FL_OK || st == FL_ERR_INVALID_ARG || st == FL_ERR_UNSUPPORTED);
                if (st == FL_OK) assert_non_null(out);
                free(out);
                out = NULL;
            }
        }
        free(buf);
        cJSON_Delete(doc);
        free(text);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_smollm2),
        cmocka_unit_test(test_qwen2),
        cmocka_unit_test(test_qwen25),
        cmocka_unit_test(test_llama3),
        cmocka_unit_test(test_llama31),
        cmocka_unit_test(test_qwen3),
        cmocka_unit_test(test_mistral_v01),
        cmocka_unit_test(test_mistral_v1),
        cmocka_unit_test(test_mistral_v03),
        cmocka_unit_test(test_detect),
        cmocka_unit_test(test_default_system_extraction),
        cmocka_unit_test(test_no_template_and_bad_input),
        cmocka_unit_test(test_mistral_v01_system_choice),
        cmocka_unit_test(test_fuzz_templates),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
