/* One vector type `vf` of VL float32 lanes per ISA level, so that each kernel is written once.
 *
 * The level comes from the build (`build.py` passes -DTS_SCALAR, -DTS_AVX2, -DTS_AVX512 or
 * -DTS_NEON with that level's -m flags), never from what the compiler targets by default: the
 * scalar build stays the plain-C reference on every host, and each level's library can be built
 * and tested on any CPU that runs it. The AVX-512 build with -DTS_BF16DOT also has the bf16
 * dot-product instructions (attention's own bf16 path uses them directly).
 *
 * bfloat16 is the upper half of a float32: widening is a shift, and narrowing rounds to nearest,
 * ties to even (what PyTorch's conversion does), so storage in bf16 works on every level.
 */
#ifndef TUTORSERVE_SIMD_H
#define TUTORSERVE_SIMD_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(TS_AVX512)
#include <immintrin.h>
enum { VL = 16 };
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vhsum(vf x) { return _mm512_reduce_add_ps(x); }
static inline float vhmax(vf x) { return _mm512_reduce_max_ps(x); }
static inline vf vround(vf x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* 2^n for integer-valued n in [-126, 127], built in the exponent field. */
static inline vf vpow2i(vf n) {
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
/* Lanes below n keep x, the others become fill. */
static inline vf vfirst(vf x, int64_t n, float fill) {
    const __mmask16 m = n <= 0 ? 0 : n >= VL ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
    return _mm512_mask_blend_ps(m, _mm512_set1_ps(fill), x);
}
static inline vf vload_bf16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline vf vround_bf16(vf x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd);
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000u)));
}
static inline void vstore_bf16(uint16_t *p, vf x) {
    const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(vround_bf16(x)), 16);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(bits));
}
/* VL vectors → one vector of their VL horizontal sums, in order (a transpose-and-add tree). */
static inline vf vsums(const vf *v) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)
        y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* VL int8 values as float32 (quantized weights' codes). */
static inline vf vload_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* Sixteen vectors of sixteen 32-bit words, transposed: out + w · stride gets word w of r[0],
 * r[1], .., r[15]. In registers: unpacks words, then 64-bit halves, then 128-bit lanes. */
static inline void store_transposed16(__m512i r[16], uint32_t *out, int64_t stride) {
    __m512i t[16];
    for (int j = 0; j < 16; j += 2) {
        t[j] = _mm512_unpacklo_epi32(r[j], r[j + 1]);
        t[j + 1] = _mm512_unpackhi_epi32(r[j], r[j + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* Now 128-bit lane L of r[4i + m] holds word 4L + m of vectors 4i .. 4i + 3. */
    for (int m = 0; m < 4; m++) {
        const __m512i v0 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0x44);
        const __m512i v1 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0xEE);
        uint32_t *o = out + m * stride; /* word 4L + m is at o + 4L stride */
        _mm512_storeu_si512(o, _mm512_shuffle_i32x4(v0, v2, 0x88));
        _mm512_storeu_si512(o + 4 * stride, _mm512_shuffle_i32x4(v0, v2, 0xDD));
        _mm512_storeu_si512(o + 8 * stride, _mm512_shuffle_i32x4(v1, v3, 0x88));
        _mm512_storeu_si512(o + 12 * stride, _mm512_shuffle_i32x4(v1, v3, 0xDD));
    }
}

#elif defined(TS_AVX2)
#include <immintrin.h>
enum { VL = 8 };
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vhsum(vf x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vhmax(vf x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline vf vround(vf x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vf vpow2i(vf n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
static inline vf vfirst(vf x, int64_t n, float fill) {
    const int k = n <= 0 ? 0 : n >= VL ? VL : (int)n;
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(k),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_blendv_ps(_mm256_set1_ps(fill), x, _mm256_castsi256_ps(keep));
}
static inline vf vload_bf16(const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline vf vround_bf16(vf x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd);
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline void vstore_bf16(uint16_t *p, vf x) {
    const __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(vround_bf16(x)), 16);
    const __m128i lo = _mm256_castsi256_si128(bits), hi = _mm256_extracti128_si256(bits, 1);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(lo, hi));
}
static inline vf vsums(const vf *v) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline vf vload_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

#elif defined(TS_NEON)
#include <arm_neon.h>
enum { VL = 4 };
typedef float32x4_t vf;
static inline vf vzero(void) { return vdupq_n_f32(0.f); }
static inline vf vset1(float x) { return vdupq_n_f32(x); }
static inline vf vload(const float *p) { return vld1q_f32(p); }
static inline void vstore(float *p, vf x) { vst1q_f32(p, x); }
static inline vf vadd(vf a, vf b) { return vaddq_f32(a, b); }
static inline vf vsub(vf a, vf b) { return vsubq_f32(a, b); }
static inline vf vmul(vf a, vf b) { return vmulq_f32(a, b); }
static inline vf vdiv(vf a, vf b) { return vdivq_f32(a, b); }
static inline vf vmax(vf a, vf b) { return vmaxq_f32(a, b); }
static inline vf vmin(vf a, vf b) { return vminq_f32(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
static inline float vhsum(vf x) { return vaddvq_f32(x); }
static inline float vhmax(vf x) { return vmaxvq_f32(x); }
static inline vf vround(vf x) { return vrndnq_f32(x); }
static inline vf vpow2i(vf n) {
    const int32x4_t e = vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127));
    return vreinterpretq_f32_s32(vshlq_n_s32(e, 23));
}
static inline vf vfirst(vf x, int64_t n, float fill) {
    const uint32_t k = n <= 0 ? 0 : n >= VL ? VL : (uint32_t)n;
    const uint32_t idx[4] = {0, 1, 2, 3};
    return vbslq_f32(vcltq_u32(vld1q_u32(idx), vdupq_n_u32(k)), x, vdupq_n_f32(fill));
}
static inline vf vload_bf16(const uint16_t *p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}
static inline vf vround_bf16(vf x) {
    const uint32x4_t u = vreinterpretq_u32_f32(x);
    const uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    const uint32x4_t r = vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7FFF)), odd);
    return vreinterpretq_f32_u32(vandq_u32(r, vdupq_n_u32(0xFFFF0000u)));
}
static inline void vstore_bf16(uint16_t *p, vf x) {
    vst1_u16(p, vshrn_n_u32(vreinterpretq_u32_f32(vround_bf16(x)), 16));
}
static inline vf vsums(const vf *v) {
    return vpaddq_f32(vpaddq_f32(v[0], v[1]), vpaddq_f32(v[2], v[3]));
}

/* Reads 8 bytes for 4 lanes: callers pad their code buffers. */
static inline vf vload_i8(const int8_t *p) {
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vld1_s8(p)))));
}

