/* Matmuls on Q4_0, Q4_1 and Q8_0 blocks with int8 activations, the way llama.cpp computes them.
 *
 * Each activation row is rounded once per call to int8 codes qx, with one scale dx (max |x| /
 * 127, to nearest) per four values, so a weight block's dot product with it is, per four
 * weights, a sum of integer products, exact in int32, times two scales:
 *   Q8_0  Σ_g d dx_g Σ q qx
 *   Q4_0  Σ_g d dx_g Σ q qx − 8 d Σ_g dx_g Σ qx
 *   Q4_1  Σ_g d dx_g Σ q qx + m Σ_g dx_g Σ qx
 * An integer multiply-add takes 32 weights per instruction (AVX2 vpmaddubsw + vpmaddwd, VNNI
 * vpdpbusd) where the float path widened every code to float32 first and took 8 or 16: the
 * batch-1 matmul is compute-bound, not bandwidth-bound, on these rows. Both instructions leave
 * the sum of four products in each 32-bit lane, so a scale per four values costs nothing over
 * llama.cpp's one per 32, and rounds far less: on SmolLM2, mean |Δlogit| against the float
 * model 0.06 against 0.20 (docs/benchmarks/quantization.md). The tests compare with a float64
 * matmul on the same rounded activations.
 */
#include <stdlib.h>

#include "convert.h"

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 }; /* ggml type ids, as quant.c */
/* Activation rows per pass over a weight row: 6 with AVX-512's 32 registers (8 spilled: slower
 * than 7), else 4. */
enum { MAX_TILE = 6, TILE = VL == 16 ? MAX_TILE : 4 };

typedef struct {
    const uint8_t *w;
    int y_bf16;
    int64_t blocks, ldy;
    const int8_t *qx; /* [batch, blocks * 32] */
    const float *dx, *sx; /* [batch, blocks * 8]: per four codes, their scale and dx Σ qx */
    void *y;
} Args;

/* Per level: STEP blocks' 32 codes each in one register (`codes`), and float `lanes`, one per
 * four codes. Weights' Q4 codes are unsigned bytes; Q8_0's and the activations' are signed. A
 * step's second block, when the row has none left, reads the first again: its activation codes,
 * scales and sums load as zeros. */
#if defined(TS_AVX2) || defined(TS_AVX512)
typedef vf lanes; /* eight per block: one block with AVX2, two with AVX-512 */
static inline lanes lanes_zero(void) { return vzero(); }
static inline lanes lanes_fma(lanes a, lanes b, lanes c) { return vfma(a, b, c); }
static inline lanes lanes_mul(lanes a, lanes b) { return vmul(a, b); }
static inline float lanes_sum(lanes a) { return vhsum(a); }
#endif

#if defined(TS_AVX512)
enum { STEP = 2 };
typedef __m512i codes;
static inline uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}
/* Codes of blocks A (qs at p) and B (at p + nb), in order: A's 32 then B's. */
static inline codes load_w(const int FMT, const uint8_t *p, int nb) {
    if (FMT == Q8_0)
        return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                                  _mm256_loadu_si256((const __m256i *)(p + nb)), 1);
    const __m256i v = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
        _mm_loadu_si128((const __m128i *)(p + nb)), 1);
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    /* [A 0-15, B 0-15, A 16-31, B 16-31] → A then B */
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return _mm512_shuffle_i64x2(w, w, _MM_SHUFFLE(3, 1, 2, 0));
}
/* The blocks' scales d and offsets m (Q4_1's m, Q4_0's −8 d), eight lanes each. */
static inline void load_dm(const int FMT, const uint8_t *b, int nb, lanes *d, lanes *m) {
    const __m128 h = _mm_cvtph_ps(_mm_set_epi32(0, 0, (int)u32_at(b + nb), (int)u32_at(b)));
    /* h = [d_A, m_A, d_B, m_B] (Q4_0 and Q8_0 have no m: lanes 1 and 3 are not read) */
    const __m512 wide = _mm512_castps128_ps512(h);
    const __m512i first = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    *d = _mm512_permutexvar_ps(first, wide);
    *m = FMT == Q4_1 ? _mm512_permutexvar_ps(_mm512_add_epi32(first, _mm512_set1_epi32(1)), wide)
                     : _mm512_mul_ps(*d, _mm512_set1_ps(-8.f));
}
static inline codes load_x(const int8_t *p, int two) {
    return two ? _mm512_loadu_si512(p)
               : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)p));
}
static inline lanes load_lanes(const float *p, int two) {
    return two ? _mm512_loadu_ps(p) : _mm512_zextps256_ps512(_mm256_loadu_ps(p));
}
static inline __m512i dot_u8s8(__m512i u, __m512i s) {
#if defined(TS_VNNI)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else /* pairs of products fit int16: 2 · 255 · 127 */
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}
/* acc + scale · Σ w x, each lane over its four codes. Signed Q8_0 codes go in as |w| and x
 * with w's sign. */
