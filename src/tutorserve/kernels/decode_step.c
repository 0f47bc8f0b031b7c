/* The decoder layers of a small step (decode rows, and rows with a few tokens: speculative
 * drafts, short prefill chunks) in one call: a loop over layers of the kernels that the
 * model's Python otherwise calls one by one (norm_act.c, quant.c, rotary.c, kv_write.c,
 * paged_attention.c), with the same arguments, in the same order.
 *
 * At batch 1 a layer's kernels take a few hundred microseconds in all, and the Python around
 * each of its ~10 calls (argument checks, a tensor per output, ctypes) adds about as much
 * again. Here the calls are C calls and the intermediate rows live in one buffer for the step,
 * so the hidden states are bit for bit those of the layer-by-layer path, but for rows that
 * share a cached prefix: their merge (`cascade`) rounds like C's expf, not PyTorch's.
 *
 * Layers are Llama's (pre-norm, fused QKV with an optional bias, rotary, grouped-query
 * attention over the paged cache, SwiGLU MLP) with every projection on quantized blocks.
 */
#include <stdlib.h>

#include "convert.h"

int add_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows,
                 int64_t n, float eps, int is_bf16, int num_threads);
int silu_mul(const void *gate_up, void *out, int64_t rows, int64_t n, int is_bf16,
             int num_threads);
int quant_matmul(const void *w, int fmt, int64_t n, int64_t k, const void *x, int x_bf16,
                 int64_t batch, int64_t ldx, void *y, int y_bf16, int64_t ldy, int num_threads);
int quant_gemm(const void *w, int fmt, int64_t n, int64_t k, const void *x, int64_t batch,
               int64_t ldx, void *y, int y_bf16, int64_t ldy, int num_threads);
int rotary_embedding(const int64_t *positions, void *q, void *k, int64_t tokens, int64_t q_heads,
                     int64_t k_heads, int64_t head_dim, int64_t q_token_stride,
                     int64_t q_head_stride, int64_t k_token_stride, int64_t k_head_stride,
                     const void *cos, const void *sin, int64_t max_positions, int table_bf16,
                     int is_bf16, int num_threads);
int write_kv(const void *k, const void *v, int64_t tokens, int64_t kv_heads, int64_t head_dim,
             int64_t k_token_stride, int64_t v_token_stride, int64_t head_stride,
             const int64_t *slots, void *k_cache, void *v_cache, int64_t num_slots,
             int64_t block_size, int src_bf16, int cache_format, int num_threads);
int paged_attention(const void *q, const void *k, const void *v, const int64_t *tables,
                    const int64_t *lens, const int64_t *causal, int64_t sets, int64_t kv_heads,
                    int64_t nq, int64_t group, int64_t dim, int64_t num_blocks,
                    int64_t block_size, int64_t width, float scale, int q_bf16, int kv_format,
                    float *out, float *lse, int num_threads);

enum { MAX_PARTS = 4 };

/* A projection: quantized parts stacked along the output (a fused QKV may mix formats). */
typedef struct {
    const void *blocks[MAX_PARTS];
    int64_t rows[MAX_PARTS];
    int32_t fmt[MAX_PARTS];
    int32_t parts;
    const void *bias;  /* [out] in the model's dtype, or NULL */
    int64_t gemm_rows; /* rows above which bf16 rows take quant_gemm (quant/layers.py) */
} Linear;

typedef struct {
    const void *input_norm, *post_norm; /* [hidden] in the model's dtype */
    Linear qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [kv_heads, num_blocks, block_size, head_dim] */
} Layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, num_blocks, block_size;
    int64_t max_positions, parallel_work;
    float eps, scale;
    int32_t is_bf16, cache_format, table_bf16; /* cache_format: kv_format.h */
    const void *cos, *sin; /* [max_positions, head_dim] rotary tables */
} Shape;

/* Decode rows that share a cached prefix, by group (cascade attention, as
 * layers/attention/backend.py computes it): each group's queries attend to the prefix once,
 * and each row's result merges with its own suffix's by log-sum-exp. */
