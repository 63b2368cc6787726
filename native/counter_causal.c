// Counter-causal surprise ("Back from the Future", Section 3.1): run the model over the cached
// tokens in their original order with an upper-triangular mask (token i attends only to cells of
// later positions), reusing the cached K and V, and read the logit of x_i at position i.
// Full: every layer, queries from the recomputed hidden states. Fast: the last layer only, from
// the hidden states that entered it during the causal pass.
#include <fcntl.h>
#include <math.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gguf.h"
#include "kvl.h"

// Rows per block: a block's [n, block, H] f32 score matrix stays near 16 MB.
static int kvl_cc_block(int n, int n_head) {
    const size_t b = (16u << 20) / (4u * (size_t) n * (size_t) n_head);
    return b < 1 ? 1 : (b > (size_t) n ? n : (int) b);
}

struct kvl_layer {
    struct ggml_tensor *attn_norm, *wq, *bq, *q_norm, *wo, *ffn_norm, *w_gate, *w_up, *w_down;
};

struct kvl_model {
    struct kvl_hparams hp;
    struct gguf_context * gguf;
    struct ggml_context * weights;  // tensor metadata; data lives in the file mapping
    void * map;
    size_t map_size;
    ggml_backend_buffer_t buffer;
    struct ggml_tensor *tok_embd, *out_norm, *output;
    struct ggml_tensor * rope_freqs;  // Llama 3's frequency factors, as mapped from the file; NULL: none
    struct kvl_layer * layers;
};

void kvl_model_free(struct kvl_model * m) {
    if (!m) return;
    if (m->buffer) ggml_backend_buffer_free(m->buffer);
    if (m->map && m->map != MAP_FAILED) munmap(m->map, m->map_size);
    if (m->weights) ggml_free(m->weights);
    if (m->gguf) gguf_free(m->gguf);
    free(m->layers);
    free(m);
}

static struct ggml_tensor * kvl_weight(struct kvl_model * m, const char * fmt, int il, bool required, bool * ok) {
    char name[GGML_MAX_NAME];
    snprintf(name, sizeof(name), fmt, il);
    struct ggml_tensor * t = ggml_get_tensor(m->weights, name);
    if (!t && required) *ok = false;
    return t;
}

// Drops this mapping's pages of the given weights once a pass has used them. The data stays in the
// page cache (and in llama.cpp's own mapping of the file), so nothing is lost; without this, RSS
// counts every weight page twice, once per mapping, for as long as the model is loaded.
static void kvl_release(const struct kvl_model * m, const struct ggml_tensor * const * ts, int n) {
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t lo_map = (uintptr_t) m->map, hi_map = lo_map + m->map_size;
    for (int i = 0; i < n; i++) {
        if (!ts[i]) continue;
        uintptr_t lo = (uintptr_t) ts[i]->data & ~(page - 1);
        uintptr_t hi = ((uintptr_t) ts[i]->data + ggml_nbytes(ts[i]) + page - 1) & ~(page - 1);
        if (lo < lo_map) lo = lo_map;
        if (hi > hi_map) hi = hi_map;
        if (hi > lo) madvise((void *) lo, hi - lo, MADV_DONTNEED);  // advisory: a failure costs only RSS
    }
}

