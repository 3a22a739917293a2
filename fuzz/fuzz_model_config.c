/*
 * fuzz_model_config.c — libFuzzer target for config.json
 * (runtime/load/model_config.c): one input is one config.json.
 *
 * Any status is fine for malformed input; a crash, a sanitizer report or a
 * hang is a bug. An accepted config must hold what the forward pass relies
 * on without checking again: positive sizes, heads divisible by KV heads, at
 * most FL_MAX_EOS EOS ids, MoE fields consistent with the expert count, and
 * the per-layer MoE query answering for every layer.
 */
#define _GNU_SOURCE
#include "fuzz/fuzz_memfd.h"

#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "runtime/load/model_config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char path[64];
    int fd = fuzz_memfd(data, size, path);
    if (fd < 0) return 0;
    fl_model_config c;
    if (fl_model_config_from_json(path, &c) == FL_OK) {
        if ((unsigned)c.arch >= FL_ARCH_COUNT || !fl_arch_name(c.arch)) abort();
        if (c.vocab_size <= 0 || c.hidden_size <= 0 || c.n_layers <= 0 || c.n_heads <= 0 ||
            c.n_kv_heads <= 0 || c.head_dim <= 0 || c.max_position_embeddings <= 0)
            abort();
        if (c.n_heads % c.n_kv_heads) abort();
        if (!(c.rms_norm_eps > 0.0f)) abort();
        if (c.n_eos < 0 || c.n_eos > FL_MAX_EOS) abort();
        if (c.n_experts < 0 || c.n_experts_per_tok < 0) abort();
        if (c.n_experts > 0 && (c.n_experts_per_tok < 1 || c.n_experts_per_tok > c.n_experts)) abort();
        int moe = 0;
        for (int l = 0; l < c.n_layers && l < 4096; l++) moe += fl_model_config_layer_is_moe(&c, l);
        if (moe && c.n_experts == 0) abort();
    }
    close(fd);
    return 0;
}
