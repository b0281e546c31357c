// Stochastic quantisers QSGD, TernGrad and DQSG (docs/codecs.md, "DQSG and NDQSG"): the CUDA
// twin of kernels/quant.c (CPU backend), byte for byte the same (random-k's and GSpar's
// buckets, which draw from the same uniforms, are in kernels/sparse.cu); formulas in
// hvdcompress/codecs/quant.py's module docstring, one IEEE float32 operation each
// (__fdiv_rn & co., never contracted).
//
// Compiled three ways from this one file, like kernels/threelc.cu: by NVRTC through
// hvdcompress/backends/cuda/ (NVRTC_OPTIONS of hvdcompress/_native.py), by nvcc in
// scripts/check_kernels.sh, and by g++ for the host through kernels/cuda_host.h
// (tests/host_kernels/). Hence plain C-like code, no #include under CUDA, no barriers or
// shared memory, no code that needs two threads at once.
//
// Names: kernels quant_<op>, helpers hvd_quant_* (the host build compiles every .cu file in
// one unit). Every index is 64-bit. Every kernel is a grid-stride loop, so any grid size is
// correct; the backend launches 256 threads per block and at most 8 blocks per
// multiprocessor.
//
// Packed codes of `bits` bits: eight consecutive codes fill exactly `bits` bytes, so one
// thread per group of eight elements owns its bytes (no two threads write one byte).
//
// `state` is the zeroed 8-word uint32 array of threelc.cu; word 2 (non-finite flag) and
// word 3 (error bits) are used here, with atomicOr.
#define HVD_QUANT_ST_NONFINITE 2
#define HVD_QUANT_ST_ERROR 3
#define HVD_QUANT_ERR_PADDING 4u  // a padding bit after the last packed value is set
#define HVD_QUANT_ERR_NORM 32u    // a norm is negative or not finite
#define HVD_QUANT_ERR_CODE 64u    // a level above s, or a zero level with the sign bit
#define HVD_QUANT_NONFINITE_BITS 0x7f800000u

#ifndef __CUDACC__
#include "cuda_host.h"
#define hvd_quant_dadd(a, b) ((a) + (b))
#define hvd_quant_dmul(a, b) ((a) * (b))
#define hvd_quant_dsqrt(a) sqrt(a)
#else
#define hvd_quant_dadd(a, b) __dadd_rn((a), (b))
#define hvd_quant_dmul(a, b) __dmul_rn((a), (b))
#define hvd_quant_dsqrt(a) __dsqrt_rn(a)
#endif

__device__ __forceinline__ long long hvd_quant_first_index()
{
    return (long long)blockIdx.x * (long long)blockDim.x + (long long)threadIdx.x;
}

__device__ __forceinline__ long long hvd_quant_grid_stride()
{
    return (long long)gridDim.x * (long long)blockDim.x;
}

// The counter-based uniform of element i (kernels/primitives.cu, primitives_uniform):
// SplitMix64 output number i + 1 of the stream seeded with key, top 24 bits, times 2^-24.
__device__ __forceinline__ float hvd_quant_uniform(unsigned long long key, long long i)
{
    unsigned long long z = key + ((unsigned long long)i + 1ull) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z = z ^ (z >> 31);
    return __fmul_rn((float)(unsigned int)(z >> 40), 5.9604644775390625e-08f);  // 2^-24
}

__device__ __forceinline__ float hvd_quant_load_f32(const unsigned char* p)
{
    const unsigned int u = (unsigned int)p[0] | ((unsigned int)p[1] << 8) |
                           ((unsigned int)p[2] << 16) | ((unsigned int)p[3] << 24);
    return __uint_as_float(u);
}

// The per-bucket and per-group math, shared by the one-tensor kernels and the bucket
// kernels of section 9. A group is eight consecutive elements, whose `bits`-bit codes
// fill exactly `bits` bytes from byte g * bits of the packed codes.

// QSGD's norm of bucket b: float32(sqrt(sum of x_i^2)), the sum in double left to right.
__device__ __forceinline__ float hvd_qsgd_norm(const float* x, long long n, long long b,
                                               long long bucket)
{
    const long long lo = b * bucket;
    const long long hi = lo + bucket < n ? lo + bucket : n;
    double sum = 0.0;
    for (long long i = lo; i < hi; ++i) {
        const double v = (double)x[i];
        sum = hvd_quant_dadd(sum, hvd_quant_dmul(v, v));
    }
    return (float)hvd_quant_dsqrt(sum);
}

__device__ __forceinline__ bool hvd_quant_nonfinite(float v)
{
    return (__float_as_uint(v) & 0x7fffffffu) >= HVD_QUANT_NONFINITE_BITS;
}

// Group g's packed codes, the low `bits` bits of each a code (up to 64 bits).
__device__ __forceinline__ unsigned long long hvd_qsgd_load_group(const unsigned char* packed,
                                                                  long long g, int bits,
                                                                  long long nbytes)
{
    unsigned long long acc = 0ull;
    const long long first_byte = g * (long long)bits;
    for (int k = 0; k < bits && first_byte + k < nbytes; ++k)
        acc |= (unsigned long long)packed[first_byte + k] << (8 * k);
    return acc;
}

