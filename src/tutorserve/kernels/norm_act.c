/* Fused elementwise steps of a decoder layer: residual add + RMSNorm, and SiLU(gate) * up.
 *
 * Eager PyTorch runs RMSNorm as about eight ops, each a pass over a float32 copy of the
 * activations, and SiLU * up as two; on a prefill chunk of 2,048 tokens those passes cost more
 * than a tenth of the step. Here each is one pass per row. Rounding follows the reference
 * (Hugging Face's) float32 / bfloat16 semantics step by step: the residual sum is rounded to the
 * activation dtype, the normalized row is rounded before the weight multiplies it, SiLU's
 * result is rounded before the product.
 *
 * Rows are contiguous, of n elements (a multiple of 16), float32 or bfloat16 (`is_bf16`).
 * Needs AVX-512 (`tutorserve_isa`); without it callers use PyTorch ops.
 */
#include <math.h>
#include <stdint.h>

#include "simd.h"
#if defined(__AVX512F__)
static inline __m512 load16(const void *p, int64_t i, int is_bf16) {
    if (!is_bf16) return _mm512_loadu_ps((const float *)p + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Round to bfloat16 (to nearest, ties to even) and widen back: what storing in bf16 does. */
static inline __m512 round_bf16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd);
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000u)));
}

static inline __m512 as_dtype(__m512 x, int is_bf16) { return is_bf16 ? round_bf16(x) : x; }

static inline void store16(void *p, int64_t i, __m512 x, int is_bf16) {
    if (!is_bf16) {
        _mm512_storeu_ps((float *)p + i, x);
        return;
    }
    const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(x)), 16);
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtepi32_epi16(bits));
}

#endif

/* out = weight * (h / rms(h)) with h = x (+ residual, in which case residual := h). */
int add_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows,
                 int64_t n, float eps, int is_bf16, int num_threads) {
#if defined(__AVX512F__)
    if (n % 16) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t at = r * n;
        const char *xr = (const char *)x + at * (is_bf16 ? 2 : 4);
        char *res = residual ? (char *)residual + at * (is_bf16 ? 2 : 4) : NULL;
        __m512 sq = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            __m512 h = load16(xr, i, is_bf16);
            if (res) {
                h = as_dtype(_mm512_add_ps(h, load16(res, i, is_bf16)), is_bf16);
                store16(res, i, h, is_bf16);
            }
            sq = _mm512_fmadd_ps(h, h, sq);
        }
        const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(sq) / (float)n + eps));
        const char *src = res ? res : xr;
        for (int64_t i = 0; i < n; i += 16) {
            const __m512 y = as_dtype(_mm512_mul_ps(load16(src, i, is_bf16), inv), is_bf16);
            store16((char *)out + at * (is_bf16 ? 2 : 4), i,
                    _mm512_mul_ps(load16(weight, i, is_bf16), y), is_bf16);
        }
    }
    return 0;
#else
    (void)x, (void)residual, (void)weight, (void)out, (void)rows, (void)n, (void)eps;
    (void)is_bf16, (void)num_threads;
    return -1;
#endif
}

/* out[r] = SiLU(gate_up[r][:n]) * gate_up[r][n:] */
int silu_mul(const void *gate_up, void *out, int64_t rows, int64_t n, int is_bf16,
             int num_threads) {
#if defined(__AVX512F__)
    if (n % 16) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const char *g = (const char *)gate_up + 2 * r * n * (is_bf16 ? 2 : 4);
        const char *u = g + n * (is_bf16 ? 2 : 4);
        for (int64_t i = 0; i < n; i += 16) {
            const __m512 x = load16(g, i, is_bf16);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            const __m512 s = as_dtype(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)),
                                      is_bf16);
            store16((char *)out + r * n * (is_bf16 ? 2 : 4), i,
                    _mm512_mul_ps(s, load16(u, i, is_bf16)), is_bf16);
        }
    }
    return 0;
#else
    (void)gate_up, (void)out, (void)rows, (void)n, (void)is_bf16, (void)num_threads;
    return -1;
#endif
}
