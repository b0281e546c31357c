// Sparse codecs on CUDA (docs/baselines.md), a bucket at a time:
//   decode: top-k bodies (top-k, DGC and GSpar send this layout) or top-k + sign bodies,
//           checked and added in one launch each (kernels/sparse.c's
//           hvdc_topk_decode_segments and hvdc_topkq_decode_segments);
//   encode: top-k with error feedback and DGC's momentum-corrected form, selected by a
//           radix select of every segment at once (hvdc_topk_encode_segments; section
//           "Top-k's bucket encode" below), top-k + sign too;
//   random-k and GSpar: their bucket encode and (random-k's) decode, kept flags drawn from
//           the counter-based uniforms (sections "Random-k's buckets" and "GSpar's
//           buckets"; kernels/sparse.c's hvdc_randomk_*_segments and
//           hvdc_gspar_encode_segments).
//
// Top-k body: k float32 values, then k indices in ascending order (int32 when n < 2^31,
// else int64), little-endian. Top-k + sign (`signs` set): one float32 magnitude m, the k
// indices, then k sign bits (1: -m, LSB first, padding bits zero). A rank's bodies sit
// anywhere in the gathered bytes, so every field is loaded byte by byte.
//
// Compiled three ways from this one file, like kernels/threelc.cu: by NVRTC through
// hvdcompress/backends/cuda/ (NVRTC_OPTIONS of hvdcompress/_native.py), by nvcc in
// scripts/check_kernels.sh, and by g++ for the host through kernels/cuda_host.h
// (tests/host_kernels/). Hence plain C-like code, no #include under CUDA, no barriers or
// shared memory, no code that needs two threads at once. Names: kernels sparse_<op>
// (random-k's and GSpar's keep the names the backend launches them by, quant_randomk_*
// and quant_gspar_*), helpers hvd_sparse_* (the host build compiles every .cu file in one
// unit). Every index is 64-bit.
//
// Segment table (threelc.cu section 7's rows of 8 int64 and its tiles, a tile being
// `tile` kept entries; the state rows are threelc.cu's, word 3 the error bits):
#define HVD_SPARSE_SEG_COLS 8
#define HVD_SPARSE_SEG_VALUES 0   // the body's first byte: the values (top-k + sign: m)
#define HVD_SPARSE_SEG_OUT 1      // float32 output (added into)
#define HVD_SPARSE_SEG_N 2        // elements of the output
#define HVD_SPARSE_SEG_INDICES 3  // the first index's byte
#define HVD_SPARSE_SEG_SIGNS 4    // top-k + sign: the first sign byte
#define HVD_SPARSE_SEG_K 5        // kept entries
#define HVD_SPARSE_SEG_TILE 6     // the segment's first tile (max(k, 1) entries a segment)
#define HVD_SPARSE_SEG_WIDE 7     // 1: int64 indices; 0: int32
#define HVD_SPARSE_STATE_WORDS 8
#define HVD_SPARSE_ST_ERROR 3
#define HVD_SPARSE_ERR_INDEX 1u   // an index outside [0, n)
#define HVD_SPARSE_ERR_ORDER 2u   // an index not above the one before it
#define HVD_SPARSE_ERR_VALUE 4u   // a value not finite (top-k + sign: m not finite and >= 0)
#define HVD_SPARSE_ERR_PADDING 8u // top-k + sign: a padding bit after the last sign is set

#ifndef __CUDACC__
#include "cuda_host.h"
#define hvd_sparse_dadd(a, b) ((a) + (b))
#else
#define hvd_sparse_dadd(a, b) __dadd_rn((a), (b))
#endif

__device__ __forceinline__ long long hvd_sparse_first_index()
{
    return (long long)blockIdx.x * (long long)blockDim.x + (long long)threadIdx.x;
}

__device__ __forceinline__ long long hvd_sparse_grid_stride()
{
    return (long long)gridDim.x * (long long)blockDim.x;
}