// QSGD's codes of group g: r = (|x| / norm) * s + u (norm 1 where it is 0),
// l = min(floor(r), s), code = 2 l + (x < 0 and l > 0), packed LSB first.
__device__ __forceinline__ void hvd_qsgd_encode_group(const float* x, long long n, long long g,
                                                      int levels, int bits, long long bucket,
                                                      unsigned long long key,
                                                      const float* norms,
                                                      unsigned char* packed)
{
    const long long lo = 8ll * g;
    const long long hi = lo + 8 < n ? lo + 8 : n;
    const float levels_f = (float)levels;
    unsigned long long acc = 0ull;
    for (long long i = lo; i < hi; ++i) {
        const float norm = norms[i / bucket];
        const float safe = norm > 0.0f ? norm : 1.0f;
        const float v = x[i];
        const float r = __fadd_rn(__fmul_rn(__fdiv_rn(fabsf(v), safe), levels_f),
                                  hvd_quant_uniform(key, i));
        // r >= 0: truncation is floor; compared as a float first (no int overflow)
        const int l = r < levels_f ? (int)r : levels;
        const unsigned long long code =
            (unsigned long long)(2 * l + ((v < 0.0f && l > 0) ? 1 : 0));
        acc |= code << (unsigned int)((i - lo) * bits);
    }
    const long long nbytes = (n * (long long)bits + 7) / 8;
    const long long first_byte = g * (long long)bits;
    for (int k = 0; k < bits && first_byte + k < nbytes; ++k)
        packed[first_byte + k] = (unsigned char)(acc >> (8 * k));
}

// The check of unit u of a body of float32s per bucket, then `bits`-bit codes (QSGD's
// norms and codes, or with `dqsg` DQSG's deltas and codes q + s): float u (u < nb) finite
// and >= 0 (HVD_QUANT_ERR_NORM), the codes of group u (u < groups) valid
// (HVD_QUANT_ERR_CODE: QSGD, a level above s or a signed zero; DQSG, a code above 2 s),
// and for unit 0 the padding bits zero (HVD_QUANT_ERR_PADDING).
__device__ __forceinline__ unsigned int hvd_packed_check_unit(const unsigned char* body,
                                                              long long n, long long u,
                                                              int levels, int bits,
                                                              long long bucket, int dqsg)
{
    const long long nb = (n + bucket - 1) / bucket;
    const long long groups = (n + 7) / 8;
    const unsigned char* packed = body + 4ll * nb;
    const long long used = n * (long long)bits;
    const long long nbytes = (used + 7) / 8;
    unsigned int err = 0u;
    if (u == 0 && (used & 7ll) &&
        ((unsigned int)packed[nbytes - 1] >> (unsigned int)(used & 7ll)))
        err |= HVD_QUANT_ERR_PADDING;
    if (u < nb) {
        const float norm = hvd_quant_load_f32(body + 4ll * u);
        if (!(norm >= 0.0f) || hvd_quant_nonfinite(norm)) err |= HVD_QUANT_ERR_NORM;
    }
    if (u < groups) {
        const long long lo = 8ll * u;
        const long long hi = lo + 8 < n ? lo + 8 : n;
        const unsigned long long acc = hvd_qsgd_load_group(packed, u, bits, nbytes);
        const unsigned long long mask = (1ull << bits) - 1ull;
        for (long long i = lo; i < hi; ++i) {
            const unsigned int code =
                (unsigned int)((acc >> (unsigned int)((i - lo) * bits)) & mask);
            const bool bad = dqsg ? (long long)code > 2ll * levels
                                  : ((int)(code >> 1) > levels || code == 1u);
            if (bad) err |= HVD_QUANT_ERR_CODE;
        }
    }
    return err;
}

// QSGD decode of group g of a checked body: out = +-((l / s) * norm), or out += that.
__device__ __forceinline__ void hvd_qsgd_decode_group(const unsigned char* body, long long n,
                                                      long long g, int levels, int bits,
                                                      long long bucket, float* out,
                                                      int accumulate)
{
    const long long nb = (n + bucket - 1) / bucket;
    const long long nbytes = (n * (long long)bits + 7) / 8;
    const unsigned long long acc = hvd_qsgd_load_group(body + 4ll * nb, g, bits, nbytes);
    const unsigned long long mask = (1ull << bits) - 1ull;
    const float levels_f = (float)levels;
    const long long lo = 8ll * g;
    const long long hi = lo + 8 < n ? lo + 8 : n;
    for (long long i = lo; i < hi; ++i) {
        const unsigned int code =
            (unsigned int)((acc >> (unsigned int)((i - lo) * bits)) & mask);
        const float norm = hvd_quant_load_f32(body + 4ll * (i / bucket));
        const float mag = __fmul_rn(__fdiv_rn((float)(code >> 1), levels_f), norm);
        const float v = (code & 1u) ? -mag : mag;
        out[i] = accumulate ? __fadd_rn(out[i], v) : v;
    }
}

// TernGrad's quartic byte of group j: digit d_i = q_i + 1, q_i = (u_i < |x_i| / M) ?
// sign(x_i) : 0 (0 everywhere when M == 0), padding digits 1.
__device__ __forceinline__ unsigned char hvd_terngrad_byte(const float* x, long long n,
                                                           long long j, float scale,
                                                           unsigned long long key)
{
    unsigned int byte = 0u;
    for (long long k = 0; k < 5; ++k) {
        const long long i = 5ll * j + k;
        unsigned int d = 1u;
        if (i < n && scale != 0.0f) {
            const float v = x[i];
            if (hvd_quant_uniform(key, i) < __fdiv_rn(fabsf(v), scale)) d = v < 0.0f ? 0u : 2u;
        }
        byte = byte * 3u + d;
    }
    return (unsigned char)byte;
}

