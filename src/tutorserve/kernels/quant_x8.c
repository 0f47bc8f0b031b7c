/* Matmuls on GGUF blocks with int8 activations, the way llama.cpp computes them.
 *
 * Each activation row is rounded once per call to int8 codes qx, with one scale dx (max |x| /
 * 127, to nearest) per four values. Every format's weights are w = d q + m with small integer
 * codes q and, per 16 weights at least, one scale d and one offset m (quant.c's table), so a
 * weight row's dot product with x is, per four weights, a sum of integer products, exact in
 * int32, times two scales, plus the offset times the activations' own scaled sum:
 *   Σ_g d dx_g Σ q qx + Σ_g m dx_g Σ qx       (Q8_0: m = 0; Q4_0: m = −8 d; Q6_K: −32 d sc)
 * An integer multiply-add takes 32 weights per instruction (AVX2 vpmaddubsw + vpmaddwd, VNNI
 * vpdpbusd) where a float path widens every code to float32 first and takes 8 or 16: the
 * batch-1 matmul is compute-bound, not bandwidth-bound, on these rows. Both instructions leave
 * the sum of four products in each 32-bit lane, so a scale per four values costs nothing over
 * llama.cpp's one per 32, and rounds far less: on SmolLM2, mean |Δlogit| against the float
 * model 0.06 against 0.20 (docs/benchmarks/quantization.md). The tests compare with a float64
 * matmul on the same rounded activations.
 *
 * A row is taken in units of 32 weights (int8_dot.h): a block of the 32-weight formats, a
 * sub-block of the K-quants' 256, whose (scale, min) or scales apply per 32 or 16 weights.
 */
#include <stdlib.h>

#include "blocks.h"
#include "int8_dot.h"

/* Activation rows per pass over a weight row: 6 with AVX-512's 32 registers (8 spilled: slower
 * than 7), else 4. */
enum { MAX_TILE = 6, TILE = VL == 16 ? MAX_TILE : 4 };

typedef struct {
    const uint8_t *w;
    int y_bf16;
    int64_t units, ldy; /* units: 32-weight units per row */
    const int8_t *qx; /* [batch, units * 32] */
    const float *dx, *sx; /* [batch, units * 8]: per four codes, their scale and dx Σ qx */
    void *y;
} Args;

/* The scales d and offsets m (w = d q + m) of a K-quant's 256-weight block, per 16 weights. */
typedef struct {
    per16 d, m;
} KScales;
__attribute__((always_inline)) static inline KScales k_scales(const int FMT, const uint8_t *b) {
    if (FMT == Q6_K) { /* 16 int8 scales, then d: w = d sc (q - 32) */
        const per16 d = per16_i8x16(b + 192, half(b + 208));
        return (KScales){d, per16_mul(d, -32.f)};
    }
    uint64_t sc, mn; /* Q4_K/Q5_K: w = d sc q - dmin mn, per 32 weights */
    k4_scales(b + 4, &sc, &mn);
    return (KScales){per16_u8x8(sc, half(b)), per16_u8x8(mn, -half(b + 2))};
}

/* Sub-block j (32 weights) of a K-quant's block: its codes. */
__attribute__((always_inline)) static inline unit k_unit(const int FMT, const uint8_t *b, int j) {
    if (FMT == Q6_K) { /* halves of 128: 64 bytes of low nibbles, 32 of high 2-bit pairs */
        const int h = j / 4, t = j % 4;
        return unit_or(nib32(b + 64 * h + 32 * (t & 1), 4 * (t >> 1)),
                       plane(b + 128 + 32 * h, 2 * t, 3));
    }
    /* sub-blocks 2p and 2p + 1: the low and high nibbles of the same 32 bytes */
    const unit u = nib32(b + (FMT == Q4_K ? 16 : 48) + 32 * (j / 2), 4 * (j & 1));
    return FMT == Q5_K ? unit_or(u, plane(b + 16, j, 1)) : u;
}

/* Block i of a 32-weight format (and i + 1 when two; else i again, whose activations load as
 * zeros): codes, and per four of them the weight scale d and offset m. Q8_0's codes are
 * signed and have no offset. */
