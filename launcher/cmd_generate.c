/*
 * cmd_generate.c — `flotilla generate`: offline batch generation.
 *
 * Reads OpenAI-batch-style JSONL requests, renders chat messages with the
 * model's chat template, tokenizes, and feeds the engine's continuous
 * batching loop. Requests are read lazily (a window of a few times
 * max_num_seqs is kept in flight), so memory does not grow with the input.
 * Each result is written as one JSON line as soon as it finishes; a
 * malformed or impossible request gets an error record and the job goes on.
 *
 * Batch-job behaviour: every record is fsync'd, so a killed job
 * loses at most the requests in flight; a restart on the same output file
 * skips what is there and cuts a torn last line (launcher/resume.c), and
 * only an output whose state file names this job (or that is empty) is
 * ever appended to or cut: anything else is refused untouched. The
 * input is pre-read once to refuse duplicate custom_ids and count the work
 * for the progress display (launcher/progress.c). SIGTERM/SIGINT stop
 * admission; in-flight requests are finished or dropped (--on-signal), and
 * the job ends cleanly on every rank with exit status 0.
 */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "launcher/cli.h"
#include "launcher/progress.h"
#include "launcher/request_prep.h"
#include "launcher/resume.h"
#include "runtime/tok/chat_template.h"
#include "runtime/engine/request.h"

/* One choice's outcome, kept until every choice of its request is done. */
typedef struct job_choice {
    char *text;
    int32_t *ids;            /* [completion_tokens] the generated token ids */
    long completion_tokens;
    const char *finish_reason;
    fl_token_logprob *lp;    /* [completion_tokens] when logprobs were asked */
} job_choice;

/* One request line: its n choices run as n sequences sharing the prompt
 * and are written as one record when the last one finishes. */
typedef struct job_group {
    fl_request req;
    long prompt_tokens;
    int pending;             /* choices still in the engine */
    bool failed;             /* a choice failed: the record is an error */
    char error[256];
    job_choice *choices;     /* [req.n] */
} job_group;

typedef struct job_req {
    fl_gen gen;              /* first member: fl_gen* maps back to job_req* */
    job_group *grp;
    int choice;              /* index in grp->choices */
    size_t text_checked;     /* bytes of decoded text already searched for stops */
    struct job_req *prev, *next; /* the in-flight list (to drop them on a signal) */
} job_req;

/* Set by the SIGTERM/SIGINT handler; only rank 0 acts on it (the other ranks
 * keep following rank 0's plans until it releases them). */
static volatile sig_atomic_t stop_signal;

static void on_stop_signal(int sig) { stop_signal = sig; }

typedef struct job {
    fl_cli_bundle b;
    fl_prep_chat chat;       /* the model's chat template */
    char *default_system;
    fl_sampling_params defaults;
    int max_tokens;
    FILE *out;
    const char *out_path;
    long n_ok, n_err;
    long prompt_tokens, completion_tokens;
    long in_flight;          /* requests queued in the engine */
    int max_num_seqs;
    job_req *flying;         /* the in-flight requests, a list */
    fl_idset *done;          /* keys already in the output (resume) */
    fl_idset *seen;          /* stdin input: ids seen so far (duplicate check) */
    bool drop_on_signal;     /* --on-signal drop */
    const char *summary_path;
    fl_progress prog;
    fl_result_style style;   /* --output-format */
    const char *model_name;  /* body.model in openai results when the request gives none */
} job;

static void group_free(job_group *grp) {
    if (!grp) return;
    for (int i = 0; grp->choices && i < grp->req.n; i++) {
        free(grp->choices[i].text);
        free(grp->choices[i].ids);
        free(grp->choices[i].lp);
    }
    free(grp->choices);
    fl_request_free(&grp->req);
    free(grp);
}

static void unlink_req(job *j, job_req *jr) {
    if (jr->prev) jr->prev->next = jr->next; else j->flying = jr->next;
    if (jr->next) jr->next->prev = jr->prev;
    jr->prev = jr->next = NULL;
}

/* One record out: fl_result_write flushes it, fsync makes it survive a
 * kill -9 or a node crash right after (the resume logic trusts what it reads). */
static fl_status emit(job *j, const fl_result *r) {
    FL_TRY(fl_result_write(j->out, r));
    if (fsync(fileno(j->out)) != 0 && errno != EINVAL)
        return FL_ERR(FL_ERR_IO, "cannot sync %s: %s", j->out_path, strerror(errno));
    return FL_OK;
}

