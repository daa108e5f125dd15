/* Validation of landed chunks before anything is written (headers, lengths, CRC, tiling).
 * Part of lynx_codec.c's single translation unit (included there, in order). */
/* ---- apply: validation ---- */

typedef struct {
    int64_t start, end, len;
    const uint8_t *payload;
    int raw;
} chunk_t;

static int check_header(const geo_t *G, int stream, const uint8_t *h, int64_t start, err_t *e) {
    const lynx_params *p = G->p;
    const char *what = stream == STREAM_ANCHOR ? "Anchor" : "Residual";
    if (memcmp(h, "LYNX", 4) != 0) return fail(e, LYNX_E_CHUNK, "not a Lynx chunk (bad magic)");
    if (h[4] != FORMAT_VERSION)
        return fail(e, LYNX_E_CHUNK,
                    "chunk format version %d, this codec reads %d: prefill and decode run different "
                    "lynx-sglang versions", h[4], FORMAT_VERSION);
    if (h[5] != stream) return fail(e, LYNX_E_CHUNK, "expected an %s chunk, got stream %d", what, h[5]);
    int flags = h[8];
    if (stream == STREAM_RESIDUAL && G->exact) flags &= ~FLAG_RAW;
    if (h[6] != p->kind || h[7] != p->dtype || flags != p->flags || h[9] != p->anchor_bits ||
        get16(h + 10) != p->group_size || get16(h + 18) != p->sink || get16(h + 20) != p->recent ||
        get32(h + 22) != p->seed)
        return fail(e, LYNX_E_CHUNK, "%s chunk's codec settings (kind, dtype, flags, bits, group, "
                    "sink/recent, seed) differ from this run's", what);
    if (get16(h + 12) != p->layer || get16(h + 14) != p->heads || get16(h + 16) != p->head_dim ||
        get64(h + 26) != p->request_tag || get32(h + 34) != (uint64_t)p->total_tokens)
        return fail(e, LYNX_E_CHUNK, "%s chunk of layer %d (tag %llu, %u tokens, %dx%d) does not "
                    "belong to this run", what, get16(h + 12), (unsigned long long)get64(h + 26),
                    get32(h + 34), get16(h + 14), get16(h + 16));
    const int64_t s = get32(h + 38), t = get32(h + 42);
    if (s != start || !(s < t && t <= G->n) || (G->over && s % G->g))
        return fail(e, LYNX_E_CHUNK, "%s chunks do not tile the run: expected one starting at "
                    "token %lld, got [%lld, %lld)", what, (long long)start, (long long)s, (long long)t);
    return LYNX_OK;
}

static int check_payload(const geo_t *G, int stream, const chunk_t *c, err_t *e) {
    const int64_t nc = c->end - c->start;
    const int64_t bound = stream == STREAM_ANCHOR ? anchor_payload_len(G, c->start, c->end)
                                                  : residual_bound(G, nc);
    if (!(stream == STREAM_RESIDUAL && G->exact && !c->raw)) {
        if (c->len != bound)
            return fail(e, LYNX_E_CHUNK, "chunk of tokens [%lld, %lld): payload_len %lld does not "
                        "match the %lld bytes its parameters imply", (long long)c->start,
                        (long long)c->end, (long long)c->len, (long long)bound);
        return LYNX_OK;
    }
    const int64_t nv = (nc - protected_count(G, c->start, c->end)) * G->hd;
    const int64_t at = low_len(G, nc) + 8 + 2 * num_blocks(nv);
    if (c->len > bound || c->len < at)
        return fail(e, LYNX_E_CHUNK, "exact Residual chunk of tokens [%lld, %lld): payload_len %lld "
                    "outside [%lld, %lld]", (long long)c->start, (long long)c->end,
                    (long long)c->len, (long long)at, (long long)bound);
    int64_t sum = 0;
    const uint8_t *lens = c->payload + low_len(G, nc) + 8;
    for (int64_t b = 0; b < num_blocks(nv); b++) sum += get16(lens + 2 * b);
    if (at + sum != c->len)
        return fail(e, LYNX_E_CHUNK, "exact Residual chunk of tokens [%lld, %lld): record lengths "
                    "sum to %lld bytes, the payload holds %lld", (long long)c->start,
                    (long long)c->end, (long long)sum, (long long)(c->len - at));
    return LYNX_OK;
}

