/* One rank's frame of a bucket, written and scanned in one call (docs/design.md
 * section 8.7): the per-payload header work of the bucket path without a Python
 * round trip per tensor. The frame and payload layouts are hvdcompress/wire.py's;
 * this file mirrors them, and tests/test_compress_bucket.py and
 * tests/fuzz/test_frame_mutations.py check the two against each
 * other byte for byte (writing) and verdict for verdict (scanning, fuzzed).
 *
 * The scan's CUDA twin, for frames gathered on a GPU, is kernels/frame.cu, section 3
 * (tests/gpu/test_buckets_gpu.py compares the two report for report); frames are written
 * on the device by the bucket encoders and hvd_checksum_store. Pure functions over
 * caller-owned buffers.
 *
 * Memory traffic: write copies each body once and reads it once more for the checksum
 * (2 B per body byte, header bytes negligible); scan reads each payload once (1 B per
 * byte, the checksum), headers aside.
 */
#include <stdint.h>
#include <string.h>

uint32_t hvdc_checksum(const uint8_t *buf, int64_t len, int64_t offset); /* threelc.c */

#define FRAME_FIXED 32     /* wire.FIXED_HEADER.size */
#define FRAME_CHECKSUM 12  /* wire.CHECKSUM_OFFSET */
#define FRAME_MAX_NDIM 8   /* wire.MAX_NDIM */
#define FRAME_MAX_PARAMS 256 /* wire.MAX_PARAMS */
#define FRAME_VERSION 1    /* wire.VERSION */

/* What hvdc_frame_scan reports per payload, FRAME_FIELDS int64 each (wire.SCAN_FIELDS
 * names them in this order). */
enum {
    SCAN_OK,        /* 1: the header's layout and the checksum hold (see below); 0: not */
    SCAN_START,     /* offset of the payload in the frame */
    SCAN_LENGTH,    /* its length in bytes */
    SCAN_CODEC,     /* codec id, flags, dtype id, ndim, params_len: the header's fields */
    SCAN_FLAGS,
    SCAN_DTYPE,
    SCAN_NDIM,
    SCAN_PARAMS_LEN,
    SCAN_NUMEL,
    SCAN_BODY_LEN,
    FRAME_FIELDS
};

static inline uint64_t load_u64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* little-endian hosts only (x86-64, aarch64): as wire.py packs */
    return v;
}

static inline void store_u64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

/* 1 when the payload's header is laid out as wire.parse_header requires, up to what the
 * caller compares against its own expectations (codec id, flags, dtype id, shape), and
 * its checksum matches: magic, version, reserved byte, ndim <= 8, params_len <= 256, the
 * announced header fits, the shape's non-zero dimensions multiply to at most 2^63 - 1,
 * its product is numel, body_len is what follows the header. */
static int scan_payload(const uint8_t *p, int64_t len, int64_t *f, uint64_t *shape) {
    if (len < FRAME_FIXED) return 0;
    if (memcmp(p, "HVDC", 4) != 0 || p[4] != FRAME_VERSION || p[9] != 0) return 0;
    int64_t ndim = p[8], params_len = p[10] | (p[11] << 8);
    f[SCAN_CODEC] = p[5];
    f[SCAN_FLAGS] = p[6];
    f[SCAN_DTYPE] = p[7];
    f[SCAN_NDIM] = ndim;
    f[SCAN_PARAMS_LEN] = params_len;
    if (ndim > FRAME_MAX_NDIM || params_len > FRAME_MAX_PARAMS) return 0;
    int64_t header_len = FRAME_FIXED + 8 * ndim + params_len;
    if (len < header_len) return 0;
    uint64_t numel = load_u64(p + 16), body_len = load_u64(p + 24);
    uint64_t prod = 1, nonzero = 1;
    for (int64_t d = 0; d < ndim; d++) {
        uint64_t dim = load_u64(p + FRAME_FIXED + 8 * d);
        shape[d] = dim;
        if (__builtin_mul_overflow(nonzero, dim ? dim : 1, &nonzero)) return 0;
        if (nonzero > (uint64_t)INT64_MAX) return 0;
        prod *= dim; /* <= nonzero: no overflow */
    }
    if (prod != numel || body_len != (uint64_t)(len - header_len)) return 0;
    f[SCAN_NUMEL] = (int64_t)numel;
    f[SCAN_BODY_LEN] = (int64_t)body_len;
    /* The checksum is computed with its own field zeroed: the field's four bytes are
     * summed as zeros in their place (wire.checksum_without_field). */
    uint32_t stored;
    memcpy(&stored, p + FRAME_CHECKSUM, 4);
    uint32_t sum = hvdc_checksum(p, FRAME_CHECKSUM, 0) + hvdc_checksum(p + FRAME_CHECKSUM + 4,
                                                                        len - FRAME_CHECKSUM - 4,
                                                                        FRAME_CHECKSUM + 4);
    static const uint8_t zeros[4] = {0, 0, 0, 0};
    sum += hvdc_checksum(zeros, 4, FRAME_CHECKSUM);
    return sum == stored;
}

