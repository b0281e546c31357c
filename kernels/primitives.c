/* Shared primitives of the codecs (docs/codecs.md, "DQSG and NDQSG" and docs/baselines.md) on the
 * CPU, loaded through ctypes (hvdcompress/backends/cpu/); the CUDA twin is primitives.cu next to
 * this file, byte for byte the same. signSGD, EF-signSGD, QSGD, TernGrad and DQSG run as
 * single-pass native codecs (sign.c, quant.c), which draw their uniforms from
 * hvdc_prim_uniform below; the other codecs' element-wise math runs as torch ops
 * (identical on the CPU and on CUDA: each op is one IEEE-rounded operation), and what
 * torch cannot do identically on both devices lives here:
 *
 *   hvdc_prim_uniform     counter-based uniforms: SplitMix64 output number offset + i + 1
 *                         of the stream seeded with `key`, top 24 bits, times 2^-24
 *                         (exact in float32, in [0, 1));
 *   hvdc_prim_hash24      those top 24 bits as integers (random-k compares them);
 *   hvdc_prim_bitpack     fixed-width bit packing, LSB first: value i occupies bits
 *                         [i b, i b + b) of the little-endian bit stream, padding zero;
 *   hvdc_prim_bitunpack   the inverse, rejecting a wrong length or non-zero padding;
 *   hvdc_prim_add_rows    four staged rows of doubles added to four sums side by side
 *   hvdc_prim_chunk_sums  per-chunk sums of |x| or x^2 in double, accumulated strictly
 *                         left to right (an order-fixed, hence device-independent, sum);
 *   hvdc_prim_nonfinite   whether a float32, float16 or bfloat16 array holds a NaN or an
 *                         Inf (all exponent bits set): the public decode's overflow check.
 *
 * Pure functions over caller-owned buffers; no allocation, no global state. Built with
 * -ffp-contract=off and without fast-math (C_FLAGS in hvdcompress/_native.py): s += v * v
 * is a product, then a sum.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PRIM_GOLDEN 0x9E3779B97F4A7C15ull

/* An AVX-512 version of the uniform loop (64-bit lane multiplies), picked at load time by
 * the CPU, else the scalar loop: AVX2 has no 64-bit multiply, and its emulation (three
 * 32-bit products per 64-bit one) ran 1.6x slower than scalar code on an AVX2 machine
 * (1e7 uniforms: 29-31 ms vs 17-18 ms, AMD EPYC family 23). Running an SSE2 emulation
 * beside the scalar hashes (four of each a step) gained only 16% there (1.22 -> 1.02 ns a
 * value in L1), not worth a second code path. Integer math and one exact float product,
 * so the bytes do not change. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PRIM_VECTOR __attribute__((target_clones("arch=x86-64-v4", "default")))
#else
#define PRIM_VECTOR
#endif
#define PRIM_ERR_LENGTH -1  /* the packed body does not have ceil(n b / 8) bytes */
#define PRIM_ERR_PADDING -4 /* a padding bit after the last value is set */

/* The top 24 bits of SplitMix64's output function (Steele, Lea, Flood 2014) of z:
 * mix64(z) = z2 ^ (z2 >> 31) with z2 = (z1 ^ (z1 >> 27)) * C2, z1 = (z ^ (z >> 30)) * C1,
 * and bits 40..63 of z2 >> 31 are bits 71..94 of z2, which are zero: the top 24 bits of
 * mix64(z) are those of z2, and the last xor-shift is skipped. */
static inline uint32_t prim_mix64_top24(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (uint32_t)(z >> 40);
}

#define PRIM_UNIFORM_CHUNK 512 /* uniforms staged as integers (2 KB, in L1) */

/* r[i] = mix64(key + (offset + i + 1) * golden) >> 40, i < n: the uniforms' 24-bit
 * integers (u_i = r_i 2^-24, so u_i < T 2^-24 exactly when r_i < T: random-k compares
 * these, kernels/sparse.c). Four independent hashes an iteration; the counter advances
 * by additions of golden. */
