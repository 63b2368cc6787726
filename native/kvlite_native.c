// kvlite's score kernels, as ggml graphs run on the ggml that llama.cpp itself uses.
// Called from Python through ctypes (kvlite/native.py). Arrays are C-contiguous; shapes below are
// in numpy order (slowest dimension first), ggml's ne is the reverse.
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

// Bumped whenever a signature or a layout changes; Python refuses a library with another value.
#define KVL_ABI_VERSION 4

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

// Row-wise maximum over dim 0 (ggml has no max-reduction op; a max-pool over the whole row is one).
static struct ggml_tensor * kvl_row_max(struct ggml_context * g, struct ggml_tensor * x) {
    return ggml_pool_1d(g, x, GGML_OP_POOL_MAX, (int) x->ne[0], (int) x->ne[0], 0);
}

// log(sum(exp(x))) over dim 0, stable: m + log(sum(exp(x - m))).
static struct ggml_tensor * kvl_logsumexp(struct ggml_context * g, struct ggml_tensor * x) {
    struct ggml_tensor * m = kvl_row_max(g, x);
    struct ggml_tensor * s = ggml_sum_rows(g, ggml_exp(g, ggml_sub(g, x, m)));
    return ggml_add(g, m, ggml_log(g, s));
}

// SnapKV-style smoothing: y[i] = max(x[i - h .. i + h]), h = kernel / 2, along dim 0, x >= 0.
// The CPU backend only pools with stride == kernel, so pool each of the `kernel` phase-shifted
// views of the zero-padded input (zero is neutral: scores are >= 0) and interleave the results.
static struct ggml_tensor * kvl_max_smooth(struct ggml_context * g, struct ggml_tensor * x, int kernel) {
    const int64_t n = x->ne[0];
    const int h = kernel / 2;
    const int64_t J = (n + kernel - 1) / kernel;
    const int64_t padded = J * kernel + kernel - 1;
    struct ggml_tensor * xp = ggml_pad_ext(g, x, h, (int) (padded - n - h), 0, 0, 0, 0, 0, 0);
    struct ggml_tensor * y = NULL;
    for (int o = 0; o < kernel; o++) {
        struct ggml_tensor * v = ggml_view_4d(g, xp, J * kernel, xp->ne[1], xp->ne[2], xp->ne[3], xp->nb[1], xp->nb[2],
                                              xp->nb[3], o * xp->nb[0]);
        struct ggml_tensor * p = ggml_pool_1d(g, ggml_cont(g, v), GGML_OP_POOL_MAX, kernel, kernel, 0);  // [J, ...]
        p = ggml_reshape_4d(g, p, 1, J, p->ne[1], p->ne[2]);
        y = y ? ggml_concat(g, y, p, 0) : p;  // [o, J, ...]: memory order i = j * kernel + o
    }
    y = ggml_reshape_3d(g, y, J * kernel, x->ne[1], x->ne[2]);
    return ggml_cont(g, ggml_view_3d(g, y, n, y->ne[1], y->ne[2], y->nb[1], y->nb[2], 0));
}

// Scaled, masked logits of keys [c0, c0 + len) for every query: [len, n_q, n_head, n_layer].
static struct ggml_tensor * kvl_chunk_logits(struct ggml_context * g, struct ggml_tensor * tq, struct ggml_tensor * tk,
                                             struct ggml_tensor * tm, int c0, int len, float scale) {
    struct ggml_tensor * kc =
        ggml_view_4d(g, tk, tk->ne[0], len, tk->ne[2], tk->ne[3], tk->nb[1], tk->nb[2], tk->nb[3], (size_t) c0 * tk->nb[1]);
    // f16 keys are widened first: a mixed f16 x f32 product would round the queries to f16
    if (kc->type != GGML_TYPE_F32) kc = ggml_cast(g, kc, GGML_TYPE_F32);
    struct ggml_tensor * x = ggml_scale(g, ggml_mul_mat(g, kc, tq), scale);  // KV head h/group serves query head h
    return tm ? ggml_add(g, x, ggml_view_1d(g, tm, len, (size_t) c0 * sizeof(float))) : x;
}