// DQSG's delta of bucket b: max|w| / s (the max exact, one float32 division); the max's
// bits also into *worst (NaN / Inf when they are >= HVD_QUANT_NONFINITE_BITS).
__device__ __forceinline__ float hvd_dqsg_delta(const float* w, long long n, long long b,
                                                long long bucket, int levels,
                                                unsigned int* worst)
{
    const long long lo = b * bucket;
    const long long hi = lo + bucket < n ? lo + bucket : n;
    unsigned int m = 0u;
    for (long long i = lo; i < hi; ++i) {
        const unsigned int a = __float_as_uint(w[i]) & 0x7fffffffu;
        m = a > m ? a : m;
    }
    *worst = m > *worst ? m : *worst;
    return __fdiv_rn(__uint_as_float(m), (float)levels);
}

// DQSG's q of element i: clamp(rint(w / safe + (v - 1/2)), -s, s), safe = delta, or 1
// where delta == 0 (rint half to even).
__device__ __forceinline__ int hvd_dqsg_q(float w, float delta, int levels,
                                          unsigned long long key, long long i)
{
    const float levels_f = (float)levels;
    const float safe = delta > 0.0f ? delta : 1.0f;
    const float u = __fsub_rn(hvd_quant_uniform(key, i), 0.5f);
    float q = rintf(__fadd_rn(__fdiv_rn(w, safe), u));
    q = q > levels_f ? levels_f : (q < -levels_f ? -levels_f : q);
    return (int)q;
}

// DQSG's reconstruction of element i: delta * (q - (v - 1/2)).
__device__ __forceinline__ float hvd_dqsg_value(int q, float delta, unsigned long long key,
                                                long long i)
{
    const float u = __fsub_rn(hvd_quant_uniform(key, i), 0.5f);
    return __fmul_rn(delta, __fsub_rn((float)q, u));
}

// NDQSG's coset of the fine index k in the coarse lattice rho Z: k - rho rint(k / rho)
// (float32 operations, rint half to even; kernels/quant.c hvdc_ndqsg_coset).
__device__ __forceinline__ int hvd_ndqsg_coset(int k, int rho)
{
    const float kf = (float)k, rho_f = (float)rho;
    return (int)__fsub_rn(kf, __fmul_rn(rho_f, rintf(__fdiv_rn(kf, rho_f))));
}

// NDQSG's side-information decode of element i (kernels/quant.c ndqsg_side_decode): with
// u = v - 1/2 and safe = delta, or 1 where delta == 0, r = safe (m - u) - y,
// k = m - rho rint(r / (safe rho)) (0 where delta == 0), returns w = delta (k - u); k into
// *k_out. Each one float32 operation, in the CPU's order.
__device__ __forceinline__ float hvd_ndqsg_side(int m, float delta, int rho, float y,
                                                unsigned long long key, long long i,
                                                float* k_out)
{
    const float rho_f = (float)rho;
    const float safe = delta > 0.0f ? delta : 1.0f;
    const float coarse = __fmul_rn(safe, rho_f);
    const float u = __fsub_rn(hvd_quant_uniform(key, i), 0.5f), mf = (float)m;
    const float r = __fsub_rn(__fmul_rn(safe, __fsub_rn(mf, u)), y);
    float k = __fsub_rn(mf, __fmul_rn(rho_f, rintf(__fdiv_rn(r, coarse))));
    k = delta > 0.0f ? k : 0.0f;
    *k_out = k;
    return __fmul_rn(delta, __fsub_rn(k, u));
}

// out_i += the decode of digit or coset m of element i: DQSG's delta (m - u) (rho 0), or
// NDQSG's side decode with y = out_i / y_divisor; returns 1 when k_true (the sender's fine
// indices, or 0) is given and its k_i differs from the decoded k (an aliased index).
__device__ __forceinline__ int hvd_digits_add(float* out, long long i, int m, float delta,
                                              unsigned long long key, int rho, float y_divisor,
                                              const signed char* k_true)
{
    if (!rho) {
        out[i] = __fadd_rn(out[i], hvd_dqsg_value(m, delta, key, i));
        return 0;
    }
    float k;
    const float w = hvd_ndqsg_side(m, delta, rho, __fdiv_rn(out[i], y_divisor), key, i, &k);
    out[i] = __fadd_rn(out[i], w);
    return k_true && (float)k_true[i] != k;
}

// DQSG's codes q + s of group g (with rho >= 2 NDQSG's codes coset(q) + rho / 2), packed
// `bits` bits each after the deltas; q into k_out[i] when k_out is not 0.
__device__ __forceinline__ void hvd_dqsg_encode_group(const float* w, long long n, long long g,
                                                      int levels, int bits, long long bucket,
                                                      unsigned long long key,
                                                      const float* deltas,
                                                      unsigned char* packed, int rho,
                                                      signed char* k_out)
{
    const long long lo = 8ll * g;
    const long long hi = lo + 8 < n ? lo + 8 : n;
    unsigned long long acc = 0ull;
    for (long long i = lo; i < hi; ++i) {
        const int q = hvd_dqsg_q(w[i], deltas[i / bucket], levels, key, i);
        if (k_out) k_out[i] = (signed char)q;
        const int code = rho ? hvd_ndqsg_coset(q, rho) + rho / 2 : q + levels;
        acc |= (unsigned long long)code << (unsigned int)((i - lo) * bits);
    }
    const long long nbytes = (n * (long long)bits + 7) / 8;
    const long long first_byte = g * (long long)bits;
    for (int k = 0; k < bits && first_byte + k < nbytes; ++k)
        packed[first_byte + k] = (unsigned char)(acc >> (8 * k));
}