PRIM_VECTOR void hvdc_prim_hash24(uint64_t key, int64_t offset, int64_t n, uint32_t *r) {
    uint64_t z = key + ((uint64_t)offset + 1u) * PRIM_GOLDEN;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        r[i] = prim_mix64_top24(z);
        r[i + 1] = prim_mix64_top24(z + PRIM_GOLDEN);
        r[i + 2] = prim_mix64_top24(z + 2 * PRIM_GOLDEN);
        r[i + 3] = prim_mix64_top24(z + 3 * PRIM_GOLDEN);
        z += 4 * PRIM_GOLDEN;
    }
    for (; i < n; i++) {
        r[i] = prim_mix64_top24(z);
        z += PRIM_GOLDEN;
    }
}

/* out[i] = (mix64(key + (offset + i + 1) * golden) >> 40) * 2^-24, i < n: the integers of
 * hvdc_prim_hash24, a chunk at a time, then converted by a second, vectorised loop (the
 * conversion no longer sits between the hash's multiplies, which bound the time on a
 * machine without 64-bit vector multiplies). */
PRIM_VECTOR void hvdc_prim_uniform(uint64_t key, int64_t offset, int64_t n, float *out) {
    uint32_t r[PRIM_UNIFORM_CHUNK];
    for (int64_t lo = 0; lo < n; lo += PRIM_UNIFORM_CHUNK) {
        const int64_t len = n - lo < PRIM_UNIFORM_CHUNK ? n - lo : PRIM_UNIFORM_CHUNK;
        hvdc_prim_hash24(key, offset + lo, len, r);
        for (int64_t i = 0; i < len; i++) out[lo + i] = (float)(int32_t)r[i] * 0x1p-24f;
    }
}

/* Packs `groups` groups of eight codes (their low `bits` bits) into bits bytes per group, LSB
 * first: group g fills dst[bits g .. bits g + bits). The last 4 groups are stored byte by
 * byte, the others as one 8-byte word that the following groups overwrite (4 groups of at
 * least 2 bytes cover a word's spill). */
static inline __attribute__((always_inline)) void prim_pack_groups_of(const uint8_t *codes,
                                                                      int64_t groups, int bits,
                                                                      uint8_t *dst) {
    const uint8_t mask = (uint8_t)((1u << bits) - 1u); /* the bits above are ignored */
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *c = codes + 8 * g;
        uint64_t acc = 0;
        for (int k = 0; k < 8; k++) acc |= (uint64_t)(c[k] & mask) << (k * bits);
        if (g + 4 < groups) {
            memcpy(dst + g * bits, &acc, sizeof acc);
        } else {
            for (int k = 0; k < bits; k++) dst[g * bits + k] = (uint8_t)(acc >> (8 * k));
        }
    }
}

/* prim_pack_groups_of with `bits` a constant in each case: the shifts become immediates. */
static void prim_pack_groups(const uint8_t *codes, int64_t groups, int bits, uint8_t *dst) {
    switch (bits) {
    case 2: prim_pack_groups_of(codes, groups, 2, dst); break;
    case 3: prim_pack_groups_of(codes, groups, 3, dst); break;
    case 4: prim_pack_groups_of(codes, groups, 4, dst); break;
    case 5: prim_pack_groups_of(codes, groups, 5, dst); break;
    case 6: prim_pack_groups_of(codes, groups, 6, dst); break;
    case 7: prim_pack_groups_of(codes, groups, 7, dst); break;
    default: prim_pack_groups_of(codes, groups, bits, dst); break;
    }
}

