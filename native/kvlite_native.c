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
#define KVL_ABI_VERSION 2

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