static inline lanes acc_dot(lanes acc, codes w, codes x, lanes scale, const int SIGNED) {
    __m512i d;
    if (SIGNED) {
        const __mmask64 negative = _mm512_movepi8_mask(w);
        d = dot_u8s8(_mm512_abs_epi8(w),
                     _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x));
    } else {
        d = dot_u8s8(w, x);
    }
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc);
}

#elif defined(TS_AVX2)
enum { STEP = 1 };
typedef __m256i codes;
static inline codes load_w(const int FMT, const uint8_t *p, int nb) {
    (void)nb;
    if (FMT == Q8_0) return _mm256_loadu_si256((const __m256i *)p);
    const __m128i v = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
}
static inline void load_dm(const int FMT, const uint8_t *b, int nb, lanes *d, lanes *m) {
    (void)nb;
    *d = _mm256_set1_ps(half(b));
    *m = _mm256_set1_ps(FMT == Q4_1 ? half(b + 2) : -8.f * half(b));
}
static inline codes load_x(const int8_t *p, int two) {
    (void)two;
    return _mm256_loadu_si256((const __m256i *)p);
}
static inline lanes load_lanes(const float *p, int two) {
    (void)two;
    return _mm256_loadu_ps(p);
}
static inline lanes acc_dot(lanes acc, codes w, codes x, lanes scale, const int SIGNED) {
    const __m256i u = SIGNED ? _mm256_sign_epi8(w, w) : w, s = SIGNED ? _mm256_sign_epi8(x, w) : x;
    const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), scale, acc);
}

#else /* scalar and NEON: plain C, over the same eight lanes */
enum { STEP = 1 };
typedef struct {
    int8_t v[32];
} codes;
typedef struct {
    float v[8];
} lanes;
static inline lanes lanes_zero(void) { return (lanes){{0}}; }
static inline lanes lanes_set1(float x) {
    lanes out;
    for (int l = 0; l < 8; l++) out.v[l] = x;
    return out;
}
static inline lanes lanes_fma(lanes a, lanes b, lanes c) {
    for (int l = 0; l < 8; l++) c.v[l] += a.v[l] * b.v[l];
    return c;
}
static inline lanes lanes_mul(lanes a, lanes b) {
    for (int l = 0; l < 8; l++) a.v[l] *= b.v[l];
    return a;
}
static inline float lanes_sum(lanes a) {
    float s = 0.f;
    for (int l = 0; l < 8; l++) s += a.v[l];
    return s;
}
static inline codes load_w(const int FMT, const uint8_t *p, int nb) {
    (void)nb;
    codes c;
    if (FMT == Q8_0) {
        memcpy(c.v, p, 32);
    } else {
        for (int i = 0; i < 16; i++) {
            c.v[i] = (int8_t)(p[i] & 0x0F);
            c.v[i + 16] = (int8_t)(p[i] >> 4);
        }
    }
    return c;
}
static inline void load_dm(const int FMT, const uint8_t *b, int nb, lanes *d, lanes *m) {
    (void)nb;
    const float scale = half(b);
    *d = lanes_set1(scale);
    *m = lanes_set1(FMT == Q4_1 ? half(b + 2) : -8.f * scale);
}
static inline codes load_x(const int8_t *p, int two) {
    (void)two;
    codes c;
    memcpy(c.v, p, 32);
    return c;
}
static inline lanes load_lanes(const float *p, int two) {
    (void)two;
    lanes out;
    memcpy(out.v, p, sizeof out.v);
    return out;
}
static inline lanes acc_dot(lanes acc, codes w, codes x, lanes scale, const int SIGNED) {
    (void)SIGNED;
    for (int l = 0; l < 8; l++) {
        int32_t s = 0;
        for (int j = 0; j < 4; j++) s += (int32_t)w.v[4 * l + j] * x.v[4 * l + j];
        acc.v[l] += scale.v[l] * (float)s;
    }
    return acc;
}
#endif

