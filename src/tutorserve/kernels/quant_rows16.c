/* Q4_0, Q4_1 and Q5_0 matmuls on weights repacked sixteen rows at a time, so that each vector
 * lane computes one output row.
 *
 * In GGUF's layout each row's blocks follow each other, so a vector holds one row's codes: its
 * lanes' products must be added across the vector at the end of every row, and each block's
 * scale is spread over the lanes that its codes occupy. Repacked, a block of sixteen rows holds
 * their sixteen scales (d, and Q4_1's m) side by side, then their codes as 32-bit words of
 * four bytes, one row per lane: word j of every row, then word j + 1. One 32-bit word of
 * activation codes, broadcast, meets a vector of sixteen rows' words in one integer
 * multiply-add (VNNI vpdpbusd, or vpmaddubsw + vpmaddwd), and the results are already the
 * sixteen rows' sums: no shuffles, no horizontal sums, one scale load per block for all rows.
 * llama.cpp interleaves Q4_0 rows in the same spirit on CPUs that gain from it. The bytes are
 * GGUF's, moved: a repacked weight is exactly as large.
 *
 * Byte j of a Q4 block holds code j in its low nibble and code j + 16 in its high one, so word
 * j (bytes 4j..4j+3) holds codes 4j..4j+3 low and 16+4j..16+4j+3 high, and each meets its own
 * four activation codes, whose scale (one per four, as in quant_x8.c) it is then multiplied by.
 *
 * Q5_0's fifth bits (a 32-bit word per row and block) are regrouped the same way: for word j,
 * one 64-bit mask for the low codes and one for the high ones, bit 4l + t for lane l's code t,
 * so that one masked byte move (AVX-512; AVX2 expands half a mask) ORs them into the codes.
 *
 * Repacked block of sixteen rows: d[16] (half), Q4_1's m[16] (half), Q5_0's masks[4][2]
 * (uint64), then words[4][16].
 */
#include <stdlib.h>

#include "blocks.h"
#include "int8_dot.h"

enum { LANES = 16, MAX_ROWS = 4 };

void tutorserve_quantize_rows(const void *x, int x_bf16, int64_t batch, int64_t ldx, int64_t k,
                              int8_t *qx, float *dx, float *sx, int num_threads); /* quant_x8.c */

/* Bytes per row before a block's codes: d, Q4_1's m, Q5_0's fifth bits. */
static int head_bytes(int fmt) { return fmt == Q4_0 ? 2 : fmt == Q4_1 ? 4 : 6; }
static int halves_of(int fmt) { return fmt == Q4_1 ? 2 : 1; } /* d, and Q4_1's m */
static int repacks(int fmt) { return fmt == Q4_0 || fmt == Q4_1 || fmt == Q5_0; }

/* GGUF rows (n of them, k weights each) → the repacked layout. 0; -1 for another format or
 * rows that do not come in sixteens of whole blocks. */
int quant_repack16(const void *src, int fmt, int64_t n, int64_t k, void *dst) {
    if (!repacks(fmt) || n % LANES || k % 32) return -1;
    const int nb = bytes_of(fmt), head = head_bytes(fmt);
    const int64_t blocks = k / 32;
    for (int64_t g = 0; g < n / LANES; g++)
        for (int64_t i = 0; i < blocks; i++) {
            uint8_t *o = (uint8_t *)dst + (g * blocks + i) * LANES * nb;
            uint64_t masks[8] = {0};
            for (int l = 0; l < LANES; l++) {
                const uint8_t *b = (const uint8_t *)src + ((g * LANES + l) * blocks + i) * nb;
                for (int h = 0; h < halves_of(fmt); h++)
                    memcpy(o + 2 * (h * LANES + l), b + 2 * h, 2);
                const uint32_t qh = fmt == Q5_0 ? u32_at(b + 2) : 0;
                for (int m = 0; m < 8; m++) /* m = 2j + h: bits 16h + 4j .. + 3 */
                    masks[m] |= (uint64_t)(qh >> (16 * (m & 1) + 4 * (m / 2)) & 0xF) << 4 * l;
                for (int j = 0; j < 4; j++)
                    memcpy(o + head * LANES + (j * LANES + l) * 4, b + head + 4 * j, 4);
            }
            if (fmt == Q5_0) memcpy(o + 2 * LANES, masks, sizeof masks); /* after d[16] */
        }
    return 0;
}

/* Row r of a repacked weight, back in GGUF's layout (its `blocks` blocks) at out. */
void tutorserve_unpack16_row(const void *w, int fmt, int64_t r, int64_t blocks, uint8_t *out) {
    const int nb = bytes_of(fmt), head = head_bytes(fmt);
    const int64_t g = r / LANES, l = r % LANES;
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *o = (const uint8_t *)w + (g * blocks + i) * LANES * nb;
        uint8_t *b = out + i * nb;
        for (int h = 0; h < halves_of(fmt); h++) memcpy(b + 2 * h, o + 2 * (h * LANES + l), 2);
        if (fmt == Q5_0) {
            uint64_t masks[8];
            uint32_t qh = 0;
            memcpy(masks, o + 2 * LANES, sizeof masks);
            for (int m = 0; m < 8; m++)
                qh |= (uint32_t)(masks[m] >> 4 * l & 0xF) << (16 * (m & 1) + 4 * (m / 2));
            memcpy(b + 2, &qh, sizeof qh);
        }
        for (int j = 0; j < 4; j++)
            memcpy(b + head + 4 * j, o + head * LANES + (j * LANES + l) * 4, 4);
    }
}

