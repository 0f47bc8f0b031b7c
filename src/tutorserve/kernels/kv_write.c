/* Writes the new tokens' K and V into the paged cache at their slots, converting to the
 * cache's dtype (which may be narrower than the model's) as it copies.
 *
 * The cache is [kv_heads, slots, head_dim] per layer (slots = blocks * block_size), paired
 * within each block in `KV_BF16_PAIRED` (kv_format.h); the new tokens' K and V are [tokens,
 * kv_heads, head_dim] views (last dim contiguous) into the fused QKV projection's output.
 * PyTorch needs a transpose, a dtype copy and an index_copy_ for each of K and V; this is one
 * pass over both.
 */
#include "convert.h"
#include "kv_format.h"

static void copy_row(const char *src, int src_bf16, char *dst, int dst_bf16, int64_t n) {
    if (src_bf16 == dst_bf16) {
        memcpy(dst, src, (size_t)n * (src_bf16 ? 2 : 4));
        return;
    }
    for (int64_t i = 0; i < n; i++) store_any(dst, i, load_any(src, i, src_bf16), dst_bf16);
}

/* A token's key and value into their blocks of a paired cache (`kb`, `vb`: the blocks' first
 * elements), at offset o: dims 2c, 2c + 1 of the key at word c × block_size + o; dim d of the
 * value at word (o / 2) × n + d, in its half o % 2. */
static void pair_rows(const char *k, const char *v, int src_bf16, uint16_t *kb, uint16_t *vb,
                      int64_t block_size, int64_t o, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        kb[(i / 2 * block_size + o) * 2 + i % 2] = bf16_bits(load_any(k, i, src_bf16));
        vb[(o / 2 * n + i) * 2 + o % 2] = bf16_bits(load_any(v, i, src_bf16));
    }
}

int write_kv(const void *k, const void *v, int64_t tokens, int64_t kv_heads, int64_t head_dim,
             int64_t k_token_stride, int64_t v_token_stride, int64_t head_stride,
             const int64_t *slots, void *k_cache, void *v_cache, int64_t num_slots,
             int64_t block_size, int src_bf16, int cache_format, int num_threads) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    const int cache_bf16 = cache_format != KV_F32, paired = cache_format == KV_BF16_PAIRED;
    const int64_t ss = src_bf16 ? 2 : 4, cs = cache_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t dst = ((h * num_slots) + slots[t]) * head_dim * cs;
            const char *kt = (const char *)k + (t * k_token_stride + h * head_stride) * ss;
            const char *vt = (const char *)v + (t * v_token_stride + h * head_stride) * ss;
            if (paired) {
                const int64_t o = slots[t] % block_size, block = dst / cs - o * head_dim;
                pair_rows(kt, vt, src_bf16, (uint16_t *)k_cache + block,
                          (uint16_t *)v_cache + block, block_size, o, head_dim);
            } else {
                copy_row(kt, src_bf16, (char *)k_cache + dst, cache_bf16, head_dim);
                copy_row(vt, src_bf16, (char *)v_cache + dst, cache_bf16, head_dim);
            }
        }
    return 0;
}
