/* The payload checksum (hvdc_checksum, hvdc_checksum_segments), and one rank's frame of a
 * bucket, written and scanned in one call (docs/wire-format.md, "Bucket frame"): the per-payload
 * header work of the bucket path without a Python round trip per tensor. The frame and payload layouts are hvdcompress/wire.py's;
 * this file mirrors them, and tests/test_compress_bucket.py and
 * tests/fuzz/test_frame_mutations.py check the two against each
 * other byte for byte (writing) and verdict for verdict (scanning, fuzzed).
 *
 * The CUDA twin is kernels/frame.cu: the checksum kernels, and the scan, for frames
 * gathered on a GPU, in its section 3 (tests/gpu/test_buckets_gpu.py compares the two
 * report for report); frames are written
 * on the device by the bucket encoders and hvd_checksum_store. Pure functions over
 * caller-owned buffers.
 *
 * Memory traffic: write copies each body once and reads it once more for the checksum
 * (2 B per body byte, header bytes negligible); scan reads each payload once (1 B per
 * byte, the checksum), headers aside.
 */
#include <stdint.h>
#include <string.h>

/* ---- The payload checksum (wire.py's; the CUDA twin: frame.cu sections 1 and 2) ---- */

#define FRAME_GOLDEN 0x9E3779B97F4A7C15ull /* the checksum's mix multiplier (wire.py) */

/* AVX-512 and AVX2 versions of the portable lanes, picked at load time by the CPU. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FRAME_VECTOR __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define FRAME_VECTOR
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FRAME_X86_PATHS 1
static int frame_use_avx2;

__attribute__((constructor)) static void frame_init_x86_paths(void) {
    __builtin_cpu_init();
    frame_use_avx2 = __builtin_cpu_supports("avx2");
}
#endif

/* The payload checksum in 64-bit lanes (the portable path): the 64-bit product
 * (offset + j) * golden advances by golden each byte (an induction variable, modulo 2^64
 * like the product), so no lane multiplies 64-bit numbers. */
FRAME_VECTOR static uint32_t checksum_lanes64(const uint8_t *buf, int64_t len, uint64_t offset) {
    uint32_t sum = 0;
    uint64_t product = offset * FRAME_GOLDEN; /* modulo 2^64: offsets wrap, never overflow */
    for (int64_t j = 0; j < len; j++) {
        sum += (uint32_t)(buf[j] + 1) * ((uint32_t)(product >> 32) | 1u);
        product += FRAME_GOLDEN;
    }
    return sum;
}

#ifdef FRAME_X86_PATHS
/* The AVX2 checksum: eight positions per vector with the 64-bit product kept as two 32-bit
 * lanes (low, high) and the carry of the low add taken by an unsigned compare, so that
 * every multiply is a 32-bit one (AVX2 has no 64-bit lane multiply, and 64-bit lanes hold
 * only four positions). Two vectors of positions (sixteen bytes) a step, each stepping by
 * 16 golden, so that the two chains of the product's update (add, compare, subtract) run
 * side by side (one vector a step: 0.77 ms for 1.56 MB). Integer math mod 2^32: the same
 * sum as checksum_lanes64. */
__attribute__((target("avx2"))) static uint32_t checksum_avx2(const uint8_t *buf, int64_t len,
                                                              uint64_t offset) {
    const int64_t vec = len / 16 * 16;
    uint32_t sum = 0;
    if (vec > 0) {
        uint32_t lo0[16], hi0[16];
        for (int k = 0; k < 16; k++) {
            const uint64_t p = (offset + (uint64_t)k) * FRAME_GOLDEN;
            lo0[k] = (uint32_t)p;
            hi0[k] = (uint32_t)(p >> 32);
        }
        const uint64_t step = 16 * FRAME_GOLDEN;
        const __m256i step_lo = _mm256_set1_epi32((int)(uint32_t)step);
        const __m256i step_hi = _mm256_set1_epi32((int)(uint32_t)(step >> 32));
        const __m256i flip = _mm256_set1_epi32((int)0x80000000u); /* unsigned compare */
        const __m256i step_lo_flipped = _mm256_xor_si256(step_lo, flip);
        const __m256i one = _mm256_set1_epi32(1);
        __m256i lo[2], hi[2], acc[2];
        for (int h = 0; h < 2; h++) {
            lo[h] = _mm256_loadu_si256((const __m256i *)(const void *)(lo0 + 8 * h));
            hi[h] = _mm256_loadu_si256((const __m256i *)(const void *)(hi0 + 8 * h));
            acc[h] = _mm256_setzero_si256();
        }
        for (int64_t j = 0; j < vec; j += 16) {
            for (int h = 0; h < 2; h++) {
                const __m256i b = _mm256_cvtepu8_epi32(
                    _mm_loadl_epi64((const __m128i *)(const void *)(buf + j + 8 * h)));
                const __m256i weight = _mm256_or_si256(hi[h], one);
                acc[h] = _mm256_add_epi32(acc[h],
                                          _mm256_mullo_epi32(_mm256_add_epi32(b, one), weight));
                /* product += 16 golden: low add, carry = (new low < step low) unsigned */
                lo[h] = _mm256_add_epi32(lo[h], step_lo);
                const __m256i carry = _mm256_cmpgt_epi32(
                    step_lo_flipped, _mm256_xor_si256(lo[h], flip)); /* -1 or 0 */
                hi[h] = _mm256_sub_epi32(_mm256_add_epi32(hi[h], step_hi), carry);
            }
        }
        uint32_t lanes[8];
        _mm256_storeu_si256((__m256i *)(void *)lanes, _mm256_add_epi32(acc[0], acc[1]));
        for (int k = 0; k < 8; k++) sum += lanes[k];
    }
    return sum + checksum_lanes64(buf + vec, len - vec, offset + (uint64_t)vec);
}
#endif

/* Payload checksum of buf[0..len) placed at payload position offset (see wire.py):
 * sum of (b + 1) * mix(offset + j) modulo 2^32 (integer sums in any order: vectorised). */
uint32_t hvdc_checksum(const uint8_t *buf, int64_t len, int64_t offset) {
#ifdef FRAME_X86_PATHS
    if (frame_use_avx2) return checksum_avx2(buf, len, (uint64_t)offset);
#endif
    return checksum_lanes64(buf, len, (uint64_t)offset);
}

/* The checksums of `count` payloads inside one buffer (a bucket's frame): out[p] is
 * hvdc_checksum(buf + starts[p], lens[p], 0). One call per bucket instead of per payload. */
void hvdc_checksum_segments(const uint8_t *buf, int64_t count, const int64_t *starts,
                            const int64_t *lens, uint32_t *out) {
    for (int64_t p = 0; p < count; p++) out[p] = hvdc_checksum(buf + starts[p], lens[p], 0);
}

/* ---- Frames ---- */


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