static fl_status write_error(job *j, const char *custom_id, long line, const char *msg,
                             const char *param) {
    fl_result r = {.style = j->style, .custom_id = custom_id, .error_message = msg,
                   .error_param = param, .error_line = line};
    j->n_err++;
    FL_TRY(fl_progress_result(&j->prog, NULL, true, 0, 0));
    return emit(j, &r);
}

/* Reads the next request line and queues it; *eof at end of input. Errors
 * about one request become error records; only I/O errors are returned. */
static fl_status admit_one(job *j, fl_request_reader *rd, bool *eof) {
    long line;
    const char *text;
    size_t len;
    FL_TRY(fl_request_reader_next(rd, &line, &text, &len));
    if (!text) {
        *eof = true;
        return FL_OK;
    }
    job_group *grp = calloc(1, sizeof *grp);
    if (!grp) return FL_ERR(FL_ERR_OOM, "out of memory");
    fl_status st = fl_request_parse(text, len, line, fl_request_reader_path(rd), &grp->req);
    fl_request *rq = &grp->req;
    char kb[48];
    const char *key = fl_resume_key(rq->custom_id, line, kb, sizeof kb);
    if (fl_idset_has(j->done, key)) { /* written by an earlier run of this job */
        group_free(grp);
        return FL_OK;
    }
    if (j->seen && rq->custom_id) { /* stdin: no pre-pass, check as we go */
        bool added;
        long prev = 0;
        fl_status dst = fl_idset_put(j->seen, key, line, &added, &prev);
        if (dst == FL_OK && !added)
            dst = FL_ERR(FL_ERR_INVALID_ARG, "duplicate custom_id \"%.200s\" at %s:%ld and %s:%ld",
                         key, fl_request_reader_path(rd), prev, fl_request_reader_path(rd), line);
        if (dst != FL_OK) {
            group_free(grp);
            return dst;
        }
    }
    if (st == FL_OK && j->style == FL_RESULT_COMPACT && (rq->n > 1 || rq->logprobs)) {
        snprintf(rq->param, sizeof rq->param, "%s", rq->n > 1 ? "n" : "logprobs");
        st = FL_ERR(FL_ERR_UNSUPPORTED, "%s:%ld: body.%s needs the OpenAI output format "
                    "(--output-format compact has one text per request and no logprobs)",
                    fl_request_reader_path(rd), line, rq->param);
    }
    int32_t *ids = NULL;
    size_t n = 0;
    if (st == FL_OK) st = fl_prep_tokenize(j->b.tok, &j->chat, rq, &ids, &n);
    if (st == FL_OK && n == 0) st = FL_ERR(FL_ERR_INVALID_ARG, "the prompt is empty");
    if (st == FL_OK) {
        grp->choices = calloc((size_t)rq->n, sizeof *grp->choices);
        if (!grp->choices) st = FL_ERR(FL_ERR_OOM, "out of memory");
        grp->prompt_tokens = (long)n;
    }
    for (int c = 0; st == FL_OK && c < rq->n; c++) {
        job_req *jr = calloc(1, sizeof *jr);
        if (!jr) {
            st = FL_ERR(FL_ERR_OOM, "out of memory");
            break;
        }
        st = fl_prep_gen_init(&jr->gen, line, rq, &j->defaults, j->max_tokens, c, ids, n);
        fl_gen *g = &jr->gen;
        g->user = jr;
        jr->grp = grp;
        jr->choice = c;
        if (st == FL_OK) st = fl_engine_add(j->b.eng, g);
        if (st != FL_OK) {
            /* choices already queued run on; the record becomes this error */
            fl_gen_free(g);
            free(jr);
            break;
        }
        grp->pending++;
        j->in_flight++;
        jr->next = j->flying;
        if (j->flying) j->flying->prev = jr;
        j->flying = jr;
    }
    free(ids);
    if (st != FL_OK) {
        if (grp->pending > 0) { /* reported when the queued choices finish */
            grp->failed = true;
            snprintf(grp->error, sizeof grp->error, "%s", fl_error_msg());
            return FL_OK;
        }
        char msg[1200];
        snprintf(msg, sizeof msg, "%s", fl_error_msg());
        fl_status wst = write_error(j, rq->custom_id, line, msg, rq->param[0] ? rq->param : NULL);
        group_free(grp);
        return wst;
    }
    return FL_OK;
}