typedef struct {
    int64_t groups, members, width, grouped;
    const int64_t *rows;          /* [groups, members] decode row of each member, padded with 0 */
    const int64_t *tables, *lens; /* [groups, width] prefix blocks, [groups] prefix keys */
    const int64_t *member_slots;  /* [grouped] group * members + member of each grouped row */
    const int64_t *grouped_rows;  /* [grouped] its decode row */
} Shared;

/* A row computing several tokens this step (a short prefill chunk, or a token and its
 * speculative drafts), causal over its context: rows start..end of the step. */
typedef struct {
    int64_t start, end, width;
    const int64_t *table;   /* [width] its blocks, through this step's tokens */
    const int64_t *kv_len;  /* [1] keys after this step */
    const int64_t *q_start; /* [1] position of its first token */
} Span;

/* The threads the Python wrappers give an elementwise kernel over `work` elements. */
static int threads_for(const Shape *s, int64_t work, int num_threads) {
    return work >= s->parallel_work ? num_threads : 1;
}

/* y [rows, out] (row stride ldy) = x W^T (+ bias, added in float32 before the one rounding). */
static int project(const Linear *l, const void *x, int64_t k, int64_t rows, int x_bf16, void *y,
                   int y_bf16, int64_t ldy, float *wide, int num_threads) {
    int64_t col = 0;
    const int64_t size = y_bf16 ? 2 : 4;
    void *dst = l->bias ? (void *)wide : y;
    const int dst_bf16 = l->bias ? 0 : y_bf16;
    const int64_t dst_size = l->bias ? 4 : size;
    const int gemm = x_bf16 && rows > l->gemm_rows;
    for (int p = 0; p < l->parts; p++) {
        void *out = (char *)dst + col * dst_size;
        const int status =
            gemm ? quant_gemm(l->blocks[p], l->fmt[p], l->rows[p], k, x, rows, k, out, dst_bf16,
                              ldy, num_threads)
                 : quant_matmul(l->blocks[p], l->fmt[p], l->rows[p], k, x, x_bf16, rows, k, out,
                                dst_bf16, ldy, num_threads);
        if (status) return status;
        col += l->rows[p];
    }
    if (l->bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < col; c++)
                store_any(y, r * ldy + c, wide[r * ldy + c] + load_any(l->bias, c, y_bf16), y_bf16);
    return 0;
}

static float log_add_exp(float a, float b) {
    const float m = fmaxf(a, b);
    return m == -INFINITY ? m : m + log1pf(expf(-fabsf(a - b)));
}

/* Attention of the grouped rows over their shared prefix, merged into attn / lse ([rows, heads,
 * dim] / [rows, heads], over each row's own suffix). q: [rows, heads, dim] in the model's dtype;
 * qp, op, lsep: room for [groups, kv_heads, members * group, dim] (lsep without dim). */
static int cascade(const Shared *sh, const Shape *s, const Layer *L, const char *q, float *attn,
                   float *lse, char *qp, float *op, float *lsep, int num_threads) {
    const int64_t D = s->head_dim, kvh = s->kv_heads, g = s->heads / kvh, nq = sh->members * g;
    const int64_t size = s->is_bf16 ? 2 : 4;
    for (int64_t gi = 0; gi < sh->groups; gi++)
        for (int64_t m = 0; m < sh->members; m++)
            for (int64_t h = 0; h < kvh; h++)
                memcpy(qp + ((gi * kvh + h) * nq + m * g) * D * size,
                       q + (sh->rows[gi * sh->members + m] * s->heads + h * g) * D * size,
                       (size_t)(g * D * size));
    const int status = paged_attention(qp, L->k_cache, L->v_cache, sh->tables, sh->lens, NULL,
                                       sh->groups, kvh, nq, 1, D, s->num_blocks, s->block_size,
                                       sh->width, s->scale, s->is_bf16, s->cache_format, op, lsep,
                                       num_threads);
    if (status) return status;
    for (int64_t i = 0; i < sh->grouped; i++) {
        const int64_t row = sh->grouped_rows[i], gi = sh->member_slots[i] / sh->members;
        const int64_t m = sh->member_slots[i] % sh->members;
        for (int64_t hd = 0; hd < s->heads; hd++) {
            const int64_t p = (gi * kvh + hd / g) * nq + m * g + hd % g;
            const float own = lse[row * s->heads + hd], total = log_add_exp(own, lsep[p]);
            const float a = expf(own - total), b = expf(lsep[p] - total);
            float *o = attn + (row * s->heads + hd) * D;
            for (int64_t d = 0; d < D; d++) o[d] = o[d] * a + op[p * D + d] * b;
        }
    }
    return 0;
}