// The segment of tile t: the last row whose first tile (in column `col`) is <= t.
__device__ __forceinline__ long long hvd_sparse_tile_segment_at(const long long* seg,
                                                                long long nseg, long long t,
                                                                int col)
{
    long long lo = 0, hi = nseg - 1;
    while (lo < hi) {
        const long long mid = (lo + hi + 1) >> 1;
        if (seg[mid * HVD_SPARSE_SEG_COLS + col] <= t) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

// The segment of tile t in the tile column.
__device__ __forceinline__ long long hvd_sparse_tile_segment(const long long* seg,
                                                             long long nseg, long long t)
{
    return hvd_sparse_tile_segment_at(seg, nseg, t, HVD_SPARSE_SEG_TILE);
}

// The counter-based uniform of element i (kernels/primitives.cu, primitives_uniform; the
// same as quant.cu's hvd_quant_uniform): SplitMix64 output number i + 1 of the stream
// seeded with key, top 24 bits, times 2^-24.
__device__ __forceinline__ float hvd_sparse_uniform(unsigned long long key, long long i)
{
    unsigned long long z = key + ((unsigned long long)i + 1ull) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z = z ^ (z >> 31);
    return __fmul_rn((float)(unsigned int)(z >> 40), 5.9604644775390625e-08f);  // 2^-24
}

// True for a NaN or an Inf.
__device__ __forceinline__ bool hvd_sparse_nonfinite(float v)
{
    return (__float_as_uint(v) & 0x7fffffffu) >= 0x7f800000u;
}

// Index j of a body (int32 or int64, little-endian, any byte offset), as int64.
__device__ __forceinline__ long long hvd_sparse_index(const unsigned char* p, long long j,
                                                      int wide)
{
    if (wide) {
        unsigned long long v = 0ull;
        for (int b = 7; b >= 0; --b) v = (v << 8) | p[8 * j + b];
        return (long long)v;
    }
    const unsigned char* q = p + 4 * j;
    return (long long)(int)((unsigned int)q[0] | ((unsigned int)q[1] << 8) |
                            ((unsigned int)q[2] << 16) | ((unsigned int)q[3] << 24));
}

// Value j of a body (float32, little-endian, any byte offset).
__device__ __forceinline__ float hvd_sparse_value(const unsigned char* p, long long j)
{
    const unsigned char* q = p + 4 * j;
    return __uint_as_float((unsigned int)q[0] | ((unsigned int)q[1] << 8) |
                           ((unsigned int)q[2] << 16) | ((unsigned int)q[3] << 24));
}

// Entry j's value: value j, or with `signs` -m or +m by sign bit j.
__device__ __forceinline__ float hvd_sparse_entry(const long long* row, long long j, int signs)
{
    const unsigned char* values = (const unsigned char*)row[HVD_SPARSE_SEG_VALUES];
    if (!signs) return hvd_sparse_value(values, j);
    const unsigned char* bits = (const unsigned char*)row[HVD_SPARSE_SEG_SIGNS];
    const float m = hvd_sparse_value(values, 0);
    return (bits[j >> 3] >> (j & 7)) & 1u ? -m : m;
}

// Each segment's body checked into its state, before any decode writes: every index in
// [0, n) and above the one before it, every value finite, or with `signs` m finite and
// >= 0 and the padding bits zero (the checks of the CPU's decoder; an error anywhere
// refuses the body, and the host words it from the per-payload decoder). grid: blocks
// loop over tiles of `tile` entries. bytes: reads (8 or 12) k, or (4 or 8) k + k / 8.
extern "C" __global__ void sparse_topk_check_segments(const long long* __restrict__ seg,
                                                      long long nseg, long long ntiles,
                                                      long long tile, int signs,
                                                      unsigned int* __restrict__ states)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sparse_tile_segment(seg, nseg, t);
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        const unsigned char* indices = (const unsigned char*)row[HVD_SPARSE_SEG_INDICES];
        const long long n = row[HVD_SPARSE_SEG_N], k = row[HVD_SPARSE_SEG_K];
        const int wide = (int)row[HVD_SPARSE_SEG_WIDE];
        const long long first = (t - row[HVD_SPARSE_SEG_TILE]) * tile;
        const long long end = first + tile < k ? first + tile : k;
        unsigned int err = 0u;
        if (signs && first == 0 && threadIdx.x == 0) {  // once a segment, even when k = 0
            const float m = hvd_sparse_value((const unsigned char*)row[HVD_SPARSE_SEG_VALUES], 0);
            if (!(m >= 0.0f) || (__float_as_uint(m) & 0x7fffffffu) >= 0x7f800000u)
                err |= HVD_SPARSE_ERR_VALUE;
            const unsigned char* bits = (const unsigned char*)row[HVD_SPARSE_SEG_SIGNS];
            if ((k & 7) && (bits[(k - 1) >> 3] >> (k & 7))) err |= HVD_SPARSE_ERR_PADDING;
        }
        for (long long j = first + threadIdx.x; j < end; j += blockDim.x) {
            const long long i = hvd_sparse_index(indices, j, wide);
            if (i < 0 || i >= n) err |= HVD_SPARSE_ERR_INDEX;
            if (j > 0 && hvd_sparse_index(indices, j - 1, wide) >= i) err |= HVD_SPARSE_ERR_ORDER;
            const unsigned int bits = __float_as_uint(hvd_sparse_entry(row, j, signs));
            if ((bits & 0x7fffffffu) >= 0x7f800000u) err |= HVD_SPARSE_ERR_VALUE;
        }
        if (err) atomicOr(states + s * HVD_SPARSE_STATE_WORDS + HVD_SPARSE_ST_ERROR, err);
    }
}

// out[index_j] += value_j (or -m / +m) for every entry of each checked segment (the host
// launches it for the segments before the first refused one; indices strictly increase,
// so no two threads add into one element). grid: blocks loop over tiles of `tile`
// entries. bytes: reads (8 or 12) k + 4 k, writes 4 k.
extern "C" __global__ void sparse_topk_add_segments(const long long* __restrict__ seg,
                                                    long long nseg, long long ntiles,
                                                    long long tile, int signs)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sparse_tile_segment(seg, nseg, t);
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        const unsigned char* indices = (const unsigned char*)row[HVD_SPARSE_SEG_INDICES];
        float* out = (float*)row[HVD_SPARSE_SEG_OUT];
        const long long k = row[HVD_SPARSE_SEG_K];
        const int wide = (int)row[HVD_SPARSE_SEG_WIDE];
        const long long first = (t - row[HVD_SPARSE_SEG_TILE]) * tile;
        const long long end = first + tile < k ? first + tile : k;
        for (long long j = first + threadIdx.x; j < end; j += blockDim.x) {
            const long long i = hvd_sparse_index(indices, j, wide);
            out[i] = __fadd_rn(out[i], hvd_sparse_entry(row, j, signs));
        }
    }
}

// ---------------------------------------------------------------------------------------
// Top-k's bucket encode: kernels/sparse.c's hvdc_topk_encode_segments, the same kept set
// (t = the k-th largest |a|, exact; every |a_i| > t, then the |a_i| == t in index order
// until there are k), bodies, residuals and velocities, as one launch sequence with no
// read before the last launch:
//   sparse_topk_finite_segments     which segments' a holds a NaN or an Inf
//   sparse_topk_update_segments     a into e (DGC: u and v) where finite, the first digit's
//                                   histogram
//   sparse_topk_pick_segments       the digit of the k-th largest |a| (three digits of 11,
//   sparse_topk_histogram_segments  11 and 10 bits from the top, as sparse.c's radix select)
//   sparse_topk_ties_segments       1 where |a| == t; the host's stream scans them
//   sparse_topk_keep_segments       the kept flags; the host's stream scans them
//   sparse_topk_gather_segments     the kept values and indices into the bodies, and the
//                                   residual (DGC: also the velocity) zeroed there
// Top-k + sign (hvdc_topkq_select_segments and hvdc_topkq_write_segments) runs the same
// select, gathers the kept values and indices into slots instead, sums the values' chunks
// (primitives_chunk_sums), and after the one read, for the host's correctly rounded
// magnitudes, sparse_topkq_write_segments writes the bodies and the residuals.
// a = g + e for top-k; for DGC (column 3 set) u' = m u + g (g itself when m == 0: -0.0
// stays -0.0) and a = v + u', v the residual; each one float32 operation. Magnitudes are
// the bits of |a| (finite non-negative floats order like their bits), so the select is
// integer work. Histograms: HVD_TOPK_BINS words a segment, zeroed by the host once; the
// pick kernel zeroes the bins it has read for the next digit.
// Table (rows of 8 int64): 0 g, 1 e (v for DGC; a is written there), 2 n, 3 u (DGC's
// velocity, 0 for top-k), 4 k (0 <= k <= n), 5 the segment's first flag in the bucket,
// 6 its first element tile, 7 its body's address (8-byte aligned: k float32 values, then
// k indices, int32, or int64 from `wide_from` elements on). State rows: word 0 the
// threshold's bits found so far, 2 the non-finite flag, 4-5 the rank left (int64).
#define HVD_TOPK_SEG_G 0
#define HVD_TOPK_SEG_A 1
#define HVD_TOPK_SEG_N 2
#define HVD_TOPK_SEG_U 3
#define HVD_TOPK_SEG_K 4
#define HVD_TOPK_SEG_FLAGS 5
#define HVD_TOPK_SEG_BODY 7
#define HVD_TOPK_ST_PREFIX 0
#define HVD_TOPK_ST_NONFINITE 2
#define HVD_TOPK_ST_RANK 4
#define HVD_TOPK_BINS 2048
#define HVD_TOPK_ABS 0x7fffffffu

