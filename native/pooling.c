// EchoKV scores: attention pooling (Eq. 3) and RoPE proposals (Eq. 2).
#include <math.h>

#include "kvl.h"

// exp(x) in float, branch-free so the compiler vectorizes its loop (libm's expf is a call): Cephes'
// expf, 2^n exp(r) with |r| <= ln2/2 and a degree-7 polynomial, relative error ~1e-7. x below
// KVL_EXP_MIN gives 0 (a masked key's -1e30 included), as the softmax's underflow would.
#define KVL_EXP_MIN (-87.0f)
static inline float kvl_exp(float x) {
    const float c = x < KVL_EXP_MIN ? KVL_EXP_MIN : x;
    const float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
    const float r = c - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float e = p * r * r + r + 1.0f;
    union { int32_t i; float f; } two_n = {.i = ((int32_t) n + 127) << 23};
    return x < KVL_EXP_MIN ? 0.0f : e * two_n.f;
}

// The three passes over one row of logits that the fused op makes, all in cache: v = x * scale +
// mask and its maximum; e = exp(v - max) and its sum; out += e / sum. Cloned for AVX-512 and AVX2
// where the compiler can (the library is built once for every x86-64 CPU).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static void kvl_softmax_add_row(const float * x, const float * mask, float scale, int len, float * e, float * out) {
    // maxima and sums kept in KVL_LANES lanes: a float reduction in one accumulator is not
    // reordered, so not vectorized, without -ffast-math (which would also change NaN and inf)
    enum { KVL_LANES = 16 };
    const int body = len - len % KVL_LANES;
    float lane[KVL_LANES];
    for (int j = 0; j < KVL_LANES; j++) lane[j] = -INFINITY;
    for (int i = 0; i < len; i++) e[i] = x[i] * scale + (mask ? mask[i] : 0.0f);
    for (int i = 0; i < body; i += KVL_LANES) {
        for (int j = 0; j < KVL_LANES; j++) lane[j] = e[i + j] > lane[j] ? e[i + j] : lane[j];
    }
    float mx = -INFINITY;
    for (int j = 0; j < KVL_LANES; j++) mx = lane[j] > mx ? lane[j] : mx;
    for (int i = body; i < len; i++) mx = e[i] > mx ? e[i] : mx;
    for (int i = 0; i < len; i++) e[i] = kvl_exp(e[i] - mx);
    for (int j = 0; j < KVL_LANES; j++) lane[j] = 0.0f;
    for (int i = 0; i < body; i += KVL_LANES) {
        for (int j = 0; j < KVL_LANES; j++) lane[j] += e[i + j];
    }
    float sum = 0.0f;
    for (int j = 0; j < KVL_LANES; j++) sum += lane[j];
    for (int i = body; i < len; i++) sum += e[i];
    const float inv = 1.0f / sum;
    for (int i = 0; i < len; i++) out[i] += e[i] * inv;
}

struct kvl_colsum {
    float scale;
};

// A custom op (CPU): dst [len, n_head_kv, parts] from src[0], the logits [len, rows, n_head_kv];
// src[1]: scratch [len, parts], a row for each thread; src[2]: the key mask [len], if any. Thread
// ith takes every nth row and adds its softmax to part ith; the graph sums the parts. One read of
// the logits and no write, where ggml's softmax and one add per row made four passes and two
// writes (docs/cache.md, "Where an eviction's time goes").
static void kvl_softmax_colsum(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const struct kvl_colsum * a = userdata;
    const struct ggml_tensor * x = dst->src[0];
    const float * mask = dst->src[2] ? (const float *) dst->src[2]->data : NULL;
    const int len = (int) x->ne[0], n_head_kv = (int) x->ne[2], parts = (int) dst->ne[2];
    const size_t part = (size_t) len * n_head_kv;
    float * out = (float *) dst->data + (size_t) ith * part;
    float * e = (float *) dst->src[1]->data + (size_t) ith * len;
    memset(out, 0, part * sizeof(float));
    if (ith == 0 && parts > nth) memset((float *) dst->data + (size_t) nth * part, 0, (parts - nth) * part * sizeof(float));
    const int rows = (int) x->ne[1];  // the block's queries x the group's query heads
    for (int j = ith; j < rows * n_head_kv; j += nth) {
        const int h = j / rows, r = j % rows;
        const float * row = (const float *) ((const char *) x->data + (size_t) r * x->nb[1] + (size_t) h * x->nb[2]);
        kvl_softmax_add_row(row, mask, a->scale, len, e, out + (size_t) h * len);
    }
}