// DQSG decode of group g of a checked body: out += delta * ((code - s) - (v - 1/2)); with
// rho >= 2 (levels = rho / 2, the code offset) NDQSG's side decode of m = code - levels
// (hvd_digits_add). Returns the aliased indices against k_true (0 without).
__device__ __forceinline__ int hvd_dqsg_decode_add_group(const unsigned char* body, long long n,
                                                         long long g, int levels, int bits,
                                                         long long bucket,
                                                         unsigned long long key, float* out,
                                                         int rho, float y_divisor,
                                                         const signed char* k_true)
{
    int aliased = 0;
    const long long nb = (n + bucket - 1) / bucket;
    const long long nbytes = (n * (long long)bits + 7) / 8;
    const unsigned long long acc = hvd_qsgd_load_group(body + 4ll * nb, g, bits, nbytes);
    const unsigned long long mask = (1ull << bits) - 1ull;
    const long long hi = 8ll * g + 8 < n ? 8ll * g + 8 : n;
    for (long long i = 8ll * g; i < hi; ++i) {
        const int code = (int)((acc >> (unsigned int)((i - 8ll * g) * bits)) & mask);
        const float delta = hvd_quant_load_f32(body + 4ll * (i / bucket));
        aliased += hvd_digits_add(out, i, code - levels, delta, key, rho, y_divisor, k_true);
    }
    return aliased;
}

// 1. QSGD norms: norms[b] = float32(sqrt(sum over bucket b of x_i^2)), the sum in double
// strictly left to right (one thread per bucket: the CPU's order). A NaN / Inf norm (NaN or
// Inf input, or float32 overflow) sets the non-finite word. grid: grid-stride over
// ceil(n / bucket) buckets. bytes: reads 4n, writes 4 per bucket.
extern "C" __global__ void quant_qsgd_norms(const float* __restrict__ x, long long n,
                                            long long bucket, float* __restrict__ norms,
                                            unsigned int* __restrict__ state)
{
    const long long nb = (n + bucket - 1) / bucket;
    const long long stride = hvd_quant_grid_stride();
    bool bad = false;
    for (long long b = hvd_quant_first_index(); b < nb; b += stride) {
        norms[b] = hvd_qsgd_norm(x, n, b, bucket);
        bad = bad || hvd_quant_nonfinite(norms[b]);
    }
    if (bad) atomicOr(state + HVD_QUANT_ST_NONFINITE, 1u);
}

// 2. QSGD codes: r = (|x| / norm) * s + u (norm 1 where it is 0), l = min(floor(r), s),
// code = 2 l + (x < 0 and l > 0), packed LSB first. One thread per group of eight elements,
// which fill bytes [bits g, bits g + bits). grid: grid-stride over ceil(n / 8) groups.
// bytes: reads 4n (+ the norms), writes n bits / 8.
extern "C" __global__ void quant_qsgd_encode(const float* __restrict__ x, long long n,
                                             int levels, int bits, long long bucket,
                                             unsigned long long key,
                                             const float* __restrict__ norms,
                                             unsigned char* __restrict__ packed)
{
    const long long groups = (n + 7) / 8;
    const long long stride = hvd_quant_grid_stride();
    for (long long g = hvd_quant_first_index(); g < groups; g += stride)
        hvd_qsgd_encode_group(x, n, g, levels, bits, bucket, key, norms, packed);
}

// 3. QSGD body check, before any decode writes: norms finite and >= 0 (one float per
// bucket, unaligned), padding bits zero, every code 2 l + sign with l <= s and no signed
// zero level; sets HVD_QUANT_ERR_* bits. The caller checked the body length. grid:
// grid-stride over max(ceil(n / 8), buckets). bytes: reads n bits / 8 + 4 per bucket.
extern "C" __global__ void quant_qsgd_check(const unsigned char* __restrict__ body, long long n,
                                            int levels, int bits, long long bucket,
                                            unsigned int* __restrict__ state)
{
    const long long nb = (n + bucket - 1) / bucket;
    const long long groups = (n + 7) / 8;
    const long long work = groups > nb ? groups : nb;
    const long long stride = hvd_quant_grid_stride();
    unsigned int err = 0u;
    for (long long u = hvd_quant_first_index(); u < work; u += stride)
        err |= hvd_packed_check_unit(body, n, u, levels, bits, bucket, 0);
    if (err) atomicOr(state + HVD_QUANT_ST_ERROR, err);
}

// 4. QSGD decode of a checked body: out[i] = +-((l / s) * norm) (or added to out[i]). One
// thread per group of eight elements. grid: grid-stride over ceil(n / 8). bytes: reads
// n bits / 8 + the norms, writes 4n (reads 4n more with accumulate).
extern "C" __global__ void quant_qsgd_decode(const unsigned char* __restrict__ body, long long n,
                                             int levels, int bits, long long bucket,
                                             float* __restrict__ out, int accumulate)
{
    const long long groups = (n + 7) / 8;
    const long long stride = hvd_quant_grid_stride();
    for (long long g = hvd_quant_first_index(); g < groups; g += stride)
        hvd_qsgd_decode_group(body, n, g, levels, bits, bucket, out, accumulate);
}

// 5. TernGrad quartic bytes: digit d_i = q_i + 1, q_i = (u_i < |x_i| / M) ? sign(x_i) : 0
// (0 everywhere when M == 0), byte 81 d0 + 27 d1 + 9 d2 + 3 d3 + d4 of elements 5j .. 5j + 4
// (padded with d = 1); threelc.cu's zero-run kernels then encode them. M = max|x|, finite.
// One thread per quartic byte. grid: grid-stride over ceil(n / 5). bytes: reads 4n,
// writes n / 5.
extern "C" __global__ void quant_terngrad_quartic(const float* __restrict__ x, long long n,
                                                  float scale, unsigned long long key,
                                                  unsigned char* __restrict__ quartic)
{
    const long long m = (n + 4) / 5;
    const long long stride = hvd_quant_grid_stride();
    for (long long j = hvd_quant_first_index(); j < m; j += stride)
        quartic[j] = hvd_terngrad_byte(x, n, j, scale, key);
}