/* Unpacks `groups` groups of eight codes of `bits` bits from src (bits bytes a group). */
static inline __attribute__((always_inline)) void prim_unpack_groups_of(const uint8_t *src,
                                                                        int64_t groups,
                                                                        int bits,
                                                                        uint8_t *codes) {
    const uint64_t mask = (1ull << bits) - 1ull;
    for (int64_t g = 0; g < groups; g++) {
        uint64_t acc = 0;
        if (g + 4 < groups) {
            memcpy(&acc, src + g * bits, sizeof acc);
        } else {
            for (int k = 0; k < bits; k++) acc |= (uint64_t)src[g * bits + k] << (8 * k);
        }
        for (int k = 0; k < 8; k++) codes[8 * g + k] = (uint8_t)((acc >> (k * bits)) & mask);
    }
}

/* prim_unpack_groups_of with `bits` a constant in each case: the shifts become immediates. */
static void prim_unpack_groups(const uint8_t *src, int64_t groups, int bits, uint8_t *codes) {
    switch (bits) {
    case 2: prim_unpack_groups_of(src, groups, 2, codes); break;
    case 3: prim_unpack_groups_of(src, groups, 3, codes); break;
    case 4: prim_unpack_groups_of(src, groups, 4, codes); break;
    case 5: prim_unpack_groups_of(src, groups, 5, codes); break;
    case 6: prim_unpack_groups_of(src, groups, 6, codes); break;
    case 7: prim_unpack_groups_of(src, groups, 7, codes); break;
    default: prim_unpack_groups_of(src, groups, bits, codes); break;
    }
}

/* The SSSE3 unpack: sixteen codes (two groups, 2 bits bytes) from one 16-byte load. Code k
 * starts at bit k bits, in byte lo = k bits / 8 at shift k bits % 8, and ends in byte lo or
 * lo + 1 (bits <= 8), at most byte 15. One pshufb per eight codes puts bytes lo and lo + 1
 * in a 16-bit lane; a multiply by 2^(16 - shift - bits) moves the code to the lane's top
 * (the lane keeps its low 16 bits), a shift right by 16 - bits brings it down, and a pack
 * narrows the sixteen lanes to bytes. prim_unpack_rows[bits] holds the controls and
 * multipliers, built at load time; the codes are those of prim_unpack_groups_of. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PRIM_X86_PATHS 1

typedef struct {
    uint8_t shuffle[2][16]; /* codes 0..7 and 8..15 of a 16-code chunk */
    int16_t multiplier[2][8];
} prim_unpack_row;
static prim_unpack_row prim_unpack_rows[9];
static int prim_use_ssse3;

__attribute__((constructor)) static void prim_init_x86_paths(void) {
    for (int bits = 1; bits <= 8; bits++) {
        prim_unpack_row *row = &prim_unpack_rows[bits];
        for (int k = 0; k < 16; k++) {
            const int lo = k * bits / 8, shift = k * bits % 8;
            row->shuffle[k / 8][2 * (k % 8)] = (uint8_t)lo;
            row->shuffle[k / 8][2 * (k % 8) + 1] = lo + 1 < 16 ? (uint8_t)(lo + 1) : 0x80;
            row->multiplier[k / 8][k % 8] = (int16_t)(1 << (16 - shift - bits));
        }
    }
    __builtin_cpu_init();
    prim_use_ssse3 = __builtin_cpu_supports("ssse3");
}

/* The SSSE3 pack of sixteen codes (two groups) below 2^bits, bits <= 6: a multiply-add of
 * byte pairs (c0 + c1 2^bits in a 16-bit lane), one of 16-bit pairs (four codes in a
 * 32-bit lane, 4 bits bits), the upper 32-bit half of each 64-bit lane shifted down
 * next to the lower one (eight codes, bits bytes), and a pshufb that closes the gap
 * between the two groups. The store writes 16 bytes; the next pair overwrites the 16 -
 * 2 bits beyond. Returns the number of groups packed (even), those whose 16-byte store
 * stays inside the `groups` groups of dst. */
