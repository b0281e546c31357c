// Checksums and frames on CUDA: the payload checksum (section 1), its bucket form and the
// checksum fields written on the device (section 2), the scan of one rank's frame gathered
// on the device (section 3) and the length prefixes of a device allgather (section 4). The
// CUDA twin of kernels/frame.c (hvdc_checksum, hvdc_checksum_segments, hvdc_frame_scan),
// byte for byte the same; the checksum is defined in hvdcompress/wire.py and
// docs/wire-format.md.
//
// Compiled three ways from this one file, like kernels/threelc.cu: by NVRTC through
// hvdcompress/backends/cuda (NVRTC_OPTIONS of hvdcompress/_native.py), by nvcc in
// scripts/check_kernels.sh, and by g++ for the host through kernels/cuda_host.h
// (tests/host_kernels/). Hence plain C-like code, no #include under CUDA, no barriers or
// shared memory, no code that needs two threads at once; the warp reduction of
// hvd_warp_atomic_add reduces nothing on the host (each thread then does its own atomic,
// which gives the same sum). Names: kernels hvd_checksum*, hvd_frame_* and
// hvd_length_prefixes (the names the backend launches), helpers hvd_frame_* where
// threelc.cu has the same helper (the host build compiles every .cu file in one unit).
// Every index is 64-bit; every kernel is a grid-stride loop (or, for one small table, one
// thread), so any grid size is correct; the backend launches 256 threads per block (a
// multiple of 32 is required by the warp helper) and at most 8 blocks per SM.
//
// `state` rows are threelc.cu's 8-word uint32 scratch arrays; the checksum accumulates in
// word 7 (threelc.cu's HVD_ST_SUM), atomicAdd (mod 2^32). Segment tables are threelc.cu
// section 7's rows of 8 int64 (its HVD_SEG_*), of which the checksum reads three columns.
#define HVD_FRAME_ST_SUM 7
#define HVD_FRAME_STATE_WORDS 8
#define HVD_FRAME_SEG_COLS 8
#define HVD_FRAME_SEG_IN 0    // pointer: the payload's first byte
#define HVD_FRAME_SEG_N 2     // bytes
#define HVD_FRAME_SEG_TILE 6  // the segment's first tile

#ifndef __CUDACC__
#include "cuda_host.h"
#endif

// ---------------------------------------------------------------------------------------
// Helpers (threelc.cu's, under frame names but hvd_warp_atomic_add, which only the
// checksums use)

__device__ __forceinline__ long long hvd_frame_first_index()
{
    return (long long)blockIdx.x * (long long)blockDim.x + (long long)threadIdx.x;
}

__device__ __forceinline__ long long hvd_frame_grid_stride()
{
    return (long long)gridDim.x * (long long)blockDim.x;
}

// Warp-aggregated atomic add. Must be reached by all 32 lanes of the warp (so: after the
// grid-stride loop, never inside a divergent branch), with blockDim.x a multiple of 32.
__device__ __forceinline__ void hvd_warp_atomic_add(unsigned int* p, unsigned int v)
{
#ifdef __CUDACC__
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    v = __reduce_add_sync(0xffffffffu, v);
#else
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
#endif
    if ((threadIdx.x & 31u) == 0u) atomicAdd(p, v);
#else
    atomicAdd(p, v);
#endif
}

// ---------------------------------------------------------------------------------------
// 1. Payload checksum: sum over j < len of (buf[j] + 1) * mix(offset + j) mod 2^32 with
// mix(p) = (uint32)((uint64)p * 0x9E3779B97F4A7C15 >> 32) | 1 (see hvdcompress/wire.py).
// Addition mod 2^32 is order-independent, so the atomic reduction equals the CPU's sum.
// grid: grid-stride over len bytes. bytes: reads len; one atomic per warp.
__device__ __forceinline__ unsigned int hvd_checksum_term(unsigned char b, unsigned long long p)
{
    const unsigned int w = (unsigned int)((p * 0x9E3779B97F4A7C15ull) >> 32) | 1u;
    return ((unsigned int)b + 1u) * w;
}

