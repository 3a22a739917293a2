/*
 * validate.c — fl_ckpt_validate: a checkpoint's metadata checked against
 * itself before a model is built from it (see checkpoint.h).
 *
 * Why here and not in each reader: the config readers take what the file
 * says (and drop a special-token id they cannot use), the model builder
 * finds a contradiction only when it reaches the tensor, and `inspect` never
 * builds the model. One check after opening gives every subcommand the same
 * answer, before any weight is read: an EOS id outside the vocabulary would
 * otherwise load silently and generation would never stop at EOS.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/load/checkpoint_impl.h"
#include "runtime/tok/tokenizer.h"

static fl_status check_id(const fl_ckpt *ck, const char *key, int64_t id, int vocab) {
    if (id >= 0 && id < vocab) return FL_OK;
    return FL_ERR(FL_ERR_FORMAT, "%s: %s = %lld is outside the vocabulary (%d tokens, ids 0..%d)",
                  ck->path, key, (long long)id, vocab, vocab - 1);
}

/* Output and input features of a linear weight, however it is stored:
 * prefix.weight [out, in], AutoAWQ's prefix.qweight [in, out / 8], GPTQ's
 * prefix.qweight [in / 8, out] or compressed-tensors' prefix.weight_packed
 * [out, in / 8]. */
static bool linear_dims(const fl_ckpt *ck, const char *prefix, const char **name, int64_t *out,
                        int64_t *in) {
    static char buf[256];
    const fl_ckpt_tensor *t = NULL;
    snprintf(buf, sizeof buf, "%s.weight", prefix);
    if (fl_ckpt_get(ck, buf, &t) == FL_OK && t->ndim == 2) {
        *out = t->shape[0];
        *in = t->shape[1];
        *name = t->name;
        return true;
    }
    snprintf(buf, sizeof buf, "%s.qweight", prefix);
    if (fl_ckpt_get(ck, buf, &t) == FL_OK && t->ndim == 2) {
        const bool gptq = ck->cfg.quant == FL_QUANT_GPTQ; /* [in / 8, out] */
        *in = gptq ? t->shape[0] * 8 : t->shape[0];
        *out = gptq ? t->shape[1] : t->shape[1] * 8;
        *name = t->name;
        return true;
    }
    snprintf(buf, sizeof buf, "%s.weight_packed", prefix); /* compressed-tensors: [out, in / 8] */
    if (fl_ckpt_get(ck, buf, &t) == FL_OK && t->ndim == 2) {
        *out = t->shape[0];
        *in = t->shape[1] * 8;
        *name = t->name;
        return true;
    }
    fl_error_clear();
    return false;
}

static fl_status check_rows(const fl_ckpt *ck, const char *prefix, int64_t want_out,
                            int64_t want_in, const char *why) {
    const char *name;
    int64_t out, in;
    if (!linear_dims(ck, prefix, &name, &out, &in)) return FL_OK; /* the builder names it */
    if (out != want_out)
        return FL_ERR(FL_ERR_FORMAT, "%s: tensor %s has %lld output features, but the config gives "
                      "%s = %lld", ck->path, name, (long long)out, why, (long long)want_out);
    if (in != want_in)
        return FL_ERR(FL_ERR_FORMAT, "%s: tensor %s has %lld input features, but the config gives "
                      "hidden_size = %lld", ck->path, name, (long long)in, (long long)want_in);
    return FL_OK;
}