// Memory-maps the GGUF (the page cache then holds one copy, shared with llama.cpp's own mapping)
// and points ggml tensors at the weights as stored, quantized or not. NULL on failure.
struct kvl_model * kvl_model_load(const char * path, const struct kvl_hparams * hp) {
    struct kvl_model * m = calloc(1, sizeof(*m));
    if (!m) return NULL;
    m->hp = *hp;
    m->hp.rope.freq_factors = NULL;  // the caller's array is not kept: the file's own tensor is used
    struct gguf_init_params gp = {true, &m->weights};
    m->gguf = gguf_init_from_file(path, gp);
    if (!m->gguf) goto fail;
    int fd = open(path, O_RDONLY);
    if (fd < 0) goto fail;
    struct stat st;
    if (fstat(fd, &st) != 0) { close(fd); goto fail; }
    m->map_size = (size_t) st.st_size;
    m->map = mmap(NULL, m->map_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (m->map == MAP_FAILED) goto fail;
    // ggml never writes to these tensors; the buffer just describes where they are.
    m->buffer = ggml_backend_cpu_buffer_from_ptr(m->map, m->map_size);
    if (!m->buffer) goto fail;
    const size_t data_offset = gguf_get_data_offset(m->gguf);
    for (int64_t i = 0; i < gguf_get_n_tensors(m->gguf); i++) {
        struct ggml_tensor * t = ggml_get_tensor(m->weights, gguf_get_tensor_name(m->gguf, i));
        const size_t off = data_offset + gguf_get_tensor_offset(m->gguf, i);
        if (!t || off + ggml_nbytes(t) > m->map_size) goto fail;
        if (ggml_backend_tensor_alloc(m->buffer, t, (char *) m->map + off) != GGML_STATUS_SUCCESS) goto fail;
    }
    bool ok = true;
    m->tok_embd = kvl_weight(m, "token_embd.weight", 0, true, &ok);
    m->out_norm = kvl_weight(m, "output_norm.weight", 0, true, &ok);
    m->output = kvl_weight(m, "output.weight", 0, false, &ok);
    if (!m->output) m->output = m->tok_embd;  // tied embeddings
    m->rope_freqs = kvl_weight(m, "rope_freqs.weight", 0, hp->rope.freq_factors != NULL, &ok);
    if (m->rope_freqs && (m->rope_freqs->type != GGML_TYPE_F32 || m->rope_freqs->ne[0] != hp->rope.n_dims / 2)) ok = false;
    m->layers = calloc(hp->n_layer, sizeof(*m->layers));
    if (!m->layers) goto fail;
    for (int il = 0; il < hp->n_layer; il++) {
        struct kvl_layer * L = &m->layers[il];
        L->attn_norm = kvl_weight(m, "blk.%d.attn_norm.weight", il, true, &ok);
        L->wq = kvl_weight(m, "blk.%d.attn_q.weight", il, true, &ok);
        L->bq = kvl_weight(m, "blk.%d.attn_q.bias", il, false, &ok);  // optional on every architecture
        L->q_norm = kvl_weight(m, "blk.%d.attn_q_norm.weight", il, hp->qk_norm, &ok);
        L->wo = kvl_weight(m, "blk.%d.attn_output.weight", il, true, &ok);
        L->ffn_norm = kvl_weight(m, "blk.%d.ffn_norm.weight", il, true, &ok);
        L->w_gate = kvl_weight(m, "blk.%d.ffn_gate.weight", il, true, &ok);
        L->w_up = kvl_weight(m, "blk.%d.ffn_up.weight", il, true, &ok);
        L->w_down = kvl_weight(m, "blk.%d.ffn_down.weight", il, true, &ok);
    }
    if (!ok || m->tok_embd->ne[0] != hp->n_embd || m->output->ne[1] != hp->n_vocab) goto fail;
    return m;
fail:
    kvl_model_free(m);
    return NULL;
}

// Attention of query rows [a, a + len) over the cached K/V of one layer, cells in *descending*
// position order: cell i attends to cells 0 .. i-1-gap, the later positions at least gap cells
// away (ggml's causal mask with n_past = a - 1 - gap). Requires a > gap. Only the keys the rows
// can see are read (and widened, f16 to f32: a mixed product would round the queries to f16).
//   q: [D, H, len] (roped); k, v: [D, Hkv, n]. Returns [D * H, len].
static struct ggml_tensor * kvl_cc_attention(struct ggml_context * g, const struct kvl_hparams * hp,
                                             struct ggml_tensor * q, struct ggml_tensor * k, struct ggml_tensor * v,
                                             int a, int len, int gap) {
    const int D = hp->head_dim, H = hp->n_head, nk = a + len - 1 - gap;
    struct ggml_tensor * kb = ggml_view_3d(g, k, D, k->ne[1], nk, k->nb[1], k->nb[2], 0);
    struct ggml_tensor * vb = ggml_view_3d(g, v, D, v->ne[1], nk, v->nb[1], v->nb[2], 0);
    if (kb->type != GGML_TYPE_F32) {
        kb = ggml_cast(g, kb, GGML_TYPE_F32);
        vb = ggml_cast(g, vb, GGML_TYPE_F32);
    }
    struct ggml_tensor * kp = ggml_permute(g, kb, 0, 2, 1, 3);               // [D, nk, Hkv]
    struct ggml_tensor * vt = ggml_cont(g, ggml_permute(g, vb, 1, 2, 0, 3));  // [nk, D, Hkv]
    struct ggml_tensor * qp = ggml_permute(g, q, 0, 2, 1, 3);                // [D, len, H]
    struct ggml_tensor * kq = ggml_scale(g, ggml_mul_mat(g, kp, qp), 1.0f / sqrtf((float) D));  // [nk, len, H]
    kq = ggml_soft_max(g, ggml_diag_mask_inf(g, kq, a - 1 - gap));
    struct ggml_tensor * o = ggml_mul_mat(g, vt, kq);  // [D, len, H]
    return ggml_reshape_2d(g, ggml_cont(g, ggml_permute(g, o, 0, 2, 1, 3)), D * H, len);
}

// The counter-causal pass, one layer at a time, driven from Python (kvlite/scoring/surprise.py):
//   kvl_cc_embed   the input rows of layer 0 (the token embeddings);
//   kvl_cc_layer   one layer over every cell, reading that layer's cached K/V, hidden rows in place;
//   kvl_cc_output  the logit (or log-probability) of x_i at every cell from the last hidden rows.
// Cells come in strictly DESCENDING position order: cell i attends to the cells after it (lower
// index), skipping the nearest `gap` ones (the reference code's min_gap, against K/V leakage; 0 in
// the paper); cells 0 .. gap see nothing and get a zero attention output. A row's pass reads the
// cached K/V, never another row's hidden state, so rows go in blocks, one graph each: memory is one
// layer's K/V (copied to the backend once per layer) plus one block's activations, and the caller
// holds the hidden rows [n, n_embd] and one layer's K/V at a time.
//   block: rows per block (0: keep a block's [n, block, H] score matrix near 16 MB)

// tokens i32 [n] -> hidden f32 [n, n_embd] (dequantized rows of token_embd)
int kvl_cc_embed(struct kvl_ctx * c, const struct kvl_model * m, int n, const int32_t * tokens, float * hidden) {
    if (!c || !m || n <= 0) return KVL_BAD_SHAPE;
    struct ggml_init_params ip = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), NULL, true};
    struct ggml_context * g = ggml_init(ip);
    if (!g) return KVL_NO_MEMORY;
    struct ggml_tensor * t_tok = ggml_new_tensor_1d(g, GGML_TYPE_I32, n);
    struct ggml_tensor * x = ggml_get_rows(g, m->tok_embd, t_tok);
    struct ggml_cgraph * gf = ggml_new_graph(g);
    ggml_build_forward_expand(gf, x);
    const struct kvl_input in[] = {{t_tok, tokens}};
    const int rc = kvl_run(c, gf, in, 1, x, hidden);
    ggml_free(g);
    kvl_release(m, (const struct ggml_tensor * const[]) {m->tok_embd}, 1);
    return rc;
}