#elif defined(TS_SCALAR)
enum { VL = 1 };
typedef float vf;
static inline vf vzero(void) { return 0.f; }
static inline vf vset1(float x) { return x; }
static inline vf vload(const float *p) { return *p; }
static inline void vstore(float *p, vf x) { *p = x; }
static inline vf vadd(vf a, vf b) { return a + b; }
static inline vf vsub(vf a, vf b) { return a - b; }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline vf vdiv(vf a, vf b) { return a / b; }
static inline vf vmax(vf a, vf b) { return a > b ? a : b; }
static inline vf vmin(vf a, vf b) { return a < b ? a : b; }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline float vhsum(vf x) { return x; }
static inline float vhmax(vf x) { return x; }
static inline vf vround(vf x) { return rintf(x); } /* to nearest, ties to even */
static inline vf vpow2i(vf n) {
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}
static inline vf vfirst(vf x, int64_t n, float fill) { return n > 0 ? x : fill; }
static inline vf vload_bf16(const uint16_t *p) {
    const uint32_t bits = (uint32_t)*p << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}
static inline vf vround_bf16(vf x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&x, &u, sizeof x);
    return x;
}
static inline void vstore_bf16(uint16_t *p, vf x) {
    uint32_t u;
    x = vround_bf16(x);
    memcpy(&u, &x, sizeof u);
    *p = (uint16_t)(u >> 16);
}
static inline vf vsums(const vf *v) { return v[0]; }

static inline vf vload_i8(const int8_t *p) { return (float)*p; }

#else
#error "build with one of -DTS_SCALAR, -DTS_AVX2, -DTS_AVX512, -DTS_NEON (see build.py)"
#endif

/* exp(x): 2^(x log2 e) as a degree-6 polynomial on the fraction (relative error ~1e-7),
 * scaled by the integer part; clamped to [-87, 88], so -inf gives ~0 and +inf stays finite. */
static inline vf vexp(vf x) {
    x = vmin(vmax(x, vset1(-87.f)), vset1(88.f));
    const vf t = vmul(x, vset1(1.44269504088896341f));
    const vf n = vround(t);
    const vf f = vsub(t, n);
    vf p = vset1(1.5403530393381606e-4f);
    p = vfma(p, f, vset1(1.3333558146428443e-3f));
    p = vfma(p, f, vset1(9.6181291076284772e-3f));
    p = vfma(p, f, vset1(5.5504108664821580e-2f));
    p = vfma(p, f, vset1(2.4022650695910071e-1f));
    p = vfma(p, f, vset1(6.9314718055994531e-1f));
    p = vfma(p, f, vset1(1.f));
    return vmul(p, vpow2i(n));
}

/* Element i of a float32 or bfloat16 array (`is_bf16`) and the VL after it, as float32. */
static inline vf vload_as(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? vload_bf16((const uint16_t *)p + i) : vload((const float *)p + i);
}
static inline void vstore_as(void *p, int64_t i, vf x, int is_bf16) {
    if (is_bf16)
        vstore_bf16((uint16_t *)p + i, x);
    else
        vstore((float *)p + i, x);
}
#endif