// u' of DGC's element i: m u_i + g_i, or g_i when m == 0.
__device__ __forceinline__ float hvd_topk_velocity(const long long* row, long long i,
                                                   float momentum)
{
    const float g = ((const float*)row[HVD_TOPK_SEG_G])[i];
    if (momentum == 0.0f) return g;
    return __fadd_rn(__fmul_rn(((const float*)row[HVD_TOPK_SEG_U])[i], momentum), g);
}

// a_i before the update: e_i + g_i (top-k), or v_i + u'_i (DGC).
__device__ __forceinline__ float hvd_topk_a(const long long* row, long long i, float momentum)
{
    const float e = ((const float*)row[HVD_TOPK_SEG_A])[i];
    if (row[HVD_TOPK_SEG_U]) return __fadd_rn(e, hvd_topk_velocity(row, i, momentum));
    return __fadd_rn(e, ((const float*)row[HVD_TOPK_SEG_G])[i]);
}

// Index j of a body's index words (4-byte aligned): i as int32, or with `wide` as a
// little-endian int64 in two words (an int64 index need not be 8-byte aligned: j odd).
__device__ __forceinline__ void hvd_topk_put_index(unsigned int* words, long long j,
                                                   long long i, bool wide)
{
    if (wide) {
        words[2 * j] = (unsigned int)((unsigned long long)i & 0xffffffffull);
        words[2 * j + 1] = (unsigned int)((unsigned long long)i >> 32);
    } else {
        words[j] = (unsigned int)i;
    }
}

// Whether segment s selects: a finite a and k > 0.
__device__ __forceinline__ bool hvd_topk_active(const long long* row,
                                                const unsigned int* state)
{
    return !state[HVD_TOPK_ST_NONFINITE] && row[HVD_TOPK_SEG_K] > 0;
}

// The radix digits: shift and width of digit `pass` (0, 1, 2), and the mask of the bits
// above it (the prefix found so far).
__device__ __forceinline__ int hvd_topk_shift(int pass)
{
    return pass == 0 ? 21 : pass == 1 ? 10 : 0;
}
__device__ __forceinline__ unsigned int hvd_topk_width(int pass)
{
    return pass == 2 ? 0x3ffu : 0x7ffu;
}
__device__ __forceinline__ unsigned int hvd_topk_above_mask(int pass)
{
    return pass == 0 ? 0u : pass == 1 ? 0xffe00000u : 0xfffffc00u;
}

// The non-finite flag of each segment whose a holds a NaN or an Inf (nothing written).
// grid: blocks loop over tiles of `tile` elements. bytes: reads 8n (DGC 12n).
extern "C" __global__ void sparse_topk_finite_segments(const long long* __restrict__ seg,
                                                       long long nseg, long long ntiles,
                                                       long long tile, float momentum,
                                                       unsigned int* __restrict__ states)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sparse_tile_segment(seg, nseg, t);
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        const long long n = row[HVD_TOPK_SEG_N];
        const long long first = (t - row[HVD_SPARSE_SEG_TILE]) * tile;
        const long long end = first + tile < n ? first + tile : n;
        bool bad = false;
        for (long long i = first + threadIdx.x; i < end; i += blockDim.x)
            bad |= (__float_as_uint(hvd_topk_a(row, i, momentum)) & HVD_TOPK_ABS) >= 0x7f800000u;
        if (bad) atomicOr(states + s * HVD_SPARSE_STATE_WORDS + HVD_TOPK_ST_NONFINITE, 1u);
    }
}

// For each finite segment: e <- a (DGC: u <- u', v <- a), and with k > 0 the histogram of
// the first digit of |a|. grid: blocks loop over tiles of `tile` elements. bytes: reads 8n,
// writes 4n (DGC: reads 12n, writes 8n), one atomic add an element.
extern "C" __global__ void sparse_topk_update_segments(const long long* __restrict__ seg,
                                                       long long nseg, long long ntiles,
                                                       long long tile, float momentum,
                                                       const unsigned int* __restrict__ states,
                                                       unsigned int* __restrict__ hist)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sparse_tile_segment(seg, nseg, t);
        const unsigned int* state = states + s * HVD_SPARSE_STATE_WORDS;
        if (state[HVD_TOPK_ST_NONFINITE]) continue;
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        float* e = (float*)row[HVD_TOPK_SEG_A];
        float* u = (float*)row[HVD_TOPK_SEG_U];
        const float* g = (const float*)row[HVD_TOPK_SEG_G];
        unsigned int* h = hist + s * HVD_TOPK_BINS;
        const bool select = row[HVD_TOPK_SEG_K] > 0;
        const long long n = row[HVD_TOPK_SEG_N];
        const long long first = (t - row[HVD_SPARSE_SEG_TILE]) * tile;
        const long long end = first + tile < n ? first + tile : n;
        for (long long i = first + threadIdx.x; i < end; i += blockDim.x) {
            float a;
            if (u) {
                const float un = hvd_topk_velocity(row, i, momentum);
                u[i] = un;
                a = __fadd_rn(e[i], un);
            } else {
                a = __fadd_rn(e[i], g[i]);
            }
            e[i] = a;
            if (select) atomicAdd(h + ((__float_as_uint(a) & HVD_TOPK_ABS) >> 21), 1u);
        }
    }
}

