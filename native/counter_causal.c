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

// Query rows per attention block: the [n, block, H] f32 score matrix stays near 64 MB.
static int kvl_cc_block(int n, int n_head) {
    const size_t b = (64u << 20) / (4u * (size_t) n * (size_t) n_head);
    return b < 1 ? 1 : (b > (size_t) n ? n : (int) b);
}

struct kvl_layer {
    struct ggml_tensor *attn_norm, *wq, *bq, *wo, *ffn_norm, *w_gate, *w_up, *w_down;
};

struct kvl_model {
    struct kvl_hparams hp;
    struct gguf_context * gguf;
    struct ggml_context * weights;  // tensor metadata; data lives in the file mapping
    void * map;
    size_t map_size;
    ggml_backend_buffer_t buffer;
    struct ggml_tensor *tok_embd, *out_norm, *output;
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

// Memory-maps the GGUF (the page cache then holds one copy, shared with llama.cpp's own mapping)
// and points ggml tensors at the weights as stored, quantized or not. NULL on failure.
struct kvl_model * kvl_model_load(const char * path, const struct kvl_hparams * hp) {
    struct kvl_model * m = calloc(1, sizeof(*m));
    if (!m) return NULL;
    m->hp = *hp;
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
    m->layers = calloc(hp->n_layer, sizeof(*m->layers));
    if (!m->layers) goto fail;
    for (int il = 0; il < hp->n_layer; il++) {
        struct kvl_layer * L = &m->layers[il];
        L->attn_norm = kvl_weight(m, "blk.%d.attn_norm.weight", il, true, &ok);
        L->wq = kvl_weight(m, "blk.%d.attn_q.weight", il, true, &ok);
        L->bq = kvl_weight(m, "blk.%d.attn_q.bias", il, hp->arch == 1, &ok);
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

// Attention of every query over the cached K/V of one layer, cells in *descending* position
// order: cell i attends to cells 0 .. i-1-gap, the later positions at least gap cells away. That
// is ggml's causal mask once queries are shifted by 1 + gap (query row r is cell r + 1 + gap,
// seeing columns 0 .. r); cells 0 .. gap have nothing to attend to and get a zero attention
// output. Queries go in blocks so the score matrix stays near 64 MB whatever n is. n > gap + 1.
// Returns [D * H, n].
static struct ggml_tensor * kvl_cc_attention(struct ggml_context * g, const struct kvl_hparams * hp,
                                             struct ggml_tensor * q, struct ggml_tensor * k, struct ggml_tensor * v,
                                             int n, int gap, int block) {
    const int D = hp->head_dim, H = hp->n_head;
    struct ggml_tensor * kp = ggml_permute(g, k, 0, 2, 1, 3);               // [D, n, Hkv]
    struct ggml_tensor * vt = ggml_cont(g, ggml_permute(g, v, 1, 2, 0, 3));  // [n, D, Hkv]
    struct ggml_tensor * qp = ggml_permute(g, q, 0, 2, 1, 3);               // [D, n, H]
    struct ggml_tensor * out = NULL;
    const int rows = n - 1 - gap;
    for (int r0 = 0; r0 < rows; r0 += block) {
        const int len = r0 + block <= rows ? block : rows - r0;
        struct ggml_tensor * qb =
            ggml_view_3d(g, qp, D, len, H, qp->nb[1], qp->nb[2], (size_t) (r0 + 1 + gap) * qp->nb[1]);
        // this block's rows see columns 0 .. r0 + len - 1 at most: skip the rest of the cells
        const int nk = r0 + len;
        struct ggml_tensor * kb = ggml_view_3d(g, kp, D, nk, kp->ne[2], kp->nb[1], kp->nb[2], 0);
        struct ggml_tensor * vb = ggml_view_3d(g, vt, nk, D, vt->ne[2], vt->nb[1], vt->nb[2], 0);
        struct ggml_tensor * kq = ggml_scale(g, ggml_mul_mat(g, kb, qb), 1.0f / sqrtf((float) D));  // [nk, len, H]
        kq = ggml_soft_max(g, ggml_diag_mask_inf(g, kq, r0));
        struct ggml_tensor * o = ggml_mul_mat(g, vb, kq);  // [D, len, H]
        o = ggml_reshape_2d(g, ggml_cont(g, ggml_permute(g, o, 0, 2, 1, 3)), D * H, len);
        out = out ? ggml_concat(g, out, o, 1) : o;
    }
    for (int i = 0; i <= gap; i++) {  // zero columns for the cells with nothing to attend to
        out = ggml_concat(g, ggml_scale(g, ggml_view_2d(g, out, D * H, 1, out->nb[1], 0), 0.0f), out, 1);
    }
    return out;
}

// Logits (normalized = 0) or log-probabilities (normalized = 1) of x_i at every cell i, from
// layer first_layer on (0: full; n_layer - 1: fast). Cell i attends to the cells after it, skipping
// the nearest `gap` ones (the reference code's min_gap, against K/V leakage; 0 in the paper).
//   tokens, pos: i32 [n], cells in strictly DESCENDING position order
//   k, v:        kv_type (0 f32, 1 f16) [n_layer - first_layer, n, n_head_kv * head_dim]
//   hidden:      f32 [n, n_embd], the input of first_layer (required when first_layer > 0; at layer 0,
//                NULL reads the token embeddings, and rows given replace them)
//   out:         f32 [n]; the first gap + 1 cells see nothing: their values mean nothing
//   block:       query rows per attention block (0: keep the score matrix near 64 MB)
//   n >= gap + 2
int kvl_counter_causal(struct kvl_ctx * c, const struct kvl_model * m, int first_layer, int normalized, int gap,
                       int block, int n,
                       const int32_t * tokens, const int32_t * pos, const void * k, const void * v, int kv_type,
                       const float * hidden, float * out) {
    const struct kvl_hparams * hp = &m->hp;
    if (!c || !m || gap < 0 || n < gap + 2 || first_layer < 0 || first_layer >= hp->n_layer) return KVL_BAD_SHAPE;
    if (first_layer > 0 && !hidden) return KVL_BAD_SHAPE;
    if (kv_type != GGML_TYPE_F32 && kv_type != GGML_TYPE_F16) return KVL_BAD_TYPE;
    const int D = hp->head_dim, Hkv = hp->n_head_kv, n_used = hp->n_layer - first_layer;
    if (block <= 0) block = kvl_cc_block(n, hp->n_head);
    const size_t n_nodes = 256 + (size_t) n_used * (64 + 16 * ((size_t) n / block + 1));
    struct ggml_init_params ip = {ggml_tensor_overhead() * n_nodes + ggml_graph_overhead_custom(n_nodes, false), NULL,
                                  true};
    struct ggml_context * g = ggml_init(ip);
    if (!g) return KVL_NO_MEMORY;

    struct ggml_tensor * t_tok = ggml_new_tensor_1d(g, GGML_TYPE_I32, n);
    struct ggml_tensor * t_pos = ggml_new_tensor_1d(g, GGML_TYPE_I32, n);
    struct ggml_tensor * t_k = ggml_new_tensor_4d(g, (enum ggml_type) kv_type, D, Hkv, n, n_used);
    struct ggml_tensor * t_v = ggml_new_tensor_4d(g, (enum ggml_type) kv_type, D, Hkv, n, n_used);
    // The input rows of first_layer: required from layer 1 on; at layer 0 they replace the token
    // embeddings when given (kvlite's blind variant feeds a neutral row there).
    struct ggml_tensor * t_h = first_layer > 0 || hidden ? ggml_new_tensor_2d(g, GGML_TYPE_F32, hp->n_embd, n) : NULL;
    ggml_set_input(t_tok);
    ggml_set_input(t_pos);
    ggml_set_input(t_k);
    ggml_set_input(t_v);
    if (t_h) ggml_set_input(t_h);

    struct ggml_tensor * x = t_h ? t_h : ggml_get_rows(g, m->tok_embd, t_tok);  // [n_embd, n]
    for (int il = first_layer; il < hp->n_layer; il++) {
        const struct kvl_layer * L = &m->layers[il];
        const size_t lo = (size_t) (il - first_layer);
        struct ggml_tensor * cur = ggml_mul(g, ggml_rms_norm(g, x, hp->rms_eps), L->attn_norm);
        struct ggml_tensor * q = ggml_mul_mat(g, L->wq, cur);
        if (L->bq) q = ggml_add(g, q, L->bq);
        q = kvl_rope_ext(g, ggml_reshape_3d(g, q, D, hp->n_head, n), t_pos, &hp->rope);
        struct ggml_tensor * kl = ggml_view_3d(g, t_k, D, Hkv, n, t_k->nb[1], t_k->nb[2], lo * t_k->nb[3]);
        struct ggml_tensor * vl = ggml_view_3d(g, t_v, D, Hkv, n, t_v->nb[1], t_v->nb[2], lo * t_v->nb[3]);
        if (kv_type != GGML_TYPE_F32) {  // widen: a mixed product would round the queries to f16
            kl = ggml_cast(g, kl, GGML_TYPE_F32);
            vl = ggml_cast(g, vl, GGML_TYPE_F32);
        }
        x = ggml_add(g, x, ggml_mul_mat(g, L->wo, kvl_cc_attention(g, hp, q, kl, vl, n, gap, block)));
        cur = ggml_mul(g, ggml_rms_norm(g, x, hp->rms_eps), L->ffn_norm);
        cur = ggml_mul(g, ggml_silu(g, ggml_mul_mat(g, L->w_gate, cur)), ggml_mul_mat(g, L->w_up, cur));
        x = ggml_add(g, x, ggml_mul_mat(g, L->w_down, cur));
    }
    x = ggml_mul(g, ggml_rms_norm(g, x, hp->rms_eps), m->out_norm);
    // The paper's score needs only row x_i of the output matrix at cell i: a gather and a dot,
    // not a projection on the whole vocabulary.
    struct ggml_tensor * rows = ggml_get_rows(g, m->output, t_tok);  // [n_embd, n], dequantized
    struct ggml_tensor * s = ggml_sum_rows(g, ggml_mul(g, rows, x));  // [1, n]
    if (normalized) s = ggml_sub(g, s, kvl_logsumexp(g, ggml_mul_mat(g, m->output, x)));
    ggml_set_output(s);

    struct ggml_cgraph * gf = ggml_new_graph_custom(g, n_nodes, false);
    ggml_build_forward_expand(gf, s);
    const struct kvl_input in[] = {{t_tok, tokens}, {t_pos, pos}, {t_k, k}, {t_v, v}, {t_h, hidden}};
    const int rc = kvl_run(c, gf, in, 5, s, out);
    ggml_free(g);
    return rc;
}
