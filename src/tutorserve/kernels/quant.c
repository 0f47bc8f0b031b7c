/* GGUF-quantized weights kept in their block format: the matmul's entry, and dequantization.
 *
 * A decode step reads every weight once, so its speed is bandwidth over weight bytes: a 4-bit
 * block costs a seventh of a float32 row. Each weight row (K inputs) is a run of blocks in
 * llama.cpp's layout; `decode` turns one block into int8 codes q with, per 16 weights, a scale
 * and an offset (w = scale * q + offset), which covers every format here:
 *
 *   Q8_0  32 weights: d, 32 int8                    w = d q
 *   Q4_0  32: d, 16 bytes of nibbles                w = d (q - 8)
 *   Q4_1  32: d, m, nibbles                         w = d q + m
 *   Q5_0  32: d, 32 high bits, nibbles              w = d (q - 16)
 *   Q5_1  32: d, m, high bits, nibbles              w = d q + m
 *   Q4_K  256: d, dmin, 8 x 6-bit (scale, min), nibbles          w = d sc q - dmin mn
 *   Q5_K  256: as Q4_K plus one high bit per weight
 *   Q6_K  256: 4 low + 2 high bits, 16 int8 scales, d            w = d sc (q - 32)
 * `quant_dequantize` writes rows of w (prefill-sized batches multiply on them with PyTorch's
 * GEMM). The codes are exact small integers and the scales are what the reference dequantizer
 * computes, so the rows are exactly gguf's. `quant_matmul` multiplies on the blocks themselves,
 * with int8 activations: quant_x8.c in GGUF's layout, quant_rows16.c on rows repacked.
 */
#include <stdlib.h>

#include "blocks.h"
#include "convert.h"

enum { CHUNK = 16 }; /* weights per scale and offset */

int quant_matmul_x8(const void *w, int fmt, int64_t n, int64_t k, const void *x, int x_bf16,
                    int64_t batch, int64_t ldx, void *y, int y_bf16, int64_t ldy,
                    int num_threads);
int quant_matmul_rows16(const void *w, int fmt, int64_t n, int64_t k, const void *x, int x_bf16,
                        int64_t batch, int64_t ldx, void *y, int y_bf16, int64_t ldy,
                        int num_threads);
void tutorserve_unpack16_row(const void *w, int fmt, int64_t r, int64_t k, uint8_t *out);

/* HIGH_BIT[b]: eight bytes, byte j = 0x10 if bit j of b is set (Q5_0/Q5_1's fifth bits, eight
 * weights per table lookup instead of a variable shift per weight, which does not vectorize). */
#define S1(b)                                                                                 \
    ((uint64_t)((b) & 1) << 4 | (uint64_t)((b) >> 1 & 1) << 12 | (uint64_t)((b) >> 2 & 1) << 20 | \
     (uint64_t)((b) >> 3 & 1) << 28 | (uint64_t)((b) >> 4 & 1) << 36 |                            \
     (uint64_t)((b) >> 5 & 1) << 44 | (uint64_t)((b) >> 6 & 1) << 52 | (uint64_t)((b) >> 7 & 1) << 60)
#define S4(b) S1(b), S1(b + 1), S1(b + 2), S1(b + 3)
#define S16(b) S4(b), S4(b + 4), S4(b + 8), S4(b + 12)
#define S64(b) S16(b), S16(b + 16), S16(b + 32), S16(b + 48)
static const uint64_t HIGH_BIT[256] = {S64(0), S64(64), S64(128), S64(192)};

/* A 32-weight block's codes from its 16 bytes of nibbles (low nibbles are weights 0-15, high
 * ones 16-31) and, for Q5_0/Q5_1, its 32-bit qh (bit i: weight i's fifth bit). Built in 64-bit
 * words, eight codes each (little-endian, as x86 and AArch64 are), and stored 16 bytes at a
 * time as the dot product loads them: codes stored byte by byte and read back as vectors stall
 * on store forwarding (4.3 against 0.6 ms for a 9,728 × 896 Q5_0 matmul). */
static inline void nibbles(const uint8_t *qs, const uint8_t *qh, int8_t *q) {
    const uint64_t low = 0x0F0F0F0F0F0F0F0FULL;
    uint64_t v[2], out[4];
    memcpy(v, qs, sizeof v);
    out[0] = v[0] & low;
    out[1] = v[1] & low;
    out[2] = v[0] >> 4 & low;
    out[3] = v[1] >> 4 & low;
    if (qh)
        for (int m = 0; m < 4; m++) out[m] |= HIGH_BIT[qh[m]];
#if defined(TS_AVX2) || defined(TS_AVX512)
    _mm_storeu_si128((__m128i *)q, _mm_set_epi64x((long long)out[1], (long long)out[0]));
    _mm_storeu_si128((__m128i *)(q + 16), _mm_set_epi64x((long long)out[3], (long long)out[2]));
#else
    memcpy(q, out, sizeof out);
#endif
}

