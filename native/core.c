// The library's life cycle and the graph runner every kernel uses.
#include "kvl.h"

int kvl_abi_version(void) { return KVL_ABI_VERSION; }

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

int kvl_run(struct kvl_ctx * c, struct ggml_cgraph * gf, const struct kvl_input * inputs, int n_inputs,
            struct ggml_tensor * out, void * out_data) {
    if (!ggml_gallocr_alloc_graph(c->galloc, gf)) return KVL_NO_MEMORY;
    for (int i = 0; i < n_inputs; i++) {
        if (inputs[i].tensor) ggml_backend_tensor_set(inputs[i].tensor, inputs[i].data, 0, ggml_nbytes(inputs[i].tensor));
    }
    if (ggml_backend_graph_compute(c->backend, gf) != GGML_STATUS_SUCCESS) return KVL_COMPUTE_FAILED;
    ggml_backend_tensor_get(out, out_data, 0, ggml_nbytes(out));
    return KVL_OK;
}

struct ggml_tensor * kvl_row_max(struct ggml_context * g, struct ggml_tensor * x) {
    // ggml has no max-reduction op; a max-pool over the whole row is one.
    return ggml_pool_1d(g, x, GGML_OP_POOL_MAX, (int) x->ne[0], (int) x->ne[0], 0);
}

struct ggml_tensor * kvl_logsumexp(struct ggml_context * g, struct ggml_tensor * x) {
    struct ggml_tensor * m = kvl_row_max(g, x);
    struct ggml_tensor * s = ggml_sum_rows(g, ggml_exp(g, ggml_sub(g, x, m)));
    return ggml_add(g, m, ggml_log(g, s));
}