// EchoKV Eq. 3, attention pooling: for every layer l and KV group g,
//   out[l, g, i] = sum over queries q of group g of softmax_i(q . k_i * scale + mask_i)
// where the softmax runs over the n_keys keys given. Query head h belongs to KV group
// h / (n_head / n_head_kv), as in llama.cpp's grouped-query attention.
//   q:        f32 [n_layer, n_head, n_q, head_dim]
//   k:        f32 or f16 (k_type: 0 = f32, 1 = f16) [n_layer, n_head_kv, n_keys, head_dim]
//   key_mask: f32 [n_keys], 0 for a key that counts, a large negative value (-1e30) for one that
//             does not (its probability is 0); NULL: every key counts
//   chunk:    keys per chunk (0: all at once). Memory is bounded by the chunk, not n_keys: a first
//             pass takes each query's log-sum-exp over the chunks, a second recomputes each chunk's
//             logits and turns them into probabilities.
//   pool_kernel: odd width of a max-pool over keys applied to the pooled scores (0 or 1: none)
//   out:      f32 [n_layer, n_head_kv, n_keys]
int kvl_attn_pool(struct kvl_ctx * c, const float * q, const void * k, int k_type, const float * key_mask,
                  int n_layer, int n_head, int n_head_kv, int n_q, int n_keys, int head_dim, float scale, int chunk,
                  int pool_kernel, float * out) {
    if (!c || n_layer <= 0 || n_head <= 0 || n_head_kv <= 0 || n_q <= 0 || n_keys <= 0 || head_dim <= 0 ||
        n_head % n_head_kv != 0 || chunk < 0 || pool_kernel < 0 || (pool_kernel > 1 && pool_kernel % 2 == 0)) {
        return KVL_BAD_SHAPE;
    }
    if (k_type != GGML_TYPE_F32 && k_type != GGML_TYPE_F16) return KVL_BAD_TYPE;
    const int group = n_head / n_head_kv;
    if (chunk == 0 || chunk > n_keys) chunk = n_keys;
    const int n_chunk = (n_keys + chunk - 1) / chunk;

    const size_t n_tensors = 64 + (size_t) n_chunk * 48 + (size_t) pool_kernel * 8;
    struct ggml_init_params ip = {ggml_tensor_overhead() * n_tensors + ggml_graph_overhead_custom(n_tensors, false),
                                  NULL, true};
    struct ggml_context * g = ggml_init(ip);
    if (!g) return KVL_NO_MEMORY;

    struct ggml_tensor * tq = ggml_new_tensor_4d(g, GGML_TYPE_F32, head_dim, n_q, n_head, n_layer);
    struct ggml_tensor * tk = ggml_new_tensor_4d(g, (enum ggml_type) k_type, head_dim, n_keys, n_head_kv, n_layer);
    struct ggml_tensor * tm = key_mask ? ggml_new_tensor_1d(g, GGML_TYPE_F32, n_keys) : NULL;
    ggml_set_input(tq);
    ggml_set_input(tk);
    if (tm) ggml_set_input(tm);

    struct ggml_tensor * lse = NULL;  // [1, n_q, n_head, n_layer]
    if (n_chunk > 1) {
        struct ggml_tensor * parts = NULL;
        for (int ci = 0; ci < n_chunk; ci++) {
            const int c0 = ci * chunk, len = c0 + chunk <= n_keys ? chunk : n_keys - c0;
            struct ggml_tensor * l = kvl_logsumexp(g, kvl_chunk_logits(g, tq, tk, tm, c0, len, scale));
            parts = parts ? ggml_concat(g, parts, l, 0) : l;
        }
        lse = kvl_logsumexp(g, parts);
    }
    struct ggml_tensor * s = NULL;  // [n_keys, n_head_kv, n_layer]
    for (int ci = 0; ci < n_chunk; ci++) {
        const int c0 = ci * chunk, len = c0 + chunk <= n_keys ? chunk : n_keys - c0;
        struct ggml_tensor * x = kvl_chunk_logits(g, tq, tk, tm, c0, len, scale);
        struct ggml_tensor * p = lse ? ggml_exp(g, ggml_sub(g, x, lse)) : ggml_soft_max(g, x);
        // queries of one group are adjacent: [len, n_q * group, n_head_kv, n_layer] -> sum over them
        p = ggml_reshape_4d(g, p, len, n_q * group, n_head_kv, n_layer);
        p = ggml_sum_rows(g, ggml_cont(g, ggml_permute(g, p, 1, 0, 2, 3)));  // [1, len, n_head_kv, n_layer]
        p = ggml_reshape_3d(g, p, len, n_head_kv, n_layer);
        s = s ? ggml_concat(g, s, p, 0) : p;
    }
    if (pool_kernel > 1) s = kvl_max_smooth(g, s, pool_kernel);
    ggml_set_output(s);

    struct ggml_cgraph * gf = ggml_new_graph_custom(g, n_tensors, false);
    ggml_build_forward_expand(gf, s);
    int rc = KVL_OK;
    if (!ggml_gallocr_alloc_graph(c->galloc, gf)) {
        rc = KVL_NO_MEMORY;
    } else {
        ggml_backend_tensor_set(tq, q, 0, ggml_nbytes(tq));
        ggml_backend_tensor_set(tk, k, 0, ggml_nbytes(tk));
        if (tm) ggml_backend_tensor_set(tm, key_mask, 0, ggml_nbytes(tm));
        if (ggml_backend_graph_compute(c->backend, gf) != GGML_STATUS_SUCCESS) {
            rc = KVL_COMPUTE_FAILED;
        } else {
            ggml_backend_tensor_get(s, out, 0, ggml_nbytes(s));
        }
    }
    ggml_free(g);
    return rc;
}

