/* Integer dot products of weight codes with int8 activation codes, per ISA level (quant_x8.c).
 *
 * Weights are taken a unit at a time: 32 codes (one 32-weight block, or a K-quant's 32-weight
 * sub-block), STEP units to a register (two in AVX-512's 64 bytes, else one). Each four
 * products' int32 sum is scaled in a float lane of its own, eight lanes per unit.
 *
 * A unit's codes are built from its block's bits with: `nib16` (a 32-weight block's 16 bytes:
 * codes 0-15 in the low nibbles, 16-31 in the high ones), `nib32` (32 bytes' nibbles at a
 * shift: half a K-quant's pair of sub-blocks), `plane` (bits of 32 bytes at a shift, moved up
 * to bit 4: Q5_K's and Q6_K's high bits), `unit_or`, and `join`, which puts STEP units into
 * one register. The 32-weight formats' STEP blocks go at once through `nib16_blocks`,
 * `bits32_blocks` (0x10 where a block's 32-bit word has a bit: Q5_0/Q5_1's fifth bits) and
 * `dm_blocks` (their scales and offsets).
 * A K-quant block's scales are a `per16` (one float per 16 weights, from its 8 bytes of
 * per-32 scales or 16 int8 per-16 ones), and `lanes_at(s, j)` spreads those of units j.. over
 * their lanes. Weights' codes are unsigned bytes except Q8_0's, which are signed like the
 * activations'.
 */
#ifndef TUTORSERVE_INT8_DOT_H
#define TUTORSERVE_INT8_DOT_H
#include "blocks.h"
#include "convert.h"

#if defined(TS_AVX2) || defined(TS_AVX512)
typedef __m256i unit;
typedef vf lanes; /* eight per unit: one unit with AVX2, two with AVX-512 */
static inline lanes lanes_zero(void) { return vzero(); }
static inline lanes lanes_fma(lanes a, lanes b, lanes c) { return vfma(a, b, c); }
static inline lanes lanes_mul(lanes a, lanes b) { return vmul(a, b); }
static inline float lanes_sum(lanes a) { return vhsum(a); }

static inline unit bytes32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline unit nib16(const uint8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
}
static inline unit nib32(const uint8_t *p, int shift) {
    return _mm256_and_si256(_mm256_srl_epi16(bytes32(p), _mm_cvtsi32_si128(shift)),
                            _mm256_set1_epi8(0x0F));
}
/* Byte l: ((p[l] >> shift) & mask) << 4; mask's bits stay within the byte, so 16-bit shifts
 * do not carry between bytes once masked. */
static inline unit plane(const uint8_t *p, int shift, int mask) {
    const unit v = _mm256_and_si256(_mm256_srl_epi16(bytes32(p), _mm_cvtsi32_si128(shift)),
                                    _mm256_set1_epi8((char)mask));
    return _mm256_slli_epi16(v, 4);
}
static inline unit unit_or(unit a, unit b) { return _mm256_or_si256(a, b); }
#endif

#if defined(TS_AVX512)
enum { STEP = 2 };
typedef __m512i codes;
static inline codes join(const unit *u) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(u[0]), u[1], 1);
}
static inline codes codes_or(codes a, codes b) { return _mm512_or_si512(a, b); }
typedef __m512 per16;
static inline per16 per16_u8x8(uint64_t bytes, float mul) { /* each byte for 32 weights */
    const __m256i wide = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)bytes));
    const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(wide), _mm256_set1_ps(mul));
    const __m512i twice = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    return _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(v));
}
static inline per16 per16_i8x16(const uint8_t *p, float mul) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), _mm512_set1_ps(mul));
}
static inline per16 per16_mul(per16 s, float mul) { return _mm512_mul_ps(s, _mm512_set1_ps(mul)); }
static inline lanes lanes_at(per16 s, int j) { /* units j, j + 1: lane l takes s[2j + l / 4] */
    const __m512i quarter = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(_mm512_add_epi32(quarter, _mm512_set1_epi32(2 * j)), s);
}
/* Two 32-weight blocks nb bytes apart, in one pass: their nibble codes (one 256-bit nibble
 * split and a shuffle, not one split per block), fifth bits, and scales d and offsets m (m the
 * half after d when has_m, else bias · d), four halves converted at once. */