/* Every choice of grp is done: one record out. */
static fl_status write_group(job *j, job_group *grp, const fl_gen *last) {
    fl_request *rq = &grp->req;
    if (grp->failed) return write_error(j, rq->custom_id, rq->line, grp->error, NULL);
    fl_status st = FL_OK;
    const int n = rq->n;
    fl_result_choice *ch = calloc((size_t)n, sizeof *ch);
    fl_prep_lp *views = calloc((size_t)n, sizeof *views);
    long completion = 0;
    FL_CHECK_ALLOC(ch, st, done);
    FL_CHECK_ALLOC(views, st, done);
    for (int c = 0; c < n; c++) {
        const job_choice *jc = &grp->choices[c];
        ch[c] = (fl_result_choice){.text = jc->text, .text_len = jc->text ? strlen(jc->text) : 0,
                                   .completion_tokens = jc->completion_tokens,
                                   .finish_reason = jc->finish_reason};
        completion += jc->completion_tokens;
        if (!rq->logprobs) continue;
        FL_TRY_GOTO(fl_prep_lp_build(j->b.tok, jc->ids, jc->lp, (size_t)jc->completion_tokens,
                                     &views[c]), st, done);
        ch[c].tokens = views[c].toks;
        ch[c].n_tokens = (size_t)jc->completion_tokens;
    }
    fl_result r = {
        .style = j->style, .endpoint = rq->endpoint, .custom_id = rq->custom_id,
        .model = rq->model ? rq->model : j->model_name, .created = (long)time(NULL),
        .prompt_tokens = grp->prompt_tokens, .choices = ch, .n_choices = n,
    };
    st = emit(j, &r);
    if (st == FL_OK) st = fl_progress_result(&j->prog, last, false, grp->prompt_tokens, completion);
    j->n_ok++;
    j->prompt_tokens += grp->prompt_tokens;
    j->completion_tokens += completion;
done:
    for (int c = 0; views && c < n; c++) fl_prep_lp_free(&views[c]);
    free(views);
    free(ch);
    return st;
}

/* Takes a finished (or dropped) choice out of flight; the group goes when
 * its last choice does. */
static void retire(job *j, job_req *jr) {
    job_group *grp = jr->grp;
    j->in_flight--;
    unlink_req(j, jr);
    fl_gen_free(&jr->gen);
    free(jr);
    if (--grp->pending == 0) group_free(grp);
}

static fl_status on_token(job *j, job_req *jr) {
    fl_gen *g = &jr->gen;
    job_group *grp = jr->grp;
    const fl_request *rq = &grp->req;
    const int32_t *gen_ids = g->seq.tokens + g->seq.n_prompt;
    size_t n_gen = (size_t)fl_gen_n_generated(g);
    char *text = NULL;
    /* vLLM: stop strings count only from min_tokens on */
    const bool check_stop = rq->n_stop && (int)n_gen >= rq->min_tokens;
    if (g->finish == FL_FINISH_NONE && !check_stop) return FL_OK;
    FL_TRY(fl_tokenizer_decode(j->b.tok, gen_ids, n_gen, true, &text));
    size_t len = strlen(text), cut;
    if (check_stop && fl_request_find_stop(rq, text, len, jr->text_checked, &cut)) {
        text[cut] = 0; /* the stop string and what follows are not returned */
        if (g->finish == FL_FINISH_NONE) fl_engine_finish(j->b.eng, g, FL_FINISH_STOP);
        g->finish = FL_FINISH_STOP; /* a stop string wins over a length limit hit at once */
    }
    jr->text_checked = check_stop ? len : 0;
    fl_status st = FL_OK;
    if (g->finish == FL_FINISH_NONE) {
        free(text);
        return FL_OK;
    }
    if (g->finish == FL_FINISH_ERROR) {
        if (!grp->failed) snprintf(grp->error, sizeof grp->error, "%s", g->error);
        grp->failed = true;
        free(text);
    } else {
        job_choice *jc = &grp->choices[jr->choice];
        jc->text = text;
        jc->completion_tokens = (long)n_gen;
        jc->finish_reason = g->finish == FL_FINISH_LENGTH ? "length" : "stop";
        jc->ids = malloc((n_gen ? n_gen : 1) * sizeof *jc->ids);
        if (!jc->ids) return FL_ERR(FL_ERR_OOM, "out of memory");
        memcpy(jc->ids, gen_ids, n_gen * sizeof *jc->ids);
        jc->lp = g->lp; /* the choice takes the engine's logprobs */
        g->lp = NULL;
        g->lp_cap = 0;
    }
    if (grp->pending == 1) st = write_group(j, grp, g);
    retire(j, jr);
    return st;
}

