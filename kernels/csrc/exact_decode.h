/* The exact Residual's section decoder.
 * Part of lynx_codec.c's single translation unit (included there, in order). */
/* ---- exact Residual section: decoder ---- */

INLINE uint64_t peek(const uint8_t *data, int64_t pos) { return get64(data + (pos >> 3)) >> (pos & 7); }

static int corrupt(err_t *e, const char *what) {
    return fail(e, LYNX_E_CHUNK, "corrupt exact Residual section: %s", what);
}

/* The unary codes a byte of the U area holds, LSB first: `zeros` codes end in it; runs[i] (byte
 * i of `runs`, 0 past the last) is the number of ones before its i-th zero (counted from the
 * previous zero, or from the byte's start for i = 0); `tail` ones follow its last zero. */
typedef struct {
    uint64_t runs[256];
    uint8_t zeros[256], tail[256];
} unary_t;

static unary_t unary_tab;
static pthread_once_t unary_once = PTHREAD_ONCE_INIT;

static void unary_init(void) {
    for (int b = 0; b < 256; b++) {
        uint64_t runs = 0;
        int z = 0, run = 0;
        for (int bit = 0; bit < 8; bit++) {
            if (b >> bit & 1) {
                run++;
            } else {
                runs |= (uint64_t)run << (8 * z++);
                run = 0;
            }
        }
        unary_tab.runs[b] = runs;
        unary_tab.zeros[b] = (uint8_t)z;
        unary_tab.tail[b] = (uint8_t)run;
    }
}

static const unary_t *unary_table(void) {
    pthread_once(&unary_once, unary_init);
    return &unary_tab;
}

/* Decodes a coded chunk's corrections against its `nv` predictions (S->zc: r bits and class per
 * value) into `out` (value i at out[i]: the chunk's unprotected values, row-major). */