extern "C" __global__ void hvd_checksum(const unsigned char* __restrict__ buf, long long len,
                                        unsigned long long offset,
                                        unsigned int* __restrict__ state)
{
    unsigned int acc = 0u;
    const long long stride = hvd_frame_grid_stride();
    for (long long j = hvd_frame_first_index(); j < len; j += stride) {
        acc += hvd_checksum_term(buf[j], offset + (unsigned long long)j);
    }
    hvd_warp_atomic_add(state + HVD_FRAME_ST_SUM, acc);
}

// ---------------------------------------------------------------------------------------
// 2. Checksums of a bucket (threelc.cu section 7's segment tables and tiles, a tile being
// `tile` bytes).

// The segment of tile t: the last row whose first tile is <= t.
__device__ __forceinline__ long long hvd_frame_tile_segment(const long long* seg,
                                                            long long nseg, long long t)
{
    long long lo = 0, hi = nseg - 1;
    while (lo < hi) {
        const long long mid = (lo + hi + 1) >> 1;
        if (seg[mid * HVD_FRAME_SEG_COLS + HVD_FRAME_SEG_TILE] <= t) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

__device__ __forceinline__ long long hvd_frame_min64(long long a, long long b)
{
    return a < b ? a : b;
}

// Segment form of hvd_checksum (offset 0): each segment's sum into its state.
// grid: blocks loop over the tiles of `tile` bytes. bytes: reads every segment's bytes;
// one atomic per warp and tile.
extern "C" __global__ void hvd_checksum_segments(const long long* __restrict__ seg,
                                                 long long nseg, long long ntiles,
                                                 long long tile,
                                                 unsigned int* __restrict__ states)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_frame_tile_segment(seg, nseg, t);
        const long long* row = seg + s * HVD_FRAME_SEG_COLS;
        const unsigned char* buf = (const unsigned char*)row[HVD_FRAME_SEG_IN];
        const long long first = (t - row[HVD_FRAME_SEG_TILE]) * tile;
        const long long end = hvd_frame_min64(first + tile, row[HVD_FRAME_SEG_N]);
        unsigned int acc = 0u;
        for (long long j = first + threadIdx.x; j < end; j += blockDim.x) {
            acc += hvd_checksum_term(buf[j], (unsigned long long)j);
        }
        hvd_warp_atomic_add(states + s * HVD_FRAME_STATE_WORDS + HVD_FRAME_ST_SUM, acc);
    }
}

// Writes each segment's checksum (from hvd_checksum_segments) little-endian into the 4
// bytes at its first byte + field: a frame's checksum fields, with no host round trip.
// grid: grid-stride over nseg segments. bytes: reads 4, writes 4 a segment.
extern "C" __global__ void hvd_checksum_store(const long long* __restrict__ seg,
                                              long long nseg, long long field,
                                              const unsigned int* __restrict__ states)
{
    const long long stride = hvd_frame_grid_stride();
    for (long long s = hvd_frame_first_index(); s < nseg; s += stride) {
        unsigned char* at = (unsigned char*)seg[s * HVD_FRAME_SEG_COLS + HVD_FRAME_SEG_IN] + field;
        const unsigned int sum = states[s * HVD_FRAME_STATE_WORDS + HVD_FRAME_ST_SUM];
        for (int k = 0; k < 4; ++k) at[k] = (unsigned char)(sum >> (8 * k));
    }
}