// EchoKV Eq. 2, proposals: RoPE as llama.cpp applies it (ggml_rope_ext with the model's mode,
// base, frequency scale and YaRN parameters), here to rotate pre-RoPE queries to chosen positions.
//   x: f32 [n_tok, n_head, head_dim] (pre-RoPE); pos: i32 [n_tok]; out: f32, same shape as x.
int kvl_rope(struct kvl_ctx * c, const float * x, const int32_t * pos, int n_tok, int n_head, int head_dim, int n_dims,
             int mode, int n_ctx_orig, float freq_base, float freq_scale, float ext_factor, float attn_factor,
             float beta_fast, float beta_slow, float * out) {
    if (!c || n_tok <= 0 || n_head <= 0 || head_dim <= 0 || n_dims <= 0 || n_dims > head_dim || n_dims % 2) {
        return KVL_BAD_SHAPE;
    }
    struct ggml_init_params ip = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), NULL, true};
    struct ggml_context * g = ggml_init(ip);
    if (!g) return KVL_NO_MEMORY;
    struct ggml_tensor * tx = ggml_new_tensor_3d(g, GGML_TYPE_F32, head_dim, n_head, n_tok);
    struct ggml_tensor * tp = ggml_new_tensor_1d(g, GGML_TYPE_I32, n_tok);
    ggml_set_input(tx);
    ggml_set_input(tp);
    struct ggml_tensor * r = ggml_rope_ext(g, tx, tp, NULL, n_dims, mode, n_ctx_orig, freq_base, freq_scale, ext_factor,
                                           attn_factor, beta_fast, beta_slow);
    ggml_set_output(r);
    struct ggml_cgraph * gf = ggml_new_graph(g);
    ggml_build_forward_expand(gf, r);
    int rc = KVL_OK;
    if (!ggml_gallocr_alloc_graph(c->galloc, gf)) {
        rc = KVL_NO_MEMORY;
    } else {
        ggml_backend_tensor_set(tx, x, 0, ggml_nbytes(tx));
        ggml_backend_tensor_set(tp, pos, 0, ggml_nbytes(tp));
        if (ggml_backend_graph_compute(c->backend, gf) != GGML_STATUS_SUCCESS) {
            rc = KVL_COMPUTE_FAILED;
        } else {
            ggml_backend_tensor_get(r, out, 0, ggml_nbytes(r));
        }
    }
    ggml_free(g);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Eval-callback capture. llama.cpp calls the callback once per graph node to ask whether the
// caller wants it (every "yes" splits the graph there) and again after computing a wanted node.
// Doing this in C keeps the per-node cost out of Python (a Python callback cost ~15% of decode).

#define KVL_MAX_WANT 1024
#define KVL_NAME_LEN 64
#define KVL_OP_LEN 32

struct kvl_want {
    char name[KVL_NAME_LEN];
    char op[KVL_OP_LEN];
};

struct kvl_record {
    int want;        // index into wants
    int64_t ne[4];   // ggml order
    float * data;    // ne[0]*ne[1]*ne[2]*ne[3] floats, ne[0] fastest
};

struct kvl_capture {
    int enabled;
    int n_want;
    struct kvl_want want[KVL_MAX_WANT];
    int n_rec, cap_rec;
    struct kvl_record * rec;
    int failed;  // a record could not be stored (out of memory or an unsupported type)
};

struct kvl_capture * kvl_capture_new(void) {
    struct kvl_capture * c = calloc(1, sizeof(*c));
    if (c) c->enabled = 1;
    return c;
}

