/* Shared primitives of the codecs (docs/design.md sections 3 and 4) on the CPU, loaded
 * through ctypes (hvdcompress/backends/cpu.py); the CUDA twin is primitives.cu next to
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
 *                         left to right (an order-fixed, hence device-independent, sum).
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

/* Pack n codes of `bits` (1..8) bits each into ceil(n bits / 8) bytes, LSB first. Bits
 * of a code above `bits` are ignored. */
void hvdc_prim_bitpack(const uint8_t *codes, int64_t n, int bits, uint8_t *out) {
    const uint32_t mask = (1u << bits) - 1u;
    uint64_t acc = 0;
    int have = 0;
    int64_t o = 0;
    if (bits == 8) {
        memcpy(out, codes, (size_t)n);
        return;
    }
    for (int64_t i = 0; i < n; i++) {
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
 * PRIM_ERR_PADDING (codes untouched on error). */
int64_t hvdc_prim_bitunpack(const uint8_t *in, int64_t nbytes, int64_t n, int bits,
                            uint8_t *codes) {
    const int64_t used = n * bits;
    if (nbytes != (used + 7) / 8) return PRIM_ERR_LENGTH;
    if ((used & 7) && (in[nbytes - 1] >> (used & 7))) return PRIM_ERR_PADDING;
    if (bits == 8) {
        memcpy(codes, in, (size_t)n);
        return 0;
    }
    const uint32_t mask = (1u << bits) - 1u;
    uint64_t acc = 0;
    int have = 0;
    int64_t j = 0;
    for (int64_t i = 0; i < n; i++) {
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