__attribute__((always_inline)) static inline void load_blocks(const int FMT, const uint8_t *row,
                                                              int64_t i, int two, codes *w,
                                                              lanes *d, lanes *m) {
    const uint8_t *b = row + i * bytes_of(FMT);
    const int next = two ? bytes_of(FMT) : 0, has_m = FMT == Q4_1 || FMT == Q5_1;
    const int fifth = FMT == Q5_0 || FMT == Q5_1;
    const uint8_t *qs = b + 2 + 2 * has_m + 4 * fifth;
    if (FMT == Q8_0) {
        const unit u[2] = {bytes32(qs), bytes32(qs + next)};
        *w = join(u);
    } else {
        *w = nib16_blocks(qs, next);
    }
    if (fifth) *w = codes_or(*w, bits32_blocks(b + 2 + 2 * has_m, next));
    dm_blocks(b, next, has_m, fifth ? -16.f : -8.f, d, m);
}

/* STEP units' products from unit i into accumulator set U of ROWS activation rows from b0. */
__attribute__((always_inline)) static inline void accumulate(const Args *a, const int FMT,
                                                             codes w, lanes d, lanes m, int64_t i,
                                                             int64_t b0, const int ROWS,
                                                             lanes (*acc)[2], const int U,
                                                             int two) {
    for (int b = 0; b < ROWS; b++) {
        const int64_t j = (b0 + b) * a->units + i;
        const lanes scale = lanes_mul(d, load_lanes(a->dx + j * 8, two));
        acc[b][U] = acc_dot(acc[b][U], w, load_x(a->qx + j * 32, two), scale, FMT == Q8_0);
        if (FMT != Q8_0) acc[b][U] = lanes_fma(m, load_lanes(a->sx + j * 8, two), acc[b][U]);
    }
}

__attribute__((always_inline)) static inline void step(const Args *a, const int FMT,
                                                       const uint8_t *row, int64_t i, int64_t b0,
                                                       const int ROWS, lanes (*acc)[2],
                                                       const int U, int two) {
    codes w;
    lanes d, m;
    load_blocks(FMT, row, i, two, &w, &d, &m);
    accumulate(a, FMT, w, d, m, i, b0, ROWS, acc, U, two);
}

/* y[b, r] for ROWS activation rows from b0; FMT and ROWS are compile-time in the callers, so
 * each pair gets its own loop with the accumulators in registers. Each row has two, for
 * alternate steps, so that consecutive steps do not wait on each other's multiply-add latency,
 * and at every ROWS: a row's sum is then the same whatever rows share its tile (a row verifying
 * speculative drafts gets the logits that plain decoding would give it). A K-quant's block is
 * taken whole: its scales once, its eight sub-blocks unrolled. */
__attribute__((always_inline)) static inline void tile(const Args *a, const int FMT, int64_t r,
                                                       int64_t b0, const int ROWS) {
    const uint8_t *row = a->w + r * (a->units * 32 / group_of(FMT)) * bytes_of(FMT);
    lanes acc[MAX_TILE][2];
    for (int b = 0; b < ROWS; b++) acc[b][0] = acc[b][1] = lanes_zero();
    if (FMT == Q4_K || FMT == Q5_K || FMT == Q6_K) {
        for (int64_t i = 0; i < a->units; i += 8) {
            const uint8_t *b = row + i / 8 * bytes_of(FMT);
            const KScales s = k_scales(FMT, b);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j += STEP) {
                unit u[STEP];
                for (int t = 0; t < STEP; t++) u[t] = k_unit(FMT, b, j + t);
                accumulate(a, FMT, join(u), lanes_at(s.d, j), lanes_at(s.m, j), i + j, b0, ROWS,
                           acc, j / STEP % 2, 1);
            }
        }
    } else {
        int64_t i = 0;
        for (; i + 2 * STEP <= a->units; i += 2 * STEP) {
            step(a, FMT, row, i, b0, ROWS, acc, 0, 1);
            step(a, FMT, row, i + STEP, b0, ROWS, acc, 1, 1);
        }
        for (; i < a->units; i += STEP) step(a, FMT, row, i, b0, ROWS, acc, 0, i + 1 < a->units);
    }
    for (int b = 0; b < ROWS; b++)
        store_any(a->y, (b0 + b) * a->ldy + r, lanes_sum(acc[b][0]) + lanes_sum(acc[b][1]),
                  a->y_bf16);
}