void kvl_capture_clear(struct kvl_capture * c) {
    for (int i = 0; i < c->n_rec; i++) free(c->rec[i].data);
    c->n_rec = 0;
    c->failed = 0;
}

void kvl_capture_free(struct kvl_capture * c) {
    if (!c) return;
    kvl_capture_clear(c);
    free(c->rec);
    free(c);
}

// Returns the want's index, or -1 when the table is full or a string is too long.
int kvl_capture_want(struct kvl_capture * c, const char * name, const char * op) {
    if (c->n_want >= KVL_MAX_WANT || strlen(name) >= KVL_NAME_LEN || strlen(op) >= KVL_OP_LEN) return -1;
    struct kvl_want * w = &c->want[c->n_want];
    strcpy(w->name, name);
    strcpy(w->op, op);
    return c->n_want++;
}

void kvl_capture_forget(struct kvl_capture * c) {
    kvl_capture_clear(c);
    c->n_want = 0;
}

void kvl_capture_enable(struct kvl_capture * c, int on) { c->enabled = on; }

static int kvl_match(const struct kvl_capture * c, const struct ggml_tensor * t) {
    for (int i = 0; i < c->n_want; i++) {
        const struct kvl_want * w = &c->want[i];
        if (w->name[0] == t->name[0] && strcmp(w->name, t->name) == 0 && strcmp(w->op, ggml_op_desc(t)) == 0) {
            return i;
        }
    }
    return -1;
}

// Copy any f32/f16 tensor, contiguous or a strided view, on any backend, into contiguous f32.
static float * kvl_copy_f32(const struct ggml_tensor * t) {
    const size_t n = (size_t) ggml_nelements(t);
    const size_t esize = ggml_type_size(t->type);
    if (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_F16) return NULL;
    float * out = malloc(n * sizeof(float));
    if (!out) return NULL;
    if (t->type == GGML_TYPE_F32 && ggml_is_contiguous(t)) {
        ggml_backend_tensor_get(t, out, 0, n * sizeof(float));
        return out;
    }
    size_t extent = esize;
    for (int d = 0; d < 4; d++) extent += (size_t) (t->ne[d] - 1) * t->nb[d];
    char * raw = malloc(extent);
    if (!raw) { free(out); return NULL; }
    ggml_backend_tensor_get(t, raw, 0, extent);
    size_t k = 0;
    for (int64_t i3 = 0; i3 < t->ne[3]; i3++)
    for (int64_t i2 = 0; i2 < t->ne[2]; i2++)
    for (int64_t i1 = 0; i1 < t->ne[1]; i1++) {
        const char * row = raw + i3 * t->nb[3] + i2 * t->nb[2] + i1 * t->nb[1];
        for (int64_t i0 = 0; i0 < t->ne[0]; i0++) {
            const char * p = row + i0 * t->nb[0];
            out[k++] = t->type == GGML_TYPE_F32 ? *(const float *) p : ggml_fp16_to_fp32(*(const ggml_fp16_t *) p);
        }
    }
    free(raw);
    return out;
}

bool kvl_capture_eval(struct ggml_tensor * t, bool ask, void * user_data) {
    struct kvl_capture * c = user_data;
    if (!c->enabled || c->n_want == 0) return !ask;  // ask: not wanted; after compute: go on
    const int i = kvl_match(c, t);
    if (i < 0) return !ask;
    if (ask) return true;
    if (c->n_rec == c->cap_rec) {
        int cap = c->cap_rec ? 2 * c->cap_rec : 64;
        struct kvl_record * r = realloc(c->rec, cap * sizeof(*r));
        if (!r) { c->failed = 1; return true; }
        c->rec = r;
        c->cap_rec = cap;
    }
    float * data = kvl_copy_f32(t);
    if (!data) { c->failed = 1; return true; }
    struct kvl_record * r = &c->rec[c->n_rec++];
    r->want = i;
    memcpy(r->ne, t->ne, sizeof(r->ne));
    r->data = data;
    return true;
}

int kvl_capture_count(const struct kvl_capture * c) { return c->failed ? -1 : c->n_rec; }

// The i-th record: its want index and shape; returns its data (owned by the capture).
const float * kvl_capture_record(const struct kvl_capture * c, int i, int * want, int64_t * ne) {
    if (i < 0 || i >= c->n_rec) return NULL;
    *want = c->rec[i].want;
    memcpy(ne, c->rec[i].ne, sizeof(c->rec[i].ne));
    return c->rec[i].data;
}