/* --on-signal drop: the in-flight requests are abandoned unwritten (a later
 * run on the same output redoes them). */
static void drop_in_flight(job *j) {
    while (j->flying) {
        job_req *jr = j->flying;
        if (jr->grp->pending == 1) j->prog.dropped++; /* counted per request */
        fl_engine_finish(j->b.eng, &jr->gen, FL_FINISH_ERROR);
        retire(j, jr);
    }
}

/* The requests in flight, for the progress line: prompt tokens computed and
 * tokens generated so far, and how far along they are as a fraction of
 * whole requests (generated / max_new_tokens), so a long request moves the
 * line and the ETA while it decodes. */
/* The engine's preemption and disk-tier counters into the progress report. */
static void progress_preemptions(fl_progress *p, const fl_engine_stats *es) {
    p->disk_hit_blocks = (long)es->disk_hit_blocks;
    p->disk_hit_tokens = (long)es->disk_hit_tokens;
    p->kv_disk = es->kv_disk;
    p->preemptions = (long)es->preemptions;
    p->swap_preemptions = (long)es->swap_preemptions;
    p->swap_out_bytes = (double)es->swap_out_bytes;
    p->swap_in_bytes = (double)es->swap_in_bytes;
}

static void progress_live(job *j) {
    long in = 0, out = 0;
    double frac = 0;
    for (const job_req *jr = j->flying; jr; jr = jr->next) {
        const fl_gen *g = &jr->gen;
        int np = g->seq.n_prompt, nc = g->seq.n_computed;
        in += nc < np ? nc : np;
        out += fl_gen_n_generated(g);
        if (g->max_new_tokens > 0) frac += (double)fl_gen_n_generated(g) / g->max_new_tokens;
    }
    fl_progress_live(&j->prog, in, out, frac);
}

/* This run's identity for the state file beside the output: the input, the
 * model and every option that changes what is written. */
/* Floats as %g: the parsed float's value, stable across runs, and "0.7"
 * rather than its binary expansion in messages. */
static fl_status job_ident(const job *j, const fl_cli_model_opts *mo, const char *in,
                           fl_batch_ident *id) {
    char v[64];
    const fl_sampling_params *d = &j->defaults;
    memset(id, 0, sizeof *id);
    FL_TRY(fl_resume_ident_files(in, mo->model, id));
#define SET(name, ...) \
    do { snprintf(v, sizeof v, __VA_ARGS__); FL_TRY(fl_batch_ident_set_opt(id, name, v)); } while (0)
    SET("max_tokens", "%d", j->max_tokens);
    SET("temperature", "%g", (double)d->temperature);
    SET("top_p", "%g", (double)d->top_p);
    SET("top_k", "%d", d->top_k);
    SET("min_p", "%g", (double)d->min_p);
    SET("repetition_penalty", "%g", (double)d->repetition_penalty);
    SET("seed", "%llu", (unsigned long long)d->seed);
    SET("quantize", "%s", mo->quantize && strcmp(mo->quantize, "none") ? mo->quantize : "none");
    SET("max_model_len", "%s", mo->max_model_len ? mo->max_model_len : "model");
    SET("output_format", "%s", j->style == FL_RESULT_COMPACT ? "compact" : "openai");
#undef SET
    return FL_OK;
}

/* What `generate --help` says after the options: the output contract and
 * the signals. */