// Digit `pass` of each selecting segment's threshold t: walking the histogram down from
// the top bin, the bin where the count of |a| above reaches the rank left (k at pass 0);
// the rank becomes the rank within that bin, the digit joins the prefix, and the bins are
// zeroed for the next pass. After pass 2 the prefix is t and the rank left is how many
// |a_i| == t are kept. grid: one thread a segment (grid-stride). bytes: reads and zeroes
// up to 8 KiB a segment.
extern "C" __global__ void sparse_topk_pick_segments(const long long* __restrict__ seg,
                                                     long long nseg, int pass,
                                                     unsigned int* __restrict__ hist,
                                                     unsigned int* __restrict__ states)
{
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long s = (long long)blockIdx.x * blockDim.x + threadIdx.x; s < nseg; s += stride) {
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        unsigned int* state = states + s * HVD_SPARSE_STATE_WORDS;
        if (!hvd_topk_active(row, state)) continue;
        unsigned int* h = hist + s * HVD_TOPK_BINS;
        long long* rank = (long long*)(state + HVD_TOPK_ST_RANK);
        const long long want = pass == 0 ? row[HVD_TOPK_SEG_K] : *rank;
        const unsigned int width = hvd_topk_width(pass);
        unsigned int d = width;
        long long above = 0;
        for (; d > 0 && above + (long long)h[d] < want; --d) above += h[d];
        *rank = want - above;
        state[HVD_TOPK_ST_PREFIX] |= d << hvd_topk_shift(pass);
        for (unsigned int b = 0; b <= width; ++b) h[b] = 0u;
    }
}

// The histogram of digit `pass` (1 or 2) of the |a_i| whose higher digits are the prefix.
// grid: blocks loop over tiles of `tile` elements. bytes: reads 4n, an atomic add for each
// element in the prefix's bin.
extern "C" __global__ void sparse_topk_histogram_segments(const long long* __restrict__ seg,
                                                          long long nseg, long long ntiles,
                                                          long long tile, int pass,
                                                          const unsigned int* __restrict__ states,
                                                          unsigned int* __restrict__ hist)
{
    const unsigned int mask = hvd_topk_above_mask(pass), width = hvd_topk_width(pass);
    const int shift = hvd_topk_shift(pass);
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sparse_tile_segment(seg, nseg, t);
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        const unsigned int* state = states + s * HVD_SPARSE_STATE_WORDS;
        if (!hvd_topk_active(row, state)) continue;
        const unsigned int prefix = state[HVD_TOPK_ST_PREFIX];
        const float* a = (const float*)row[HVD_TOPK_SEG_A];
        unsigned int* h = hist + s * HVD_TOPK_BINS;
        const long long n = row[HVD_TOPK_SEG_N];
        const long long first = (t - row[HVD_SPARSE_SEG_TILE]) * tile;
        const long long end = first + tile < n ? first + tile : n;
        for (long long i = first + threadIdx.x; i < end; i += blockDim.x) {
            const unsigned int w = __float_as_uint(a[i]) & HVD_TOPK_ABS;
            if ((w & mask) == prefix) atomicAdd(h + ((w >> shift) & width), 1u);
        }
    }
}

// ties[i] = 1 where |a_i| == t in a selecting segment, else 0 (every element of the
// bucket). grid: blocks loop over tiles of `tile` elements. bytes: reads 4n, writes n.
extern "C" __global__ void sparse_topk_ties_segments(const long long* __restrict__ seg,
                                                     long long nseg, long long ntiles,
                                                     long long tile,
                                                     const unsigned int* __restrict__ states,
                                                     unsigned char* __restrict__ ties)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sparse_tile_segment(seg, nseg, t);
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        const unsigned int* state = states + s * HVD_SPARSE_STATE_WORDS;
        const bool active = hvd_topk_active(row, state);
        const unsigned int thr = state[HVD_TOPK_ST_PREFIX];
        const float* a = (const float*)row[HVD_TOPK_SEG_A];
        unsigned char* f = ties + row[HVD_TOPK_SEG_FLAGS];
        const long long n = row[HVD_TOPK_SEG_N];
        const long long first = (t - row[HVD_SPARSE_SEG_TILE]) * tile;
        const long long end = first + tile < n ? first + tile : n;
        for (long long i = first + threadIdx.x; i < end; i += blockDim.x)
            f[i] = active && (__float_as_uint(a[i]) & HVD_TOPK_ABS) == thr ? 1 : 0;
    }
}

// keep[i] = 1 where |a_i| > t, or |a_i| == t and at most `rank left` ties come before or
// at i (from `ties_incl`, the inclusive scan of the ties), in a selecting segment; else 0.
// grid: blocks loop over tiles of `tile` elements. bytes: reads 4n + 8n, writes n.
extern "C" __global__ void sparse_topk_keep_segments(const long long* __restrict__ seg,
                                                     long long nseg, long long ntiles,
                                                     long long tile,
                                                     const unsigned int* __restrict__ states,
                                                     const long long* __restrict__ ties_incl,
                                                     unsigned char* __restrict__ keep)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sparse_tile_segment(seg, nseg, t);
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        const unsigned int* state = states + s * HVD_SPARSE_STATE_WORDS;
        const bool active = hvd_topk_active(row, state);
        const unsigned int thr = state[HVD_TOPK_ST_PREFIX];
        const long long need = *(const long long*)(state + HVD_TOPK_ST_RANK);
        const float* a = (const float*)row[HVD_TOPK_SEG_A];
        const long long off = row[HVD_TOPK_SEG_FLAGS];
        const long long before = off > 0 ? ties_incl[off - 1] : 0;
        const long long n = row[HVD_TOPK_SEG_N];
        const long long first = (t - row[HVD_SPARSE_SEG_TILE]) * tile;
        const long long end = first + tile < n ? first + tile : n;
        for (long long i = first + threadIdx.x; i < end; i += blockDim.x) {
            const unsigned int w = __float_as_uint(a[i]) & HVD_TOPK_ABS;
            const bool kept = w > thr || (w == thr && ties_incl[off + i] - before <= need);
            keep[off + i] = active && kept ? 1 : 0;
        }
    }
}