// What kvl_softmax_colsum computes, as a graph node: [n_keys, n_head_kv], summed over the parts.
static struct ggml_tensor * kvl_fused_colsum(struct ggml_context * g, struct ggml_tensor * x, struct ggml_tensor * tm,
                                             const struct kvl_colsum * a, int parts) {
    const int64_t len = x->ne[0], n_head_kv = x->ne[2];
    struct ggml_tensor * args[] = {x, ggml_new_tensor_2d(g, GGML_TYPE_F32, len, parts), tm};
    struct ggml_tensor * y = ggml_custom_4d(g, GGML_TYPE_F32, len, n_head_kv, parts, 1, args, tm ? 3 : 2,
                                            kvl_softmax_colsum, parts, (void *) a);
    struct ggml_tensor * s = ggml_view_2d(g, y, len, n_head_kv, y->nb[1], 0);
    for (int p = 1; p < parts; p++) s = ggml_add(g, s, ggml_view_2d(g, y, len, n_head_kv, y->nb[1], p * y->nb[2]));
    return parts > 1 ? s : ggml_cont(g, s);
}

// Logits of keys [c0, c0 + len) for every query, times scale (1: left to the softmax), plus the
// key mask: [len, rows, n_head_kv] (rows = the block's queries x the group's query heads).
static struct ggml_tensor * kvl_chunk_logits(struct ggml_context * g, struct ggml_tensor * qg, struct ggml_tensor * kl,
                                             struct ggml_tensor * tm, int c0, int len, float scale) {
    struct ggml_tensor * kc = ggml_view_3d(g, kl, kl->ne[0], len, kl->ne[2], kl->nb[1], kl->nb[2], (size_t) c0 * kl->nb[1]);
    struct ggml_tensor * x = ggml_mul_mat(g, kc, qg);
    if (scale != 1.0f) x = ggml_scale(g, x, scale);
    return tm ? ggml_add(g, x, ggml_view_1d(g, tm, len, (size_t) c0 * sizeof(float))) : x;
}