// Layer il over n cells: pos i32 [n]; k, v kv_type (0 f32, 1 f16) [n, n_head_kv * head_dim], this
// layer's cached rows; hidden f32 [n, n_embd], the layer's input rows, replaced by its output.
int kvl_cc_layer(struct kvl_ctx * c, const struct kvl_model * m, int il, int gap, int block, int n,
                 const int32_t * pos, const void * k, const void * v, int kv_type, float * hidden) {
    const struct kvl_hparams * hp = &m->hp;
    if (!c || !m || gap < 0 || n < gap + 2 || il < 0 || il >= hp->n_layer) return KVL_BAD_SHAPE;
    if (kv_type != GGML_TYPE_F32 && kv_type != GGML_TYPE_F16) return KVL_BAD_TYPE;
    const int D = hp->head_dim, Hkv = hp->n_head_kv;
    if (block <= 0) block = kvl_cc_block(n, hp->n_head);
    const struct kvl_layer * L = &m->layers[il];

    struct ggml_init_params kp = {ggml_tensor_overhead() * 2, NULL, true};
    struct ggml_context * gkv = ggml_init(kp);
    if (!gkv) return KVL_NO_MEMORY;
    struct ggml_tensor * t_k = ggml_new_tensor_3d(gkv, (enum ggml_type) kv_type, D, Hkv, n);
    struct ggml_tensor * t_v = ggml_new_tensor_3d(gkv, (enum ggml_type) kv_type, D, Hkv, n);
    ggml_backend_buffer_t kv_buf = ggml_backend_alloc_ctx_tensors(gkv, c->backends[0]);
    if (!kv_buf) { ggml_free(gkv); return KVL_NO_MEMORY; }
    ggml_backend_tensor_set(t_k, k, 0, ggml_nbytes(t_k));
    ggml_backend_tensor_set(t_v, v, 0, ggml_nbytes(t_v));

    int rc = KVL_OK;
    const size_t n_nodes = 160;
    for (int r0 = 0; r0 < n && rc == KVL_OK; r0 += block) {
        const int len = r0 + block <= n ? block : n - r0;
        const int z = gap + 1 - r0 > len ? len : (gap + 1 - r0 > 0 ? gap + 1 - r0 : 0);  // rows seeing nothing
        struct ggml_init_params ip = {ggml_tensor_overhead() * n_nodes + ggml_graph_overhead_custom(n_nodes, false),
                                      NULL, true};
        struct ggml_context * g = ggml_init(ip);
        if (!g) { rc = KVL_NO_MEMORY; break; }
        struct ggml_tensor * t_pos = ggml_new_tensor_1d(g, GGML_TYPE_I32, len);
        struct ggml_tensor * x = ggml_new_tensor_2d(g, GGML_TYPE_F32, hp->n_embd, len);
        struct ggml_tensor * cur = ggml_mul(g, ggml_rms_norm(g, x, hp->rms_eps), L->attn_norm);
        struct ggml_tensor * q = ggml_mul_mat(g, L->wq, cur);
        if (L->bq) q = ggml_add(g, q, L->bq);
        q = ggml_reshape_3d(g, q, D, hp->n_head, len);
        if (L->q_norm) q = ggml_mul(g, ggml_rms_norm(g, q, hp->rms_eps), L->q_norm);  // over each head's D
        q = kvl_rope_ext(g, q, t_pos, m->rope_freqs, &hp->rope);
        struct ggml_tensor * att = NULL;  // [D * H, len]; rows with nothing to attend to get zeros
        if (z < len) {
            struct ggml_tensor * qs = ggml_view_3d(g, q, D, hp->n_head, len - z, q->nb[1], q->nb[2], z * q->nb[2]);
            att = kvl_cc_attention(g, hp, qs, t_k, t_v, r0 + z, len - z, gap);
        }
        if (z > 0) {
            struct ggml_tensor * q2 = ggml_reshape_2d(g, q, D * hp->n_head, len);
            struct ggml_tensor * zero = ggml_scale(g, ggml_view_2d(g, q2, D * hp->n_head, z, q2->nb[1], 0), 0.0f);
            att = att ? ggml_concat(g, zero, att, 1) : zero;
        }
        struct ggml_tensor * y = ggml_add(g, x, ggml_mul_mat(g, L->wo, att));
        cur = ggml_mul(g, ggml_rms_norm(g, y, hp->rms_eps), L->ffn_norm);
        cur = ggml_mul(g, ggml_silu(g, ggml_mul_mat(g, L->w_gate, cur)), ggml_mul_mat(g, L->w_up, cur));
        y = ggml_add(g, y, ggml_mul_mat(g, L->w_down, cur));

        struct ggml_cgraph * gf = ggml_new_graph_custom(g, n_nodes, false);
        ggml_build_forward_expand(gf, y);
        float * rows = hidden + (size_t) r0 * hp->n_embd;  // read into the graph first, then overwritten
        const struct kvl_input in[] = {{t_pos, pos + r0}, {x, rows}};
        rc = kvl_run(c, gf, in, 2, y, rows);
        ggml_free(g);
    }
    ggml_backend_buffer_free(kv_buf);
    ggml_free(gkv);
    const struct ggml_tensor * used[] = {L->attn_norm, L->wq, L->bq, L->q_norm, L->wo, L->ffn_norm, L->w_gate, L->w_up,
                                         L->w_down};
    kvl_release(m, used, (int) (sizeof(used) / sizeof(used[0])));
    return rc;
}