__attribute__((always_inline)) static inline void weight_row(const Args *a, int64_t r,
                                                             int64_t batch, const int FMT) {
    for (int64_t b0 = 0; b0 < batch; b0 += TILE) {
        switch (batch - b0 < TILE ? batch - b0 : TILE) { /* above 4 only with AVX-512 */
        case 1: tile(a, FMT, r, b0, 1); break;
        case 2: tile(a, FMT, r, b0, 2); break;
        case 3: tile(a, FMT, r, b0, 3); break;
        case 4: tile(a, FMT, r, b0, 4); break;
        case 5: tile(a, FMT, r, b0, 5); break;
        default: tile(a, FMT, r, b0, MAX_TILE); break;
        }
    }
}

/* A row of x (k values, float32 or bf16) → int8 codes, and per four of them their scale and
 * the scale times their sum. */
static void quantize_row(const void *x, int x_bf16, int64_t k, int8_t *qx, float *dx, float *sx) {
    for (int64_t g = 0; g < k / 4; g++) {
        float v[4], amax = 0.f;
        for (int j = 0; j < 4; j++) {
            v[j] = load_any(x, g * 4 + j, x_bf16);
            /* not fmaxf: AArch64 GCC 12 crashes vectorizing that reduction */
            amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
        }
        const float inv = amax > 0.f ? 127.f / amax : 0.f, d = amax / 127.f;
        int32_t sum = 0;
        for (int j = 0; j < 4; j++) {
            qx[g * 4 + j] = (int8_t)nearbyintf(v[j] * inv);
            sum += qx[g * 4 + j];
        }
        dx[g] = d;
        sx[g] = d * (float)sum;
    }
}

/* `batch` rows of x, ldx apart → quantize_row's codes qx [batch, k], scales dx and scaled sums
 * sx [batch, k / 4]. On one core, rounding 64 rows held up a small projection's matmul (its
 * kernel then works on all cores), so from 8 rows on they are rounded in parallel. */
void tutorserve_quantize_rows(const void *x, int x_bf16, int64_t batch, int64_t ldx, int64_t k,
                              int8_t *qx, float *dx, float *sx, int num_threads) {
    const int elem = x_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (batch >= 8)
    for (int64_t b = 0; b < batch; b++)
        quantize_row((const uint8_t *)x + b * ldx * elem, x_bf16, k, qx + b * k, dx + b * k / 4,
                     sx + b * k / 4);
}

/* y = x W^T as quant_matmul (quant.c) takes it. 0; -1 for rows that are not whole blocks or a
 * format this file does not know; -2 when a buffer cannot be allocated. */
int quant_matmul_x8(const void *w, int fmt, int64_t n, int64_t k, const void *x, int x_bf16,
                    int64_t batch, int64_t ldx, void *y, int y_bf16, int64_t ldy,
                    int num_threads) {
    if (group_of(fmt) == 0 || k % group_of(fmt)) return -1;
    int8_t *qx = malloc((size_t)(batch * k));
    float *scales = malloc(sizeof(float) * (size_t)(batch * k / 2));
    if (!qx || !scales) {
        free(qx), free(scales);
        return -2;
    }
    float *dx = scales, *sx = scales + batch * k / 4;
    tutorserve_quantize_rows(x, x_bf16, batch, ldx, k, qx, dx, sx, num_threads);
    const Args a = {w, y_bf16, k / 32, ldy, qx, dx, sx, y};
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < n; r++) {
        switch (fmt) { /* each format's loop compiled on its own */
        case Q4_0: weight_row(&a, r, batch, Q4_0); break;
        case Q4_1: weight_row(&a, r, batch, Q4_1); break;
        case Q5_0: weight_row(&a, r, batch, Q5_0); break;
        case Q5_1: weight_row(&a, r, batch, Q5_1); break;
        case Q8_0: weight_row(&a, r, batch, Q8_0); break;
        case Q4_K: weight_row(&a, r, batch, Q4_K); break;
        case Q5_K: weight_row(&a, r, batch, Q5_K); break;
        case Q6_K: weight_row(&a, r, batch, Q6_K); break;
        }
    }
    free(qx), free(scales);
    return 0;
}
