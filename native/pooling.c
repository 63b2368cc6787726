// EchoKV scores: attention pooling (Eq. 3) and RoPE proposals (Eq. 2).
#include "kvl.h"

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
//   k:        f32 or f16 (k_type: 0 = f32, 1 = f16) [n_layer, n_head_kv, n_keys, head_dim]
//   key_mask: f32 [n_keys], 0 for a key that counts, a large negative value (-1e30) for one that
//             does not (its probability is 0); NULL: every key counts
//   chunk:    keys per chunk (0: one chunk while its logits stay under 64 MB). Memory beyond the
//             inputs: one chunk's temporaries plus the exponentials of one layer.
//   pool_kernel: odd width of a max-pool over keys applied to the pooled scores (0 or 1: none)
//   out:      f32 [n_layer, n_head_kv, n_keys]
// One graph per layer, so memory follows one layer's chunk, not the whole model.
int kvl_attn_pool(struct kvl_ctx * c, const float * q, const void * k, int k_type, const float * key_mask,
                  int n_layer, int n_head, int n_head_kv, int n_q, int n_keys, int head_dim, float scale, int chunk,
                  int pool_kernel, int reduce_max, int causal_tail, float * out) {
    if (!c || n_layer <= 0 || n_head <= 0 || n_head_kv <= 0 || n_q <= 0 || n_keys <= 0 || head_dim <= 0 ||
        n_head % n_head_kv != 0 || chunk < 0 || pool_kernel < 0 || (pool_kernel > 1 && pool_kernel % 2 == 0) ||
        causal_tail < 0 || causal_tail > n_keys || (causal_tail > 0 && causal_tail != n_q)) {
        return KVL_BAD_SHAPE;
    }
    if (k_type != GGML_TYPE_F32 && k_type != GGML_TYPE_F16) return KVL_BAD_TYPE;
    const int group = n_head / n_head_kv;
    // One chunk per layer unless its logits would pass 64 MB: the fused softmax of one chunk ran
    // ~2x faster than chunks of 4K keys at 16K keys.
    if (chunk == 0) {
        const size_t fit = (64u << 20) / (4u * (size_t) n_q * (size_t) n_head);
        chunk = fit < 1 ? 1 : (int) (fit < (size_t) n_keys ? fit : (size_t) n_keys);
    }
    if (chunk > n_keys || causal_tail > 0) chunk = n_keys;  // the causal block is masked within one chunk
    const int n_chunk = (n_keys + chunk - 1) / chunk;
    const int rows = n_q * group;
    const size_t q_layer = (size_t) n_head * n_q * head_dim;
    const size_t k_layer = (size_t) n_head_kv * n_keys * head_dim * (k_type == GGML_TYPE_F32 ? 4 : 2);
    const size_t n_tensors = 64 + (size_t) n_chunk * (32 + 2 * (size_t) rows) + (size_t) pool_kernel * 8;

    for (int il = 0; il < n_layer; il++) {
        struct ggml_init_params ip = {ggml_tensor_overhead() * n_tensors + ggml_graph_overhead_custom(n_tensors, false),
                                      NULL, true};
        struct ggml_context * g = ggml_init(ip);
        if (!g) return KVL_NO_MEMORY;
        struct ggml_tensor * tq = ggml_new_tensor_3d(g, GGML_TYPE_F32, head_dim, n_q, n_head);
        struct ggml_tensor * tk = ggml_new_tensor_3d(g, (enum ggml_type) k_type, head_dim, n_keys, n_head_kv);
        struct ggml_tensor * tm = key_mask ? ggml_new_tensor_1d(g, GGML_TYPE_F32, n_keys) : NULL;
        ggml_set_input(tq);
        ggml_set_input(tk);
        if (tm) ggml_set_input(tm);

        // Softmax over all keys in one pass over the chunks: keep each chunk's e = exp(x - m_c)
        // with its row maxima m_c and sums; once every chunk is seen, row r of chunk c is scaled by
        // exp(m_c - M) / sum_c' (sums_c' exp(m_c' - M)), M the largest m_c. One chunk: plain softmax.
        struct ggml_tensor ** e = malloc(sizeof(*e) * n_chunk);
        if (!e) { ggml_free(g); return KVL_NO_MEMORY; }
        struct ggml_tensor *maxes = NULL, *sums = NULL;  // [n_chunk, rows, n_head_kv]
        for (int ci = 0; ci < n_chunk; ci++) {
            const int c0 = ci * chunk, len = c0 + chunk <= n_keys ? chunk : n_keys - c0;
            struct ggml_tensor * x = kvl_chunk_logits(g, tq, tk, tm, c0, len, scale);  // [len, rows, n_head_kv]
            if (causal_tail > 0) {
                // rows are g * n_q + q: as [len, n_q, group * n_head_kv], query q sees key i up to
                // n_keys - n_q + q, which is ggml's diagonal mask with n_past = n_keys - n_q
                x = ggml_reshape_3d(g, x, len, n_q, group * n_head_kv);
                x = ggml_reshape_3d(g, ggml_diag_mask_inf(g, x, n_keys - causal_tail), len, rows, n_head_kv);
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
        if (pool_kernel > 1) s = kvl_max_smooth(g, s, pool_kernel);
        ggml_set_output(s);

        struct ggml_cgraph * gf = ggml_new_graph_custom(g, n_tensors, false);
        ggml_build_forward_expand(gf, s);
        const struct kvl_input in[] = {
            {tq, q + il * q_layer}, {tk, (const char *) k + il * k_layer}, {tm, key_mask}};
        const int rc = kvl_run(c, gf, in, 3, s, out + (size_t) il * n_head_kv * n_keys);
        ggml_free(g);
        if (rc != KVL_OK) return rc;
    }
    return KVL_OK;
}

// EchoKV Eq. 2, proposals: RoPE as llama.cpp applies it (ggml_rope_ext with the model's mode,
// base, frequency scale and YaRN parameters), here to rotate pre-RoPE queries to chosen positions.
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
    ggml_set_input(tx);
    ggml_set_input(tp);
    struct ggml_tensor * r = kvl_rope_ext(g, tx, tp, rope);
    ggml_set_output(r);
    struct ggml_cgraph * gf = ggml_new_graph(g);
    ggml_build_forward_expand(gf, r);
    const struct kvl_input in[] = {{tx, x}, {tp, pos}};
    const int rc = kvl_run(c, gf, in, 2, r, out);
    ggml_free(g);
    return rc;
}