// For each kept element (slot j: its rank among the segment's kept ones, from `incl`, the
// inclusive scan of the kept flags): value j of the body = a_i, index j = i, then a_i = 0
// (DGC: u_i = 0 too). Top-k + sign (`slot_indices` set): column 7 is instead the
// segment's first slot in `slot_values`; value j goes there and index j (int64) to the
// same slot of `slot_indices`, and a stays (sparse_topkq_write_segments subtracts +-m).
// grid: blocks loop over tiles of `tile` elements. bytes: reads n + 8n, and for each kept
// element reads 4, writes 8 or 12 (+ 4, DGC + 8).
extern "C" __global__ void sparse_topk_gather_segments(const long long* __restrict__ seg,
                                                       long long nseg, long long ntiles,
                                                       long long tile, long long wide_from,
                                                       const unsigned char* __restrict__ keep,
                                                       const long long* __restrict__ incl,
                                                       const float* __restrict__ slot_values,
                                                       long long* __restrict__ slot_indices)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sparse_tile_segment(seg, nseg, t);
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        float* a = (float*)row[HVD_TOPK_SEG_A];
        float* u = (float*)row[HVD_TOPK_SEG_U];
        float* values = (float*)row[HVD_TOPK_SEG_BODY];
        const long long n = row[HVD_TOPK_SEG_N], k = row[HVD_TOPK_SEG_K];
        unsigned int* indices = (unsigned int*)(values + k);  // 4-byte aligned words
        long long* slots = slot_indices ? slot_indices + (values - slot_values) : 0;
        const bool wide = n >= wide_from;
        const long long off = row[HVD_TOPK_SEG_FLAGS];
        const long long before = off > 0 ? incl[off - 1] : 0;
        const long long first = (t - row[HVD_SPARSE_SEG_TILE]) * tile;
        const long long end = first + tile < n ? first + tile : n;
        for (long long i = first + threadIdx.x; i < end; i += blockDim.x) {
            if (!keep[off + i]) continue;
            const long long j = incl[off + i] - 1 - before;
            values[j] = a[i];
            if (slots) {
                slots[j] = i;
                continue;
            }
            hvd_topk_put_index(indices, j, i, wide);
            a[i] = 0.0f;
            if (u) u[i] = 0.0f;
        }
    }
}

// Top-k + sign's bodies, after the host has the magnitudes ms[s] (float32 of the correctly
// rounded mean of the kept |a|, from primitives_chunk_sums over `slot_values`; 0 where
// k = 0): m, the k indices (int32, or int64 from `wide_from` elements on), the sign bits
// (1 for a value < 0, LSB first, padding zero), and a_i -= (value < 0 ? -m : m) at each
// kept i; non-finite segments are skipped (kernels/sparse.c's hvdc_topkq_write_segments).
// Table (its own rows of 8 int64): 0 a, 1 the body (4-byte aligned), 2 n, 4 k, 6 the
// first slot tile (max(k, 1) slots a segment), 7 the first slot in `slot_values`. grid:
// blocks loop over tiles of `tile` slots. bytes: per kept value reads 4 + 8 + 4 + 4/8,
// writes 4 or 8 + 4 + 1/8.
#define HVD_TOPKQ_SEG_A 0
#define HVD_TOPKQ_SEG_BODY 1
extern "C" __global__ void sparse_topkq_write_segments(const long long* __restrict__ seg,
                                                       long long nseg, long long ntiles,
                                                       long long tile, long long wide_from,
                                                       const float* __restrict__ slot_values,
                                                       const long long* __restrict__ slot_indices,
                                                       const float* __restrict__ ms,
                                                       const unsigned int* __restrict__ states)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sparse_tile_segment(seg, nseg, t);
        if (states[s * HVD_SPARSE_STATE_WORDS + HVD_TOPK_ST_NONFINITE]) continue;
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        float* a = (float*)row[HVD_TOPKQ_SEG_A];
        unsigned char* body = (unsigned char*)row[HVD_TOPKQ_SEG_BODY];
        const float* values = (const float*)row[HVD_TOPK_SEG_BODY];
        const long long* slots = slot_indices + (values - slot_values);
        const long long n = row[HVD_TOPK_SEG_N], k = row[HVD_TOPK_SEG_K];
        const bool wide = n >= wide_from;
        unsigned int* indices = (unsigned int*)(body + 4);
        unsigned char* signs = body + 4 + (wide ? 8 : 4) * k;
        const float m = ms[s];
        const long long first = (t - row[HVD_SPARSE_SEG_TILE]) * tile;
        if (first == 0 && threadIdx.x == 0) *(float*)body = m;  // once a segment, k = 0 too
        const long long end = first + tile < k ? first + tile : k;
        for (long long j = first + threadIdx.x; j < end; j += blockDim.x) {
            const long long i = slots[j];
            hvd_topk_put_index(indices, j, i, wide);
            a[i] = __fsub_rn(a[i], values[j] < 0.0f ? -m : m);
            if ((j & 7) == 0) {  // the sign byte of slots j .. j + 7
                unsigned int byte = 0u;
                for (long long b = 0; b < 8 && j + b < k; ++b)
                    byte |= (values[j + b] < 0.0f ? 1u : 0u) << b;
                signs[j >> 3] = (unsigned char)byte;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Random-k's buckets (docs/baselines.md; the CPU's hvdc_randomk_*_segments).
// Both sides start with every segment's kept flags (element i kept iff its uniform
// < T 2^-24) and one scan of the bucket's flags on the host's stream, which gives a kept
// element its slot in the body.
// Encode: every segment's kept count and non-finite flag, one read, then the kept values
// into the bodies (and with error feedback e = a with the kept entries zeroed).
// Decode: every segment's kept count and values checked, one read, then the scaled values
// added at the kept elements of the segments before the first refused one.
// Table: column 0 g (encode) or the values (decode: little-endian float32, any byte
// offset), 1 e (encode; 0 for none) or out (decode), 2 n, 3 the segment's first flag in
// the bucket, 4 its first value tile (decode: max(values, 1) a segment), 5 the key, 6 its
// first element tile, 7 the body's bytes (decode).
#define HVD_RANDOMK_SEG_IN 0
#define HVD_RANDOMK_SEG_AUX 1
#define HVD_RANDOMK_SEG_N 2
#define HVD_RANDOMK_SEG_FLAGS 3
#define HVD_RANDOMK_SEG_VALUE_TILE 4
#define HVD_RANDOMK_SEG_KEY 5
#define HVD_RANDOMK_SEG_TILE 6
#define HVD_RANDOMK_SEG_BODY_LEN 7
#define HVD_RANDOMK_ST_NONFINITE 2
#define HVD_RANDOMK_ST_ERROR 3
#define HVD_RANDOMK_ST_COUNT 4      // int64 at words 4-5 (threelc.cu's HVD_ST_COUNT)
#define HVD_RANDOMK_ERR_VALUE 128u  // a value is not finite (quant.cu's error bits below it)

// grid: blocks loop over tiles of `tile` elements. bytes: writes n over all segments.
extern "C" __global__ void quant_randomk_flags_segments(const long long* __restrict__ seg,
                                                        long long nseg, long long ntiles,
                                                        long long tile, float limit,
                                                        unsigned char* __restrict__ flags)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sparse_tile_segment_at(seg, nseg, t, HVD_RANDOMK_SEG_TILE);
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        const long long n = row[HVD_RANDOMK_SEG_N];
        const unsigned long long key = (unsigned long long)row[HVD_RANDOMK_SEG_KEY];
        unsigned char* f = flags + row[HVD_RANDOMK_SEG_FLAGS];
        const long long first = (t - row[HVD_RANDOMK_SEG_TILE]) * tile;
        const long long end = first + tile < n ? first + tile : n;
        for (long long i = first + threadIdx.x; i < end; i += blockDim.x)
            f[i] = hvd_sparse_uniform(key, i) < limit ? 1 : 0;
    }
}