/* STEP blocks from block i (the first alone when !two) into accumulator set U of ROWS
 * activation rows from b0. */
__attribute__((always_inline)) static inline void step(const Args *a, const int FMT,
                                                       const uint8_t *row, int64_t i, int64_t b0,
                                                       const int ROWS, lanes (*acc)[2],
                                                       const int U, int two) {
    const int nb = FMT == Q8_0 ? 34 : FMT == Q4_1 ? 20 : 18;
    const uint8_t *blk = row + i * nb;
    const codes w = load_w(FMT, blk + (FMT == Q4_1 ? 4 : 2), two ? nb : 0);
    lanes d, m;
    load_dm(FMT, blk, two ? nb : 0, &d, &m);
    for (int b = 0; b < ROWS; b++) {
        const int64_t j = (b0 + b) * a->blocks + i;
        const lanes scale = lanes_mul(d, load_lanes(a->dx + j * 8, two));
        acc[b][U] = acc_dot(acc[b][U], w, load_x(a->qx + j * 32, two), scale, FMT == Q8_0);
        if (FMT != Q8_0) acc[b][U] = lanes_fma(m, load_lanes(a->sx + j * 8, two), acc[b][U]);
    }
}

/* y[b, r] for ROWS activation rows from b0; FMT and ROWS are compile-time in the callers, so
 * each pair gets its own loop with the accumulators in registers. Below four rows, each row has
 * two, for alternate steps, so that consecutive steps do not wait on each other's multiply-add
 * latency; with more rows that latency is hidden already, and twice the accumulators spill. */
__attribute__((always_inline)) static inline void tile(const Args *a, const int FMT, int64_t r,
                                                       int64_t b0, const int ROWS) {
    const int nb = FMT == Q8_0 ? 34 : FMT == Q4_1 ? 20 : 18;
    const uint8_t *row = a->w + r * a->blocks * nb;
    lanes acc[MAX_TILE][2];
    for (int b = 0; b < ROWS; b++) acc[b][0] = acc[b][1] = lanes_zero();
    int64_t i = 0;
    for (; i + 2 * STEP <= a->blocks; i += 2 * STEP) {
        step(a, FMT, row, i, b0, ROWS, acc, 0, 1);
        step(a, FMT, row, i + STEP, b0, ROWS, acc, ROWS < 4, 1);
    }
    for (; i < a->blocks; i += STEP) step(a, FMT, row, i, b0, ROWS, acc, 0, i + 1 < a->blocks);
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
void tutorserve_quantize_row(const void *x, int x_bf16, int64_t k, int8_t *qx, float *dx,
                             float *sx) {
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

/* y = x W^T as quant_matmul (quant.c) takes it, for Q4_0, Q4_1 and Q8_0 rows. 0; -1 for rows
 * that are not whole blocks or another format; -2 when a buffer cannot be allocated. */
int quant_matmul_x8(const void *w, int fmt, int64_t n, int64_t k, const void *x, int x_bf16,
                    int64_t batch, int64_t ldx, void *y, int y_bf16, int64_t ldy,
                    int num_threads) {
    if (k % 32 || (fmt != Q4_0 && fmt != Q4_1 && fmt != Q8_0)) return -1;
    const int64_t blocks = k / 32;
    int8_t *qx = malloc((size_t)(batch * k));
    float *scales = malloc(sizeof(float) * (size_t)(batch * k / 2));
    if (!qx || !scales) {
        free(qx), free(scales);
        return -2;
    }
    float *dx = scales, *sx = scales + batch * k / 4;
    const int elem = x_bf16 ? 2 : 4;
    for (int64_t b = 0; b < batch; b++)
        tutorserve_quantize_row((const uint8_t *)x + b * ldx * elem, x_bf16, k, qx + b * k,
                                dx + b * k / 4, sx + b * k / 4);
    const Args a = {w, y_bf16, blocks, ldy, qx, dx, sx, y};
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < n; r++) {
        if (fmt == Q4_0)
            weight_row(&a, r, batch, Q4_0);
        else if (fmt == Q4_1)
            weight_row(&a, r, batch, Q4_1);
        else
            weight_row(&a, r, batch, Q8_0);
    }
    free(qx), free(scales);
    return 0;
}
