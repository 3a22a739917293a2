/*
 * checkpoint_impl.h — the body of fl_ckpt, shared by the format readers
 * (safetensors in checkpoint.c / safetensors.c, GGUF in gguf.c). Not a
 * public header: only loaders include it.
 */
#ifndef FL_CHECKPOINT_IMPL_H
#define FL_CHECKPOINT_IMPL_H

#include "runtime/load/checkpoint.h"
#include "runtime/load/mapfile.h"

struct fl_ckpt {
    char *path;                 /* folder or .gguf file as given */
    const char *format;         /* "safetensors" | "gguf" (static string) */
    fl_ckpt_tensor *tensors;    /* [n_tensors], names malloc'd, sorted by name */
    size_t n_tensors;
    fl_mapfile *maps;           /* [n_maps] mappings the tensors point into */
    size_t n_maps;
    void *built;                /* [built_size] bytes of tensors built at open rather than mapped
                                   (GGUF DeepSeek-V2's joined kv_b_proj), or NULL; freed with ck */
    size_t built_size;
    fl_model_config cfg;        /* filled at open */
    char *chat_template;        /* Jinja text or NULL (tokenizer_config.json / GGUF) */
    void *aux;                  /* format-specific state (GGUF metadata), freed by aux_free */
    size_t *bytes_read;         /* loader accounting (a pointer so const loaders can count);
                                   allocated lazily, freed by fl_ckpt_free */
    void (*aux_free)(void *aux);
    bool noted_dense;           /* the GPTQ act-order note was printed (once per checkpoint) */
    /* token ids named by the metadata (GGUF tokenizer.ggml.*_token_id), as
     * stored, for fl_ckpt_validate to check against the vocabulary */
    struct {
        const char *key;        /* static string */
        int64_t id;
    } token_keys[16];
    int n_token_keys;
};

/* Implemented in gguf.c: opens a GGUF file as a checkpoint. */
fl_status fl_ckpt_open_gguf(const char *path, fl_ckpt **out);

/* Sorts ck->tensors by name so fl_ckpt_get can bsearch; fails with
 * FL_ERR_FORMAT naming the duplicate when a name appears twice. */
fl_status fl_ckpt_index(fl_ckpt *ck);

#endif /* FL_CHECKPOINT_IMPL_H */