__attribute__((target("ssse3"))) static int64_t prim_pack_pairs_ssse3(const uint8_t *codes,
                                                                       int64_t groups,
                                                                       int bits,
                                                                       uint8_t *dst) {
    if (bits > 6) return 0; /* 2^bits must be a positive int8 multiplier */
    const __m128i pair_mul = _mm_set1_epi16((int16_t)(1 | (1 << (bits + 8))));
    const __m128i quad_mul = _mm_set1_epi32(1 | (1 << (2 * bits + 16)));
    const __m128i low_half = _mm_set1_epi64x(0xffffffff);
    const __m128i up = _mm_cvtsi32_si128(32 - 4 * bits);
    const __m128i low = _mm_set1_epi8((char)((1 << bits) - 1)); /* the bits above: ignored */
    uint8_t ctrl[16];
    for (int k = 0; k < 16; k++) /* group 0: bytes 0.., group 1: bytes 8.., then zeros */
        ctrl[k] = k < bits ? (uint8_t)k : k < 2 * bits ? (uint8_t)(8 + k - bits) : 0x80;
    const __m128i close = _mm_loadu_si128((const __m128i *)ctrl);
    int64_t g = 0;
    for (; g * bits + 16 <= groups * bits; g += 2) {
        const __m128i c = _mm_and_si128(_mm_loadu_si128((const __m128i *)(codes + 8 * g)), low);
        const __m128i quads = _mm_madd_epi16(_mm_maddubs_epi16(c, pair_mul), quad_mul);
        const __m128i eights = _mm_or_si128(_mm_and_si128(quads, low_half),
                                            _mm_srl_epi64(_mm_andnot_si128(low_half, quads), up));
        _mm_storeu_si128((__m128i *)(dst + g * bits), _mm_shuffle_epi8(eights, close));
    }
    return g;
}

/* prim_unpack_groups for the pairs of groups whose 16-byte load stays inside the `groups`
 * groups of src; returns the number of groups unpacked (even). */
__attribute__((target("ssse3"))) static int64_t prim_unpack_pairs_ssse3(const uint8_t *src,
                                                                         int64_t groups,
                                                                         int bits,
                                                                         uint8_t *codes) {
    const prim_unpack_row *row = &prim_unpack_rows[bits];
    const __m128i lo_ctrl = _mm_loadu_si128((const __m128i *)row->shuffle[0]);
    const __m128i hi_ctrl = _mm_loadu_si128((const __m128i *)row->shuffle[1]);
    const __m128i lo_mul = _mm_loadu_si128((const __m128i *)row->multiplier[0]);
    const __m128i hi_mul = _mm_loadu_si128((const __m128i *)row->multiplier[1]);
    const __m128i down = _mm_cvtsi32_si128(16 - bits);
    int64_t g = 0;
    for (; g * bits + 16 <= groups * bits; g += 2) { /* 2 bits <= 16: both groups inside */
        const __m128i in = _mm_loadu_si128((const __m128i *)(src + g * bits));
        __m128i a = _mm_mullo_epi16(_mm_shuffle_epi8(in, lo_ctrl), lo_mul);
        __m128i b = _mm_mullo_epi16(_mm_shuffle_epi8(in, hi_ctrl), hi_mul);
        a = _mm_srl_epi16(a, down);
        b = _mm_srl_epi16(b, down);
        _mm_storeu_si128((__m128i *)(codes + 8 * g), _mm_packus_epi16(a, b));
    }
    return g;
}
#endif

/* Packs `groups` groups of eight codes below 2^bits into bits bytes each at dst: the
 * SSSE3 path where the CPU has it and bits <= 6, else (and near the end) the portable
 * one. */
static void prim_pack(const uint8_t *codes, int64_t groups, int bits, uint8_t *dst,
                       int portable) {
    int64_t done = 0;
#ifdef PRIM_X86_PATHS
    if (prim_use_ssse3 && !portable) done = prim_pack_pairs_ssse3(codes, groups, bits, dst);
#else
    (void)portable;
#endif
    prim_pack_groups(codes + 8 * done, groups - done, bits, dst + done * bits);
}

/* Test hook: prim_pack, SSSE3 (portable == 0) or portable. */
void hvdc_prim_pack_groups(const uint8_t *codes, int64_t groups, int bits, uint8_t *dst,
                            int portable) {
    prim_pack(codes, groups, bits, dst, portable);
}