static const char help_epilogue[] =
    "\nOutput files:\n"
    "  generate appends to or truncates only a file it can prove its own: beside\n"
    "  --output it keeps OUTPUT.flotilla.json, naming the job (input path, size and\n"
    "  hash, model, and the options that change results).\n"
    "  - missing or empty output: a new job;\n"
    "  - output with the state file of this job: resumed (results already there are\n"
    "    skipped, a last line torn by a kill is cut and redone);\n"
    "  - state file of another job (other input, model or options): refused, unless\n"
    "    --overwrite (start over) or --force (continue it anyway);\n"
    "  - non-empty output without a state file: refused, unless --resume and every\n"
    "    line is a complete result for a request of this input (then adopted);\n"
    "    --overwrite of such a file needs --force unless every line is a result;\n"
    "  - the input file itself (also through links), or not a regular file: refused;\n"
    "    --output - writes to standard output (no resume).\n"
    "  Strings holding an escaped NUL (\\u0000) are refused with an error record.\n"
    "\nResult lines:\n"
    "  OpenAI Batch output by default ({id, custom_id, response: {status_code,\n"
    "  request_id, body}, error}; body a text_completion or chat.completion object,\n"
    "  or {error} with status 400 for a refused request); --output-format compact\n"
    "  writes {custom_id, text, prompt_tokens, completion_tokens, finish_reason}.\n"
    "  Fields flotilla does not implement (response_format, tools, logit_bias,\n"
    "  stream, ...) are refused per request, naming the field.\n"
    "\nSignals:\n"
    "  The first SIGTERM/SIGINT stops admitting requests and ends the job cleanly\n"
    "  (--on-signal). A second one ends the process at once (exit 130 for SIGINT,\n"
    "  143 for SIGTERM); results written so far are complete lines and a later run\n"
    "  resumes the job.\n";

static fl_status run(job *j, const char *in_path, bool *interrupted) {
    fl_request_reader *rd = NULL;
    fl_status st = FL_OK;
    FL_TRY(fl_request_reader_open(in_path, &rd));
    bool eof = false;
    /* Read ahead enough to fill every step, not the whole file. */
    const long window = 4L * j->max_num_seqs;
    for (;;) {
        if (stop_signal && !*interrupted) {
            *interrupted = true;
            eof = true; /* admit nothing more */
            fprintf(stderr, "%sflotilla generate: signal %d: %s %ld in-flight requests, then "
                    "stopping (a second signal ends the process at once)\n",
                    j->prog.drawn ? "\n" : "", (int)stop_signal,
                    j->drop_on_signal ? "dropping" : "finishing", j->in_flight);
            if (j->drop_on_signal) drop_in_flight(j);
        }
        while (!eof && j->in_flight < window) FL_TRY_GOTO(admit_one(j, rd, &eof), st, done);
        double now = fl_engine_now();
        if (fl_progress_due(&j->prog, now)) {
            fl_engine_stats es;
            fl_engine_get_stats(j->b.eng, &es);
            j->prog.prefix_prompt_tokens = (long)es.prompt_tokens;
            j->prog.prefix_cached_tokens = (long)es.cached_prompt_tokens;
            progress_preemptions(&j->prog, &es);
            progress_live(j);
            fl_progress_tick(&j->prog, now, false);
        }
        if (!fl_engine_has_work(j->b.eng)) {
            if (eof) break;
            continue;
        }
        fl_gen **up;
        int nu;
        FL_TRY_GOTO(fl_engine_step(j->b.eng, &up, &nu), st, done);
        for (int i = 0; i < nu; i++) FL_TRY_GOTO(on_token(j, up[i]->user), st, done);
    }
done:
    if (st != FL_OK) drop_in_flight(j); /* the job failed: free what it still holds */
    fl_request_reader_close(rd);
    return st;
}