// One block of queries (qb: f32 [head_dim, nb, n_head], the block's query rows b0..b0+nb) pooled
// over every key of the layer kl (f32 [head_dim, n_keys, n_head_kv]): [n_keys, n_head_kv].
// colsum: the softmax and the sum over queries in one custom op of `parts` threads (the CPU; one
// chunk, a sum, no causal tail), else ggml's own ops, which every backend has.
static struct ggml_tensor * kvl_pool_block(struct ggml_context * g, struct ggml_tensor * qb, struct ggml_tensor * kl,
                                           struct ggml_tensor * tm, int n_q, int b0, float scale, int chunk,
                                           int reduce_max, int causal_tail, const struct kvl_colsum * colsum,
                                           int parts) {
    const int n_keys = (int) kl->ne[1], n_head_kv = (int) kl->ne[2];
    const int nb = (int) qb->ne[1], group = (int) qb->ne[2] / n_head_kv, rows = nb * group;
    // The queries of a KV group are adjacent heads: as [D, nb * group, n_head_kv] each cached head
    // is read once for all of them (a broadcast product reads it once per query head). The logits
    // then have the same memory layout as [len, nb, n_head].
    struct ggml_tensor * qg = ggml_reshape_3d(g, qb, qb->ne[0], rows, n_head_kv);
    const int n_chunk = (n_keys + chunk - 1) / chunk;
    if (colsum && n_chunk == 1 && !reduce_max && causal_tail == 0) {
        return kvl_fused_colsum(g, kvl_chunk_logits(g, qg, kl, NULL, 0, n_keys, 1.0f), tm, colsum, parts);
    }
    // One unmasked chunk: the scale is fused into ggml's softmax (a pass over the logits fewer)
    const float fused = n_chunk == 1 && !tm && scale > 0.0f ? scale : 1.0f;
    // Softmax over all keys in one pass over the chunks: keep each chunk's e = exp(x - m_c)
    // with its row maxima m_c and sums; once every chunk is seen, row r of chunk c is scaled by
    // exp(m_c - M) / sum_c' (sums_c' exp(m_c' - M)), M the largest m_c. One chunk: plain softmax.
    struct ggml_tensor ** e = malloc(sizeof(*e) * n_chunk);
    if (!e) return NULL;
    struct ggml_tensor *maxes = NULL, *sums = NULL;  // [n_chunk, rows, n_head_kv]
    for (int ci = 0; ci < n_chunk; ci++) {
        const int c0 = ci * chunk, len = c0 + chunk <= n_keys ? chunk : n_keys - c0;
        struct ggml_tensor * x = kvl_chunk_logits(g, qg, kl, tm, c0, len, scale / fused);
        if (causal_tail > 0) {
            // rows are g * nb + r: as [len, nb, group * n_head_kv], query b0 + r sees key i up to
            // n_keys - n_q + b0 + r, which is ggml's diagonal mask with n_past = n_keys - n_q + b0
            x = ggml_reshape_3d(g, x, len, nb, group * n_head_kv);
            x = ggml_reshape_3d(g, ggml_diag_mask_inf(g, x, n_keys - n_q + b0), len, rows, n_head_kv);
        }
        if (n_chunk == 1) {
            e[ci] = ggml_soft_max_ext_inplace(g, x, NULL, fused, 0.0f);
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
    return s;
}

// max(a, b) elementwise, as a + relu(b - a) (ggml has no binary max): b exactly where b - a is
// exact, else within an ulp of it.
static struct ggml_tensor * kvl_max2(struct ggml_context * g, struct ggml_tensor * a, struct ggml_tensor * b) {
    return ggml_add(g, a, ggml_relu(g, ggml_sub(g, b, a)));
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
// Memory: one graph per layer, its queries in blocks sized so that a block's probabilities stay
// under KVL_POOL_BYTES; the graph allocator reuses one block's buffers for the next, so beyond the
// inputs an eviction holds ~KVL_POOL_BYTES and the layer's keys widened to f32, not queries x keys
// x heads (docs/cache.md). One graph, not one per block: the layer's keys are copied in and widened
// once.
#ifndef KVL_POOL_BYTES
#define KVL_POOL_BYTES (8u << 20)
#endif

static int kvl_pool_layer(struct kvl_ctx * c, const float * q_layer, const void * k_layer, int k_type,
                          const float * key_mask, int n_head, int n_head_kv, int n_q, int n_keys, int head_dim,
                          float scale, int chunk, int reduce_max, int causal_tail, float * out) {
    const int group = n_head / n_head_kv;
    const size_t per_query = 4u * (size_t) n_keys * (size_t) n_head;  // bytes of one query's probabilities
    const int block = per_query >= KVL_POOL_BYTES ? 1 : (int) (KVL_POOL_BYTES / per_query < (size_t) n_q ?
                                                              KVL_POOL_BYTES / per_query : (size_t) n_q);
    const int n_block = (n_q + block - 1) / block;
    if (chunk == 0) {  // one chunk unless its logits would pass KVL_POOL_BYTES (a fused softmax is fastest)
        const size_t fit = KVL_POOL_BYTES / (4u * (size_t) block * group * (size_t) n_head_kv);
        chunk = fit < 1 ? 1 : (int) (fit < (size_t) n_keys ? fit : (size_t) n_keys);
    }
    if (chunk > n_keys || causal_tail > 0) chunk = n_keys;  // the causal block is masked within one chunk
    const size_t n_chunk = (size_t) (n_keys + chunk - 1) / chunk;
    const size_t n_tensors = 64 + (size_t) n_block * (16 + n_chunk * (32 + 2 * (size_t) block * group));
    struct ggml_init_params ip = {ggml_tensor_overhead() * n_tensors + ggml_graph_overhead_custom(n_tensors, false),
                                  NULL, true};
    struct ggml_context * g = ggml_init(ip);
    if (!g) return KVL_NO_MEMORY;
    struct ggml_tensor * tq = ggml_new_tensor_3d(g, GGML_TYPE_F32, head_dim, n_q, n_head);
    struct ggml_tensor * tk = ggml_new_tensor_3d(g, (enum ggml_type) k_type, head_dim, n_keys, n_head_kv);
    struct ggml_tensor * tm = key_mask ? ggml_new_tensor_1d(g, GGML_TYPE_F32, n_keys) : NULL;
    // f16 and quantized keys are widened first: a mixed product would round the queries to the
    // keys' type (f16: parity with the torch twin then fails its tolerance)
    struct ggml_tensor * kl = k_type == GGML_TYPE_F32 ? tk : ggml_cast(g, tk, GGML_TYPE_F32);
    // the fused op on the CPU alone: on a device it would bring every block's logits back to the host
    const struct kvl_colsum colsum = {scale};
    const struct kvl_colsum * fused = c->n_backends == 1 ? &colsum : NULL;
    struct ggml_tensor * s = NULL;  // [n_keys, n_head_kv]
    for (int b0 = 0; b0 < n_q; b0 += block) {
        const int nb = b0 + block <= n_q ? block : n_q - b0;
        struct ggml_tensor * qb = n_block == 1 ? tq :
            ggml_cont(g, ggml_view_3d(g, tq, head_dim, nb, n_head, tq->nb[1], tq->nb[2], (size_t) b0 * tq->nb[1]));
        struct ggml_tensor * sb = kvl_pool_block(g, qb, kl, tm, n_q, b0, scale, chunk, reduce_max, causal_tail,
                                                 fused, c->n_threads);
        if (!sb) { ggml_free(g); return KVL_NO_MEMORY; }
        s = !s ? sb : reduce_max ? kvl_max2(g, s, sb) : ggml_add(g, s, sb);
    }
    struct ggml_cgraph * gf = ggml_new_graph_custom(g, n_tensors, false);
    ggml_build_forward_expand(gf, s);
    const struct kvl_input in[] = {{tq, q_layer}, {tk, k_layer}, {tm, key_mask}};
    const int rc = kvl_run(c, gf, in, 3, s, out);
    ggml_free(g);
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
    // casts them to f32, so no widened copy of a layer is ever made on the host)
    if (k_type != GGML_TYPE_F32 && (k_type < 0 || k_type >= GGML_TYPE_COUNT ||
                                    !ggml_get_type_traits((enum ggml_type) k_type)->to_float ||
                                    head_dim % ggml_blck_size((enum ggml_type) k_type))) {
        return KVL_BAD_TYPE;
    }
    const size_t q_layer = (size_t) n_head * n_q * head_dim;
    const size_t k_layer = (size_t) n_head_kv * n_keys * ggml_row_size((enum ggml_type) k_type, head_dim);
    const size_t n_out = (size_t) n_head_kv * n_keys;
    int rc = KVL_OK;
    for (int il = 0; il < n_layer && rc == KVL_OK; il++) {
        rc = kvl_pool_layer(c, q + il * q_layer, (const char *) k + il * k_layer, k_type, key_mask, n_head, n_head_kv,
                            n_q, n_keys, head_dim, scale, chunk, reduce_max, causal_tail, out + il * n_out);
    }
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

