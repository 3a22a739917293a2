/*
 * request_prep.h — what `flotilla generate` and `flotilla serve` share to
 * run a parsed request: its prompt as token ids (chat template applied),
 * the per-choice engine options, and a choice's logprobs decoded into the
 * strings the result writer takes.
 *
 * Threading: the caller's engine thread (the tokenizer is used unlocked).
 */
#ifndef FL_REQUEST_PREP_H
#define FL_REQUEST_PREP_H

#include <stddef.h>
#include <stdint.h>

#include "runtime/engine/engine.h"
#include "runtime/engine/request.h"
#include "runtime/tok/chat_template.h"
#include "runtime/tok/tokenizer.h"

/* The model's chat template, as the requests' messages are rendered. */
typedef struct fl_prep_chat {
    fl_chat_family family;
    const char *template_src;
} fl_prep_chat;

/* Prompt text -> ids (malloc'd *ids[*n]). Chat renderings carry their own
 * BOS text (parsed as a special token); raw prompts get BOS when the
 * tokenizer asks for it, as HF tokenizers' encode(add_special_tokens=True)
 * does. FL_ERR_UNSUPPORTED for messages when the model has no chat template
 * flotilla understands. */
fl_status fl_prep_tokenize(fl_tokenizer *tok, const fl_prep_chat *chat, const fl_request *rq,
                           int32_t **ids, size_t *n);

/* Choice c of rq as an engine sequence: fl_gen_init with the request's
 * sampling (defaults for what it does not give; choice c draws from seed + c)
 * and its OpenAI / vLLM options. max_tokens: the default when rq gives none. */
fl_status fl_prep_gen_init(fl_gen *g, int64_t id, const fl_request *rq,
                           const fl_sampling_params *defaults, int max_tokens, int c,
                           const int32_t *ids, size_t n);

/* One choice's logprobs as the writer takes them: decoded token strings. */
typedef struct fl_prep_lp {
    fl_result_token *toks; /* [nt] */
    const char **text;     /* [nt * (1 + top)]: per token the chosen, then the top ones */
    size_t *len;
    char **own;            /* the decoded strings */
    size_t n_own;
} fl_prep_lp;

/* ids[nt] the generated tokens, lp[nt] their logprobs. Free v with
 * fl_prep_lp_free also after a failure. */
fl_status fl_prep_lp_build(fl_tokenizer *tok, const int32_t *ids, const fl_token_logprob *lp,
                           size_t nt, fl_prep_lp *v);
void fl_prep_lp_free(fl_prep_lp *v);

#endif /* FL_REQUEST_PREP_H */