// Each segment's kept count (from the inclusive scan `incl` of the flags) into its state's
// count words, and HVD_RANDOMK_ERR_VALUE for a value (of the body's whole float32s) that is
// not finite. grid: blocks loop over tiles of `tile` values (tile column 4). bytes: reads
// the bodies and 16 bytes of the scan a segment.
extern "C" __global__ void quant_randomk_check_segments(const long long* __restrict__ seg,
                                                        long long nseg, long long ntiles,
                                                        long long tile,
                                                        const long long* __restrict__ incl,
                                                        unsigned int* __restrict__ states)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sparse_tile_segment_at(seg, nseg, t, HVD_RANDOMK_SEG_VALUE_TILE);
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        const unsigned char* values = (const unsigned char*)row[HVD_RANDOMK_SEG_IN];
        const long long n = row[HVD_RANDOMK_SEG_N], off = row[HVD_RANDOMK_SEG_FLAGS];
        const long long count = row[HVD_RANDOMK_SEG_BODY_LEN] / 4;
        unsigned int* state = states + s * HVD_SPARSE_STATE_WORDS;
        const long long first = (t - row[HVD_RANDOMK_SEG_VALUE_TILE]) * tile;
        if (first == 0 && threadIdx.x == 0) {  // once a segment
            const long long before = off > 0 ? incl[off - 1] : 0;
            *(long long*)(state + HVD_RANDOMK_ST_COUNT) = n > 0 ? incl[off + n - 1] - before : 0;
        }
        const long long end = first + tile < count ? first + tile : count;
        bool bad = false;
        for (long long j = first + threadIdx.x; j < end; j += blockDim.x)
            bad |= hvd_sparse_nonfinite(hvd_sparse_value(values, j));
        if (bad) atomicOr(state + HVD_RANDOMK_ST_ERROR, HVD_RANDOMK_ERR_VALUE);
    }
}

// out[i] += value_j * scale at the kept elements (value j: element i's rank among the
// segment's kept ones, from the scan), for the checked segments the host launches it
// over. grid: blocks loop over tiles of `tile` elements. bytes: reads n + 8n + the values
// + 4 per kept element, writes 4 per kept element.
extern "C" __global__ void quant_randomk_add_segments(const long long* __restrict__ seg,
                                                      long long nseg, long long ntiles,
                                                      long long tile,
                                                      const unsigned char* __restrict__ flags,
                                                      const long long* __restrict__ incl,
                                                      float scale)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sparse_tile_segment_at(seg, nseg, t, HVD_RANDOMK_SEG_TILE);
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        const unsigned char* values = (const unsigned char*)row[HVD_RANDOMK_SEG_IN];
        float* out = (float*)row[HVD_RANDOMK_SEG_AUX];
        const long long n = row[HVD_RANDOMK_SEG_N], off = row[HVD_RANDOMK_SEG_FLAGS];
        const long long before = off > 0 ? incl[off - 1] : 0;
        const long long first = (t - row[HVD_RANDOMK_SEG_TILE]) * tile;
        const long long end = first + tile < n ? first + tile : n;
        for (long long i = first + threadIdx.x; i < end; i += blockDim.x) {
            if (!flags[off + i]) continue;
            const float v = hvd_sparse_value(values, incl[off + i] - 1 - before);
            out[i] = __fadd_rn(out[i], __fmul_rn(v, scale));
        }
    }
}

// a_i of the encode: g_i + e_i (e's address in column 1; 0 for none: g_i).
__device__ __forceinline__ float hvd_randomk_a(const long long* row, long long i)
{
    const float* g = (const float*)row[HVD_RANDOMK_SEG_IN];
    const float* e = (const float*)row[HVD_RANDOMK_SEG_AUX];
    return e ? __fadd_rn(e[i], g[i]) : g[i];
}

// The encode's kept count of each segment into its state's count words, and its
// non-finite flag when some a_i is a NaN or an Inf. grid: blocks loop over tiles of
// `tile` elements. bytes: reads 4n (8n with e) and 16 bytes of the scan a segment.
extern "C" __global__ void quant_randomk_count_segments(const long long* __restrict__ seg,
                                                        long long nseg, long long ntiles,
                                                        long long tile,
                                                        const long long* __restrict__ incl,
                                                        unsigned int* __restrict__ states)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sparse_tile_segment_at(seg, nseg, t, HVD_RANDOMK_SEG_TILE);
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        const long long n = row[HVD_RANDOMK_SEG_N], off = row[HVD_RANDOMK_SEG_FLAGS];
        unsigned int* state = states + s * HVD_SPARSE_STATE_WORDS;
        const long long first = (t - row[HVD_RANDOMK_SEG_TILE]) * tile;
        if (first == 0 && threadIdx.x == 0) {  // once a segment (each has n >= 1)
            const long long before = off > 0 ? incl[off - 1] : 0;
            *(long long*)(state + HVD_RANDOMK_ST_COUNT) = incl[off + n - 1] - before;
        }
        const long long end = first + tile < n ? first + tile : n;
        bool bad = false;
        for (long long i = first + threadIdx.x; i < end; i += blockDim.x)
            bad |= hvd_sparse_nonfinite(hvd_randomk_a(row, i));
        if (bad) atomicOr(state + HVD_RANDOMK_ST_NONFINITE, 1u);
    }
}