static inline codes nib16_blocks(const uint8_t *p, int nb) {
    const __m256i v = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
        _mm_loadu_si128((const __m128i *)(p + nb)), 1);
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(v, low);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    /* [A 0-15, B 0-15, A 16-31, B 16-31] → A then B */
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return _mm512_shuffle_i64x2(w, w, _MM_SHUFFLE(3, 1, 2, 0));
}
static inline codes bits32_blocks(const uint8_t *qh, int nb) {
    return _mm512_maskz_set1_epi8((uint64_t)u32_at(qh) | (uint64_t)u32_at(qh + nb) << 32, 0x10);
}
static inline void dm_blocks(const uint8_t *b, int nb, int has_m, float bias, lanes *d,
                             lanes *m) {
    const __m128 h = _mm_cvtph_ps(_mm_set_epi32(0, 0, (int)u32_at(b + nb), (int)u32_at(b)));
    /* h = [d_A, m_A, d_B, m_B] (lanes 1 and 3 are not read without m) */
    const __m512 wide = _mm512_castps128_ps512(h);
    const __m512i first = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    *d = _mm512_permutexvar_ps(first, wide);
    *m = has_m ? _mm512_permutexvar_ps(_mm512_add_epi32(first, _mm512_set1_epi32(1)), wide)
               : _mm512_mul_ps(*d, _mm512_set1_ps(bias));
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
static inline unit bits32(uint32_t x) {
    const __m256i spread = _mm256_shuffle_epi8( /* byte l ← byte l / 8 of x */
        _mm256_set1_epi32((int)x),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                         3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL); /* bit l % 8 */
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                            _mm256_set1_epi8(0x10));
}
static inline codes join(const unit *u) { return u[0]; }
static inline codes codes_or(codes a, codes b) { return _mm256_or_si256(a, b); }
static inline lanes lanes_set1(float x) { return _mm256_set1_ps(x); }
typedef struct {
    __m256 v[2];
} per16;
static inline per16 per16_u8x8(uint64_t bytes, float mul) {
    const __m256i wide = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)bytes));
    const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(wide), _mm256_set1_ps(mul));
    const __m256i low = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    return (per16){{_mm256_permutevar8x32_ps(v, low),
                    _mm256_permutevar8x32_ps(v, _mm256_add_epi32(low, _mm256_set1_epi32(4)))}};
}
static inline per16 per16_i8x16(const uint8_t *p, float mul) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    const __m256 m = _mm256_set1_ps(mul);
    const __m256i first = _mm256_cvtepi8_epi32(v);
    const __m256i second = _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8));
    return (per16){{_mm256_mul_ps(_mm256_cvtepi32_ps(first), m),
                    _mm256_mul_ps(_mm256_cvtepi32_ps(second), m)}};
}
static inline per16 per16_mul(per16 s, float mul) {
    const __m256 m = _mm256_set1_ps(mul);
    return (per16){{_mm256_mul_ps(s.v[0], m), _mm256_mul_ps(s.v[1], m)}};
}
static inline lanes lanes_at(per16 s, int j) { /* unit j: lane l takes s[2j + l / 4] */
    const __m256i idx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    return _mm256_permutevar8x32_ps(s.v[j / 4],
                                    _mm256_add_epi32(idx, _mm256_set1_epi32(2 * (j % 4))));
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
} unit;
typedef unit codes;
typedef struct {
    float v[8];
} lanes;
static inline lanes lanes_zero(void) { return (lanes){{0}}; }
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
static inline unit bytes32(const uint8_t *p) {
    unit u;
    memcpy(u.v, p, 32);
    return u;
}
static inline unit nib16(const uint8_t *p) {
    unit u;
    for (int i = 0; i < 16; i++) {
        u.v[i] = (int8_t)(p[i] & 0x0F);
        u.v[i + 16] = (int8_t)(p[i] >> 4);
    }
    return u;
}
static inline unit nib32(const uint8_t *p, int shift) {
    unit u;
    for (int i = 0; i < 32; i++) u.v[i] = (int8_t)(p[i] >> shift & 0x0F);
    return u;
}
static inline unit plane(const uint8_t *p, int shift, int mask) {
    unit u;
    for (int i = 0; i < 32; i++) u.v[i] = (int8_t)((p[i] >> shift & mask) << 4);
    return u;
}
static inline unit bits32(uint32_t x) {
    unit u;
    for (int i = 0; i < 32; i++) u.v[i] = (int8_t)((x >> i & 1) << 4);
    return u;
}
static inline unit unit_or(unit a, unit b) {
    for (int i = 0; i < 32; i++) a.v[i] |= b.v[i];
    return a;
}
static inline codes join(const unit *u) { return u[0]; }
static inline codes codes_or(codes a, codes b) { return unit_or(a, b); }
static inline lanes lanes_set1(float x) {
    lanes out;
    for (int l = 0; l < 8; l++) out.v[l] = x;
    return out;
}
typedef struct {
    float v[16];
} per16;
static inline per16 per16_u8x8(uint64_t bytes, float mul) {
    per16 s;
    for (int c = 0; c < 16; c++) s.v[c] = (float)(bytes >> 8 * (c / 2) & 0xFF) * mul;
    return s;
}
static inline per16 per16_i8x16(const uint8_t *p, float mul) {
    per16 s;
    for (int c = 0; c < 16; c++) s.v[c] = (float)(int8_t)p[c] * mul;
    return s;
}
static inline per16 per16_mul(per16 s, float mul) {
    for (int c = 0; c < 16; c++) s.v[c] *= mul;
    return s;
}
static inline lanes lanes_at(per16 s, int j) {
    lanes out;
    for (int l = 0; l < 8; l++) out.v[l] = s.v[2 * j + l / 4];
    return out;
}
static inline codes load_x(const int8_t *p, int two) {
    (void)two;
    return bytes32((const uint8_t *)p);
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

#if !defined(TS_AVX512) /* one block per step: the unit helpers are the block helpers */
static inline codes nib16_blocks(const uint8_t *p, int nb) {
    (void)nb;
    return nib16(p);
}
static inline codes bits32_blocks(const uint8_t *qh, int nb) {
    (void)nb;
    return bits32(u32_at(qh));
}
static inline void dm_blocks(const uint8_t *b, int nb, int has_m, float bias, lanes *d,
                             lanes *m) {
    (void)nb;
    const float d0 = half(b);
    *d = lanes_set1(d0);
    *m = lanes_set1(has_m ? half(b + 2) : bias * d0);
}
#endif
#endif
