// The library's life cycle and the graph runner every kernel uses.
#include "kvl.h"

int kvl_abi_version(void) { return KVL_ABI_VERSION; }

// The kernels run on `device` (a ggml device name such as "CUDA0", "Metal" or "RPC0"; NULL or "":
// none) with ggml's CPU backend beside it: the scheduler gives each op to the first backend that
// supports it and its operands' buffers, so an op a device lacks, or one reading host weights (the
// counter-causal pass maps the GGUF file), runs on the CPU. Inputs and the output cross with
// ggml_backend_tensor_set/get, so no kernel ever reads device memory directly.
struct kvl_ctx * kvl_init(int n_threads, const char * device) {
    struct kvl_ctx * c = calloc(1, sizeof(*c));
    if (!c) return NULL;
    if (device && device[0]) {
        ggml_backend_dev_t dev = ggml_backend_dev_by_name(device);
        c->backends[c->n_backends] = dev ? ggml_backend_dev_init(dev, NULL) : NULL;
        if (!c->backends[c->n_backends]) { free(c); return NULL; }
        c->n_backends++;
    }
    ggml_backend_t cpu = ggml_backend_cpu_init();
    if (!cpu) { kvl_free(c); return NULL; }
    c->n_threads = n_threads > 0 ? n_threads : 1;
    ggml_backend_cpu_set_n_threads(cpu, c->n_threads);
    c->backends[c->n_backends++] = cpu;
    return c;
}

void kvl_set_threads(struct kvl_ctx * c, int n_threads) {
    if (!c) return;
    c->n_threads = n_threads > 0 ? n_threads : 1;
    ggml_backend_cpu_set_n_threads(c->backends[c->n_backends - 1], c->n_threads);
}

// n_rows rows of n_per_row values of a ggml type (a KV cache's bf16, q8_0, q4_0, ...) widened to
// f32 by ggml's own type traits: the dequantization llama.cpp's kernels use.
// row_bytes: the caller's row size, checked against the type's.
int kvl_to_float(int type, const void * src, int64_t row_bytes, float * dst, int64_t n_rows, int64_t n_per_row) {
    if (type < 0 || type >= GGML_TYPE_COUNT) return KVL_BAD_TYPE;
    const struct ggml_type_traits * t = ggml_get_type_traits((enum ggml_type) type);
    if (!t->to_float || t->blck_size <= 0 || n_per_row % t->blck_size) return KVL_BAD_TYPE;
    const size_t row = ggml_row_size((enum ggml_type) type, n_per_row);
    if ((size_t) row_bytes != row) return KVL_BAD_SHAPE;
    for (int64_t r = 0; r < n_rows; r++) t->to_float((const char *) src + (size_t) r * row, dst + r * n_per_row, n_per_row);
    return KVL_OK;
}

void kvl_free_buffers(struct kvl_ctx * c) {
    if (!c || !c->sched) return;
    ggml_backend_sched_free(c->sched);
    c->sched = NULL;
    c->sched_size = 0;
}

const char * kvl_device(const struct kvl_ctx * c) { return ggml_backend_name(c->backends[0]); }

void kvl_free(struct kvl_ctx * c) {
    if (!c) return;
    if (c->sched) ggml_backend_sched_free(c->sched);
    for (int i = 0; i < c->n_backends; i++) ggml_backend_free(c->backends[i]);
    free(c);
}

int kvl_run(struct kvl_ctx * c, struct ggml_cgraph * gf, const struct kvl_input * inputs, int n_inputs,
            struct ggml_tensor * out, void * out_data) {
    const size_t size = (size_t) ggml_graph_size(gf);
    if (!c->sched || c->sched_size < size) {  // sized to the largest graph seen (a kernel's grows with its input)
        if (c->sched) ggml_backend_sched_free(c->sched);
        c->sched = ggml_backend_sched_new(c->backends, NULL, c->n_backends, size, false, false);
        c->sched_size = c->sched ? size : 0;
        if (!c->sched) return KVL_NO_MEMORY;
    }
    ggml_backend_sched_reset(c->sched);
    for (int i = 0; i < n_inputs; i++) {
        if (inputs[i].tensor) ggml_set_input(inputs[i].tensor);
    }
    ggml_set_output(out);
    if (!ggml_backend_sched_alloc_graph(c->sched, gf)) return KVL_NO_MEMORY;
    for (int i = 0; i < n_inputs; i++) {
        if (inputs[i].tensor) ggml_backend_tensor_set(inputs[i].tensor, inputs[i].data, 0, ggml_nbytes(inputs[i].tensor));
    }
    if (ggml_backend_sched_graph_compute(c->sched, gf) != GGML_STATUS_SUCCESS) return KVL_COMPUTE_FAILED;
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