/* Unpacks `groups` groups of eight codes of `bits` bits (bits bytes a group) from src:
 * the SSSE3 path where the CPU has it, the portable one (and the portable one for the
 * groups near the end, where a 16-byte load would pass the last group). */
static void prim_unpack(const uint8_t *src, int64_t groups, int bits, uint8_t *codes,
                         int portable) {
    int64_t done = 0;
#ifdef PRIM_X86_PATHS
    if (prim_use_ssse3 && !portable) done = prim_unpack_pairs_ssse3(src, groups, bits, codes);
#else
    (void)portable;
#endif
    prim_unpack_groups(src + done * bits, groups - done, bits, codes + 8 * done);
}

/* Test hook: prim_unpack, its SSSE3 path (portable == 0, where the CPU has it) or its
 * portable one; tests/test_quantizers.py compares both with the reference bit unpack. */
void hvdc_prim_unpack_groups(const uint8_t *src, int64_t groups, int bits, uint8_t *codes,
                              int portable) {
    prim_unpack(src, groups, bits, codes, portable);
}

/* Pack n codes of `bits` (1..8) bits each into ceil(n bits / 8) bytes, LSB first. Bits
 * of a code above `bits` are ignored. Whole groups of eight codes (bits bytes each) go
 * through prim_pack (2 <= bits <= 7), the last n % 8 codes through one word. */
void hvdc_prim_bitpack(const uint8_t *codes, int64_t n, int bits, uint8_t *out) {
    if (bits == 8) {
        if (n > 0) memcpy(out, codes, (size_t)n); /* an empty tensor may pass NULL buffers */
        return;
    }
    const uint32_t mask = (1u << bits) - 1u;
    int64_t i = 0, o = 0;
    if (bits >= 2) {
        const int64_t groups = n / 8;
        prim_pack(codes, groups, bits, out, 0);
        i = 8 * groups;
        o = bits * groups;
    }
    uint64_t acc = 0;
    int have = 0;
    for (; i < n; i++) {
        acc |= (uint64_t)(codes[i] & mask) << have;
        have += bits;
        if (have >= 32) {
            out[o] = (uint8_t)acc;
            out[o + 1] = (uint8_t)(acc >> 8);
            out[o + 2] = (uint8_t)(acc >> 16);
            out[o + 3] = (uint8_t)(acc >> 24);
            o += 4;
            acc >>= 32;
            have -= 32;
        }
    }
    while (have > 0) {
        out[o++] = (uint8_t)acc;
        acc >>= 8;
        have -= 8;
    }
}

/* Unpack n codes of `bits` bits from in[0..nbytes). Returns 0, PRIM_ERR_LENGTH or
 * PRIM_ERR_PADDING (codes untouched on error). Whole groups through prim_unpack
 * (2 <= bits <= 7), the rest code by code. */
int64_t hvdc_prim_bitunpack(const uint8_t *in, int64_t nbytes, int64_t n, int bits,
                            uint8_t *codes) {
    const int64_t used = n * bits;
    if (nbytes != (used + 7) / 8) return PRIM_ERR_LENGTH;
    if ((used & 7) && (in[nbytes - 1] >> (used & 7))) return PRIM_ERR_PADDING;
    if (bits == 8) {
        if (n > 0) memcpy(codes, in, (size_t)n); /* an empty tensor may pass NULL buffers */
        return 0;
    }
    const uint32_t mask = (1u << bits) - 1u;
    int64_t i = 0, j = 0;
    if (bits >= 2) {
        const int64_t groups = n / 8;
        prim_unpack(in, groups, bits, codes, 0);
        i = 8 * groups;
        j = bits * groups;
    }
    uint64_t acc = 0;
    int have = 0;
    for (; i < n; i++) {
        if (have < bits) {
            acc |= (uint64_t)in[j++] << have;
            have += 8;
        }
        codes[i] = (uint8_t)(acc & mask);
        acc >>= bits;
        have -= bits;
    }
    return 0;
}