/* Attention of a span's tokens over its context (as the layer-by-layer prefill path calls
 * it: the tokens' query heads of one KV head side by side), into attn [rows, heads, dim].
 * qs, os: room for [kv_heads, tokens * group, dim], ls for [kv_heads, tokens * group]. */
static int span_attention(const Span *sp, const Shape *s, const Layer *L, const char *q,
                          float *attn, char *qs, float *os, float *ls, int num_threads) {
    const int64_t D = s->head_dim, kvh = s->kv_heads, g = s->heads / kvh, n = sp->end - sp->start;
    const int64_t size = s->is_bf16 ? 2 : 4;
    for (int64_t t = 0; t < n; t++)
        for (int64_t h = 0; h < kvh; h++)
            memcpy(qs + (h * n + t) * g * D * size,
                   q + ((sp->start + t) * s->heads + h * g) * D * size, (size_t)(g * D * size));
    const int status = paged_attention(qs, L->k_cache, L->v_cache, sp->table, sp->kv_len,
                                       sp->q_start, 1, kvh, n * g, g, D, s->num_blocks,
                                       s->block_size, sp->width, s->scale, s->is_bf16,
                                       s->cache_format, os, ls, num_threads);
    for (int64_t t = 0; t < n && !status; t++)
        for (int64_t h = 0; h < kvh; h++)
            memcpy(attn + ((sp->start + t) * s->heads + h * g) * D, os + (h * n + t) * g * D,
                   sizeof(float) * (size_t)(g * D));
    return status;
}

/* x [rows, hidden]: the embedded tokens in, the last layer's MLP output out; residual
 * [rows, hidden]: the residual stream before that output. The first decode_rows rows are
 * one-token rows (tables [decode_rows, width] and lens as paged_attention takes them, after
 * any shared prefix; `shared` NULL when none), the others belong to `spans`. 0; -1 for a
 * slot, position or shape a kernel refuses; -2 when the step's buffer cannot be allocated. */
