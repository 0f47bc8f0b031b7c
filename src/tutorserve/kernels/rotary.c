/* Rotary position embedding in the rotate-half (NeoX / Hugging Face) layout, in place on the
 * query and key heads of each token.
 *
 * Eager PyTorch spends about ten ops on it per layer (two chunks, negations, concatenations,
 * products and sums, each a new tensor), which at decode batch 1 cost more than the rotation.
 * Here it is one pass. With bfloat16 heads the rounding is the reference's step by step: cos
 * and sin are rounded to bfloat16, each product is rounded, then their sum; so the result is
 * bit-for-bit PyTorch's. Heads are rows of head_dim elements (last dim contiguous); a token's
 * heads are `head_stride` elements apart and tokens `token_stride` apart, so q and k may be
 * views into the fused QKV projection's output.
 */
#include "convert.h"

static inline float as_dtype(float x, int is_bf16) {
    if (!is_bf16) return x;
    const uint32_t bits = (uint32_t)bf16_bits(x) << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static void rotate_heads(char *x, int64_t heads, int64_t head_stride, int64_t half,
                         const void *cos, const void *sin, int table_bf16, int is_bf16) {
    const int64_t size = is_bf16 ? 2 : 4;
    for (int64_t h = 0; h < heads; h++) {
        char *row = x + h * head_stride * size;
        char *second = row + half * size;
        for (int64_t i = 0; i < half; i++) {
            const float c = as_dtype(load_any(cos, i, table_bf16), is_bf16);
            const float s = as_dtype(load_any(sin, i, table_bf16), is_bf16);
            const float x1 = load_any(row, i, is_bf16), x2 = load_any(second, i, is_bf16);
            const float a1 = as_dtype(x1 * c, is_bf16), b1 = as_dtype(x2 * s, is_bf16);
            const float a2 = as_dtype(x2 * c, is_bf16), b2 = as_dtype(x1 * s, is_bf16);
            store_any(row, i, a1 - b1, is_bf16);
            store_any(second, i, a2 + b2, is_bf16);
        }
    }
}

/* cos, sin: [max_positions, head_dim] tables, float32 or bfloat16 (`table_bf16`), whose first
 * head_dim / 2 columns are used (the reference repeats them for the second half). */
int rotary_embedding(const int64_t *positions, void *q, void *k, int64_t tokens, int64_t q_heads,
                     int64_t k_heads, int64_t head_dim, int64_t q_token_stride,
                     int64_t q_head_stride, int64_t k_token_stride, int64_t k_head_stride,
                     const void *cos, const void *sin, int64_t max_positions, int table_bf16,
                     int is_bf16, int num_threads) {
    if (head_dim % 2) return -1;
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_positions) return -1;
    const int64_t size = is_bf16 ? 2 : 4, table_size = table_bf16 ? 2 : 4, half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t row = positions[t] * head_dim * table_size;
        const char *c = (const char *)cos + row, *s = (const char *)sin + row;
        rotate_heads((char *)q + t * q_token_stride * size, q_heads, q_head_stride, half, c, s,
                     table_bf16, is_bf16);
        rotate_heads((char *)k + t * k_token_stride * size, k_heads, k_head_stride, half, c, s,
                     table_bf16, is_bf16);
    }
    return 0;
}
