/* Decode attention over paged K/V, reading each row's blocks where they lie in the cache.
 *
 * One query token per row; the query heads of a KV head (GQA group) share every key read.
 * Keys are visited block by block with an online softmax (running max and sum, rescaling the
 * accumulator when the max grows), so nothing is gathered and each K/V byte is read once.
 * Outputs are float32 together with the log-sum-exp of the scores, so that the caller can
 * merge this partial result with attention over a shared prefix (cascade attention).
 *
 * Layouts (all contiguous):
 *   q       [rows, kv_heads, group, dim] float32
 *   k, v    [kv_heads, num_blocks, block_size, dim] float32 or bfloat16
 *   tables  [rows, width] int64: the blocks of each row, in order
 *   lens    [rows] int64: keys of each row (its blocks hold them from the first slot on)
 *   out     [rows, kv_heads, group, dim] float32
 *   lse     [rows, kv_heads, group] float32 (-inf for a row with no keys)
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    const float *q;
    const void *k, *v;
    const int64_t *tables, *lens;
    int64_t kv_heads, group, dim, num_blocks, block_size, width;
    float scale;
    float *out, *lse;
} Args;

/* bfloat16 is the upper half of a float32; widening is a shift, which vectorizes. */
static void load_block(const void *cache, int is_bf16, int64_t offset, int64_t n, float *dst) {
    if (!is_bf16) {
        memcpy(dst, (const float *)cache + offset, n * sizeof(float));
        return;
    }
    const uint16_t *src = (const uint16_t *)cache + offset;
    uint32_t *bits = (uint32_t *)dst; /* built with -fno-strict-aliasing */
    for (int64_t i = 0; i < n; i++) bits[i] = (uint32_t)src[i] << 16;
}

static void attend_one(const Args *a, int is_bf16, int64_t row, int64_t head) {
    const int64_t G = a->group, D = a->dim, BS = a->block_size;
    const float *q = a->q + (row * a->kv_heads + head) * G * D;
    float acc[G * D], peak[G], total[G], p[G * BS], kv[BS * D];
    for (int64_t g = 0; g < G; g++) {
        peak[g] = -INFINITY;
        total[g] = 0.f;
    }
    memset(acc, 0, sizeof(acc));
    const int64_t len = a->lens[row], head_base = head * a->num_blocks * BS * D;
    for (int64_t b = 0; b * BS < len; b++) {
        const int64_t n = len - b * BS < BS ? len - b * BS : BS;
        const int64_t base = head_base + a->tables[row * a->width + b] * BS * D;
        load_block(a->k, is_bf16, base, n * D, kv);
        for (int64_t t = 0; t < n; t++) {
            for (int64_t g = 0; g < G; g++) {
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += q[g * D + d] * kv[t * D + d];
                p[g * BS + t] = dot * a->scale;
            }
        }
        for (int64_t g = 0; g < G; g++) {
            float m = peak[g];
            for (int64_t t = 0; t < n; t++) m = p[g * BS + t] > m ? p[g * BS + t] : m;
            const float rescale = expf(peak[g] - m);
            total[g] *= rescale;
            for (int64_t d = 0; d < D; d++) acc[g * D + d] *= rescale;
            for (int64_t t = 0; t < n; t++) {
                p[g * BS + t] = expf(p[g * BS + t] - m);
                total[g] += p[g * BS + t];
            }
            peak[g] = m;
        }
        load_block(a->v, is_bf16, base, n * D, kv);
        for (int64_t t = 0; t < n; t++) {
            for (int64_t g = 0; g < G; g++) {
                const float w = p[g * BS + t];
                for (int64_t d = 0; d < D; d++) acc[g * D + d] += w * kv[t * D + d];
            }
        }
    }
    float *out = a->out + (row * a->kv_heads + head) * G * D;
    float *lse = a->lse + (row * a->kv_heads + head) * G;
    for (int64_t g = 0; g < G; g++) {
        const float inv = total[g] > 0.f ? 1.f / total[g] : 0.f;
        for (int64_t d = 0; d < D; d++) out[g * D + d] = acc[g * D + d] * inv;
        lse[g] = peak[g] + logf(total[g]);
    }
}

void paged_decode(const float *q, const void *k, const void *v, const int64_t *tables,
                  const int64_t *lens, int64_t rows, int64_t kv_heads, int64_t group,
                  int64_t dim, int64_t num_blocks, int64_t block_size, int64_t width,
                  float scale, int is_bf16, float *out, float *lse, int num_threads) {
    const Args a = {q, k, v, tables, lens, kv_heads, group, dim, num_blocks, block_size,
                    width, scale, out, lse};
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < rows * kv_heads; i++) attend_one(&a, is_bf16, i / kv_heads, i % kv_heads);
}
