/* What quant_rows16.c (the 32-weight formats) and quant_rows16_k.c (the K-quants) share: a
 * repacked weight's group of sixteen rows, the call's arguments, and the integer vectors that
 * hold one 32-bit word of four codes per row (lane). */
#ifndef TUTORSERVE_ROWS16_H
#define TUTORSERVE_ROWS16_H
#include "blocks.h"
#include "int8_dot.h"

/* MAX_ROWS: activation rows a tile holds in the K-quants and the plain-C path (quant_rows16.c's
 * vector tiles hold TILE_ROWS). */
enum { LANES = 16, MAX_ROWS = 4 };

/* The 32-weight formats' group block (quant_rows16.c): bytes per row before the codes (d,
 * Q4_1's m, Q5_0's fifth bits), and code words per row. */
static inline int head_bytes(int fmt) { return fmt == Q4_1 ? 4 : fmt == Q5_0 ? 6 : 2; }
static inline int words_of(int fmt) { return fmt == Q8_0 ? 8 : 4; } /* code words per row */
static const uint32_t Q8_FLIP = 0x80808080;                          /* int8 codes ↔ + 128 */
/* Where each field starts in a K-quant's repacked group block (bytes; quant_rows16_k.c). */
enum { Q4K_D = 0, Q4K_DMIN = 32, Q4K_SCALES = 64, Q4K_CODES = 256 };
enum { Q6K_LOW = 0, Q6K_HIGH = 2048, Q6K_SCALES = 3072, Q6K_D = 3328 };

typedef struct {
    const uint8_t *w;
    int64_t blocks, k, ldy; /* blocks: the format's blocks per row */
    const int8_t *qx;
    const float *dx, *sums; /* per four codes their scale; per 16 codes dx Σ qx over them */
    void *y;
    int y_bf16;
} Args;

static inline int32_t word_at(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Activation row b's dx Σ qx over its 32 codes from `at`. */
static inline float sum32(const Args *a, int64_t b, int64_t at) {
    const float *s = a->sums + (b * a->k + at) / 16;
    return s[0] + s[1];
}

/* The K-quants' halves (quant_rows16_k.c). */
int k_repack16(const void *src, int fmt, int64_t n, int64_t k, void *dst);
void k_unpack16_block(const uint8_t *group_block, int fmt, int lane, uint8_t *out);
void k_group(const Args *a, int64_t g, int64_t batch, int fmt);

#if defined(TS_AVX512) || defined(TS_AVX2)
#if defined(TS_AVX512)
enum { W = 16 }; /* rows a vector holds: all sixteen */
typedef __m512i vi;
static inline vi vi_load(const uint8_t *p) { return _mm512_loadu_si512(p); }
static inline vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
static inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vi vi_and(vi a, uint32_t m) { return _mm512_and_si512(a, _mm512_set1_epi32((int)m)); }
static inline vi vi_srl(vi a, int n) { return _mm512_srli_epi32(a, (unsigned)n); }
static inline vi vi_sll(vi a, int n) { return _mm512_slli_epi32(a, (unsigned)n); }
static inline vf vi_float(vi a) { return _mm512_cvtepi32_ps(a); }
static inline vf halves(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline vf int8s(const uint8_t *p) { /* W signed bytes as floats */
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vi fifth_bits(const uint8_t *masks, int m, int part) { /* 0x10 where set */
    (void)part;
    uint64_t bits;
    memcpy(&bits, masks + 8 * m, sizeof bits);
    return _mm512_maskz_set1_epi8(bits, 0x10);
}
static inline vi dot4_i32(vi u, int32_t x) { /* per lane: Σ of four unsigned codes × signed x */
#if defined(TS_VNNI)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_set1_epi32(x));
#else
    const vi p = _mm512_maddubs_epi16(u, _mm512_set1_epi32(x));
    return _mm512_madd_epi16(p, _mm512_set1_epi16(1));
#endif
}
#else
enum { W = 8 }; /* rows a vector holds: half of them, each half in its own pass */
typedef __m256i vi;
static inline vi vi_load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi vi_or(vi a, vi b) { return _mm256_or_si256(a, b); }
static inline vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
static inline vi vi_and(vi a, uint32_t m) { return _mm256_and_si256(a, _mm256_set1_epi32((int)m)); }
static inline vi vi_srl(vi a, int n) { return _mm256_srli_epi32(a, n); }
static inline vi vi_sll(vi a, int n) { return _mm256_slli_epi32(a, n); }
static inline vf vi_float(vi a) { return _mm256_cvtepi32_ps(a); }
static inline vf halves(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline vf int8s(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vi fifth_bits(const uint8_t *masks, int m, int part) { /* lanes of this part */
    uint64_t bits;
    memcpy(&bits, masks + 8 * m, sizeof bits);
    return bits32((uint32_t)(bits >> 32 * part));
}
static inline vi dot4_i32(vi u, int32_t x) {
    const vi p = _mm256_maddubs_epi16(u, _mm256_set1_epi32(x));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}
#endif
static inline vi vi_nibbles(vi v, int high) { return vi_and(high ? vi_srl(v, 4) : v, 0x0F0F0F0F); }
static inline vf dot4(vi u, int32_t x) { return vi_float(dot4_i32(u, x)); }
/* dot4 for codes of a whole byte (0-255): without VNNI, vpmaddubsw would saturate the sum of
 * two products, so the codes' nibbles are multiplied apart and joined as 16 hi + lo. */
static inline vf dot4_u8(vi u, int32_t x) {
#if defined(TS_VNNI)
    return dot4(u, x);
#else
    const vi high = vi_sll(dot4_i32(vi_nibbles(u, 1), x), 4);
    return vi_float(vi_add(high, dot4_i32(vi_nibbles(u, 0), x)));
#endif
}
/* ROWS rows of accumulated outputs, lanes part·W .. of group g, into y. */
static inline void store_tile(const Args *a, int64_t g, int part, int64_t b0, const vf *acc,
                              int rows) {
    for (int b = 0; b < rows; b++)
        vstore_as((char *)a->y + (b0 + b) * a->ldy * (a->y_bf16 ? 2 : 4), g * LANES + part * W,
                  acc[b], a->y_bf16);
}
/* Per lane the four bytes of `byte` (0-3) of each word, as floats: a K-quant's unpacked scale. */
static inline vf byte_lanes(vi v, int byte) { return vi_float(vi_and(vi_srl(v, 8 * byte), 0xFF)); }
/* A Q4_K group block's (scale, min) pairs for lanes part·W ..: byte s % 4 of sc[s / 4] and
 * mn[s / 4] are sub-block s's, unpacked as k4_scales does, sixteen rows at once. */
static inline void q4k_scale_words(const uint8_t *blk, int part, vi sc[2], vi mn[2]) {
    const vi lo = vi_load(blk + Q4K_SCALES + 4 * part * W);
    const vi hi = vi_load(blk + Q4K_SCALES + 4 * (LANES + part * W));
    const vi top = vi_load(blk + Q4K_SCALES + 4 * (2 * LANES + part * W));
    const vi sc_top = vi_sll(vi_and(vi_srl(lo, 6), 0x03030303), 4);
    const vi mn_top = vi_sll(vi_and(vi_srl(hi, 6), 0x03030303), 4);
    sc[0] = vi_and(lo, 0x3F3F3F3F);
    sc[1] = vi_or(vi_and(top, 0x0F0F0F0F), sc_top);
    mn[0] = vi_and(hi, 0x3F3F3F3F);
    mn[1] = vi_or(vi_and(vi_srl(top, 4), 0x0F0F0F0F), mn_top);
}
#endif
#endif
