/*
 * chat_template.h — turns a list of chat messages into the prompt text a
 * model was fine-tuned on.
 *
 * Models ship a Jinja chat template (tokenizer_config.json "chat_template",
 * GGUF tokenizer.chat_template). flotilla does not embed a Jinja interpreter:
 * it recognises the template family from marker strings and renders the
 * family in C, reading the few things that vary inside a family (ChatML's
 * default system message, Mistral's spacing and where the system message
 * goes) from the template source. The renderings are tested byte for byte
 * against jinja2 renderings of the real templates (tests/chat/, made by
 * scripts/make_chat_fixtures.py).
 *
 * Families:
 *  - CHATML  ("<|im_start|>"; SmolLM2-Instruct, Qwen2, Qwen2.5, Qwen3):
 *      [<|im_start|>system\n{default}<|im_end|>\n]   when the first message is
 *                                                     not a system message and
 *                                                     the template injects one
 *      <|im_start|>{role}\n{content}<|im_end|>\n ...  <|im_start|>assistant\n
 *    Qwen3 templates (marked by "last_query_index" and "</think>") cut
 *    <think>...</think> reasoning out of assistant turns and write it back
 *    only for turns after the last user query, as their Jinja does.
 *  - LLAMA3  ("<|start_header_id|>"; Meta-Llama-3-*-Instruct, 3.1/3.2/3.3):
 *      {bos}<|start_header_id|>{role}<|end_header_id|>\n\n{content|trim}<|eot_id|> ...
 *      <|start_header_id|>assistant<|end_header_id|>\n\n
 *    3.1+ templates ("Cutting Knowledge Date") always start with a system
 *    turn: the knowledge-date line, "Today Date: {date}\n\n" (the template's
 *    date_string literal, or today when it calls strftime_now, as HF does),
 *    then the trimmed system message.
 *  - MISTRAL ("[INST]"; Mistral-7B-Instruct v0.1 .. v0.3):
 *      {bos}[INST] {user} [/INST]{assistant}</s>[INST] ...   (spacing per variant,
 *    read from the template's literals: " [INST] ", "[/INST]", ' ' + content,
 *    content|trim). The system message is joined to a user message with
 *    "\n\n": the first one (2024 v0.1/v0.2 templates), the last one when it is
 *    the final message (v0.3, as its Jinja does), or the first one for the
 *    original v0.1 template, which has no system support at all (its Jinja
 *    raises; we choose to keep the instruction). Roles must alternate
 *    user/assistant after the optional system message, as every Mistral
 *    template enforces. The EOS text after assistant turns is "</s>" (every
 *    Mistral tokenizer's).
 *
 * Not handled: tools / tool messages, multimodal content, any other template
 * family (fl_chat_template_detect returns NONE: send "prompt" instead).
 */
#ifndef FL_CHAT_TEMPLATE_H
#define FL_CHAT_TEMPLATE_H

#include <stddef.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One chat turn. role is "system", "user" or "assistant"; both strings are
 * NUL-terminated UTF-8 owned by whoever built the array (fl_request owns the
 * ones it parsed). */
typedef struct fl_chat_message {
    char *role;
    char *content;
} fl_chat_message;

typedef enum fl_chat_family {
    FL_CHAT_FAMILY_NONE = 0, /* no template, or one we do not recognise */
    FL_CHAT_FAMILY_CHATML,
    FL_CHAT_FAMILY_LLAMA3,
    FL_CHAT_FAMILY_MISTRAL,
} fl_chat_family;

/* Family of a Jinja template source by its marker strings, checked in this
 * order: "<|im_start|>" CHATML, "<|start_header_id|>" LLAMA3, "[INST]" MISTRAL.
 * NULL or anything else: NONE. */
fl_chat_family fl_chat_template_detect(const char *jinja_or_null);

/* "chatml", "llama3", "mistral", "none". */
const char *fl_chat_family_name(fl_chat_family family);

/* The default system text a ChatML template injects when the conversation
 * does not start with a system message: the text between
 * "<|im_start|>system\n" and "<|im_end|>" inside one Jinja string literal of
 * the source ('...' or "...", the newline either raw or written \n; Jinja
 * escapes are decoded). *out is NULL when the template has none. Caller frees
 * *out. */
fl_status fl_chat_template_default_system(const char *jinja_source, char **out);

/* Renders messages[0..n) with the generation prompt appended (as
 * apply_chat_template(..., add_generation_prompt=True)). jinja_source is the
 * model's template (used to read the family's variable details; may be NULL,
 * giving the family's plain form). bos_text is the tokenizer's BOS token text
 * ("<|begin_of_text|>", "<s>"), emitted where the template writes bos_token;
 * NULL means "". The text is therefore to be tokenized WITHOUT adding BOS
 * again. *out is malloc'd and NUL-terminated; caller frees.
 * Errors: FL_ERR_UNSUPPORTED for FL_CHAT_FAMILY_NONE (send "prompt" instead),
 * FL_ERR_INVALID_ARG for an empty conversation, an unknown role, or a role
 * order the family's template rejects (message names the family and index). */
fl_status fl_chat_template_render(fl_chat_family family, const char *jinja_source,
                                  const fl_chat_message *messages, size_t n,
                                  const char *bos_text, char **out);

#ifdef __cplusplus
}
#endif
#endif /* FL_CHAT_TEMPLATE_H */