// 6. DQSG deltas: deltas[b] = max|w| over bucket b / s (the max exact, one float32
// division); NaN / Inf input sets the non-finite word. One thread per bucket. grid:
// grid-stride over ceil(n / bucket). bytes: reads 4n, writes 4 per bucket.
extern "C" __global__ void quant_dqsg_deltas(const float* __restrict__ w, long long n,
                                             int levels, long long bucket,
                                             float* __restrict__ deltas,
                                             unsigned int* __restrict__ state)
{
    const long long nb = (n + bucket - 1) / bucket;
    const long long stride = hvd_quant_grid_stride();
    unsigned int worst = 0u;
    for (long long b = hvd_quant_first_index(); b < nb; b += stride)
        deltas[b] = hvd_dqsg_delta(w, n, b, bucket, levels, &worst);
    if (worst >= HVD_QUANT_NONFINITE_BITS) atomicOr(state + HVD_QUANT_ST_NONFINITE, 1u);
}

// 7. DQSG quantiser: q = clamp(rint(w / safe + (v - 1/2)), -s, s) (safe = delta, or 1
// where delta == 0; rint half to even), out[i] = q + code_offset as a byte. One thread per
// element. grid: grid-stride over n. bytes: reads 4n (+ the deltas), writes n.
extern "C" __global__ void quant_dqsg_quantize(const float* __restrict__ w, long long n,
                                               int levels, long long bucket,
                                               unsigned long long key, int code_offset,
                                               const float* __restrict__ deltas,
                                               unsigned char* __restrict__ out)
{
    const long long stride = hvd_quant_grid_stride();
    for (long long i = hvd_quant_first_index(); i < n; i += stride) {
        const int q = hvd_dqsg_q(w[i], deltas[i / bucket], levels, key, i);
        out[i] = (unsigned char)(q + code_offset);
    }
}

// 8. DQSG reconstruction: out[i] = delta * (q - (v - 1/2)), or added to out[i]; deltas are
// the body's little-endian float32 (any byte offset), validated by the caller. One thread
// per element. grid: grid-stride over n. bytes: reads n (+ the deltas), writes 4n (reads 4n
// more with accumulate).
extern "C" __global__ void quant_dqsg_dequantize(const signed char* __restrict__ q, long long n,
                                                 const unsigned char* __restrict__ deltas,
                                                 long long bucket, unsigned long long key,
                                                 float* __restrict__ out, int accumulate)
{
    const long long stride = hvd_quant_grid_stride();
    for (long long i = hvd_quant_first_index(); i < n; i += stride) {
        const float delta = hvd_quant_load_f32(deltas + 4ll * (i / bucket));
        const float v = hvd_dqsg_value((int)q[i], delta, key, i);
        out[i] = accumulate ? __fadd_rn(out[i], v) : v;
    }
}

// ---------------------------------------------------------------------------------------
// 9. Buckets (docs/backends.md, "The CUDA path"): QSGD's and DQSG's norms or
// deltas, codes, checks and decode, and TernGrad's quartic bytes, of every tensor of a
// bucket in one launch each.
// TernGrad's kernel runs between threelc.cu's threelc_absmax_segments
// (M_s into word 0 of each state row) and its bucket zero-run encoder. The segment table
// is threelc.cu's (section 7: x, n, first quartic byte, first tile), with the uniforms'
// key in column 5. A non-finite M_s gives bytes of 121 (all digits 1): the host drops
// that tensor's body.
#define HVD_QUANT_SEG_COLS 8
#define HVD_QUANT_SEG_IN 0
#define HVD_QUANT_SEG_N 2
#define HVD_QUANT_SEG_QOFF 3
#define HVD_QUANT_SEG_KEY 5
#define HVD_QUANT_SEG_TILE 6
#define HVD_QUANT_STATE_WORDS 8

// The segment of tile t: the last row whose first tile (in column `col`) is <= t.
__device__ __forceinline__ long long hvd_quant_tile_segment(const long long* seg,
                                                            long long nseg, long long t,
                                                            int col)
{
    long long lo = 0, hi = nseg - 1;
    while (lo < hi) {
        const long long mid = (lo + hi + 1) >> 1;
        if (seg[mid * HVD_QUANT_SEG_COLS + col] > t) {
            hi = mid - 1;
        } else {
            lo = mid;
        }
    }
    return lo;
}

// grid: blocks loop over tiles of `tile` quartic bytes, 256 threads. bytes: reads 4n,
// writes n / 5 over all segments.
extern "C" __global__ void quant_terngrad_quartic_segments(const long long* __restrict__ seg,
                                                           long long nseg, long long ntiles,
                                                           long long tile,
                                                           const unsigned int* __restrict__ states,
                                                           unsigned char* __restrict__ quartic)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_quant_tile_segment(seg, nseg, t, HVD_QUANT_SEG_TILE);
        const long long* row = seg + s * HVD_QUANT_SEG_COLS;
        const float* x = (const float*)row[HVD_QUANT_SEG_IN];
        const long long n = row[HVD_QUANT_SEG_N];
        const unsigned long long key = (unsigned long long)row[HVD_QUANT_SEG_KEY];
        const unsigned int mbits = states[s * HVD_QUANT_STATE_WORDS];
        const float scale = mbits >= HVD_QUANT_NONFINITE_BITS ? 0.0f : __uint_as_float(mbits);
        unsigned char* qb = quartic + row[HVD_QUANT_SEG_QOFF];
        const long long first = (t - row[HVD_QUANT_SEG_TILE]) * tile;
        const long long m = (n + 4) / 5;
        const long long end = first + tile < m ? first + tile : m;
        for (long long j = first + threadIdx.x; j < end; j += blockDim.x)
            qb[j] = hvd_terngrad_byte(x, n, j, scale, key);
    }
}