/* Validates every chunk of a stream's bytes for this run (header fields, token tiling [0, n),
 * payload lengths, CRC); with `match`, the chunks must have its token ranges. */
static int walk(const geo_t *G, int stream, const uint8_t *buf, int64_t len, const chunk_t *match,
                int64_t nmatch, chunk_t **out, int64_t *count, err_t *e) {
    const char *what = stream == STREAM_ANCHOR ? "Anchor" : "Residual";
    int64_t cap = 16, k = 0, pos = 0, start = 0;
    chunk_t *arr = malloc(sizeof(chunk_t) * cap);
    if (!arr) return fail(e, LYNX_E_NOMEM, "out of memory");
    int rc = LYNX_OK;
    while (pos < len) {
        if (len - pos < HEADER_SIZE) {
            rc = fail(e, LYNX_E_CHUNK, "%s bytes end inside a chunk header at byte %lld of %lld",
                      what, (long long)pos, (long long)len);
            break;
        }
        const uint8_t *h = buf + pos;
        const int64_t plen = get32(h + 46), end = pos + HEADER_SIZE + plen;
        if (end > len) {
            rc = fail(e, LYNX_E_CHUNK, "%s chunk at byte %lld runs past the end (%lld > %lld)", what,
                      (long long)pos, (long long)end, (long long)len);
            break;
        }
        if ((rc = check_header(G, stream, h, start, e)) != LYNX_OK) break;
        chunk_t c = {get32(h + 38), get32(h + 42), plen, h + HEADER_SIZE, (h[8] & FLAG_RAW) != 0};
        if ((rc = check_payload(G, stream, &c, e)) != LYNX_OK) break;
        uint8_t zeroed[HEADER_SIZE];
        memcpy(zeroed, h, HEADER_SIZE);
        put32(zeroed + 50, 0);
        if (crc32_update(crc32_update(0, zeroed, HEADER_SIZE), c.payload, plen) != get32(h + 50)) {
            rc = fail(e, LYNX_E_CHUNK, "%s chunk of tokens [%lld, %lld): checksum mismatch (corrupt "
                      "chunk)", what, (long long)c.start, (long long)c.end);
            break;
        }
        if (match && (k >= nmatch || match[k].start != c.start || match[k].end != c.end)) {
            rc = fail(e, LYNX_E_CHUNK, "Residual chunk of tokens [%lld, %lld) has no Anchor chunk "
                      "of the same tokens", (long long)c.start, (long long)c.end);
            break;
        }
        if (k == cap) {
            chunk_t *grown = realloc(arr, sizeof(chunk_t) * (cap *= 2));
            if (!grown) {
                rc = fail(e, LYNX_E_NOMEM, "out of memory");
                break;
            }
            arr = grown;
        }
        arr[k++] = c;
        start = c.end;
        pos = end;
    }
    if (rc == LYNX_OK && start != G->n)
        rc = fail(e, LYNX_E_CHUNK, "%s chunks cover tokens [0, %lld) of %lld", what,
                  (long long)start, (long long)G->n);
    if (rc != LYNX_OK) {
        free(arr);
        return rc;
    }
    *out = arr;
    *count = k;
    return LYNX_OK;
}

static int check_slots(const geo_t *G, const int64_t *slots, err_t *e) {
    for (int64_t t = 0; t < G->n; t++)
        if (slots[t] < 0 || slots[t] >= G->p->pool_rows)
            return fail(e, LYNX_E_ARG, "slot %lld of token %lld is outside the pool's %lld rows",
                        (long long)slots[t], (long long)t, (long long)G->p->pool_rows);
    return LYNX_OK;
}
