/*
 * cmd_env.c — `flotilla env`: every option of the registry
 * (core/option_list.h) with its doc, default and the value in force, marking
 * those the environment sets, then the launcher and CUDA variables flotilla
 * reads (core/option_external.h) with their values. --json writes one JSON
 * object for scripts. A malformed FL_ variable is listed as such and makes
 * the command fail (exit 2) with a line naming it, like every other
 * subcommand at start-up.
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/option.h"
#include "launcher/cli.h"

static const char *source(const fl_opt_info *o) {
    return o->invalid ? "malformed" : o->from_env ? "environment" : "default";
}

static int print_json(void) {
    cJSON *r = cJSON_CreateObject(), *opts = cJSON_AddArrayToObject(r, "options"),
          *ext = cJSON_AddArrayToObject(r, "external");
    if (!r || !opts || !ext) goto oom;
    for (int i = 0; i < FL_OPT_COUNT; i++) {
        fl_opt_info o;
        fl_opt_info_get((fl_opt_id)i, &o);
        cJSON *j = cJSON_CreateObject();
        if (!j || !cJSON_AddItemToArray(opts, j)) goto oom;
        cJSON_AddStringToObject(j, "name", o.env);
        cJSON_AddStringToObject(j, "kind", o.kind_name);
        if (o.choices) cJSON_AddStringToObject(j, "choices", o.choices);
        if (o.dflt) cJSON_AddStringToObject(j, "default", o.dflt);
        else cJSON_AddNullToObject(j, "default");
        if (o.value) cJSON_AddStringToObject(j, "value", o.value);
        else cJSON_AddNullToObject(j, "value");
        cJSON_AddStringToObject(j, "source", source(&o));
        if (o.env_text) cJSON_AddStringToObject(j, "environment", o.env_text);
        cJSON_AddStringToObject(j, "doc", o.doc);
    }
    for (int i = 0; i < fl_opt_external_count(); i++) {
        const char *name = fl_opt_external_name(i), *v = fl_opt_external(name);
        cJSON *j = cJSON_CreateObject();
        if (!j || !cJSON_AddItemToArray(ext, j)) goto oom;
        cJSON_AddStringToObject(j, "name", name);
        if (v) cJSON_AddStringToObject(j, "value", v);
        else cJSON_AddNullToObject(j, "value");
        cJSON_AddStringToObject(j, "doc", fl_opt_external_doc(i));
    }
    char *text = cJSON_Print(r);
    cJSON_Delete(r);
    if (!text) goto oom_text;
    printf("%s\n", text);
    cJSON_free(text);
    return 0;
oom:
    cJSON_Delete(r);
oom_text:
    fprintf(stderr, "flotilla env: out of memory\n");
    return 1;
}

static void print_text(void) {
    printf("flotilla options (FL_ environment variables; a flag or --config key of the same name, where\n"
           "there is one, wins over the variable):\n\n");
    fl_opt_print(stdout);
    printf("\nvariables of launchers and CUDA that flotilla reads:\n\n");
    for (int i = 0; i < fl_opt_external_count(); i++) {
        const char *name = fl_opt_external_name(i), *v = fl_opt_external(name);
        printf("%-26s %s\n    %s\n", name, v ? v : "(unset)", fl_opt_external_doc(i));
    }
}

int fl_cmd_env(int argc, char **argv) {
    const char *json = NULL, *help = NULL;
    const fl_cli_opt opts[] = {
        {"json", false, &json, "write one JSON object: options[] and external[]"},
        {"help", false, &help, "show this help"},
        {0},
    };
    fl_status st = fl_cli_parse("env", argc, argv, opts);
    if (st != FL_OK) return fl_cli_fail("env", st);
    if (help) {
        fl_cli_usage(stdout, "env", "[--json]", opts);
        return 0;
    }
    const fl_status init = fl_opt_init();
    /* the message of the first malformed variable, before the listing's
     * own calls can replace it */
    char msg[600];
    snprintf(msg, sizeof msg, "%s", fl_error_msg());
    int rc = 0;
    if (json) rc = print_json();
    else print_text();
    if (init != FL_OK) {
        fprintf(stderr, "flotilla env: %s\n", msg);
        return 2;
    }
    return rc;
}