int fl_cmd_generate(int argc, char **argv) {
    fl_cli_model_opts mo = {0};
    const char *in = NULL, *outp = NULL, *max_tokens = NULL, *temp = NULL, *top_p = NULL,
               *top_k = NULL, *min_p = NULL, *rep = NULL, *seed = NULL, *help = NULL,
               *resume = NULL, *overwrite = NULL, *summary = NULL, *prog_iv = NULL,
               *on_signal = NULL, *force = NULL, *out_format = NULL;
    fl_cli_opt opts[FL_CLI_MAX_OPTS] = {
        {"input", true, &in, "requests JSONL (required; - = stdin)"},
        {"output", true, &outp, "results JSONL (required)"},
        {"max-tokens", true, &max_tokens, "default completion length (default 256)"},
        {"temperature", true, &temp, "default temperature (default 0 = greedy)"},
        {"top-p", true, &top_p, "default nucleus sampling mass (default 1)"},
        {"top-k", true, &top_k, "default top-k (default 0 = off)"},
        {"min-p", true, &min_p, "default min-p (default 0 = off)"},
        {"repetition-penalty", true, &rep, "default repetition penalty (default 1)"},
        {"seed", true, &seed, "default sampling seed (default 0)"},
        {"resume", false, &resume, "continue the job in --output (the default with its state "
                                   "file); also adopts a results file that has none"},
        {"overwrite", false, &overwrite, "start over: truncate --output instead of resuming"},
        {"force", false, &force, "resume or overwrite an output this job cannot prove its own"},
        {"summary", true, &summary, "also write the end-of-job summary to this JSON file"},
        {"progress-interval", true, &prog_iv, "seconds between progress lines off a terminal (default 10)"},
        {"on-signal", true, &on_signal, "SIGTERM/SIGINT: finish (default) or drop in-flight requests"},
        {"output-format", true, &out_format, "openai (default: OpenAI Batch output lines) or compact "
                                             "({custom_id, text, ...})"},
        {"help", false, &help, "show this help"},
    };
    int n = 17;
    fl_cli_model_opts_add(&mo, opts, &n);
    fl_status st = fl_cli_parse("generate", argc, argv, opts);
    if (st != FL_OK) return fl_cli_fail("generate", st);
    if (help) {
        fl_cli_usage(stdout, "generate", "--model PATH --input requests.jsonl --output results.jsonl",
                     opts);
        fputs(help_epilogue, stdout);
        return 0;
    }
    if (!in || !outp || !mo.model) {
        fprintf(stderr, "flotilla generate: missing %s%s%s%s%s (see flotilla generate --help)\n",
                mo.model ? "" : "--model", !mo.model && (!in || !outp) ? ", " : "",
                in ? "" : "--input", !in && !outp ? ", " : "", outp ? "" : "--output");
        return 1;
    }
    if (resume && overwrite) {
        fprintf(stderr, "flotilla generate: --resume and --overwrite contradict each other\n");
        return 1;
    }
    if (on_signal && strcmp(on_signal, "finish") != 0 && strcmp(on_signal, "drop") != 0) {
        fprintf(stderr, "flotilla generate: --on-signal must be finish or drop, not '%s'\n", on_signal);
        return 1;
    }
    if (out_format && strcmp(out_format, "openai") != 0 && strcmp(out_format, "compact") != 0) {
        fprintf(stderr, "flotilla generate: --output-format must be openai or compact, not '%s'\n",
                out_format);
        return 1;
    }
    job j;
    memset(&j, 0, sizeof j);
    j.style = out_format && !strcmp(out_format, "compact") ? FL_RESULT_COMPACT : FL_RESULT_OPENAI;
    j.model_name = mo.model;
    bool interrupted = false;
    double interval = 10;
    long n_todo = -1, n_done = 0;
    j.max_tokens = 256;
    fl_sampling_params_default(&j.defaults);
    long lv;
    double dv;
#define OPT_INT(s, flag, lo, hi, dst) \
    if (s) { FL_TRY_GOTO(fl_cli_int(flag, s, lo, hi, &lv), st, done); dst = lv; }
#define OPT_FLT(s, flag, lo, hi, dst) \
    if (s) { FL_TRY_GOTO(fl_cli_float(flag, s, lo, hi, &dv), st, done); dst = (float)dv; }
    OPT_INT(max_tokens, "max-tokens", 1, 1 << 24, j.max_tokens);
    OPT_FLT(temp, "temperature", 0, 100, j.defaults.temperature);
    OPT_FLT(top_p, "top-p", 1e-6, 1, j.defaults.top_p);
    OPT_INT(top_k, "top-k", 0, 1 << 24, j.defaults.top_k);
    OPT_FLT(min_p, "min-p", 0, 1, j.defaults.min_p);
    OPT_FLT(rep, "repetition-penalty", 1e-3, 100, j.defaults.repetition_penalty);
    if (seed) {
        FL_TRY_GOTO(fl_cli_int("seed", seed, 0, 0x7fffffffffffffffL, &lv), st, done);
        j.defaults.seed = (uint64_t)lv;
    }
    if (prog_iv) FL_TRY_GOTO(fl_cli_float("progress-interval", prog_iv, 0.01, 1e6, &interval), st, done);
#undef OPT_INT
#undef OPT_FLT
    j.drop_on_signal = on_signal && strcmp(on_signal, "drop") == 0;
    j.summary_path = summary;
    /* Every rank: a preempting scheduler signals all of them; only rank 0
     * acts, the others must not die while rank 0 still sends them plans.
     * SA_RESETHAND: a second signal ends the process the default way. */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal;
    sa.sa_flags = SA_RESTART | SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    /* fail on a missing input before spending time loading the model */
    if (fl_cli_world_rank() == 0 && strcmp(in, "-") != 0 && access(in, R_OK) != 0) {
        st = FL_ERR(FL_ERR_IO, "cannot open %s: %s", in, strerror(errno));
        goto done;
    }
    if (fl_cli_world_rank() == 0) {
        /* before loading the model: a duplicate id or a foreign output file
         * fails the job in seconds, not after the load */
        fl_batch_ident id;
        fl_resume_info ri;
        FL_TRY_GOTO(job_ident(&j, &mo, in, &id), st, done);
        FL_TRY_GOTO(fl_idset_new(&j.done), st, done);
        j.out_path = outp;
        fl_resume_job rj = {.in_path = in, .out_path = outp, .ident = &id, .resume = resume != NULL,
                            .overwrite = overwrite != NULL, .force = force != NULL};
        FL_TRY_GOTO(fl_resume_open_output(&rj, j.done, &ri, &j.out), st, done);
        n_done = ri.n_done;
        n_todo = ri.n_todo;
        if (strcmp(in, "-") == 0) FL_TRY_GOTO(fl_idset_new(&j.seen), st, done);
        if (ri.adopted)
            fprintf(stderr, "flotilla generate: %s has no job state file; every line is a result "
                    "for this input, so it is continued (--resume)\n", outp);
        if (ri.forced)
            fprintf(stderr, "flotilla generate: --force: continuing %s although it was written by "
                    "another job (%s)\n", outp, ri.why);
        if (n_done > 0 || ri.torn_bytes > 0)
            fprintf(stderr, "flotilla generate: resuming %s: %ld results already written%s, "
                    "%ld requests to go\n", outp, n_done,
                    ri.torn_bytes ? " (a torn last line was cut off and will be redone)" : "", n_todo);
    }
    FL_TRY_GOTO(fl_cli_bundle_open(&mo, FL_CLI_NEED_TOKENIZER | FL_CLI_NEED_ENGINE, &j.b), st, done);
    if (!fl_engine_is_leader(j.b.eng)) {
        /* other ranks run the plans rank 0 sends; rank 0 alone reads and writes */
        st = fl_engine_follow(j.b.eng);
        goto done;
    }
    j.max_num_seqs = fl_engine_config_of(j.b.eng)->max_num_seqs; /* given, or what the cache holds */
    j.chat.template_src = fl_ckpt_chat_template(j.b.ck);
    j.chat.family = fl_chat_template_detect(j.chat.template_src);
    if (j.b.verbose)
        fprintf(stderr, "flotilla: chat template family %s\n", fl_chat_family_name(j.chat.family));
    fl_progress_init(&j.prog, stderr, isatty(STDERR_FILENO), interval, n_todo,
                     n_done, fl_engine_now());
    st = run(&j, in, &interrupted);
    if (st == FL_OK) {
        fl_engine_stats es;
        fl_engine_get_stats(j.b.eng, &es);
        j.prog.steps = (long)es.steps, j.prog.greedy_steps = (long)es.greedy_steps;
        j.prog.sampled_steps = (long)es.sampled_steps;
        j.prog.prefix_prompt_tokens = (long)es.prompt_tokens;
        j.prog.prefix_cached_tokens = (long)es.cached_prompt_tokens;
        j.prog.peak_running = (long)es.peak_running;
        progress_preemptions(&j.prog, &es);
        j.prog.max_num_seqs = j.max_num_seqs;
        st = fl_progress_summary(&j.prog, fl_engine_now(), interrupted, j.summary_path);
    }
    if (st == FL_OK) st = fl_engine_release_followers(j.b.eng);
done:
    if (j.out && fclose(j.out) != 0 && st == FL_OK)
        st = FL_ERR(FL_ERR_IO, "cannot write %s: %s", outp, strerror(errno));
    fl_progress_free(&j.prog);
    fl_idset_free(j.done);
    fl_idset_free(j.seen);
    return fl_cli_finish("generate", &j.b, st);
}
