// Shared declarations of kvlite's native library (C on ggml, called from Python through ctypes).
// Arrays are C-contiguous; shapes in comments are in numpy order (slowest dimension first),
// ggml's ne is the reverse.
#pragma once

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

// Bumped whenever a signature or a layout changes; Python refuses a library with another value.
#define KVL_ABI_VERSION 15

enum kvl_status {
    KVL_OK = 0,
    KVL_BAD_SHAPE = -1,
    KVL_BAD_TYPE = -2,
    KVL_NO_MEMORY = -3,
    KVL_COMPUTE_FAILED = -4,
    KVL_BAD_MODEL = -5,
};

// A model's RoPE as llama.cpp applies it (ggml_rope_ext's arguments). Mirrored by kvlite/native.py.
struct kvl_rope {
    int32_t mode, n_dims, n_ctx_orig;
    float freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow;
    const float * freq_factors;  // [n_dims / 2], Llama 3's rope_freqs.weight; NULL: none
};

// The model facts a counter-causal pass needs. Mirrored by kvlite/native.py.
struct kvl_hparams {
    int32_t qk_norm;  // 1: per-head RMS norm of Q (and K) before RoPE (qwen3)
    int32_t n_layer, n_embd, n_head, n_head_kv, head_dim, n_vocab;
    float rms_eps;
    struct kvl_rope rope;
};

// ggml_rope_ext of x [head_dim, n_head, n] at positions pos with a model's RoPE; factors: an f32
// tensor [n_dims / 2] of frequency factors, or NULL.
static inline struct ggml_tensor * kvl_rope_ext(struct ggml_context * g, struct ggml_tensor * x, struct ggml_tensor * pos,
                                                struct ggml_tensor * factors, const struct kvl_rope * r) {
    return ggml_rope_ext(g, x, pos, factors, r->n_dims, r->mode, r->n_ctx_orig, r->freq_base, r->freq_scale,
                         r->ext_factor, r->attn_factor, r->beta_fast, r->beta_slow);
}

// The backends kernels run on (a device, if one was named, then the CPU) and their scheduler,
// reused across calls (see kvl_init).
struct kvl_ctx {
    ggml_backend_t backends[2];
    int n_backends;
    int n_threads;  // the CPU backend's
    ggml_backend_sched_t sched;
    size_t sched_size;  // the graph size the scheduler was made for
};
void kvl_free(struct kvl_ctx * c);
// The CPU backend's thread count (kvlite's -t), for every kernel run after this call.
void kvl_set_threads(struct kvl_ctx * c, int n_threads);
// Free the scheduler and its compute buffer (the next kernel makes them again): an eviction's
// scratch memory is then not held beside the compaction that follows it.
void kvl_free_buffers(struct kvl_ctx * c);

// Mark the inputs and `out`, allocate gf's tensors, copy inputs in, compute, copy `out` back.
// Returns a kvl_status.
struct kvl_input {
    struct ggml_tensor * tensor;
    const void * data;
};
int kvl_run(struct kvl_ctx * c, struct ggml_cgraph * gf, const struct kvl_input * inputs, int n_inputs,
            struct ggml_tensor * out, void * out_data);

// Row-wise maximum and log-sum-exp over dim 0.
struct ggml_tensor * kvl_row_max(struct ggml_context * g, struct ggml_tensor * x);
struct ggml_tensor * kvl_logsumexp(struct ggml_context * g, struct ggml_tensor * x);