INLINE int section_decode_w(const geo_t *G, section_scratch_t *S, const uint8_t *sec, int64_t sec_len,
                            int64_t nv, uint8_t *restrict out, err_t *e, const int wide) {
    uint64_t knibs = 0;
    for (int i = 0; i < 8; i++) knibs |= (uint64_t)sec[i] << (8 * i);
    const uint32_t klo = (uint32_t)knibs, khi = (uint32_t)(knibs >> 32);
    const uint32_t k_base = (uint32_t)G->p->k_base;
    const int64_t nb = num_blocks(nv), total = sec_len - 8 - 2 * nb;
    uint8_t *data = S->records;
    memcpy(data, sec + 8 + 2 * nb, (size_t)total);
    memset(data + total, 0, 16);
    const void *zc = S->zc;
    const int wb = G->wbits;
    const int64_t half = (int64_t)1 << (wb - 1);
    /* magnitudes above nan_above are NaN */
    const uint32_t mag = wide ? 0x7FFFFFFFu : 0x7FFFu;
    const uint32_t nan_above = wide ? 0x7F800000u : (G->p->dtype == DT_F16 ? 0x7C00u : 0x7F80u);
    /* L fields are read in groups (l_group: three for 16-bit dtypes, two for fp32): one 56-bit
     * peek holds a whole group. */
    const int lg = l_group(G);
    int64_t rs = 0, esc_idx[BLOCK];
    for (int64_t b = 0; b < nb; b++) {
        const int64_t re = rs + 8 * (int64_t)get16(sec + 8 + 2 * b);
        const int64_t i0 = b * BLOCK, i1 = i0 + BLOCK < nv ? i0 + BLOCK : nv;
        const int n = (int)(i1 - i0);
        /* each value's k (k_of_class: no chain, the compiler vectorizes) */
        uint8_t kb[BLOCK];
        for (int i = 0; i < n; i++) {
            const uint32_t c = (uint32_t)(zc_at(zc, wide, i0 + i) & 15);
            kb[i] = (uint8_t)k_of_class(c, klo, khi, k_base);
        }
        /* the L area's low bits (reading past the record is harmless: data has slack) */
        uint32_t lows[BLOCK];
        int64_t pl = rs;
        int i = 0;
        for (; i + lg <= n; i += lg) {
            uint64_t w = peek(data, pl);
            for (int j = 0; j < lg; j++) {
                const int k = kb[i + j];
                lows[i + j] = (uint32_t)(w & (((uint64_t)1 << k) - 1));
                w >>= k;
                pl += k;
            }
        }
        for (; i < n; i++) {
            const int k = kb[i];
            lows[i] = (uint32_t)(peek(data, pl) & (((uint64_t)1 << k) - 1));
            pl += k;
        }
        if (pl > re) return corrupt(e, "a record is shorter than its low bits");
        /* then the U area, a byte at a time through the unary table (unary_table): a byte's
         * whole codes come out of one 8-byte store, so the only chains are the code count and
         * the run of ones carried into the next byte. Up to 8 bytes land past the block's codes
         * (qs has the slack). A run of ones longer than 16 is refused as soon as it is seen, a
         * code of 17 to 23 (a run of 16 carried into a byte) by the length check below. */
        const unary_t *T = unary_table();
        uint8_t qs[BLOCK + 8];
        int64_t pu = pl;
        int cnt = 0;
        uint32_t carry = 0;
        for (;;) {
            if (pu >= re) return corrupt(e, "a unary code runs past its record");
            const uint64_t w = peek(data, pu);
            int j = 0, before = 0;
            uint32_t b = 0;
            for (; j < 7; j++) {
                b = (uint32_t)(w >> (8 * j)) & 0xFF;
                const uint32_t z = T->zeros[b];
                const uint64_t codes = T->runs[b] + (z ? carry : 0);
                memcpy(qs + cnt, &codes, 8);
                before = cnt;
                cnt += (int)z;
                carry = z ? T->tail[b] : carry + 8;
                if (cnt >= n || carry > ESCAPE_Q) break;
            }
            if (cnt >= n) {
                /* the block's last code ends at zero number n - before of this byte */
                uint32_t zb = ~b & 0xFF;
                for (int m = n - before - 1; m > 0; m--) zb &= zb - 1;
                pu += 8 * j + __builtin_ctz(zb) + 1;
                break;
            }
            if (carry > ESCAPE_Q) return corrupt(e, "a unary code longer than 16");
            pu += 56;
        }
        if (pu > re) return corrupt(e, "a unary code runs past its record");
        uint8_t qmax = 0;
        for (i = 0; i < n; i++) qmax = qs[i] > qmax ? qs[i] : qmax;
        if (qmax > ESCAPE_Q) return corrupt(e, "a unary code longer than 16");
        /* then the values (a loop the compiler vectorizes; escapes are written over afterwards) */
        uint32_t bad = 0, nan = 0;
        int64_t ne = 0;
        if (wide) {
            const uint64_t *restrict zc64 = (const uint64_t *)zc + i0;
            for (int i = 0; i < n; i++) {
                const uint64_t v = zc64[i];
                const int k = kb[i], esc = qs[i] == ESCAPE_Q;
                const uint64_t zz = ((uint64_t)qs[i] << k) | lows[i];
                const int64_t o = ord32((uint32_t)(v >> 4)) + (int64_t)((zz >> 1) ^ (0 - (zz & 1)));
                const uint32_t bits = o >= 0 ? (uint32_t)o : 0x80000000u | (uint32_t)(-1 - o);
                bad |= (uint32_t)((!esc) & ((o < -half) | (o >= half))) | (uint32_t)(esc & (lows[i] != 0));
                nan |= (uint32_t)((!esc) & ((bits & mag) > nan_above));
                ne += esc;
                put32(out + 4 * (i0 + i), bits);
            }
        } else {
            const uint32_t *restrict zc32 = (const uint32_t *)zc + i0;
            for (int i = 0; i < n; i++) {
                const uint32_t v = zc32[i];
                const int k = kb[i], esc = qs[i] == ESCAPE_Q;
                const uint32_t zz = ((uint32_t)qs[i] << k) | lows[i];
                const int32_t o = ord16(v >> 4) + (int32_t)((zz >> 1) ^ (0 - (zz & 1)));
                const uint32_t bits = o >= 0 ? (uint32_t)o : 0x8000u | (uint32_t)(-1 - o);
                bad |= (uint32_t)((!esc) & ((o < -32768) | (o > 32767))) | (uint32_t)(esc & (lows[i] != 0));
                nan |= (uint32_t)((!esc) & ((bits & mag) > nan_above));
                ne += esc;
                put16(out + 2 * (i0 + i), (uint16_t)bits);
            }
        }
        if (bad) return corrupt(e, "a correction leaves the value range, or an escape has low bits");
        if (ne)
            for (int i = 0, j = 0; i < n; i++)
                if (qs[i] == ESCAPE_Q) esc_idx[j++] = i0 + i;
        const int64_t eend = pu + ne * wb;
        if (eend > re || eend <= re - 8) return corrupt(e, "a record length does not match its contents");
        if (re > eend && (peek(data, eend) & (((uint64_t)1 << (re - eend)) - 1)))
            return corrupt(e, "non-zero padding bits");
        for (int64_t j = 0; j < ne; j++) {
            const uint32_t bits = (uint32_t)(peek(data, pu + j * wb) & (((uint64_t)1 << wb) - 1));
            nan |= (bits & mag) > nan_above;
            if (wide) put32(out + 4 * esc_idx[j], bits);
            else put16(out + 2 * esc_idx[j], (uint16_t)bits);
        }
        if (nan) return corrupt(e, "a NaN value");
        rs = re;
    }
    return LYNX_OK;
}

LYNX_CLONES
static int section_decode(const geo_t *G, section_scratch_t *S, const uint8_t *sec, int64_t sec_len,
                          int64_t nv, uint8_t *out, err_t *e) {
    return G->vb == 4 ? section_decode_w(G, S, sec, sec_len, nv, out, e, 1)
                      : section_decode_w(G, S, sec, sec_len, nv, out, e, 0);
}

