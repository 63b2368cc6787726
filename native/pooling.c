// EchoKV scores: attention pooling (Eq. 3) and RoPE proposals (Eq. 2).
#include "kvl.h"

// Scaled, masked logits of keys [c0, c0 + len) for every query: [len, n_q, n_head].
static struct ggml_tensor * kvl_chunk_logits(struct ggml_context * g, struct ggml_tensor * tq, struct ggml_tensor * tk,
                                             struct ggml_tensor * tm, int c0, int len, float scale) {
    struct ggml_tensor * kc =
        ggml_view_3d(g, tk, tk->ne[0], len, tk->ne[2], tk->nb[1], tk->nb[2], (size_t) c0 * tk->nb[1]);
    // f16 keys are widened first: a mixed f16 x f32 product would round the queries to f16
    if (kc->type != GGML_TYPE_F32) kc = ggml_cast(g, kc, GGML_TYPE_F32);
    // The queries of a KV group are adjacent heads: as [D, n_q * group, n_head_kv] each cached head
    // is read once for all of them (a broadcast product reads it once per query head). The result
    // has the same memory layout as [len, n_q, n_head].
    struct ggml_tensor * qg = ggml_reshape_3d(g, tq, tq->ne[0], tq->ne[1] * (tq->ne[2] / kc->ne[2]), kc->ne[2]);
    struct ggml_tensor * x = ggml_scale(g, ggml_mul_mat(g, kc, qg), scale);
    return tm ? ggml_add(g, x, ggml_view_1d(g, tm, len, (size_t) c0 * sizeof(float))) : x;
}

// EchoKV Eq. 3, attention pooling: for every layer l and KV group g,
//   out[l, g, i] = sum over queries q of group g of softmax_i(q . k_i * scale + mask_i)
// where the softmax runs over the n_keys keys given. Query head h belongs to KV group
// h / (n_head / n_head_kv), as in llama.cpp's grouped-query attention.
// reduce_max: the maximum over the group's queries (and query heads) instead of the sum (KVzip).
// causal_tail: the last causal_tail keys are the queries' own (n_q == causal_tail): query r sees
// tail key j only for j <= r, as a model reading them in order (KVzip's repeated tokens).
//   q:        f32 [n_layer, n_head, n_q, head_dim]
//   k:        [n_layer, n_head_kv, n_keys, head_dim] of ggml type k_type (f32, f16, bf16, q8_0, ...)
//   key_mask: f32 [n_keys], 0 for a key that counts, a large negative value (-1e30) for one that
//             does not (its probability is 0); NULL: every key counts
//   chunk:    keys per chunk (0: automatic, see below)
//   out:      f32 [n_layer, n_head_kv, n_keys]
// Memory: one graph per layer and block of queries, sized so that a block's probabilities stay
// under KVL_POOL_BYTES (softmax rows are independent, so blocks of queries add up, or max, on the
// host). Beyond the inputs an eviction then holds ~KVL_POOL_BYTES, not queries x keys x heads
// (EchoKV's 384 proposals over 8K keys were 113 MB a layer).
#define KVL_POOL_BYTES (8u << 20)