/* out[c] = sum over i in chunk c (chunk elements, the last one may be short) of |x_i|
 * (square == 0) or x_i^2 (square != 0), in double, left to right. */
void hvdc_prim_chunk_sums(const float *x, int64_t n, int64_t chunk, int square, double *out) {
    int64_t chunks = (n + chunk - 1) / chunk;
    for (int64_t c = 0; c < chunks; c++) {
        int64_t lo = c * chunk, hi = lo + chunk < n ? lo + chunk : n;
        double s = 0.0;
        if (square) {
            for (int64_t i = lo; i < hi; i++) {
                double v = (double)x[i];
                s += v * v;
            }
        } else {
            for (int64_t i = lo; i < hi; i++) s += fabs((double)x[i]);
        }
        out[c] = s;
    }
}

/* s[l] += rows[l * stride + i] for i < n[l], left to right, for each of the lanes (<= 4)
 * rows of a staged block: the order-fixed chunk sums of sign.c and quant.c, whose
 * vectorised passes stage four chunks' terms as doubles in padded rows. With four rows of
 * one length the four chains of dependent additions run side by side, overlapping their
 * latencies; each lane's sum is the same either way. */
void hvdc_prim_add_rows(const double *rows, int64_t stride, const int64_t *n, int64_t lanes,
                        double *s) {
    if (lanes == 4 && n[3] == n[0]) {
        const double *r0 = rows, *r1 = rows + stride, *r2 = rows + 2 * stride,
                     *r3 = rows + 3 * stride;
        double s0 = s[0], s1 = s[1], s2 = s[2], s3 = s[3];
        for (int64_t i = 0; i < n[0]; i++) {
            s0 += r0[i];
            s1 += r1[i];
            s2 += r2[i];
            s3 += r3[i];
        }
        s[0] = s0, s[1] = s1, s[2] = s2, s[3] = s3;
        return;
    }
    for (int64_t l = 0; l < lanes; l++)
        for (int64_t i = 0; i < n[l]; i++) s[l] += rows[l * stride + i];
}

/* 1 when some element of the n floats at x is a NaN or an Inf, else 0: an element of `width`
 * bytes (4: float32, 2: float16 or bfloat16) whose bits hold every bit of `exponent` (the
 * format's exponent field: 0x7f800000, 0x7c00, 0x7f80). One read pass at memory speed:
 * blocks of PRIM_FINITE_BLOCK elements are or-reduced without a branch (vectorised), and
 * the loop stops after the first block with a hit. The public decode into a new tensor
 * (hvdcompress/compressors/receive.py checked_cast) asks this of every decoded tensor. */
#define PRIM_FINITE_BLOCK 4096
PRIM_VECTOR int64_t hvdc_prim_nonfinite(const void *x, int64_t n, int width, uint32_t exponent) {
    if (width == 4) {
        const uint32_t *v = (const uint32_t *)x;
        for (int64_t lo = 0; lo < n; lo += PRIM_FINITE_BLOCK) {
            int64_t hi = n - lo < PRIM_FINITE_BLOCK ? n : lo + PRIM_FINITE_BLOCK;
            uint32_t hit = 0;
            for (int64_t i = lo; i < hi; i++) hit |= (v[i] & exponent) == exponent;
            if (hit) return 1;
        }
        return 0;
    }
    const uint16_t *v = (const uint16_t *)x;
    const uint16_t e = (uint16_t)exponent;
    for (int64_t lo = 0; lo < n; lo += PRIM_FINITE_BLOCK) {
        int64_t hi = n - lo < PRIM_FINITE_BLOCK ? n : lo + PRIM_FINITE_BLOCK;
        uint16_t hit = 0;
        for (int64_t i = lo; i < hi; i++) hit |= (uint16_t)((v[i] & e) == e);
        if (hit) return 1;
    }
    return 0;
}