// QSGD's bucket calls: the table's input is x (encode) or the body (decode), column 1 the
// output (decode), column 3 the body (encode: 4-byte aligned, norms first), column 5 the
// uniforms' key. Each kernel takes the tile column it loops over (`tiles_at`): the host
// fills two, one per unit (norm buckets, groups of eight elements, or the larger of the
// two for the check).
#define HVD_QUANT_SEG_AUX 1
#define HVD_QUANT_SEG_OUT 3

// QSGD and DQSG with s > 1 share the next four kernels, `dqsg` picking the codec: a body
// is 4-byte aligned, one float32 per bucket first (norms or deltas), then the `bits`-bit
// codes. DQSG's s = 1 bodies (deltas, then quartic + zero-run coded digits) take the
// deltas kernel and the three after these.

// The float32 per bucket of each segment into its body's first 4 nb bytes: QSGD's norms,
// or with `dqsg` DQSG's deltas; a NaN / Inf one sets the segment's non-finite flag.
// grid: blocks loop over tiles of `tile` buckets. bytes: reads 4n, writes 4 per bucket.
extern "C" __global__ void quant_bucket_floats_segments(const long long* __restrict__ seg,
                                                        long long nseg, long long ntiles,
                                                        long long tile, int tiles_at,
                                                        int levels, long long bucket, int dqsg,
                                                        unsigned int* __restrict__ states)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_quant_tile_segment(seg, nseg, t, tiles_at);
        const long long* row = seg + s * HVD_QUANT_SEG_COLS;
        const float* x = (const float*)row[HVD_QUANT_SEG_IN];
        float* floats = (float*)row[HVD_QUANT_SEG_OUT];
        const long long n = row[HVD_QUANT_SEG_N];
        const long long nb = (n + bucket - 1) / bucket;
        const long long first = (t - row[tiles_at]) * tile;
        const long long end = first + tile < nb ? first + tile : nb;
        unsigned int worst = 0u;
        for (long long b = first + threadIdx.x; b < end; b += blockDim.x) {
            if (dqsg) {
                floats[b] = hvd_dqsg_delta(x, n, b, bucket, levels, &worst);
            } else {
                floats[b] = hvd_qsgd_norm(x, n, b, bucket);
                const unsigned int a = __float_as_uint(floats[b]) & 0x7fffffffu;
                worst = a > worst ? a : worst;
            }
        }
        if (worst >= HVD_QUANT_NONFINITE_BITS)
            atomicOr(states + s * HVD_QUANT_STATE_WORDS + HVD_QUANT_ST_NONFINITE, 1u);
    }
}

// The codes of each segment, packed after its float32s (QSGD's, or with `dqsg` DQSG's
// codes q + s, or with rho >= 2 too NDQSG's coset codes; then column 1, when not 0, is
// where the segment's int8 fine indices q go). grid: blocks loop over tiles of `tile`
// groups of eight elements. bytes: reads 4n (+ the floats), writes n bits / 8 (+ n).
extern "C" __global__ void quant_packed_encode_segments(const long long* __restrict__ seg,
                                                        long long nseg, long long ntiles,
                                                        long long tile, int tiles_at,
                                                        int levels, int bits, long long bucket,
                                                        int dqsg, int rho)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_quant_tile_segment(seg, nseg, t, tiles_at);
        const long long* row = seg + s * HVD_QUANT_SEG_COLS;
        const float* x = (const float*)row[HVD_QUANT_SEG_IN];
        const long long n = row[HVD_QUANT_SEG_N];
        const unsigned long long key = (unsigned long long)row[HVD_QUANT_SEG_KEY];
        const float* floats = (const float*)row[HVD_QUANT_SEG_OUT];
        const long long nb = (n + bucket - 1) / bucket;
        unsigned char* packed = (unsigned char*)row[HVD_QUANT_SEG_OUT] + 4ll * nb;
        const long long groups = (n + 7) / 8;
        const long long first = (t - row[tiles_at]) * tile;
        const long long end = first + tile < groups ? first + tile : groups;
        for (long long g = first + threadIdx.x; g < end; g += blockDim.x) {
            if (dqsg) {
                signed char* k_out = (signed char*)row[HVD_QUANT_SEG_AUX];
                hvd_dqsg_encode_group(x, n, g, levels, bits, bucket, key, floats, packed, rho,
                                      k_out);
            } else {
                hvd_qsgd_encode_group(x, n, g, levels, bits, bucket, key, floats, packed);
            }
        }
    }
}