// ---------------------------------------------------------------------------------------
// 3. Frames on the device (docs/wire-format.md, "Bucket frame"): kernels/frame.c's hvdc_frame_scan
// of one rank's frame (wire.frame: count, count uint64 lengths, the payloads) as three
// launches and one device-to-host read of a few hundred bytes per payload, so that a frame
// gathered on the device is checked without copying it to the host:
//   hvd_frame_table      the length table (one thread: count is a bucket's tensor count)
//                        and one checksum segment row per payload;
//   hvd_checksum_segments each payload's sum, its checksum field's own bytes included (the
//                        host takes their terms out: frame.c sums that field as zeros);
//   hvd_frame_headers    each header's layout, frame.c's scan_payload but the checksum.
// `scan` is int64: word 0 the table's verdict (1: it describes the frame; -1: it does not;
// 0: not scanned), then count rows of HVD_FRAME_ROW words: the HVD_FRAME_FIELDS fields in
// wire.SCAN_FIELDS order, the shape (8 words, zero past ndim), the stored checksum, and
// the codec parameters (HVD_FRAME_PARAMS bytes, the first params_len of them written).
// The frame may start at any byte (a slice of a gathered buffer): every multi-byte field
// is loaded byte by byte.
#define HVD_FRAME_FIELDS 10  // frame.c's FRAME_FIELDS
#define HVD_FRAME_OK 0       // ... and the columns used here, frame.c's SCAN_*
#define HVD_FRAME_START 1
#define HVD_FRAME_LENGTH 2
#define HVD_FRAME_CODEC 3
#define HVD_FRAME_FLAGS 4
#define HVD_FRAME_DTYPE 5
#define HVD_FRAME_NDIM 6
#define HVD_FRAME_PARAMS_LEN 7
#define HVD_FRAME_NUMEL 8
#define HVD_FRAME_BODY_LEN 9
#define HVD_FRAME_SHAPE HVD_FRAME_FIELDS              // 8 words
#define HVD_FRAME_STORED (HVD_FRAME_SHAPE + 8)        // the checksum field, zero-extended
#define HVD_FRAME_PARAM_WORDS (HVD_FRAME_STORED + 1)  // wire.MAX_PARAMS bytes
#define HVD_FRAME_PARAMS 256
#define HVD_FRAME_ROW (HVD_FRAME_PARAM_WORDS + HVD_FRAME_PARAMS / 8)
#define HVD_FRAME_FIXED 32  // wire.FIXED_HEADER.size
#define HVD_FRAME_MAX_NDIM 8

__device__ __forceinline__ unsigned long long hvd_load_u64(const unsigned char* p)
{
    unsigned long long v = 0ull;
    for (int k = 7; k >= 0; --k) v = (v << 8) | p[k];  // little-endian, as wire.py packs
    return v;
}

// The length table: count payloads whose lengths add up to the rest of the frame, each
// payload's start and length into its row, and a checksum segment row per payload
// (HVD_FRAME_SEG_IN its first byte, HVD_FRAME_SEG_N its length, HVD_FRAME_SEG_TILE its
// first tile of `tile` bytes; rows past a bad table stay zero: no bytes to sum).
// grid: one thread works (count is small). bytes: reads 8 (count + 1), writes 40 a payload.
extern "C" __global__ void hvd_frame_table(const unsigned char* __restrict__ frame,
                                           long long len, long long count, long long tile,
                                           long long* __restrict__ scan,
                                           long long* __restrict__ seg)
{
    if (hvd_frame_first_index() != 0) return;
    if (count < 0 || count > (len >> 3) - 1 ||
        hvd_load_u64(frame) != (unsigned long long)count) {
        scan[0] = -1;
        return;
    }
    unsigned long long at = 8ull * (unsigned long long)(count + 1);
    for (long long p = 0; p < count; ++p) {
        const unsigned long long n = hvd_load_u64(frame + 8 * (p + 1));
        if (n > (unsigned long long)len - at) {
            scan[0] = -1;
            return;
        }
        at += n;
    }
    if (at != (unsigned long long)len) {
        scan[0] = -1;
        return;
    }
    at = 8ull * (unsigned long long)(count + 1);
    long long first_tile = 0;
    for (long long p = 0; p < count; ++p) {
        const long long n = (long long)hvd_load_u64(frame + 8 * (p + 1));
        long long* row = scan + 1 + p * HVD_FRAME_ROW;
        row[HVD_FRAME_START] = (long long)at;
        row[HVD_FRAME_LENGTH] = n;
        long long* s = seg + p * HVD_FRAME_SEG_COLS;
        s[HVD_FRAME_SEG_IN] = (long long)(frame + at);
        s[HVD_FRAME_SEG_N] = n;
        s[HVD_FRAME_SEG_TILE] = first_tile;
        first_tile += (n + tile - 1) / tile;
        at += (unsigned long long)n;
    }
    scan[0] = 1;
}

