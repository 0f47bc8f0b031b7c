/* What the kernels can use on this CPU, as built: 2 with AVX512-BF16 (attention's bf16
 * dot-product path), 1 with AVX-512 (every kernel), 0 without (callers use PyTorch ops). */
int tutorserve_isa(void) {
#if defined(__AVX512BF16__)
    return 2;
#elif defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}