/* One block → codes q[group] and a (scale, offset) per 16 weights. */
__attribute__((always_inline)) static inline void decode(int fmt, const uint8_t *b, int8_t *q,
                                                       float *scale, float *offset) {
    switch (fmt) {
    case Q8_0: {
        const float d = half(b);
        memcpy(q, b + 2, 32);
        scale[0] = scale[1] = d;
        offset[0] = offset[1] = 0.f;
        return;
    }
    case Q4_0: case Q5_0: {
        const float d = half(b);
        nibbles(fmt == Q4_0 ? b + 2 : b + 6, fmt == Q4_0 ? NULL : b + 2, q);
        scale[0] = scale[1] = d;
        offset[0] = offset[1] = (fmt == Q4_0 ? -8.f : -16.f) * d;
        return;
    }
    case Q4_1: case Q5_1: {
        const float d = half(b), m = half(b + 2);
        nibbles(fmt == Q4_1 ? b + 4 : b + 8, fmt == Q4_1 ? NULL : b + 4, q);
        scale[0] = scale[1] = d;
        offset[0] = offset[1] = m;
        return;
    }
    case Q4_K: case Q5_K: {
        const float d = half(b), dmin = half(b + 2);
        const uint8_t *qh = b + 16, *qs = b + (fmt == Q4_K ? 16 : 48);
        uint64_t sc, mn;
        k4_scales(b + 4, &sc, &mn);
        for (int j = 0; j < 8; j++) { /* sub-block j: 32 weights, nibbles of byte group j / 2 */
            const uint8_t *src = qs + 32 * (j / 2);
            const int shift = (j & 1) * 4;
            for (int l = 0; l < 32; l++) {
                int v = src[l] >> shift & 0xF;
                if (fmt == Q5_K) v |= (qh[l] >> j & 1) << 4;
                q[32 * j + l] = (int8_t)v;
            }
            scale[2 * j] = scale[2 * j + 1] = d * (float)(sc >> 8 * j & 0xFF);
            offset[2 * j] = offset[2 * j + 1] = -dmin * (float)(mn >> 8 * j & 0xFF);
        }
        return;
    }
    case Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = half(b + 208);
        for (int h = 0; h < 2; h++) { /* two halves of 128 weights */
            int8_t *o = q + 128 * h;
            const uint8_t *l4 = ql + 64 * h, *h2 = qh + 32 * h;
            for (int l = 0; l < 32; l++) {
                o[l] = (int8_t)((l4[l] & 0xF) | (h2[l] & 3) << 4);
                o[l + 32] = (int8_t)((l4[l + 32] & 0xF) | (h2[l] >> 2 & 3) << 4);
                o[l + 64] = (int8_t)((l4[l] >> 4) | (h2[l] >> 4 & 3) << 4);
                o[l + 96] = (int8_t)((l4[l + 32] >> 4) | (h2[l] >> 6 & 3) << 4);
            }
        }
        for (int c = 0; c < 16; c++) {
            scale[c] = d * (float)sc[c];
            offset[c] = -32.f * scale[c];
        }
        return;
    }
    }
}

/* decode, for quant_rows16.c's plain C path. */
void tutorserve_decode_block(int fmt, const uint8_t *b, int8_t *q, float *scale, float *offset) {
    decode(fmt, b, q, scale, offset);
}

/* Row r of the weight, all K of it: codes into q[K], per-16 scales and offsets. The switch
 * is outside the loop so that each format's decoder is inlined into its own loop. */
#define DECODE_ROW(F)                                                                    \
    for (int64_t i = 0; i < blocks; i++)                                                 \
        decode(F, row + i * nb, q + i * g, scale + i * (g / CHUNK), offset + i * (g / CHUNK))
__attribute__((always_inline)) static inline void decode_row(int fmt, const uint8_t *w, int64_t r,
                                                           int64_t k, int8_t *q, float *scale,
                       float *offset) {
    const int g = group_of(fmt), nb = bytes_of(fmt);
    const int64_t blocks = k / g;
    const uint8_t *row = w + r * blocks * nb;
    switch (fmt) {
    case Q4_0: DECODE_ROW(Q4_0); break;
    case Q4_1: DECODE_ROW(Q4_1); break;
    case Q5_0: DECODE_ROW(Q5_0); break;
    case Q5_1: DECODE_ROW(Q5_1); break;
    case Q8_0: DECODE_ROW(Q8_0); break;
    case Q4_K: DECODE_ROW(Q4_K); break;
    case Q5_K: DECODE_ROW(Q5_K); break;
    case Q6_K: DECODE_ROW(Q6_K); break;
    }
}