// The kept a_i of each finite segment into its body (bodies[s], float32, slot: the
// element's rank among the kept ones) and, with e, e_i = kept ? 0 : a_i; a non-finite
// segment is left as it is. grid: blocks loop over tiles of `tile` elements. bytes:
// reads 4n (8n with e) + n + 8n, writes 4 per kept element (+ 4n with e).
extern "C" __global__ void quant_randomk_gather_segments(const long long* __restrict__ seg,
                                                         long long nseg, long long ntiles,
                                                         long long tile,
                                                         const unsigned char* __restrict__ flags,
                                                         const long long* __restrict__ incl,
                                                         const long long* __restrict__ bodies,
                                                         const unsigned int* __restrict__ states)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sparse_tile_segment_at(seg, nseg, t, HVD_RANDOMK_SEG_TILE);
        if (states[s * HVD_SPARSE_STATE_WORDS + HVD_RANDOMK_ST_NONFINITE]) continue;
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        float* e = (float*)row[HVD_RANDOMK_SEG_AUX];
        float* values = (float*)bodies[s];
        const long long n = row[HVD_RANDOMK_SEG_N], off = row[HVD_RANDOMK_SEG_FLAGS];
        const long long before = off > 0 ? incl[off - 1] : 0;
        const long long first = (t - row[HVD_RANDOMK_SEG_TILE]) * tile;
        const long long end = first + tile < n ? first + tile : n;
        for (long long i = first + threadIdx.x; i < end; i += blockDim.x) {
            const float a = hvd_randomk_a(row, i);
            const bool kept = flags[off + i] != 0;
            if (kept) values[incl[off + i] - 1 - before] = a;
            if (e) e[i] = kept ? 0.0f : a;
        }
    }
}

// ---------------------------------------------------------------------------------------
// GSpar's buckets (docs/baselines.md, "Top-k + sign and GSpar"; the CPU's
// hvdc_gspar_encode_segments):
// p_i = min(1, c |a_i|), c the fixed point of c = (T - |S|) / sum_{i not in S} |a_i|, S the
// entries saturated at c, for every tensor of a bucket at once. The host reads once per
// round of the iteration (every tensor's saturated count and chunk sums in one copy),
// not once per tensor and round:
//   quant_gspar_prepare_segments   the non-finite flag and the non-zero count of a
//   quant_gspar_form_segments      a = g + e into e (error feedback), where finite
//   quant_gspar_round_segments     a round at the scales the host sent: the saturated
//                                  count and the ordered chunk sums of the others
//   quant_gspar_flags_segments     kept iff u_i < p_i; then one scan of the bucket's flags
//   quant_gspar_count_segments     each tensor's kept count, read by the host to size
//                                  the bodies
//   quant_gspar_gather_segments    the values (a_i / p_i, or a_i unscaled with error
//                                  feedback) and indices into the bodies, e_i = 0 there
// Table: column 0 g, 1 e (0: none; a = g), 2 n, 3 the segment's first flag in the
// bucket, 4 its first chunk, 5 the key, 6 its first element tile. `scales[s]`: the float32
// c of segment s; +inf keeps every non-zero entry (p_i = [a_i != 0]); negative: the
// segment takes no part (non-finite, or left to the per-tensor path).
#define HVD_GSPAR_SEG_IN 0
#define HVD_GSPAR_SEG_AUX 1
#define HVD_GSPAR_SEG_N 2
#define HVD_GSPAR_SEG_FLAGS 3
#define HVD_GSPAR_SEG_CHUNK 4
#define HVD_GSPAR_SEG_KEY 5
#define HVD_GSPAR_SEG_TILE 6
#define HVD_GSPAR_ST_NONFINITE 2
#define HVD_GSPAR_ST_COUNT 4  // int64 at words 4-5: the non-zero count, then the kept count

// a_i of a row: e_i once formed (or g_i + e_i before), else g_i.
__device__ __forceinline__ float hvd_gspar_a(const long long* row, long long i, bool formed)
{
    const float* g = (const float*)row[HVD_GSPAR_SEG_IN];
    const float* e = (const float*)row[HVD_GSPAR_SEG_AUX];
    if (!e) return g[i];
    return formed ? e[i] : __fadd_rn(e[i], g[i]);
}

// p_i at the scale c: min(|a_i| c, 1) (one float32 product), or [a_i != 0] at c = +inf.
__device__ __forceinline__ float hvd_gspar_p(float a, float c)
{
    const float m = fabsf(a);
    if (__float_as_uint(c) == 0x7f800000u) return m > 0.0f ? 1.0f : 0.0f;  // +inf
    const float q = __fmul_rn(m, c);
    return q > 1.0f ? 1.0f : q;
}

// Each segment's non-finite flag (some a_i a NaN or an Inf) and non-zero count of a.
// grid: blocks loop over tiles of `tile` elements. bytes: reads 4n (8n with e).
extern "C" __global__ void quant_gspar_prepare_segments(const long long* __restrict__ seg,
                                                        long long nseg, long long ntiles,
                                                        long long tile,
                                                        unsigned int* __restrict__ states)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sparse_tile_segment_at(seg, nseg, t, HVD_GSPAR_SEG_TILE);
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        unsigned int* state = states + s * HVD_SPARSE_STATE_WORDS;
        const long long n = row[HVD_GSPAR_SEG_N];
        const long long first = (t - row[HVD_GSPAR_SEG_TILE]) * tile;
        const long long end = first + tile < n ? first + tile : n;
        bool bad = false;
        unsigned long long nonzero = 0ull;
        for (long long i = first + threadIdx.x; i < end; i += blockDim.x) {
            const float a = hvd_gspar_a(row, i, false);
            bad |= hvd_sparse_nonfinite(a);
            nonzero += a != 0.0f;
        }
        if (bad) atomicOr(state + HVD_GSPAR_ST_NONFINITE, 1u);
        if (nonzero) atomicAdd((unsigned long long*)(state + HVD_GSPAR_ST_COUNT), nonzero);
    }
}

// e_i = e_i + g_i for each finite segment with a residual. grid: blocks loop over tiles of
// `tile` elements. bytes: reads 8n, writes 4n.
extern "C" __global__ void quant_gspar_form_segments(const long long* __restrict__ seg,
                                                     long long nseg, long long ntiles,
                                                     long long tile,
                                                     const unsigned int* __restrict__ states)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sparse_tile_segment_at(seg, nseg, t, HVD_GSPAR_SEG_TILE);
        if (states[s * HVD_SPARSE_STATE_WORDS + HVD_GSPAR_ST_NONFINITE]) continue;
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        const float* g = (const float*)row[HVD_GSPAR_SEG_IN];
        float* e = (float*)row[HVD_GSPAR_SEG_AUX];
        if (!e) continue;
        const long long n = row[HVD_GSPAR_SEG_N];
        const long long first = (t - row[HVD_GSPAR_SEG_TILE]) * tile;
        const long long end = first + tile < n ? first + tile : n;
        for (long long i = first + threadIdx.x; i < end; i += blockDim.x)
            e[i] = __fadd_rn(e[i], g[i]);
    }
}

