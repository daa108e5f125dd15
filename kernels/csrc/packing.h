/* Bit packing of INT8 codes into Anchor top bits and Residual low bits (ops_torch.pack_bits' layout).
 * Part of lynx_codec.c's single translation unit (included there, in order). */
/* ---- bit packing (lynx_kernels.ops_torch.pack_bits' layout) ---- */

/* A row of codes into its top `a` bits and low 8 - a bits, each packed. */
INLINE void pack_codes(const uint8_t *c, int64_t n, int a, uint8_t *top, uint8_t *low) {
    const int r = 8 - a;
    if (a == 4) {
        for (int64_t i = 0; i < n / 2; i++) {
            const uint32_t w = ((const u16a *)c)[i];
            top[i] = (uint8_t)(((w >> 4) & 0x0F) | ((w >> 8) & 0xF0));
            low[i] = (uint8_t)((w & 0x0F) | ((w >> 4) & 0xF0));
        }
        return;
    }
    for (int64_t k = 0; k < n / 8; k++) {
        const uint64_t w = get64(c + 8 * k);
        uint64_t t = 0, l = 0;
        for (int j = 0; j < 8; j++) {
            const uint64_t cj = (w >> (8 * j)) & 0xFF;
            t |= (cj >> r) << (a * j);
            l |= (cj & ((1u << r) - 1)) << (r * j);
        }
        memcpy(top + k * a, &t, (size_t)a);
        memcpy(low + k * r, &l, (size_t)r);
    }
}

/* Packed top bits (and low bits, or none: then the codes' low bits are 0) into a row of codes. */
INLINE void unpack_codes(const uint8_t *top, const uint8_t *low, int64_t n, int a, uint8_t *c) {
    const int r = 8 - a;
    if (a == 4) {
        if (low) {
            for (int64_t i = 0; i < n / 2; i++) {
                const uint32_t t = top[i], l = low[i];
                ((u16a *)c)[i] = (uint16_t)(((t & 0x0F) << 4) | (l & 0x0F) | (((t & 0xF0) | (l >> 4)) << 8));
            }
        } else {
            for (int64_t i = 0; i < n / 2; i++) {
                const uint32_t t = top[i];
                ((u16a *)c)[i] = (uint16_t)(((t & 0x0F) << 4) | ((t & 0xF0) << 8));
            }
        }
        return;
    }
    const uint64_t amask = (1u << a) - 1, rmask = (1u << r) - 1;
    for (int64_t k = 0; k < n / 8; k++) {
        uint64_t t = 0, l = 0, w = 0;
        memcpy(&t, top + k * a, (size_t)a);
        if (low) memcpy(&l, low + k * r, (size_t)r);
        for (int j = 0; j < 8; j++)
            w |= ((((t >> (a * j)) & amask) << r) | ((l >> (r * j)) & rmask)) << (8 * j);
        memcpy(c + 8 * k, &w, 8);
    }
}