// One layer, queries [b0, b0 + nb) of q_layer (f32 [n_head, n_q, head_dim]): out_block [n_head_kv, n_keys].
static int kvl_pool_block(struct kvl_ctx * c, const float * q_layer, const void * k_layer, int k_type,
                          const float * key_mask, int n_head, int n_head_kv, int n_q, int b0, int nb, int n_keys,
                          int head_dim, float scale, int chunk, int reduce_max, int causal_tail, float * out_block) {
    const int group = n_head / n_head_kv;
    const int rows = nb * group;
    if (chunk == 0) {  // one chunk unless its logits would pass KVL_POOL_BYTES (a fused softmax is fastest)
        const size_t fit = KVL_POOL_BYTES / (4u * (size_t) rows * (size_t) n_head_kv);
        chunk = fit < 1 ? 1 : (int) (fit < (size_t) n_keys ? fit : (size_t) n_keys);
    }
    if (chunk > n_keys || causal_tail > 0) chunk = n_keys;  // the causal block is masked within one chunk
    const int n_chunk = (n_keys + chunk - 1) / chunk;
    const size_t n_tensors = 64 + (size_t) n_chunk * (32 + 2 * (size_t) rows);
    float * qb = malloc(sizeof(float) * (size_t) n_head * nb * head_dim);  // the block's queries, contiguous
    if (!qb) return KVL_NO_MEMORY;
    for (int h = 0; h < n_head; h++) {
        memcpy(qb + (size_t) h * nb * head_dim, q_layer + ((size_t) h * n_q + b0) * head_dim,
               sizeof(float) * (size_t) nb * head_dim);
    }
    struct ggml_init_params ip = {ggml_tensor_overhead() * n_tensors + ggml_graph_overhead_custom(n_tensors, false),
                                  NULL, true};
    struct ggml_context * g = ggml_init(ip);
    if (!g) { free(qb); return KVL_NO_MEMORY; }
    struct ggml_tensor * tq = ggml_new_tensor_3d(g, GGML_TYPE_F32, head_dim, nb, n_head);
    struct ggml_tensor * tk = ggml_new_tensor_3d(g, (enum ggml_type) k_type, head_dim, n_keys, n_head_kv);
    struct ggml_tensor * tm = key_mask ? ggml_new_tensor_1d(g, GGML_TYPE_F32, n_keys) : NULL;

    // Softmax over all keys in one pass over the chunks: keep each chunk's e = exp(x - m_c)
    // with its row maxima m_c and sums; once every chunk is seen, row r of chunk c is scaled by
    // exp(m_c - M) / sum_c' (sums_c' exp(m_c' - M)), M the largest m_c. One chunk: plain softmax.
    struct ggml_tensor ** e = malloc(sizeof(*e) * n_chunk);
    if (!e) { ggml_free(g); free(qb); return KVL_NO_MEMORY; }
    struct ggml_tensor *maxes = NULL, *sums = NULL;  // [n_chunk, rows, n_head_kv]
    for (int ci = 0; ci < n_chunk; ci++) {
        const int c0 = ci * chunk, len = c0 + chunk <= n_keys ? chunk : n_keys - c0;
        struct ggml_tensor * x = kvl_chunk_logits(g, tq, tk, tm, c0, len, scale);  // [len, rows, n_head_kv]
        if (causal_tail > 0) {
            // rows are g * nb + r: as [len, nb, group * n_head_kv], query b0 + r sees key i up to
            // n_keys - n_q + b0 + r, which is ggml's diagonal mask with n_past = n_keys - n_q + b0
            x = ggml_reshape_3d(g, x, len, nb, group * n_head_kv);
            x = ggml_reshape_3d(g, ggml_diag_mask_inf(g, x, n_keys - causal_tail + b0), len, rows, n_head_kv);
        }
        if (n_chunk == 1) {
            e[ci] = ggml_soft_max(g, x);
            break;
        }
        struct ggml_tensor * m = kvl_row_max(g, x);
        e[ci] = ggml_exp(g, ggml_sub(g, x, m));
        struct ggml_tensor * sm = ggml_sum_rows(g, e[ci]);
        maxes = maxes ? ggml_concat(g, maxes, m, 0) : m;
        sums = sums ? ggml_concat(g, sums, sm, 0) : sm;
    }
    struct ggml_tensor * w = NULL;  // [n_chunk, rows, n_head_kv]: each chunk row's normalizer
    if (n_chunk > 1) {
        struct ggml_tensor * rel = ggml_exp(g, ggml_sub(g, maxes, kvl_row_max(g, maxes)));
        w = ggml_div(g, rel, ggml_sum_rows(g, ggml_mul(g, sums, rel)));
    }
    struct ggml_tensor * s = NULL;  // [n_keys, n_head_kv]
    for (int ci = 0; ci < n_chunk; ci++) {
        const int len = (int) e[ci]->ne[0];
        struct ggml_tensor * p = e[ci];
        if (w) p = ggml_mul(g, p, ggml_view_3d(g, w, 1, rows, n_head_kv, w->nb[1], w->nb[2], ci * w->nb[0]));
        struct ggml_tensor * acc = NULL;
        if (reduce_max) {  // the rows to dim 0, then one max-pool over them
            struct ggml_tensor * t = ggml_cont(g, ggml_permute(g, p, 1, 0, 2, 3));  // [rows, len, n_head_kv]
            acc = ggml_reshape_2d(g, kvl_row_max(g, t), len, n_head_kv);
        } else {
            // queries of one group are adjacent rows: sum them with streaming adds of contiguous
            // rows (a transpose and sum_rows is several times slower)
            for (int r = 0; r < rows; r++) {
                struct ggml_tensor * row = ggml_view_2d(g, p, len, n_head_kv, p->nb[2], (size_t) r * p->nb[1]);
                acc = acc ? ggml_add(g, acc, row) : ggml_cont(g, row);
            }
        }
        s = s ? ggml_concat(g, s, acc, 0) : acc;
    }
    free(e);
    struct ggml_cgraph * gf = ggml_new_graph_custom(g, n_tensors, false);
    ggml_build_forward_expand(gf, s);
    const struct kvl_input in[] = {{tq, qb}, {tk, k_layer}, {tm, key_mask}};
    const int rc = kvl_run(c, gf, in, 3, s, out_block);
    ggml_free(g);
    free(qb);
    return rc;
}