static int shape_ok(int fmt, int64_t k) {
    const int base = fmt & ~ROWS16;
    if (fmt & ROWS16 && !repacks16(base)) return 0;
    const int g = group_of(base);
    return g != 0 && k % g == 0;
}

/* One thread's decoded row: codes (padded: NEON's vload_i8 reads 8 bytes), scales, offsets;
 * and a repacked row's blocks back in GGUF's layout (at most 34 bytes per 32 weights). */
typedef struct {
    int8_t *q;
    float *scale, *offset;
    uint8_t *blocks;
} RowBuf;

static int row_buf_alloc(RowBuf *b, int64_t k) {
    b->q = malloc((size_t)k + 64);
    b->scale = malloc(sizeof(float) * (size_t)(k / CHUNK));
    b->offset = malloc(sizeof(float) * (size_t)(k / CHUNK));
    b->blocks = malloc((size_t)(k / 32 * 34));
    return b->q && b->scale && b->offset && b->blocks;
}

static void row_buf_free(RowBuf *b) {
    free(b->q);
    free(b->scale);
    free(b->offset);
    free(b->blocks);
}

/* Runs fn(buf, i, ctx) for rows i < n over the OpenMP team, each thread with its own row
 * buffer; 0, or -2 when a buffer could not be allocated. */
typedef void (*RowFn)(const RowBuf *buf, int64_t i, const void *ctx);
static int for_each_row(int64_t n, int64_t k, int num_threads, RowFn fn, const void *ctx) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        RowBuf buf;
        if (!row_buf_alloc(&buf, k)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < n; i++) fn(&buf, i, ctx);
        }
        row_buf_free(&buf);
    }
    return failed ? -2 : 0;
}

/* y = x W^T: W [n, k] quantized rows of `fmt`; x [batch, k] float32 or bf16 (`x_bf16`) rows ldx
 * apart; y [batch, n] float32 or bf16 rows ldy apart (a column slice of a wider output when
 * ldy > n). 0; -1 for rows that are not whole blocks; -2 when a buffer cannot be allocated. */
int quant_matmul(const void *w, int fmt, int64_t n, int64_t k, const void *x, int x_bf16,
                 int64_t batch, int64_t ldx, void *y, int y_bf16, int64_t ldy, int num_threads) {
    if (!shape_ok(fmt, k)) return -1;
    if (fmt & ROWS16)
        return quant_matmul_rows16(w, fmt & ~ROWS16, n, k, x, x_bf16, batch, ldx, y, y_bf16, ldy,
                                   num_threads);
    return quant_matmul_x8(w, fmt, n, k, x, x_bf16, batch, ldx, y, y_bf16, ldy, num_threads);
}

typedef struct {
    const uint8_t *w;
    int fmt, out_bf16;
    int64_t k;
    const int64_t *rows;
    void *out;
} DequantArgs;

static void dequantize_row(const RowBuf *buf, int64_t i, const void *ctx) {
    const DequantArgs *a = ctx;
    const int64_t k = a->k, r = a->rows ? a->rows[i] : i;
    if (a->fmt & ROWS16) {
        tutorserve_unpack16_row(a->w, a->fmt & ~ROWS16, r, k, buf->blocks);
        decode_row(a->fmt & ~ROWS16, buf->blocks, 0, k, buf->q, buf->scale, buf->offset);
    } else {
        decode_row(a->fmt, a->w, r, k, buf->q, buf->scale, buf->offset);
    }
    for (int64_t c = 0; c < k / CHUNK; c++) {
        const vf s = vset1(buf->scale[c]), o = vset1(buf->offset[c]);
        for (int v = 0; v < CHUNK; v += VL) {
            const vf wv = vfma(vload_i8(buf->q + c * CHUNK + v), s, o);
            vstore_as(a->out, i * k + c * CHUNK + v, wv, a->out_bf16);
        }
    }
}

/* out[i, :] = W[rows[i], :] dequantized (rows NULL: rows 0..n-1), float32 or bf16. */
int quant_dequantize(const void *w, int fmt, int64_t k, const int64_t *rows, int64_t n, void *out,
                     int out_bf16, int num_threads) {
    if (!shape_ok(fmt, k)) return -1;
    const DequantArgs a = {w, fmt, out_bf16, k, rows, out};
    return for_each_row(n, k, num_threads, dequantize_row, &a);
}