// out f32 [n]: the logit (normalized = 0) or log-probability (1) of tokens[i] from hidden row i.
int kvl_cc_output(struct kvl_ctx * c, const struct kvl_model * m, int normalized, int block, int n,
                  const int32_t * tokens, const float * hidden, float * out) {
    const struct kvl_hparams * hp = &m->hp;
    if (!c || !m || n <= 0) return KVL_BAD_SHAPE;
    if (block <= 0) block = kvl_cc_block(n, hp->n_head);
    int rc = KVL_OK;
    for (int r0 = 0; r0 < n && rc == KVL_OK; r0 += block) {
        const int len = r0 + block <= n ? block : n - r0;
        struct ggml_init_params ip = {ggml_tensor_overhead() * 32 + ggml_graph_overhead(), NULL, true};
        struct ggml_context * g = ggml_init(ip);
        if (!g) { rc = KVL_NO_MEMORY; break; }
        struct ggml_tensor * t_tok = ggml_new_tensor_1d(g, GGML_TYPE_I32, len);
        struct ggml_tensor * x = ggml_new_tensor_2d(g, GGML_TYPE_F32, hp->n_embd, len);
        struct ggml_tensor * h = ggml_mul(g, ggml_rms_norm(g, x, hp->rms_eps), m->out_norm);
        // The paper's score needs only row x_i of the output matrix at cell i: a gather and a dot,
        // not a projection on the whole vocabulary (that one only for log-probabilities).
        struct ggml_tensor * rows = ggml_get_rows(g, m->output, t_tok);  // [n_embd, len], dequantized
        struct ggml_tensor * s = ggml_sum_rows(g, ggml_mul(g, rows, h));  // [1, len]
        if (normalized) s = ggml_sub(g, s, kvl_logsumexp(g, ggml_mul_mat(g, m->output, h)));
        struct ggml_cgraph * gf = ggml_new_graph(g);
        ggml_build_forward_expand(gf, s);
        const struct kvl_input in[] = {{t_tok, tokens + r0}, {x, hidden + (size_t) r0 * hp->n_embd}};
        rc = kvl_run(c, gf, in, 2, s, out + r0);
        ggml_free(g);
    }
    kvl_release(m, (const struct ggml_tensor * const[]) {m->out_norm, m->output}, 2);
    return rc;
}
