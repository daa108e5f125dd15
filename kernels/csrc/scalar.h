/* Scalar conversions between fp32, fp16 and bf16, rounding to nearest even as torch does.
 * Part of lynx_codec.c's single translation unit (included there, in order). */
/* ---- scalar conversions (round to nearest even, as torch) ---- */

INLINE uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
INLINE float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
/* Branch-free select (the compiler vectorizes loops of these; it does not if-convert every ?:). */
INLINE uint32_t select_u32(uint32_t cond, uint32_t a, uint32_t b) {
    const uint32_t m = 0u - (cond != 0);
    return (a & m) | (b & ~m);
}

INLINE float select_f32(uint32_t cond, float a, float b) {
    return bits_f32(select_u32(cond, f32_bits(a), f32_bits(b)));
}

/* fp16 <-> fp32 in integer steps the compiler vectorizes (GCC 12 cannot vectorize _Float16):
 * F. Giesen's exact conversions; fp32 -> fp16 rounds to nearest even like torch and F16C
 * (checked against F16C for every fp32 and fp16 value). */
INLINE float h2f(uint32_t h) {
    uint32_t u = (h & 0x7FFFu) << 13;
    const uint32_t exp = u & (0x7C00u << 13);
    u += (127u - 15u) << 23;
    u = select_u32(exp == (0x7C00u << 13), u + ((128u - 16u) << 23), u);
    /* zero / subnormal: renormalize by an exact float subtraction */
    const uint32_t sub = f32_bits(bits_f32(u + (1u << 23)) - bits_f32(113u << 23));
    return bits_f32(select_u32(exp == 0, sub, u) | ((h & 0x8000u) << 16));
}
INLINE uint32_t f2h(float x) {
    uint32_t u = f32_bits(x);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    const float denorm_magic = bits_f32(((127u - 15u) + (23u - 10u) + 1u) << 23);
    const uint32_t sub = f32_bits(bits_f32(u) + denorm_magic) - f32_bits(denorm_magic);
    const uint32_t norm = (u + ((uint32_t)(15 - 127) << 23) + 0xFFFu + ((u >> 13) & 1u)) >> 13;
    const uint32_t big = select_u32(u > 0x7F800000u, 0x7E00u, 0x7C00u);
    return select_u32(u >= (143u << 23), big, select_u32(u < (113u << 23), sub, norm)) | (sign >> 16);
}
/* Predictions are finite (never NaN), so torch's NaN branch is not needed. */
INLINE uint32_t f2b(float x) {
    const uint32_t u = f32_bits(x);
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
INLINE uint32_t h_down(uint32_t h) {  /* fp16 nextafter toward -inf */
    return select_u32((h & 0x7FFF) == 0, 0x8001u, h + ((h >> 15) << 1) - 1);
}
INLINE uint32_t h_up(uint32_t h) {    /* fp16 nextafter toward +inf */
    return select_u32((h & 0x7FFF) == 0, 0x0001u, h + 1 - ((h >> 15) << 1));
}

INLINE uint16_t get16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
INLINE uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
INLINE uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
INLINE void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
INLINE void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
INLINE void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