// The check of each segment's body (hvd_packed_check_unit; `dqsg` picks DQSG's code rule)
// into its state, before any decode writes. grid: blocks loop over tiles of `tile` units,
// a unit being a group of eight elements and a bucket at once (max(groups, buckets) units
// a segment). bytes: reads n bits / 8 + 4 per bucket.
extern "C" __global__ void quant_packed_check_segments(const long long* __restrict__ seg,
                                                       long long nseg, long long ntiles,
                                                       long long tile, int tiles_at,
                                                       int levels, int bits, long long bucket,
                                                       int dqsg,
                                                       unsigned int* __restrict__ states)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_quant_tile_segment(seg, nseg, t, tiles_at);
        const long long* row = seg + s * HVD_QUANT_SEG_COLS;
        const unsigned char* body = (const unsigned char*)row[HVD_QUANT_SEG_IN];
        const long long n = row[HVD_QUANT_SEG_N];
        const long long nb = (n + bucket - 1) / bucket;
        const long long groups = (n + 7) / 8;
        const long long units = groups > nb ? groups : nb;
        const long long first = (t - row[tiles_at]) * tile;
        const long long end = first + tile < units ? first + tile : units;
        unsigned int err = 0u;
        for (long long u = first + threadIdx.x; u < end; u += blockDim.x)
            err |= hvd_packed_check_unit(body, n, u, levels, bits, bucket, dqsg);
        if (err) atomicOr(states + s * HVD_QUANT_STATE_WORDS + HVD_QUANT_ST_ERROR, err);
    }
}

// The decode with accumulate of each checked segment (QSGD's, or with `dqsg` DQSG's
// reconstruction, or with rho >= 2 too NDQSG's side decode: levels = rho / 2, side
// information out / y_divisor, and per segment s the aliased count against k_trues[s]
// into aliased[s] when k_trues is given); the host launches it for the segments before
// the first refused one only. grid: blocks loop over tiles of `tile` groups of eight
// elements. bytes: reads n bits / 8 + the floats + 4n (+ n), writes 4n.
extern "C" __global__ void quant_packed_decode_add_segments(
    const long long* __restrict__ seg, long long nseg, long long ntiles, long long tile,
    int tiles_at, int levels, int bits, long long bucket, int dqsg, int rho, float y_divisor,
    const long long* __restrict__ k_trues, unsigned long long* __restrict__ aliased)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_quant_tile_segment(seg, nseg, t, tiles_at);
        const long long* row = seg + s * HVD_QUANT_SEG_COLS;
        const unsigned char* body = (const unsigned char*)row[HVD_QUANT_SEG_IN];
        float* out = (float*)row[HVD_QUANT_SEG_AUX];
        const long long n = row[HVD_QUANT_SEG_N];
        const unsigned long long key = (unsigned long long)row[HVD_QUANT_SEG_KEY];
        const long long groups = (n + 7) / 8;
        const long long first = (t - row[tiles_at]) * tile;
        const long long end = first + tile < groups ? first + tile : groups;
        const signed char* k_true = k_trues ? (const signed char*)k_trues[s] : 0;
        unsigned long long count = 0ull;
        for (long long g = first + threadIdx.x; g < end; g += blockDim.x) {
            if (dqsg) {
                count += hvd_dqsg_decode_add_group(body, n, g, levels, bits, bucket, key, out,
                                                   rho, y_divisor, k_true);
            } else {
                hvd_qsgd_decode_group(body, n, g, levels, bits, bucket, out, 1);
            }
        }
        if (count) atomicAdd(aliased + s, count);
    }
}

// DQSG with s = 1 (and NDQSG's nested code with rho <= 3: its cosets of DQSG's q at
// s = levels are ternary too): the deltas as above (quant_bucket_floats_segments), then the
// digits q + 1 (coset(q) + 1) five to a quartic byte (3LC's layout, most significant
// first, padding digits 1), which threelc.cu's bucket zero-run encoder then codes. The
// digit kernel's table is a second copy of the rows (threelc.cu's zero-run kernels read
// column 3 as the quartic offset): column 0 w, 1 the first quartic byte, 2 n, 3 the
// deltas, 5 the key, 7 where the int8 q go (0: not kept).
#define HVD_QUANT_SEG_DELTAS 3
#define HVD_QUANT_SEG_QUARTIC 1
#define HVD_QUANT_SEG_KS 7
#define HVD_QUANT_SEG_DECODE_KEY 7  // the decode-add's key (threelc.cu's F32 column)
#define HVD_QUANT_ZERO_GROUP 121  // quartic byte of five zero digits (q = 0)

// The quartic byte of group j of w: digits q + 1, q = hvd_dqsg_q(w_i, delta, levels), or
// with rho coset(q) + 1; q into k_out[i] when k_out is not 0.
__device__ __forceinline__ unsigned char hvd_dqsg_ternary_byte(const float* w, long long n,
                                                               long long j, long long bucket,
                                                               unsigned long long key,
                                                               const float* deltas,
                                                               int levels, int rho,
                                                               signed char* k_out)
{
    unsigned int byte = 0u;
    for (long long k = 0; k < 5; ++k) {
        const long long i = 5ll * j + k;
        int d = 0;
        if (i < n) {
            const int q = hvd_dqsg_q(w[i], deltas[i / bucket], levels, key, i);
            if (k_out) k_out[i] = (signed char)q;
            d = rho ? hvd_ndqsg_coset(q, rho) : q;
        }
        byte = byte * 3u + (unsigned int)(d + 1);
    }
    return (unsigned char)byte;
}