/* The exact values of a Residual chunk's tokens into W->out rows (validating its corrections). */
LYNX_CLONES
static int decode_exact_chunk(const geo_t *G, dec_scratch_t *W, const chunk_t *a, const chunk_t *res,
                              err_t *e) {
    const int64_t hd = G->hd, rowb = hd * G->vb, nc = a->end - a->start;
    const uint8_t *prot = chunk_protected(G, a);
    int64_t np = 0, cur = -1;
    if (res->raw) {
        for (int64_t i = 0; i < nc * hd; i++)
            if (is_nan_bits(G, value_bits(G, res->payload, i))) return corrupt(e, "a NaN value");
        memcpy(W->out + a->start * rowb, res->payload, (size_t)(nc * rowb));
    }
    int64_t kept0, kept1, nv = 0;
    kept_range(G, a->start, a->end, &kept0, &kept1);
    for (int64_t t = a->start; t < a->end; t++) {
        if (is_protected(G, t)) {
            memcpy(W->out + t * rowb, prot + np++ * rowb, (size_t)rowb);
            continue;
        }
        if (res->raw) continue;
        load_groups(G, a, t, &W->q, &cur);
        chunk_codes(G, a, res, t, W->codes);
        predict_row(G, &W->q, 0, W->codes, W->v);
        row_scale_exponents(G, &W->q, 0, W->es);
        exact_row(G, W->v, W->es, NULL, (uint8_t *)W->S.zc + nv * G->vb * 2);
        nv += hd;
    }
    if (res->raw) return LYNX_OK;
    const int64_t at = low_len(G, nc);
    return section_decode(G, &W->S, res->payload + at, res->len - at, nv,
                          W->out + kept0 * rowb, e);
}

LYNX_CLONES
static int apply_impl(const lynx_params *p, const uint8_t *abuf, int64_t alen, const uint8_t *rbuf,
                      int64_t rlen, uint8_t *pool, const int64_t *slots, err_t *e) {
    geo_t G;
    geo_init(&G, p);
    int rc = check_slots(&G, slots, e);
    if (rc != LYNX_OK) return rc;
    chunk_t *anchors = NULL, *residuals = NULL;
    int64_t na = 0, nr = 0;
    if ((rc = walk(&G, STREAM_ANCHOR, abuf, alen, NULL, 0, &anchors, &na, e)) != LYNX_OK) return rc;
    if (rbuf && (rc = walk(&G, STREAM_RESIDUAL, rbuf, rlen, anchors, na, &residuals, &nr, e)) != LYNX_OK) {
        free(anchors);
        return rc;
    }
    const int64_t hd = G.hd;
    int64_t maxc = 0;
    for (int64_t i = 0; i < na; i++)
        maxc = anchors[i].end - anchors[i].start > maxc ? anchors[i].end - anchors[i].start : maxc;
    const int exact = rbuf && G.exact;
    dec_scratch_t W;
    void *ptrs[12];
    int np = 0;
    ptrs[np++] = W.v = xalloc(hd * 4);
    ptrs[np++] = W.codes = xalloc(hd);
    ptrs[np++] = W.es = xalloc(hd);
    ptrs[np++] = W.q.zb = xalloc(hd * 2);
    ptrs[np++] = W.q.sb = xalloc(hd * 2);
    ptrs[np++] = W.q.z = xalloc(hd * 4);
    ptrs[np++] = W.q.s = xalloc(hd * 4);
    W.q.inv = NULL;
    const int need = np;
    ptrs[np++] = W.out = exact ? xalloc(G.n * hd * G.vb) : NULL;
    ptrs[np++] = W.S.zc = exact ? xalloc(maxc * hd * G.vb * 2) : NULL;
    ptrs[np++] = W.S.records = exact ? xalloc(maxc * hd * G.vb + 64) : NULL;
    W.S.blk = NULL;
    for (int i = 0; i < np && rc == LYNX_OK; i++)
        if (!ptrs[i] && (i < need || exact)) rc = fail(e, LYNX_E_NOMEM, "out of memory for the codec's scratch");
    if (rc == LYNX_OK) {
        if (!exact) {
            for (int64_t i = 0; i < na; i++)
                decode_int8_chunk(&G, &W, anchors + i, rbuf ? residuals + i : NULL, pool, slots);
        } else {
            for (int64_t i = 0; i < na && rc == LYNX_OK; i++)
                rc = decode_exact_chunk(&G, &W, anchors + i, residuals + i, e);
            if (rc == LYNX_OK)
                for (int64_t t = 0; t < G.n; t++) {
                    if (t + PREFETCH_WRITE_AHEAD < G.n)
                        prefetch_row(pool_row(&G, pool, slots[t + PREFETCH_WRITE_AHEAD]), hd * G.vb, 1);
                    memcpy(pool + slots[t] * G.stride * G.vb, W.out + t * hd * G.vb, (size_t)(hd * G.vb));
                }
        }
    }
    free_all(ptrs, np);
    free(anchors);
    free(residuals);
    return rc;
}