/* Scan a frame of `count` payloads (wire.frame: count, count lengths as uint64, the
 * payloads). fields: count x FRAME_FIELDS int64; shapes: count x 8 uint64 (dimensions
 * past ndim untouched). Returns 0, or -1 when the length table does not describe the
 * frame (then nothing is reported). Payloads are scanned in order; each gets its own
 * SCAN_OK, so a caller falls back to the exact Python checks for the first bad one. */
int64_t hvdc_frame_scan(const uint8_t *frame, int64_t len, int64_t count, int64_t *fields,
                        uint64_t *shapes) {
    if (count < 0 || count > (len >> 3) - 1 || load_u64(frame) != (uint64_t)count) return -1;
    uint64_t at = 8 * (uint64_t)(count + 1);
    for (int64_t p = 0; p < count; p++) {
        uint64_t n = load_u64(frame + 8 * (p + 1));
        if (n > (uint64_t)len - at) return -1;
        at += n;
    }
    if (at != (uint64_t)len) return -1;
    at = 8 * (uint64_t)(count + 1);
    for (int64_t p = 0; p < count; p++) {
        int64_t n = (int64_t)load_u64(frame + 8 * (p + 1));
        int64_t *f = fields + FRAME_FIELDS * p;
        memset(f, 0, FRAME_FIELDS * sizeof *f);
        f[SCAN_START] = (int64_t)at;
        f[SCAN_LENGTH] = n;
        f[SCAN_OK] = scan_payload(frame + at, n, f, shapes + FRAME_MAX_NDIM * p);
        at += (uint64_t)n;
    }
    return 0;
}

/* Write one rank's frame of `count` payloads into `frame` (exactly 8 (count + 1) + sum
 * of head_lens + params_lens + body_lens bytes). Payload p is heads[head_starts[p]..
 * + head_lens[p]) (its packed fixed header and shape, wire.Header.pack without the
 * params, checksum field zero), with the flags byte set to flags[p], the params_len field
 * to params_lens[p] and the body_len field to body_lens[p]; then params[param_starts[p].. + params_lens[p]); then the body
 * (body_lens[p] bytes at address bodies[p]); then its checksum written into its field.
 * The bytes are wire.frame of wire.assemble of each payload. */
void hvdc_frame_write(int64_t count, const uint8_t *heads, const int64_t *head_starts,
                      const int64_t *head_lens, const uint8_t *flags, const uint8_t *params,
                      const int64_t *param_starts, const int64_t *params_lens,
                      const uint64_t *bodies, const int64_t *body_lens, uint8_t *frame) {
    store_u64(frame, (uint64_t)count);
    uint8_t *at = frame + 8 * (count + 1);
    for (int64_t p = 0; p < count; p++) {
        int64_t n = head_lens[p] + params_lens[p] + body_lens[p];
        store_u64(frame + 8 * (p + 1), (uint64_t)n);
        uint8_t *payload = at;
        memcpy(at, heads + head_starts[p], (size_t)head_lens[p]);
        payload[6] = flags[p];
        payload[10] = (uint8_t)(params_lens[p] & 0xff); /* the caller checked <= 256 */
        payload[11] = (uint8_t)(params_lens[p] >> 8);
        store_u64(payload + 24, (uint64_t)body_lens[p]);
        at += head_lens[p];
        memcpy(at, params + param_starts[p], (size_t)params_lens[p]);
        at += params_lens[p];
        if (body_lens[p]) memcpy(at, (const uint8_t *)(uintptr_t)bodies[p], (size_t)body_lens[p]);
        at += body_lens[p];
        memset(payload + FRAME_CHECKSUM, 0, 4);
        uint32_t sum = hvdc_checksum(payload, n, 0);
        memcpy(payload + FRAME_CHECKSUM, &sum, 4);
    }
}
