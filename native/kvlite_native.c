// kvlite's score kernels, as ggml graphs run on the ggml that llama.cpp itself uses.
// Called from Python through ctypes (kvlite/native.py). Arrays are C-contiguous; shapes below are
// in numpy order (slowest dimension first), ggml's ne is the reverse.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

// Bumped whenever a signature or a layout changes; Python refuses a library with another value.
#define KVL_ABI_VERSION 1

enum kvl_status {
    KVL_OK = 0,
    KVL_BAD_SHAPE = -1,
    KVL_BAD_TYPE = -2,
    KVL_NO_MEMORY = -3,
    KVL_COMPUTE_FAILED = -4,
};

struct kvl_ctx {
    ggml_backend_t backend;
    ggml_gallocr_t galloc;
};

int kvl_abi_version(void) { return KVL_ABI_VERSION; }

// sizeof(struct ggml_tensor) as compiled here: Python checks it against its ctypes mirror.
size_t kvl_ggml_tensor_size(void) { return sizeof(struct ggml_tensor); }

struct kvl_ctx * kvl_init(int n_threads) {
    struct kvl_ctx * c = calloc(1, sizeof(*c));
    if (!c) return NULL;
    c->backend = ggml_backend_cpu_init();
    if (!c->backend) { free(c); return NULL; }
    ggml_backend_cpu_set_n_threads(c->backend, n_threads > 0 ? n_threads : 1);
    c->galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(c->backend));
    if (!c->galloc) { ggml_backend_free(c->backend); free(c); return NULL; }
    return c;
}

void kvl_free(struct kvl_ctx * c) {
    if (!c) return;
    ggml_gallocr_free(c->galloc);
    ggml_backend_free(c->backend);
    free(c);
}

// EchoKV Eq. 3, attention pooling: for every layer l and KV group g,
//   out[l, g, i] = sum over queries q of group g of softmax_i(q . k_i * scale)
// where the softmax runs over the n_keys keys given. Query head h belongs to KV group
// h / (n_head / n_head_kv), as in llama.cpp's grouped-query attention.
//   q:   f32 [n_layer, n_head, n_q, head_dim]
//   k:   f32 or f16 (k_type: 0 = f32, 1 = f16) [n_layer, n_head_kv, n_keys, head_dim]
//   out: f32 [n_layer, n_head_kv, n_keys]
int kvl_attn_pool(struct kvl_ctx * c, const float * q, const void * k, int k_type, int n_layer, int n_head,
                  int n_head_kv, int n_q, int n_keys, int head_dim, float scale, float * out) {
    if (!c || n_layer <= 0 || n_head <= 0 || n_head_kv <= 0 || n_q <= 0 || n_keys <= 0 || head_dim <= 0 ||
        n_head % n_head_kv != 0) {
        return KVL_BAD_SHAPE;
    }
    if (k_type != GGML_TYPE_F32 && k_type != GGML_TYPE_F16) return KVL_BAD_TYPE;
    const int group = n_head / n_head_kv;

    struct ggml_init_params ip = {ggml_tensor_overhead() * 16 + ggml_graph_overhead(), NULL, true};
    struct ggml_context * g = ggml_init(ip);
    if (!g) return KVL_NO_MEMORY;

    struct ggml_tensor * tq = ggml_new_tensor_4d(g, GGML_TYPE_F32, head_dim, n_q, n_head, n_layer);
    struct ggml_tensor * tk = ggml_new_tensor_4d(g, (enum ggml_type) k_type, head_dim, n_keys, n_head_kv, n_layer);
    ggml_set_input(tq);
    ggml_set_input(tk);
    // f16 keys are widened first: a mixed f16 x f32 product would round the queries to f16.
    struct ggml_tensor * kf = k_type == GGML_TYPE_F32 ? tk : ggml_cast(g, tk, GGML_TYPE_F32);
    // [n_keys, n_q, n_head, n_layer]; mul_mat broadcasts KV head h/group over query head h
    struct ggml_tensor * kq = ggml_mul_mat(g, kf, tq);
    struct ggml_tensor * p = ggml_soft_max_ext(g, kq, NULL, scale, 0.0f);
    // queries of one group are adjacent: [n_keys, n_q * group, n_head_kv, n_layer]
    p = ggml_reshape_4d(g, p, n_keys, n_q * group, n_head_kv, n_layer);
    p = ggml_cont(g, ggml_permute(g, p, 1, 0, 2, 3));  // [n_q * group, n_keys, ...]
    struct ggml_tensor * s = ggml_sum_rows(g, p);        // [1, n_keys, n_head_kv, n_layer]
    ggml_set_output(s);

    struct ggml_cgraph * gf = ggml_new_graph(g);
    ggml_build_forward_expand(gf, s);
    int rc = KVL_OK;
    if (!ggml_gallocr_alloc_graph(c->galloc, gf)) {
        rc = KVL_NO_MEMORY;
    } else {
        ggml_backend_tensor_set(tq, q, 0, ggml_nbytes(tq));
        ggml_backend_tensor_set(tk, k, 0, ggml_nbytes(tk));
        if (ggml_backend_graph_compute(c->backend, gf) != GGML_STATUS_SUCCESS) {
            rc = KVL_COMPUTE_FAILED;
        } else {
            ggml_backend_tensor_get(s, out, 0, ggml_nbytes(s));
        }
    }
    ggml_free(g);
    return rc;
}