// One round at scales[s] >= 0 (c = 0 saturates nothing): counts[s] += how many |a_i| c
// >= 1 (one float32 product), sums[ch] = the sum in double, left to right, of the other
// |a_i| of chunk ch (`chunk` elements of a segment; its last may be short), as the CPU's
// hvdc_gspar_round. grid: one thread a chunk (grid-stride over the bucket's `nchunks`).
// bytes: reads 4 an element, writes 8 a chunk (uncoalesced: chunks of 1024 elements).
extern "C" __global__ void quant_gspar_round_segments(const long long* __restrict__ seg,
                                                      long long nseg, long long nchunks,
                                                      long long chunk,
                                                      const float* __restrict__ scales,
                                                      unsigned long long* __restrict__ counts,
                                                      double* __restrict__ sums)
{
    const long long stride = hvd_sparse_grid_stride();
    for (long long ch = hvd_sparse_first_index(); ch < nchunks; ch += stride) {
        const long long s = hvd_sparse_tile_segment_at(seg, nseg, ch, HVD_GSPAR_SEG_CHUNK);
        const float c = scales[s];
        if (!(c >= 0.0f)) continue;
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        const long long n = row[HVD_GSPAR_SEG_N];
        const long long lo = (ch - row[HVD_GSPAR_SEG_CHUNK]) * chunk;
        const long long hi = lo + chunk < n ? lo + chunk : n;
        unsigned long long saturated = 0ull;
        double sum = 0.0;
        for (long long i = lo; i < hi; ++i) {
            const float m = fabsf(hvd_gspar_a(row, i, true));
            const bool sat = __fmul_rn(m, c) >= 1.0f;
            saturated += sat;
            sum = hvd_sparse_dadd(sum, sat ? 0.0 : (double)m);
        }
        sums[ch] = sum;
        if (saturated) atomicAdd(counts + s, saturated);
    }
}

// flags[off + i] = 1 iff u_i < p_i at scales[s] (0 for a segment that takes no part).
// grid: blocks loop over tiles of `tile` elements. bytes: reads 4n, writes n.
extern "C" __global__ void quant_gspar_flags_segments(const long long* __restrict__ seg,
                                                      long long nseg, long long ntiles,
                                                      long long tile,
                                                      const float* __restrict__ scales,
                                                      unsigned char* __restrict__ flags)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sparse_tile_segment_at(seg, nseg, t, HVD_GSPAR_SEG_TILE);
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        const float c = scales[s];
        const unsigned long long key = (unsigned long long)row[HVD_GSPAR_SEG_KEY];
        unsigned char* f = flags + row[HVD_GSPAR_SEG_FLAGS];
        const long long n = row[HVD_GSPAR_SEG_N];
        const long long first = (t - row[HVD_GSPAR_SEG_TILE]) * tile;
        const long long end = first + tile < n ? first + tile : n;
        for (long long i = first + threadIdx.x; i < end; i += blockDim.x) {
            const bool kept =
                c >= 0.0f && hvd_sparse_uniform(key, i) < hvd_gspar_p(hvd_gspar_a(row, i, true), c);
            f[i] = kept ? 1 : 0;
        }
    }
}

// Each segment's kept count (from `incl`, the inclusive scan of the flags) into its
// state's count words. grid: one thread a segment (grid-stride). bytes: 16 a segment.
extern "C" __global__ void quant_gspar_count_segments(const long long* __restrict__ seg,
                                                      long long nseg,
                                                      const long long* __restrict__ incl,
                                                      unsigned int* __restrict__ states)
{
    const long long stride = hvd_sparse_grid_stride();
    for (long long s = hvd_sparse_first_index(); s < nseg; s += stride) {
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        const long long n = row[HVD_GSPAR_SEG_N], off = row[HVD_GSPAR_SEG_FLAGS];
        const long long before = off > 0 ? incl[off - 1] : 0;
        *(long long*)(states + s * HVD_SPARSE_STATE_WORDS + HVD_GSPAR_ST_COUNT) =
            incl[off + n - 1] - before;
    }
}

// The kept entries of each segment with a body (bodies[s] != 0: k float32 values, then k
// indices, int32, or int64 from `wide_from` elements on; k from the state's count): value
// j = a_i / p_i (`scaled`) or a_i, index j = i (slot j: i's rank among the kept ones), and
// with a residual e_i = 0. grid: blocks loop over tiles of `tile` elements. bytes: reads
// n + 8n, and for each kept element reads 4, writes 8 or 12 (+ 4 with e).
extern "C" __global__ void quant_gspar_gather_segments(const long long* __restrict__ seg,
                                                       long long nseg, long long ntiles,
                                                       long long tile, int scaled,
                                                       long long wide_from,
                                                       const float* __restrict__ scales,
                                                       const unsigned char* __restrict__ flags,
                                                       const long long* __restrict__ incl,
                                                       const long long* __restrict__ bodies,
                                                       const unsigned int* __restrict__ states)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sparse_tile_segment_at(seg, nseg, t, HVD_GSPAR_SEG_TILE);
        float* values = (float*)bodies[s];
        if (!values) continue;
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        float* e = (float*)row[HVD_GSPAR_SEG_AUX];
        const float c = scales[s];
        const long long n = row[HVD_GSPAR_SEG_N], off = row[HVD_GSPAR_SEG_FLAGS];
        const long long k =
            *(const long long*)(states + s * HVD_SPARSE_STATE_WORDS + HVD_GSPAR_ST_COUNT);
        unsigned int* indices = (unsigned int*)(values + k);  // 4-byte aligned words
        const bool wide = n >= wide_from;
        const long long before = off > 0 ? incl[off - 1] : 0;
        const long long first = (t - row[HVD_GSPAR_SEG_TILE]) * tile;
        const long long end = first + tile < n ? first + tile : n;
        for (long long i = first + threadIdx.x; i < end; i += blockDim.x) {
            if (!flags[off + i]) continue;
            const long long j = incl[off + i] - 1 - before;
            const float a = hvd_gspar_a(row, i, true);
            values[j] = scaled ? __fdiv_rn(a, hvd_gspar_p(a, c)) : a;
            if (wide) {  // little-endian int64 as two words (j odd: not 8-byte aligned)
                indices[2 * j] = (unsigned int)((unsigned long long)i & 0xffffffffull);
                indices[2 * j + 1] = (unsigned int)((unsigned long long)i >> 32);
            } else {
                indices[j] = (unsigned int)i;
            }
            if (e) e[i] = 0.0f;
        }
    }
}
