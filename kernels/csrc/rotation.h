/* The FWHT rotation over head_dim, in the reference's butterfly order (lynx_kernels.rotation).
 * Part of lynx_codec.c's single translation unit (included there, in order). */
/* ---- rotation: FWHT with the reference's butterfly order (lynx_kernels.rotation) ---- */

/* Strides 1, 2, 4 inside 8 values: lane j gets partner + (+-1) * x[j]; for the lower index of a
 * pair that is b + a (= a + b), for the upper a + (-b) (= a - b), both exact IEEE equivalents. */
INLINE v8f fwht8(v8f x) {
    const v8f s1 = {1, -1, 1, -1, 1, -1, 1, -1}, s2 = {1, 1, -1, -1, 1, 1, -1, -1};
    const v8f s4 = {1, 1, 1, 1, -1, -1, -1, -1};
    x = __builtin_shuffle(x, (v8i){1, 0, 3, 2, 5, 4, 7, 6}) + x * s1;
    x = __builtin_shuffle(x, (v8i){2, 3, 0, 1, 6, 7, 4, 5}) + x * s2;
    return __builtin_shuffle(x, (v8i){4, 5, 6, 7, 0, 1, 2, 3}) + x * s4;
}

/* fwht8's strides 1, 2, 4 and then 8, inside 16 values (one AVX-512 register; two AVX2 ones). */
INLINE v16f fwht16(v16f x) {
    const v16f s1 = {1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1};
    const v16f s2 = {1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1};
    const v16f s4 = {1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1};
    const v16f s8 = {1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1};
    x = __builtin_shuffle(x, (v16i){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}) + x * s1;
    x = __builtin_shuffle(x, (v16i){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}) + x * s2;
    x = __builtin_shuffle(x, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}) + x * s4;
    return __builtin_shuffle(x, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}) + x * s8;
}

/* One head of D = 16 * nv values, in registers: rotate (FWHT(y * signs) * inv) or unrotate
 * (FWHT(y) * signs * inv); the strides in the reference's order (1 to 8 inside a register, then
 * across registers). */
INLINE void head_regs(float *y, const float *sg, float inv, const int nv, const int unrot) {
    v16f r[8];
#pragma GCC unroll 8
    for (int i = 0; i < nv; i++)
        r[i] = fwht16(unrot ? vload16(y + 16 * i) : vload16(y + 16 * i) * vload16(sg + 16 * i));
#pragma GCC unroll 4
    for (int h = 1; h < nv; h <<= 1)
#pragma GCC unroll 4
        for (int p = 0; p < nv / 2; p++) { /* the p-th pair (j, j + h) of this stride */
            const int j = p / h * 2 * h + p % h;
            const v16f a = r[j], b = r[j + h];
            r[j] = a + b;
            r[j + h] = a - b;
        }
#pragma GCC unroll 8
    for (int i = 0; i < nv; i++)
        vstore16(y + 16 * i, (unrot ? r[i] * vload16(sg + 16 * i) : r[i]) * inv);
}

/* A head of 8 values: fwht8 alone. */
INLINE void head8(float *y, const float *sg, float inv, const int unrot) {
    const v8f r = fwht8(unrot ? vload(y) : vload(y) * vload(sg));
    vstore(y, (unrot ? r * vload(sg) : r) * inv);
}

/* Heads wider than 128 values: the same butterflies through memory. */
INLINE void head_mem(float *y, const float *sg, float inv, int d, int unrot) {
    if (!unrot)
        for (int j = 0; j < d; j++) y[j] *= sg[j];
    for (int i = 0; i < d; i += 8) vstore(y + i, fwht8(vload(y + i)));
    for (int h = 8; h < d; h <<= 1)
        for (int i = 0; i < d; i += 2 * h)
            for (int j = i; j < i + h; j += 8) {
                const v8f a = vload(y + j), b = vload(y + j + h);
                vstore(y + j, a + b);
                vstore(y + j + h, a - b);
            }
    if (unrot)
        for (int j = 0; j < d; j++) y[j] *= sg[j];
    for (int j = 0; j < d; j++) y[j] *= inv;
}

INLINE void row_transform(const geo_t *G, float *x, const int unrot) {
    const float *sg = G->p->signs;
    const float inv = G->p->inv_sqrt_d;
    for (int h = 0; h < G->H; h++) {
        float *y = x + (int64_t)h * G->D;
        switch (G->D) {
            case 128: head_regs(y, sg, inv, 8, unrot); break;
            case 64: head_regs(y, sg, inv, 4, unrot); break;
            case 32: head_regs(y, sg, inv, 2, unrot); break;
            case 16: head_regs(y, sg, inv, 1, unrot); break;
            case 8: head8(y, sg, inv, unrot); break;
            default: head_mem(y, sg, inv, G->D, unrot);
        }
    }
}
