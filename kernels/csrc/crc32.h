/* zlib's CRC-32 of the wire chunks: slicing-by-8 tables, PCLMUL folding where the CPU has it
 * (VPCLMULQDQ on 512-bit registers where it has that too).
 * Part of lynx_codec.c's single translation unit (included there, in order). */
/* ---- CRC-32 (zlib's): slicing-by-8 tables, (V)PCLMUL folding where the CPU has it ---- */

static uint32_t crc_table[8][256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (int t = 1; t < 8; t++)
        for (int i = 0; i < 256; i++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
}

/* State in, state out (the state is the complemented CRC). */
static uint32_t crc_tables(uint32_t c, const uint8_t *p, int64_t n) {
    while (n >= 8) {
        uint64_t w = get64(p) ^ c;
        c = crc_table[7][w & 0xFF] ^ crc_table[6][(w >> 8) & 0xFF] ^ crc_table[5][(w >> 16) & 0xFF] ^
            crc_table[4][(w >> 24) & 0xFF] ^ crc_table[3][(w >> 32) & 0xFF] ^
            crc_table[2][(w >> 40) & 0xFF] ^ crc_table[1][(w >> 48) & 0xFF] ^ crc_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) c = crc_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c;
}

#if defined(__x86_64__)
/* Carry-less multiplication folding (Gopal et al., "Fast CRC Computation for Generic Polynomials
 * Using PCLMULQDQ", 2009) with the bit-reflected constants of the zlib polynomial: folding a
 * 128-bit lane forward by N bits multiplies its low half by x^(N+32) and its high half by
 * x^(N-32) mod P (reflected, shifted left by one). */
static int have_clmul, have_vpclmul;

/* Four consecutive 16-byte lanes of folded state, then the rest of the input (n a multiple of
 * 16): folds on four lanes at a time, then into one, then 128 -> 64 -> 32 bits and a Barrett
 * reduction. Returns the state. */
__attribute__((target("pclmul,sse4.1")))
static uint32_t crc_fold_lanes(__m128i x1, __m128i x2, __m128i x3, __m128i x4, const uint8_t *p,
                               int64_t n) {
    const __m128i k1k2 = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL); /* N = 512 */
    const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL); /* N = 128 */
    const __m128i k5 = _mm_set_epi64x(0, 0x163cd6124LL);
    const __m128i poly = _mm_set_epi64x(0x1f7011641LL, 0x1db710641LL);
    const __m128i low32 = _mm_setr_epi32(-1, 0, -1, 0);
    while (n >= 64) {
        __m128i h1 = _mm_clmulepi64_si128(x1, k1k2, 0x11), h2 = _mm_clmulepi64_si128(x2, k1k2, 0x11);
        __m128i h3 = _mm_clmulepi64_si128(x3, k1k2, 0x11), h4 = _mm_clmulepi64_si128(x4, k1k2, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, k1k2, 0x00), h1),
                           _mm_loadu_si128((const __m128i *)p));
        x2 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x2, k1k2, 0x00), h2),
                           _mm_loadu_si128((const __m128i *)(p + 16)));
        x3 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x3, k1k2, 0x00), h3),
                           _mm_loadu_si128((const __m128i *)(p + 32)));
        x4 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x4, k1k2, 0x00), h4),
                           _mm_loadu_si128((const __m128i *)(p + 48)));
        p += 64;
        n -= 64;
    }
    __m128i rest[3] = {x2, x3, x4};
    for (int i = 0; i < 3; i++)
        x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, k3k4, 0x00),
                                         _mm_clmulepi64_si128(x1, k3k4, 0x11)), rest[i]);
    while (n >= 16) {
        x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, k3k4, 0x00),
                                         _mm_clmulepi64_si128(x1, k3k4, 0x11)),
                           _mm_loadu_si128((const __m128i *)p));
        p += 16;
        n -= 16;
    }
    __m128i x2b = _mm_clmulepi64_si128(x1, k3k4, 0x10);
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2b);
    x2b = _mm_srli_si128(x1, 4);
    x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, low32), k5, 0x00), x2b);
    x2b = _mm_clmulepi64_si128(_mm_and_si128(x1, low32), poly, 0x10);
    x2b = _mm_clmulepi64_si128(_mm_and_si128(x2b, low32), poly, 0x00);
    x1 = _mm_xor_si128(x1, x2b);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}

/* n >= 64 and a multiple of 16; state in, state out. */
__attribute__((target("pclmul,sse4.1")))
static uint32_t crc_clmul(uint32_t c, const uint8_t *p, int64_t n) {
    const __m128i x1 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128((int)c));
    return crc_fold_lanes(x1, _mm_loadu_si128((const __m128i *)(p + 16)),
                          _mm_loadu_si128((const __m128i *)(p + 32)),
                          _mm_loadu_si128((const __m128i *)(p + 48)), p + 64, n - 64);
}

/* The same folds on 512-bit registers (VPCLMULQDQ): four of them, 256 bytes a step, then folded
 * into one and handed to crc_fold_lanes as its four lanes. n >= 256 and a multiple of 16. */
__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.1")))
static uint32_t crc_vpclmul(uint32_t c, const uint8_t *p, int64_t n) {
    const __m512i k256 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x1322d1430LL, 0x11542778aLL));
    const __m512i k64 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL));
    __m512i z[4];
    for (int i = 0; i < 4; i++) z[i] = _mm512_loadu_si512((const void *)(p + 64 * i));
    z[0] = _mm512_xor_si512(z[0], _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)c)));
    p += 256;
    n -= 256;
    while (n >= 256) {
        for (int i = 0; i < 4; i++)
            z[i] = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(z[i], k256, 0x00),
                                             _mm512_clmulepi64_epi128(z[i], k256, 0x11),
                                             _mm512_loadu_si512((const void *)(p + 64 * i)), 0x96);
        p += 256;
        n -= 256;
    }
    __m512i acc = z[0];
    for (int i = 1; i < 4; i++)
        acc = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(acc, k64, 0x00),
                                        _mm512_clmulepi64_epi128(acc, k64, 0x11), z[i], 0x96);
    return crc_fold_lanes(_mm512_extracti32x4_epi32(acc, 0), _mm512_extracti32x4_epi32(acc, 1),
                          _mm512_extracti32x4_epi32(acc, 2), _mm512_extracti32x4_epi32(acc, 3), p, n);
}
#endif

static uint32_t crc32_update(uint32_t crc, const uint8_t *p, int64_t n) {
    uint32_t c = ~crc;
#if defined(__x86_64__)
    if (have_clmul && n >= 64) {
        int64_t m = n & ~(int64_t)15;
        c = have_vpclmul && m >= 256 ? crc_vpclmul(c, p, m) : crc_clmul(c, p, m);
        p += m;
        n -= m;
    }
#endif
    return ~crc_tables(c, p, n);
}