// 1 when payload p[0, len) is laid out as wire.parse_header requires, up to the caller's
// own expectations and the checksum (frame.c's scan_payload, field for field and in the
// same order, so that a refused header leaves the same fields written).
__device__ __forceinline__ long long hvd_frame_header(const unsigned char* p, long long len,
                                                      long long* f)
{
    if (len < HVD_FRAME_FIXED) return 0;
    if (p[0] != 'H' || p[1] != 'V' || p[2] != 'D' || p[3] != 'C' || p[4] != 1 || p[9] != 0) {
        return 0;
    }
    const long long ndim = p[8], params_len = p[10] | (p[11] << 8);
    f[HVD_FRAME_CODEC] = p[5];
    f[HVD_FRAME_FLAGS] = p[6];
    f[HVD_FRAME_DTYPE] = p[7];
    f[HVD_FRAME_NDIM] = ndim;
    f[HVD_FRAME_PARAMS_LEN] = params_len;
    if (ndim > HVD_FRAME_MAX_NDIM || params_len > HVD_FRAME_PARAMS) return 0;
    const long long header_len = HVD_FRAME_FIXED + 8 * ndim + params_len;
    if (len < header_len) return 0;
    f[HVD_FRAME_STORED] = (long long)(p[12] | (p[13] << 8) | (p[14] << 16)) |
                          ((long long)p[15] << 24);
    for (long long k = 0; k < params_len; ++k) {
        ((unsigned char*)(f + HVD_FRAME_PARAM_WORDS))[k] = p[header_len - params_len + k];
    }
    const unsigned long long numel = hvd_load_u64(p + 16), body_len = hvd_load_u64(p + 24);
    unsigned long long prod = 1ull, nonzero = 1ull;
    for (long long d = 0; d < ndim; ++d) {
        const unsigned long long dim = hvd_load_u64(p + HVD_FRAME_FIXED + 8 * d);
        f[HVD_FRAME_SHAPE + d] = (long long)dim;
        const unsigned long long factor = dim ? dim : 1ull;
        if (__umul64hi(nonzero, factor) != 0ull) return 0;  // the product passed 2^64
        nonzero *= factor;
        if (nonzero > 0x7fffffffffffffffull) return 0;
        prod *= dim;  // <= nonzero: no overflow
    }
    if (prod != numel || body_len != (unsigned long long)(len - header_len)) return 0;
    f[HVD_FRAME_NUMEL] = (long long)numel;
    f[HVD_FRAME_BODY_LEN] = (long long)body_len;
    return 1;
}

// Each payload's header (after hvd_frame_table; nothing when the table was refused).
// HVD_FRAME_OK is the layout's verdict; the host ands it with the checksum's.
// grid: grid-stride over count payloads. bytes: reads each header, writes a row.
extern "C" __global__ void hvd_frame_headers(const unsigned char* __restrict__ frame,
                                             long long count, long long* __restrict__ scan)
{
    if (scan[0] != 1) return;
    const long long stride = hvd_frame_grid_stride();
    for (long long p = hvd_frame_first_index(); p < count; p += stride) {
        long long* f = scan + 1 + p * HVD_FRAME_ROW;
        f[HVD_FRAME_OK] = hvd_frame_header(frame + f[HVD_FRAME_START], f[HVD_FRAME_LENGTH], f);
    }
}

// ---------------------------------------------------------------------------------------
// 4. Length prefixes of a device allgather.
// Strips a device allgather's framing (hvdcompress/transports/horovod.py: each rank's
// bytes after their 8-byte length). out (int64, size + 2 words): word 0 the verdict (1:
// the prefixes describe buf; -1: rank out[1]'s prefix is missing; -2: rank out[1]
// announced more bytes than arrived, out[2 + rank] its count; -3: out[1] trailing bytes);
// then each rank's byte count.
// grid: one thread works (size is the number of ranks). bytes: reads 8 a rank.
extern "C" __global__ void hvd_length_prefixes(const unsigned char* __restrict__ buf,
                                               long long len, long long size,
                                               long long* __restrict__ out)
{
    if (hvd_frame_first_index() != 0) return;
    long long at = 0;
    for (long long r = 0; r < size; ++r) {
        if (len - at < 8) {
            out[0] = -1;
            out[1] = r;
            return;
        }
        const unsigned long long n = hvd_load_u64(buf + at);
        at += 8;
        out[2 + r] = (long long)n;
        if (n > (unsigned long long)(len - at)) {
            out[0] = -2;
            out[1] = r;
            return;
        }
        at += (long long)n;
    }
    if (at != len) {
        out[0] = -3;
        out[1] = len - at;
        return;
    }
    out[0] = 1;
}