int kvl_attn_pool(struct kvl_ctx * c, const float * q, const void * k, int k_type, const float * key_mask,
                  int n_layer, int n_head, int n_head_kv, int n_q, int n_keys, int head_dim, float scale, int chunk,
                  int reduce_max, int causal_tail, float * out) {
    if (!c || n_layer <= 0 || n_head <= 0 || n_head_kv <= 0 || n_q <= 0 || n_keys <= 0 || head_dim <= 0 ||
        n_head % n_head_kv != 0 || chunk < 0 ||
        causal_tail < 0 || causal_tail > n_keys || (causal_tail > 0 && causal_tail != n_q)) {
        return KVL_BAD_SHAPE;
    }
    // f32, f16, or any type ggml can widen (a quantized cache's blocks, read as stored: the graph
    // casts each chunk to f32, so no widened copy of a layer is ever made on the host)
    if (k_type != GGML_TYPE_F32 && (k_type < 0 || k_type >= GGML_TYPE_COUNT ||
                                    !ggml_get_type_traits((enum ggml_type) k_type)->to_float ||
                                    head_dim % ggml_blck_size((enum ggml_type) k_type))) {
        return KVL_BAD_TYPE;
    }
    const size_t per_query = 4u * (size_t) n_keys * (size_t) n_head;  // bytes of one query's probabilities
    const int block = per_query >= KVL_POOL_BYTES ? 1 : (int) (KVL_POOL_BYTES / per_query < (size_t) n_q ?
                                                              KVL_POOL_BYTES / per_query : (size_t) n_q);
    const size_t q_layer = (size_t) n_head * n_q * head_dim;
    const size_t k_layer = (size_t) n_head_kv * n_keys * ggml_row_size((enum ggml_type) k_type, head_dim);
    const size_t n_out = (size_t) n_head_kv * n_keys;
    float * part = n_q > block ? malloc(sizeof(float) * n_out) : NULL;
    if (n_q > block && !part) return KVL_NO_MEMORY;
    int rc = KVL_OK;
    for (int il = 0; il < n_layer && rc == KVL_OK; il++) {
        float * o = out + (size_t) il * n_out;
        for (int b0 = 0; b0 < n_q && rc == KVL_OK; b0 += block) {
            const int nb = b0 + block <= n_q ? block : n_q - b0;
            rc = kvl_pool_block(c, q + il * q_layer, (const char *) k + il * k_layer, k_type, key_mask, n_head,
                                n_head_kv, n_q, b0, nb, n_keys, head_dim, scale, chunk, reduce_max, causal_tail,
                                b0 == 0 ? o : part);
            if (rc != KVL_OK || b0 == 0) continue;
            for (size_t i = 0; i < n_out; i++) o[i] = reduce_max ? (part[i] > o[i] ? part[i] : o[i]) : o[i] + part[i];
        }
    }
    free(part);
    return rc;
}

// EchoKV Eq. 2, proposals: RoPE as llama.cpp applies it (ggml_rope_ext with the model's mode,
// base, frequency scale, YaRN parameters and frequency factors), here to rotate pre-RoPE queries to chosen positions.
//   x: f32 [n_tok, n_head, head_dim] (pre-RoPE); pos: i32 [n_tok]; out: f32, same shape as x.
int kvl_rope(struct kvl_ctx * c, const struct kvl_rope * rope, const float * x, const int32_t * pos, int n_tok,
             int n_head, int head_dim, float * out) {
    if (!c || !rope || n_tok <= 0 || n_head <= 0 || head_dim <= 0 || rope->n_dims <= 0 || rope->n_dims > head_dim ||
        rope->n_dims % 2) {
        return KVL_BAD_SHAPE;
    }
    struct ggml_init_params ip = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), NULL, true};
    struct ggml_context * g = ggml_init(ip);
    if (!g) return KVL_NO_MEMORY;
    struct ggml_tensor * tx = ggml_new_tensor_3d(g, GGML_TYPE_F32, head_dim, n_head, n_tok);
    struct ggml_tensor * tp = ggml_new_tensor_1d(g, GGML_TYPE_I32, n_tok);
    struct ggml_tensor * tf = rope->freq_factors ? ggml_new_tensor_1d(g, GGML_TYPE_F32, rope->n_dims / 2) : NULL;
    struct ggml_tensor * r = kvl_rope_ext(g, tx, tp, tf, rope);
    struct ggml_cgraph * gf = ggml_new_graph(g);
    ggml_build_forward_expand(gf, r);
    const struct kvl_input in[] = {{tx, x}, {tp, pos}, {tf, rope->freq_factors}};
    const int rc = kvl_run(c, gf, in, 3, r, out);
    ggml_free(g);
    return rc;
}

