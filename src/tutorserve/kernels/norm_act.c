/* Fused elementwise steps of a decoder layer: residual add + RMSNorm, and SiLU(gate) * up.
 *
 * Eager PyTorch runs RMSNorm as about eight ops, each a pass over a float32 copy of the
 * activations, and SiLU * up as two; on a prefill chunk of 2,048 tokens those passes cost more
 * than a tenth of the step. Here each is one pass per row. Rounding follows the reference
 * (Hugging Face's) float32 / bfloat16 semantics step by step: the residual sum is rounded to the
 * activation dtype, the normalized row is rounded before the weight multiplies it, SiLU's
 * result is rounded before the product.
 *
 * Rows are contiguous, of n elements (a multiple of the level's vector width VL, see simd.h),
 * float32 or bfloat16 (`is_bf16`).
 */
#include "simd.h"

static inline vf as_dtype(vf x, int is_bf16) { return is_bf16 ? vround_bf16(x) : x; }

/* out = weight * (h / rms(h)) with h = x (+ residual, in which case residual := h). */
int add_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows,
                 int64_t n, float eps, int is_bf16, int num_threads) {
    if (n % VL) return -1;
    const int64_t size = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * n * size;
        char *res = residual ? (char *)residual + r * n * size : NULL;
        vf sq = vzero();
        for (int64_t i = 0; i < n; i += VL) {
            vf h = vload_as(xr, i, is_bf16);
            if (res) {
                h = as_dtype(vadd(h, vload_as(res, i, is_bf16)), is_bf16);
                vstore_as(res, i, h, is_bf16);
            }
            sq = vfma(h, h, sq);
        }
        const vf inv = vset1(1.f / sqrtf(vhsum(sq) / (float)n + eps));
        const char *src = res ? res : xr;
        char *o = (char *)out + r * n * size;
        for (int64_t i = 0; i < n; i += VL) {
            const vf y = as_dtype(vmul(vload_as(src, i, is_bf16), inv), is_bf16);
            vstore_as(o, i, vmul(vload_as(weight, i, is_bf16), y), is_bf16);
        }
    }
    return 0;
}

/* out[r] = SiLU(gate_up[r][:n]) * gate_up[r][n:] */
int silu_mul(const void *gate_up, void *out, int64_t rows, int64_t n, int is_bf16,
             int num_threads) {
    if (n % VL) return -1;
    const int64_t size = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const char *g = (const char *)gate_up + 2 * r * n * size;
        const char *u = g + n * size;
        char *o = (char *)out + r * n * size;
        for (int64_t i = 0; i < n; i += VL) {
            const vf x = vload_as(g, i, is_bf16);
            const vf s = as_dtype(vdiv(x, vadd(vset1(1.f), vexp(vsub(vzero(), x)))), is_bf16);
            vstore_as(o, i, vmul(s, vload_as(u, i, is_bf16)), is_bf16);
        }
    }
    return 0;
}
