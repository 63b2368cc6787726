// Eval-callback capture. llama.cpp calls the callback once per graph node to ask whether the
// caller wants it (every "yes" splits the graph there) and again after computing a wanted node.
// Doing this in C keeps the per-node cost out of Python (a Python callback cost ~15% of decode).
#include "kvl.h"

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

// Frees the records of one want and closes the gaps (their order is kept).
void kvl_capture_drop(struct kvl_capture * c, int want) {
    int w = 0;
    for (int i = 0; i < c->n_rec; i++) {
        if (c->rec[i].want == want) {
            free(c->rec[i].data);
        } else {
            c->rec[w++] = c->rec[i];
        }
    }
    c->n_rec = w;
}
