/* Structured outputs' allowed-token mask, applied in place: a token whose bit is clear gets
 * -inf. Eager PyTorch unpacks the bits into a bool tensor and masks in several passes over
 * [rows, vocab] float32 (~6 ms for 32 rows of a 49k vocabulary on our CPUs); here it is one
 * pass that reads 4 bytes per 32 logits and skips words with every token allowed.
 *
 * bitmask: [n, words] int32 (llguidance's layout: bit j of word w is token 32w + j); logits:
 * float32 rows of `vocab`, `ld` apart; mask row i applies to logits row row_ids[i].
 */
#include <math.h>
#include <stdint.h>

int apply_token_bitmask(float *logits, int64_t ld, const int64_t *row_ids, int64_t n,
                        const int32_t *bitmask, int64_t words, int64_t vocab, int num_threads) {
    if (words * 32 < vocab) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float *row = logits + row_ids[i] * ld;
        const uint32_t *bits = (const uint32_t *)bitmask + i * words;
        for (int64_t w = 0; w * 32 < vocab; w++) {
            const uint32_t m = bits[w];
            if (m == 0xffffffffu) continue;
            float *x = row + w * 32;
            const int end = vocab - w * 32 < 32 ? (int)(vocab - w * 32) : 32;
            for (int j = 0; j < end; j++)
                if (!(m >> j & 1u)) x[j] = -INFINITY;
        }
    }
    return 0;
}