typedef struct {
    const uint8_t *w;
    int64_t blocks, k, ldy;
    const int8_t *qx;
    const float *dx, *sums; /* per four codes their scale; per block dx Σ qx over its 32 */
    void *y;
    int y_bf16;
} Args;

static inline int32_t word_at(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if defined(TS_AVX512) || defined(TS_AVX2)
#if defined(TS_AVX512)
enum { W = 16 }; /* rows a vector holds: all sixteen */
typedef __m512i vi;
static inline vi vi_load(const uint8_t *p) { return _mm512_loadu_si512(p); }
static inline vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
static inline vi vi_nibbles(vi v, int high) {
    return _mm512_and_si512(high ? _mm512_srli_epi32(v, 4) : v, _mm512_set1_epi8(0x0F));
}
static inline vf halves(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline vi fifth_bits(const uint8_t *masks, int m, int part) { /* 0x10 where set */
    (void)part;
    uint64_t bits;
    memcpy(&bits, masks + 8 * m, sizeof bits);
    return _mm512_maskz_set1_epi8(bits, 0x10);
}
static inline vf dot4(vi u, int32_t x) { /* per lane: Σ of four unsigned codes × signed x */
#if defined(TS_VNNI)
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_set1_epi32(x)));
#else
    const vi p = _mm512_maddubs_epi16(u, _mm512_set1_epi32(x));
    return _mm512_cvtepi32_ps(_mm512_madd_epi16(p, _mm512_set1_epi16(1)));
#endif
}
#else
enum { W = 8 }; /* rows a vector holds: half of them, each half in its own pass */
typedef __m256i vi;
static inline vi vi_load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi vi_or(vi a, vi b) { return _mm256_or_si256(a, b); }
static inline vi vi_nibbles(vi v, int high) {
    return _mm256_and_si256(high ? _mm256_srli_epi32(v, 4) : v, _mm256_set1_epi8(0x0F));
}
static inline vf halves(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline vi fifth_bits(const uint8_t *masks, int m, int part) { /* lanes of this part */
    uint64_t bits;
    memcpy(&bits, masks + 8 * m, sizeof bits);
    return bits32((uint32_t)(bits >> 32 * part));
}
static inline vf dot4(vi u, int32_t x) {
    const vi p = _mm256_maddubs_epi16(u, _mm256_set1_epi32(x));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#endif

/* Lanes part·W .. part·W + W − 1 of sixteen rows' group g, for ROWS activation rows from b0. */
__attribute__((always_inline)) static inline void group_tile(const Args *a, const int FMT,
                                                             int64_t g, int part, int64_t b0,
                                                             const int ROWS) {
    const int nb = bytes_of(FMT), head = head_bytes(FMT);
    vf acc[MAX_ROWS];
    for (int b = 0; b < ROWS; b++) acc[b] = vzero();
    for (int64_t i = 0; i < a->blocks; i++) {
        const uint8_t *blk = a->w + (g * a->blocks + i) * LANES * nb;
        vf part_sum[MAX_ROWS];
        for (int b = 0; b < ROWS; b++) part_sum[b] = vzero();
        for (int j = 0; j < 4; j++) {
            const vi v = vi_load(blk + head * LANES + (j * LANES + part * W) * 4);
            vi lo = vi_nibbles(v, 0), hi = vi_nibbles(v, 1);
            if (FMT == Q5_0) {
                lo = vi_or(lo, fifth_bits(blk + 2 * LANES, 2 * j, part));
                hi = vi_or(hi, fifth_bits(blk + 2 * LANES, 2 * j + 1, part));
            }
            for (int b = 0; b < ROWS; b++) {
                const int8_t *q = a->qx + (b0 + b) * a->k + i * 32;
                const float *dx = a->dx + (b0 + b) * a->k / 4 + i * 8;
                part_sum[b] = vfma(dot4(lo, word_at(q + 4 * j)), vset1(dx[j]), part_sum[b]);
                part_sum[b] =
                    vfma(dot4(hi, word_at(q + 16 + 4 * j)), vset1(dx[4 + j]), part_sum[b]);
            }
        }
        const vf d = halves(blk + 2 * part * W);
        for (int b = 0; b < ROWS; b++) {
            const float s = a->sums[(b0 + b) * a->blocks + i];
            if (FMT == Q4_1) {
                acc[b] = vfma(d, part_sum[b], acc[b]);
                acc[b] = vfma(halves(blk + 2 * LANES + 2 * part * W), vset1(s), acc[b]);
            } else { /* w = d (q - 8), Q5_0's d (q - 16) */
                const float bias = FMT == Q5_0 ? 16.f : 8.f;
                acc[b] = vfma(d, vsub(part_sum[b], vset1(bias * s)), acc[b]);
            }
        }
    }
    for (int b = 0; b < ROWS; b++)
        vstore_as((char *)a->y + (b0 + b) * a->ldy * (a->y_bf16 ? 2 : 4), g * LANES + part * W,
                  acc[b], a->y_bf16);
}

#else /* scalar and NEON: plain C over the same layout, a lane at a time */
enum { W = LANES };
__attribute__((always_inline)) static inline void group_tile(const Args *a, const int FMT,
                                                             int64_t g, int part, int64_t b0,
                                                             const int ROWS) {
    (void)part;
    const int nb = bytes_of(FMT), head = head_bytes(FMT);
    for (int b = 0; b < ROWS; b++) {
        const int8_t *qx = a->qx + (b0 + b) * a->k;
        const float *dx = a->dx + (b0 + b) * a->k / 4;
        for (int l = 0; l < LANES; l++) {
            float acc = 0.f;
            for (int64_t i = 0; i < a->blocks; i++) {
                const uint8_t *blk = a->w + (g * a->blocks + i) * LANES * nb;
                float part_sum = 0.f;
                for (int j = 0; j < 4; j++) {
                    const uint8_t *word = blk + head * LANES + (j * LANES + l) * 4;
                    uint64_t m_lo = 0, m_hi = 0; /* Q5_0's fifth bits of these codes */
                    if (FMT == Q5_0) {
                        memcpy(&m_lo, blk + 2 * LANES + 8 * (2 * j), sizeof m_lo);
                        memcpy(&m_hi, blk + 2 * LANES + 8 * (2 * j + 1), sizeof m_hi);
                    }
                    int32_t lo = 0, hi = 0;
                    for (int t = 0; t < 4; t++) {
                        const int f_lo = (int)(m_lo >> (4 * l + t) & 1) << 4;
                        const int f_hi = (int)(m_hi >> (4 * l + t) & 1) << 4;
                        lo += ((word[t] & 0x0F) | f_lo) * qx[i * 32 + 4 * j + t];
                        hi += ((word[t] >> 4) | f_hi) * qx[i * 32 + 16 + 4 * j + t];
                    }
                    part_sum += (float)lo * dx[i * 8 + j] + (float)hi * dx[i * 8 + 4 + j];
                }
                const float d = half(blk + 2 * l), s = a->sums[(b0 + b) * a->blocks + i];
                acc += FMT == Q4_1 ? d * part_sum + half(blk + 2 * LANES + 2 * l) * s
                                   : d * (part_sum - (FMT == Q5_0 ? 16.f : 8.f) * s);
            }
            store_any(a->y, (b0 + b) * a->ldy + g * LANES + l, acc, a->y_bf16);
        }
    }
}
#endif

__attribute__((always_inline)) static inline void group(const Args *a, int64_t g, int64_t batch,
                                                        const int FMT) {
    for (int part = 0; part < LANES / W; part++)
        for (int64_t b0 = 0; b0 < batch; b0 += MAX_ROWS) {
            switch (batch - b0 < MAX_ROWS ? batch - b0 : MAX_ROWS) {
            case 1: group_tile(a, FMT, g, part, b0, 1); break;
            case 2: group_tile(a, FMT, g, part, b0, 2); break;
            case 3: group_tile(a, FMT, g, part, b0, 3); break;
            default: group_tile(a, FMT, g, part, b0, MAX_ROWS); break;
            }
        }
}

/* y = x W^T as quant_matmul (quant.c) takes it, W repacked by quant_repack16. 0; -1 for another
 * format or shape; -2 when a buffer cannot be allocated. */
int quant_matmul_rows16(const void *w, int fmt, int64_t n, int64_t k, const void *x, int x_bf16,
                        int64_t batch, int64_t ldx, void *y, int y_bf16, int64_t ldy,
                        int num_threads) {
    if (!repacks(fmt) || n % LANES || k % 32) return -1;
    const int64_t blocks = k / 32;
    int8_t *qx = malloc((size_t)(batch * k));
    float *scales = malloc(sizeof(float) * (size_t)(batch * (k / 2 + blocks)));
    if (!qx || !scales) {
        free(qx), free(scales);
        return -2;
    }
    float *dx = scales, *sx = scales + batch * k / 4, *sums = sx + batch * k / 4;
    tutorserve_quantize_rows(x, x_bf16, batch, ldx, k, qx, dx, sx, num_threads);
    for (int64_t b = 0; b < batch; b++)
        for (int64_t i = 0; i < blocks; i++) {
            float s = 0.f;
            for (int g = 0; g < 8; g++) s += sx[b * k / 4 + i * 8 + g];
            sums[b * blocks + i] = s;
        }
    const Args a = {w, blocks, k, ldy, qx, dx, sums, y, y_bf16};
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < n / LANES; g++) {
        switch (fmt) {
        case Q4_0: group(&a, g, batch, Q4_0); break;
        case Q4_1: group(&a, g, batch, Q4_1); break;
        default: group(&a, g, batch, Q5_0); break;
        }
    }
    free(qx), free(scales);
    return 0;
}