int decode_layers(const Layer *layers, int64_t num_layers, const Shape *s, void *x,
                  void *residual, int64_t rows, const int64_t *positions, const int64_t *slots,
                  int64_t decode_rows, const int64_t *tables, int64_t width,
                  const int64_t *lens, const Shared *shared, const Span *spans,
                  int64_t num_spans, int num_threads) {
    const int bf = s->is_bf16;
    const int64_t size = bf ? 2 : 4, H = s->hidden, D = s->head_dim, I = s->intermediate;
    const int64_t q_size = s->heads * D, kv_size = s->kv_heads * D;
    const int64_t qkv_n = q_size + 2 * kv_size, group = s->heads / s->kv_heads;
    int64_t widest = qkv_n > 2 * I ? qkv_n : 2 * I; /* of any projection's output */
    widest = widest > H ? widest : H;
    /* One buffer for the step: normed rows, QKV (then the gate/up rows), contiguous queries,
     * attention outputs in float32 and in the model's dtype, SiLU·up, a float32 bias scratch,
     * and a span's queries, outputs and log-sum-exps in the kernel's layout. */
    const int64_t bytes = rows * (H * size + widest * size + q_size * size + q_size * 4 +
                                  s->heads * 4 + q_size * size + I * size + widest * 4 +
                                  q_size * size + q_size * 4 + s->heads * 4);
    char *buf = malloc((size_t)bytes);
    if (!buf) return -2;
    char *h = buf, *wide_rows = h + rows * H * size, *q = wide_rows + rows * widest * size;
    float *attn = (float *)(q + rows * q_size * size), *lse = attn + rows * q_size;
    char *attn_dt = (char *)(lse + rows * s->heads), *act = attn_dt + rows * q_size * size;
    float *scratch = (float *)(act + rows * I * size);
    char *span_q = (char *)(scratch + rows * widest);
    float *span_o = (float *)(span_q + rows * q_size * size), *span_lse = span_o + rows * q_size;
    /* with shared prefixes: grouped queries, their prefix outputs and log-sum-exps */
    char *qp = NULL;
    float *op = NULL, *lsep = NULL;
    if (shared) {
        const int64_t n = shared->groups * shared->members * q_size;
        if (!(qp = malloc((size_t)(n * (size + 4) + n / D * 4)))) {
            free(buf);
            return -2;
        }
        op = (float *)(qp + n * size), lsep = op + n;
    }
    const int64_t num_slots = s->num_blocks * s->block_size;
    const int norm_threads = threads_for(s, rows * H, num_threads);
    int status = 0;
    memcpy(residual, x, (size_t)(rows * H * size));
    status = add_rms_norm(x, NULL, layers[0].input_norm, h, rows, H, s->eps, bf, norm_threads);
    for (int64_t l = 0; l < num_layers && !status; l++) {
        const Layer *L = &layers[l];
        if (l > 0)
            status = add_rms_norm(x, residual, L->input_norm, h, rows, H, s->eps, bf,
                                  norm_threads);
        if (!status)
            status = project(&L->qkv, h, H, rows, bf, wide_rows, bf, qkv_n, scratch,
                             num_threads);
        char *qr = wide_rows, *kr = wide_rows + q_size * size, *vr = kr + kv_size * size;
        if (!status)
            status = rotary_embedding(positions, qr, kr, rows, s->heads, s->kv_heads, D, qkv_n,
                                      D, qkv_n, D, s->cos, s->sin, s->max_positions,
                                      s->table_bf16, bf,
                                      threads_for(s, rows * (s->heads + s->kv_heads) * D,
                                                  num_threads));
        if (!status)
            status = write_kv(kr, vr, rows, s->kv_heads, D, qkv_n, qkv_n, D, slots, L->k_cache,
                              L->v_cache, num_slots, s->block_size, bf, s->cache_format,
                              threads_for(s, 2 * rows * kv_size, num_threads));
        if (status) break;
        for (int64_t r = 0; r < rows; r++)
            memcpy(q + r * q_size * size, qr + r * qkv_n * size, (size_t)(q_size * size));
        if (decode_rows)
            status = paged_attention(q, L->k_cache, L->v_cache, tables, lens, NULL, decode_rows,
                                     s->kv_heads, group, 1, D, s->num_blocks, s->block_size,
                                     width, s->scale, bf, s->cache_format, attn, lse, num_threads);
        if (!status && shared)
            status = cascade(shared, s, L, q, attn, lse, qp, op, lsep, num_threads);
        for (int64_t i = 0; i < num_spans && !status; i++)
            status = span_attention(&spans[i], s, L, q, attn, span_q, span_o, span_lse,
                                    num_threads);
        if (status) break;
        for (int64_t i = 0; i < rows * q_size; i++) store_any(attn_dt, i, attn[i], bf);
        status = project(&L->o, attn_dt, q_size, rows, bf, x, bf, H, scratch, num_threads);
        if (!status)
            status = add_rms_norm(x, residual, L->post_norm, h, rows, H, s->eps, bf,
                                  norm_threads);
        if (!status)
            status = project(&L->gate_up, h, H, rows, bf, wide_rows, bf, 2 * I, scratch,
                             num_threads);
        if (!status)
            status = silu_mul(wide_rows, act, rows, I, bf, threads_for(s, rows * I, num_threads));
        if (!status)
            status = project(&L->down, act, I, rows, bf, x, bf, H, scratch, num_threads);
    }
    free(qp);
    free(buf);
    return status;
}