// Each segment's quartic bytes; a segment flagged non-finite (by the deltas kernel) gets
// zero groups, and the host drops its body. grid: blocks loop over tiles of `tile`
// quartic bytes. bytes: reads 4n (+ the deltas), writes n / 5 over all segments.
extern "C" __global__ void quant_dqsg_quartic_segments(const long long* __restrict__ seg,
                                                       long long nseg, long long ntiles,
                                                       long long tile, long long bucket,
                                                       int levels, int rho,
                                                       const unsigned int* __restrict__ states,
                                                       unsigned char* __restrict__ quartic)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_quant_tile_segment(seg, nseg, t, HVD_QUANT_SEG_TILE);
        const long long* row = seg + s * HVD_QUANT_SEG_COLS;
        const float* w = (const float*)row[HVD_QUANT_SEG_IN];
        const long long n = row[HVD_QUANT_SEG_N];
        const unsigned long long key = (unsigned long long)row[HVD_QUANT_SEG_KEY];
        const float* deltas = (const float*)row[HVD_QUANT_SEG_DELTAS];
        const bool skip = states[s * HVD_QUANT_STATE_WORDS + HVD_QUANT_ST_NONFINITE] != 0u;
        signed char* k_out = (signed char*)row[HVD_QUANT_SEG_KS];
        unsigned char* qb = quartic + row[HVD_QUANT_SEG_QUARTIC];
        const long long first = (t - row[HVD_QUANT_SEG_TILE]) * tile;
        const long long m = (n + 4) / 5;
        const long long end = first + tile < m ? first + tile : m;
        for (long long j = first + threadIdx.x; j < end; j += blockDim.x)
            qb[j] = skip ? (unsigned char)HVD_QUANT_ZERO_GROUP
                         : hvd_dqsg_ternary_byte(w, n, j, bucket, key, deltas, levels, rho,
                                                 k_out);
    }
}

// The decode side's deltas check: every delta of a segment (column 0: its nb
// little-endian float32, at any byte offset) finite and >= 0, else HVD_QUANT_ERR_NORM
// into its state, before any decode writes. grid: blocks loop over tiles of `tile`
// deltas (tile column `tiles_at`). bytes: reads 4 per bucket.
extern "C" __global__ void quant_dqsg_deltas_check_segments(const long long* __restrict__ seg,
                                                            long long nseg, long long ntiles,
                                                            long long tile, int tiles_at,
                                                            long long bucket,
                                                            unsigned int* __restrict__ states)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_quant_tile_segment(seg, nseg, t, tiles_at);
        const long long* row = seg + s * HVD_QUANT_SEG_COLS;
        const unsigned char* deltas = (const unsigned char*)row[HVD_QUANT_SEG_IN];
        const long long nb = (row[HVD_QUANT_SEG_N] + bucket - 1) / bucket;
        const long long first = (t - row[tiles_at]) * tile;
        const long long end = first + tile < nb ? first + tile : nb;
        bool bad = false;
        for (long long b = first + threadIdx.x; b < end; b += blockDim.x) {
            const float d = hvd_quant_load_f32(deltas + 4ll * b);
            bad |= !(d >= 0.0f) || hvd_quant_nonfinite(d);
        }
        if (bad) atomicOr(states + s * HVD_QUANT_STATE_WORDS + HVD_QUANT_ST_ERROR,
                          HVD_QUANT_ERR_NORM);
    }
}

// out += delta * (q - (v - 1/2)) for every element of each checked segment, from the
// bucket's expanded quartic bytes (threelc_zre_expand with run groups written as zero
// groups: unlike 3LC, a zero q still adds the dither's -delta * u); with rho >= 2 the
// digits are NDQSG cosets, side-decoded against out / y_divisor (hvd_digits_add), and
// aliased[s] counts the indices that differ from k_trues[s] (when k_trues is given).
// Table: threelc.cu's decode layout (column 1 out, 2 n, 3 the first quartic byte, 6 the
// first tile) with column 0 the deltas (any byte offset) and column 7 the key. grid:
// blocks loop over tiles of `tile` quartic bytes. bytes: reads m + 4n (+ the deltas, + n),
// writes 4n.
extern "C" __global__ void quant_dqsg_quartic_decode_add_segments(
    const long long* __restrict__ seg, long long nseg, long long ntiles, long long tile,
    long long bucket, const unsigned char* __restrict__ quartic, int rho, float y_divisor,
    const long long* __restrict__ k_trues, unsigned long long* __restrict__ aliased)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_quant_tile_segment(seg, nseg, t, HVD_QUANT_SEG_TILE);
        const long long* row = seg + s * HVD_QUANT_SEG_COLS;
        const unsigned char* deltas = (const unsigned char*)row[HVD_QUANT_SEG_IN];
        float* out = (float*)row[HVD_QUANT_SEG_AUX];
        const long long n = row[HVD_QUANT_SEG_N];
        const unsigned long long key = (unsigned long long)row[HVD_QUANT_SEG_DECODE_KEY];
        const unsigned char* qb = quartic + row[HVD_QUANT_SEG_QOFF];
        const signed char* k_true = k_trues ? (const signed char*)k_trues[s] : 0;
        const long long first = (t - row[HVD_QUANT_SEG_TILE]) * tile;
        const long long m = (n + 4) / 5;
        const long long end = first + tile < m ? first + tile : m;
        unsigned long long count = 0ull;
        for (long long j = first + threadIdx.x; j < end; j += blockDim.x) {
            unsigned int v = qb[j];
            int d[5];
            for (int k = 4; k >= 0; --k) {
                d[k] = (int)(v % 3u);
                v /= 3u;
            }
            for (long long k = 0; k < 5 && 5ll * j + k < n; ++k) {
                const long long i = 5ll * j + k;
                const float delta = hvd_quant_load_f32(deltas + 4ll * (i / bucket));
                count += hvd_digits_add(out, i, d[k] - 1, delta, key, rho, y_divisor, k_true);
            }
        }
        if (count) atomicAdd(aliased + s, count);
    }
}