static fl_status check_tensors(const fl_ckpt *ck, const fl_model_config *c) {
    /* layers: the highest model.layers.N present must reach the config's count */
    int last = -1;
    for (size_t i = 0; i < ck->n_tensors; i++) {
        /* A name like "mlp.experts.gate_up_proj" holds every expert of a
         * layer (how transformers 5 keeps them in memory; GGUF's stacks are
         * split at open): which rows are gate and which up, and the layout
         * of any scales, differ by model, so they are refused by name. */
        const char *e = strstr(ck->tensors[i].name, ".experts.");
        if (e && (e[9] < '0' || e[9] > '9'))
            return FL_ERR(FL_ERR_UNSUPPORTED, "%s: tensor \"%s\" holds all of a layer's experts in one tensor "
                          "(fused); flotilla reads one tensor per expert (mlp.experts.<e>.gate_proj / up_proj / "
                          "down_proj, as Hugging Face checkpoints of Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek "
                          "store them)", ck->path, ck->tensors[i].name);
        int l;
        if (sscanf(ck->tensors[i].name, "model.layers.%d.", &l) == 1 && l > last) last = l;
    }
    if (last + 1 < c->n_layers)
        return FL_ERR(FL_ERR_FORMAT, "%s: the config gives num_hidden_layers = %d, but the checkpoint "
                      "has tensors for %d layers (the last is model.layers.%d)", ck->path,
                      c->n_layers, last + 1, last);
    const fl_ckpt_tensor *t = NULL;
    static const char *const vocab_tensors[] = {"model.embed_tokens.weight", "lm_head.weight"};
    for (int k = 0; k < 2; k++) {
        if (fl_ckpt_get(ck, vocab_tensors[k], &t) != FL_OK) {
            fl_error_clear();
            continue;
        }
        if (t->ndim != 2) continue;
        if (t->shape[0] != c->vocab_size)
            return FL_ERR(FL_ERR_FORMAT, "%s: tensor %s has %lld rows, but the config gives "
                          "vocab_size = %d", ck->path, t->name, (long long)t->shape[0], c->vocab_size);
        if (t->shape[1] != c->hidden_size)
            return FL_ERR(FL_ERR_FORMAT, "%s: tensor %s has %lld columns, but the config gives "
                          "hidden_size = %d", ck->path, t->name, (long long)t->shape[1], c->hidden_size);
    }
    if (c->arch == FL_ARCH_DEEPSEEK_V2) return FL_OK; /* MLA: no per-head q/k/v */
    char why[96];
    snprintf(why, sizeof why, "num_attention_heads %d x head_dim %d", c->n_heads, c->head_dim);
    FL_TRY(check_rows(ck, "model.layers.0.self_attn.q_proj", (int64_t)c->n_heads * c->head_dim,
                      c->hidden_size, why));
    snprintf(why, sizeof why, "num_key_value_heads %d x head_dim %d", c->n_kv_heads, c->head_dim);
    FL_TRY(check_rows(ck, "model.layers.0.self_attn.k_proj", (int64_t)c->n_kv_heads * c->head_dim,
                      c->hidden_size, why));
    FL_TRY(check_rows(ck, "model.layers.0.self_attn.v_proj", (int64_t)c->n_kv_heads * c->head_dim,
                      c->hidden_size, why));
    return FL_OK;
}

fl_status fl_ckpt_validate(const fl_ckpt *ck, const fl_model_config *cfg,
                           const struct fl_tokenizer *tok) {
    const int vocab = cfg->vocab_size;
    const bool gguf = ck->format && !strcmp(ck->format, "gguf");
    if (vocab <= 0)
        return FL_ERR(FL_ERR_FORMAT, "%s: the config gives vocab_size = %d", ck->path, vocab);
    for (int i = 0; i < ck->n_token_keys; i++)
        FL_TRY(check_id(ck, ck->token_keys[i].key, ck->token_keys[i].id, vocab));
    if (cfg->bos_token_id >= 0)
        FL_TRY(check_id(ck, gguf ? "tokenizer.ggml.bos_token_id" : "config.json bos_token_id",
                        cfg->bos_token_id, vocab));
    for (int i = 0; i < cfg->n_eos; i++)
        if (cfg->eos_token_ids[i] >= 0 || !gguf)
            FL_TRY(check_id(ck, gguf ? "tokenizer.ggml.eos_token_id" : "config.json eos_token_id",
                            cfg->eos_token_ids[i], vocab));
    if (tok) {
        /* every id the tokenizer can produce (added and special tokens, those
         * a chat template writes, BOS/EOS) is below its size */
        int nt = fl_tokenizer_n_vocab(tok);
        if (nt > vocab)
            return FL_ERR(FL_ERR_FORMAT, "%s: the tokenizer has %d tokens (ids up to %d), more than "
                          "the model's vocabulary of %d (vocab_size): the model has no embedding "
                          "for ids %d..%d", ck->path, nt, nt - 1, vocab, vocab, nt - 1);
        int32_t ids[2] = {fl_tokenizer_bos(tok), fl_tokenizer_eos(tok)};
        static const char *const names[2] = {"the tokenizer's BOS token id",
                                             "the tokenizer's EOS token id"};
        for (int i = 0; i < 2; i++)
            if (ids[i] >= 0) FL_TRY(check_id(ck, names[i], ids[i], vocab));
    }
    return check_tensors(ck, cfg);
}
