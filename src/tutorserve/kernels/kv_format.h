/* How a layer's KV cache ([kv_heads, blocks, block_size, head_dim] each) holds its values: the
 * `cache_format` that the KV write, attention and the decode loop take.
 *
 * KV_BF16_PAIRED is bfloat16 with each block of K stored as [head_dim / 2][block_size] 32-bit
 * words, a word being one key's two adjacent dims: the order in which the bf16 dot-product
 * instruction takes keys (one key per lane). Attention then loads a tile of keys as it lies,
 * where the row layout costs it a 16 x 16 word transpose per tile, about as many instructions
 * as the products themselves. V keeps the row layout. Only attention's bf16 path reads it
 * (bf16 queries, head size 64 or 128, blocks of a multiple of 16 keys). */
#ifndef TUTORSERVE_KV_FORMAT_H
#define TUTORSERVE_KV_FORMAT_H
enum { KV_F32 = 0, KV_BF16 = 1, KV_BF16_PAIRED = 2 };
#endif
