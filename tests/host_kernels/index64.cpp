// 64-bit index check of kernels/threelc.cu (its bucket kernels too), kernels/frame.cu's
// checksums, kernels/primitives.cu and the element-wise kernels of kernels/sign.cu and
// kernels/quant.cu, run on the host (tests/host_kernels/test_threelc_kernels.py).
//
// Tensors of more than 2^32 elements are mapped with mmap(MAP_NORESERVE): pages that are
// never touched cost nothing (reads of them see zeros), so a 86 GB virtual gradient costs a
// few pages. Each kernel then runs only the blocks of its real grid whose blockIdx.x *
// blockDim.x is above 2^32 (launch_blocks in cuda_host.h), and a second time with a grid
// whose stride gridDim.x * blockDim.x is 2^32 + 256, running block 0 only. Outputs are
// compared with a sequential reference, and the low ends of every output (where a 32-bit
// index would wrap to) hold a sentinel that must survive. A kernel with a 32-bit index or
// stride reads or writes the wrong elements (caught here) or loops for billions of
// iterations (caught by the test's timeout).
//
// Exit status: 0 all passed, 1 a check failed, 77 the mappings were refused (skip).
#include "threelc.cu"
#include "frame.cu"
#include "primitives.cu"
#include "sign.cu"
#include "quant.cu"

#include <sys/mman.h>

#include <algorithm>
#include <vector>

namespace {

const long long K32 = 1LL << 32;
const unsigned int BLOCK = 256;
const unsigned int STRIDE_GRID = (1u << 24) + 1;  // stride = (2^24 + 1) * 256 = 2^32 + 256
const long long STRIDE = (long long)STRIDE_GRID * BLOCK;
const long long LOW = 4096;  // sentinel-filled low end of each output
int failures = 0;

#define CHECK(cond, ...)                                              \
    do {                                                              \
        if (!(cond)) {                                                \
            if (failures < 40) {                                      \
                fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
                fprintf(stderr, __VA_ARGS__);                         \
                fputc('\n', stderr);                                  \
            }                                                         \
            ++failures;                                               \
        }                                                             \
    } while (0)

template <typename T>
T* vmap(long long count)
{
    void* p = mmap(nullptr, (size_t)count * sizeof(T), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        perror("index64: mmap of a sparse virtual buffer failed");
        exit(77);
    }
    return (T*)p;
}

unsigned int grid_of(long long work) { return (unsigned int)((work + BLOCK - 1) / BLOCK); }

// Runs the blocks of the full grid for `work` items that cover items [lo, hi).
template <typename... P, typename... A>
void run_range(void (*k)(P...), long long work, long long lo, long long hi, A... args)
{
    const unsigned long long first = (unsigned long long)(lo / BLOCK);
    const unsigned long long last = (unsigned long long)((hi - 1) / BLOCK);
    launch_blocks(k, grid_of(work), BLOCK, first, last - first + 1, args...);
}

// Runs block 0 of a grid whose stride exceeds 2^32.
template <typename... P, typename... A>
void run_stride(void (*k)(P...), A... args)
{
    launch_blocks(k, STRIDE_GRID, BLOCK, 0ull, 1ull, args...);
}

// Items that block 0 of the stride grid visits, below `work`.
std::vector<long long> stride_items(long long work)
{
    std::vector<long long> v;
    for (long long t = 0; t < BLOCK; ++t)
        for (long long i = t; i < work; i += STRIDE) v.push_back(i);
    return v;
}

long long first_of_block(long long i) { return i / BLOCK * BLOCK; }

template <typename T>
void fill_low(T* p, T v)
{
    for (long long i = 0; i < LOW; ++i) p[i] = v;
}

template <typename T>
long long low_changed(const T* p, T v, long long from)
{
    long long c = 0;
    for (long long i = from; i < LOW; ++i) c += p[i] != v;
    return c;
}

float f_of(unsigned int u) { return __uint_as_float(u); }
unsigned int bits(float f) { return __float_as_uint(f); }

// Reference quantisation of one element (docs/codecs.md, "3LC"), as the CPU backend computes it.
int ref_q(float a, float S)
{
    if (S == 0.0f) return 0;
    return (int)rintf(a / S);
}

float pattern(long long i)
{
    static const float v[] = {-8.0f, -3.9f, 4.1f, 0.0f, 8.0f, 6.0f, -6.0f, 1.0f, -0.0f, 7.5f};
    return v[(unsigned long long)i * 2654435761ull % 10];
}

// ---------------------------------------------------------------------------------------

void test_absmax(float* g, float* e, long long n)
{
    // Data near 2^32; canaries in the low end that correct indexing never reads.
    for (long long i = K32 - 64; i < K32 + 600; ++i) {
        g[i] = pattern(i) * 0.25f;
        e[i] = 0.125f;
    }
    g[K32 + 300] = 7.0f;
    for (long long i = 0; i < 256; ++i) g[i] = 0.5f;
    for (long long i = 256; i < LOW; ++i) g[i] = 1e30f;

    unsigned int state[HVD_STATE_WORDS] = {0};
    run_range(threelc_absmax, n, K32, K32 + 512, (const float*)g, (const float*)e, n, state);
    unsigned int want = 0;
    for (long long i = K32; i < K32 + 512; ++i)
        want = std::max(want, bits(g[i] + e[i]) & 0x7fffffffu);
    CHECK(state[HVD_ST_ABSMAX] == want, "absmax high blocks: got %g want %g",
          f_of(state[HVD_ST_ABSMAX]), f_of(want));
    CHECK(want == bits(7.125f), "absmax reference");

    memset(state, 0, sizeof state);
    run_stride(threelc_absmax, (const float*)g, (const float*)e, n, state);
    want = 0;
    for (long long i : stride_items(n)) want = std::max(want, bits(g[i] + e[i]) & 0x7fffffffu);
    CHECK(state[HVD_ST_ABSMAX] == want, "absmax stride: got %g want %g",
          f_of(state[HVD_ST_ABSMAX]), f_of(want));
}

void check_groups(const float* g, const float* e0, const float* e, const signed char* q,
                  const unsigned char* qb, long long n, float S, long long j)
{
    int byte = 0;
    for (int t = 0; t < 5; ++t) {
        const long long i = 5 * j + t;
        int d = 1;
        if (i < n) {
            const float a = g[i] + e0[i - (5 * j)];
            const int qi = ref_q(a, S);
            d = qi + 1;
            CHECK(q[i] == qi, "quantize q[%lld] = %d, want %d", i, q[i], qi);
            CHECK(bits(e[i]) == bits(a - S * (float)qi), "residual e[%lld]", i);
        }
        byte = 3 * byte + d;
    }
    CHECK(qb[j] == byte, "quartic[%lld] = %d, want %d", j, qb[j], byte);
}

void test_quantize(float* g, float* e, signed char* q, unsigned char* qb, long long n)
{
    const long long m = (n + 4) / 5;
    const long long j_cross = K32 / 5;  // its group straddles element 2^32
    std::vector<long long> groups;
    for (long long j = first_of_block(j_cross); j < first_of_block(j_cross) + BLOCK; ++j)
        groups.push_back(j);
    for (long long j = K32; j < m; ++j) groups.push_back(j);
    for (long long j : groups)
        for (long long i = 5 * j; i < std::min(5 * j + 5, n); ++i) {
            g[i] = pattern(i);
            e[i] = (i % 3 == 0) ? 0.5f : 0.0f;
        }
    fill_low(qb, (unsigned char)0xEE);
    fill_low(e, -123.0f);
    fill_low(q, (signed char)55);
    // Remember e before the kernel (it updates e in place).
    std::vector<std::vector<float>> e_before;
    for (long long j : groups) {
        std::vector<float> v(5, 0.0f);
        for (int t = 0; t < 5 && 5 * j + t < n; ++t) v[t] = e[5 * j + t];
        e_before.push_back(v);
    }

    unsigned int state[HVD_STATE_WORDS] = {0};
    state[HVD_ST_ABSMAX] = bits(8.0f);
    const float s = 1.5f, S = s * 8.0f;
    run_range(threelc_quantize_quartic, m, first_of_block(j_cross),
              first_of_block(j_cross) + BLOCK, (const float*)g, e, n, s, state, qb, q);
    run_range(threelc_quantize_quartic, m, K32, m, (const float*)g, e, n, s, state, qb, q);
    for (size_t k = 0; k < groups.size(); ++k)
        check_groups(g, e_before[k].data(), e, q, qb, n, S, groups[k]);
    CHECK(low_changed(qb, (unsigned char)0xEE, 0) == 0, "quantize wrote low quartic bytes");
    CHECK(low_changed(e, -123.0f, 0) == 0, "quantize wrote low residuals");
    CHECK(low_changed(q, (signed char)55, 0) == 0, "quantize wrote low q");

    // Quartic decode / encode building blocks on the same high groups.
    std::vector<signed char> q_saved;
    for (long long i = 5 * K32; i < n; ++i) q_saved.push_back(q[i]);
    for (long long i = 5 * K32; i < n; ++i) q[i] = 99;
    memset(state, 0, sizeof state);
    run_range(threelc_quartic_decode, m, K32, m, (const unsigned char*)qb, n, q, state);
    CHECK(state[HVD_ST_ERROR] == 0, "quartic_decode flagged valid bytes");
    for (long long i = 5 * K32; i < n; ++i)
        CHECK(q[i] == q_saved[i - 5 * K32], "quartic_decode q[%lld]", i);
    std::vector<unsigned char> qb_saved(qb + K32, qb + m);
    for (long long j = K32; j < m; ++j) qb[j] = 0;
    run_range(threelc_quartic_encode, m, K32, m, (const signed char*)q, n, qb, state);
    CHECK(state[HVD_ST_ERROR] == 0, "quartic_encode flagged valid q");
    for (long long j = K32; j < m; ++j) CHECK(qb[j] == qb_saved[j - K32], "quartic_encode %lld", j);
    CHECK(low_changed(qb, (unsigned char)0xEE, 0) == 0, "quartic_encode wrote low bytes");
    CHECK(low_changed(q, (signed char)55, 0) == 0, "quartic_decode wrote low q");

    // Stride: block 0 visits groups t and t + 2^32 + 256.
    std::vector<long long> sg = stride_items(m);
    for (long long j : sg)
        for (long long i = 5 * j; i < std::min(5 * j + 5, n); ++i) {
            g[i] = pattern(i + 1);
            e[i] = 0.0f;
        }
    const float zeros[5] = {0, 0, 0, 0, 0};
    state[HVD_ST_ABSMAX] = bits(8.0f);
    run_stride(threelc_quantize_quartic, (const float*)g, e, n, s, state, qb, q);
    for (long long j : sg) check_groups(g, zeros, e, q, qb, n, S, j);
    // (Only block 0 thread 0 stores S and the flag: this run has it.)
    CHECK(state[HVD_ST_SCALE] == bits(S) && state[HVD_ST_NONFINITE] == 0, "quantize state");
    CHECK(low_changed(qb, (unsigned char)0xEE, BLOCK) == 0, "quantize stride wrote bytes");
}

// Sequential zero-run encoding (as the CPU backend), appending to out.
void ref_zre(const unsigned char* in, long long m, std::vector<unsigned char>& out)
{
    long long i = 0;
    while (i < m) {
        if (in[i] != HVD_ZERO_GROUP) {
            out.push_back(in[i++]);
            continue;
        }
        long long r = 0;
        while (i < m && in[i] == HVD_ZERO_GROUP) ++r, ++i;
        for (long long k = r / 14; k > 0; --k) out.push_back(255);
        if (r % 14 >= 2) out.push_back((unsigned char)(241 + r % 14));
        if (r % 14 == 1) out.push_back(121);
    }
}

void test_zre_encode(unsigned char* qb, long long* start, unsigned char* emit, long long* incl,
                     unsigned char* out, long long m)
{
    // Window [ws, m): runs across 2^32, of 45, 14, 1, 28 and a run to the end. Bytes
    // before ws are zero (literals), so each emits itself.
    const long long ws = K32 - 100;
    for (long long i = ws; i < m; ++i) qb[i] = (unsigned char)(i % 200 == 121 ? 7 : i % 200);
    for (long long i = K32 - 30; i < K32 + 15; ++i) qb[i] = 121;
    for (long long i = K32 + 40; i < K32 + 54; ++i) qb[i] = 121;
    qb[K32 + 60] = 121;
    for (long long i = K32 + 100; i < K32 + 128; ++i) qb[i] = 121;
    for (long long i = m - 20; i < m; ++i) qb[i] = 121;
    const long long bs = first_of_block(ws);
    fill_low(out, (unsigned char)0xEE);
    fill_low(start, (long long)-7);

    run_range(threelc_zre_run_starts, m, ws, m, (const unsigned char*)qb, m, start);
    for (long long i = bs; i < m; ++i) {
        const bool begins = qb[i] == 121 && qb[i - 1] != 121;
        CHECK(start[i] == (begins ? i : -1), "run start %lld: %lld", i, start[i]);
    }
    for (long long i = bs + 1; i < m; ++i) start[i] = std::max(start[i], start[i - 1]);
    unsigned int state[HVD_STATE_WORDS] = {0};
    run_range(threelc_zre_flags, m, ws, m, (const unsigned char*)qb, (const long long*)start, m,
              emit, state);
    long long acc = bs;  // every byte before bs is a literal
    for (long long i = bs; i < m; ++i) incl[i] = acc += emit[i];
    run_range(threelc_zre_scatter, m, ws, m, (const unsigned char*)qb, (const long long*)start,
              (const long long*)incl, m, out, m, state);

    std::vector<unsigned char> want(qb + bs, qb + ws);  // the literals before the window
    ref_zre(qb + ws, m - ws, want);
    long long total;
    memcpy(&total, state + HVD_ST_COUNT, sizeof total);
    CHECK(total == bs + (long long)want.size(), "zre length %lld, want %lld", total,
          bs + (long long)want.size());
    CHECK(state[HVD_ST_ERROR] == 0, "zre error bits %u", state[HVD_ST_ERROR]);
    for (size_t k = 0; k < want.size(); ++k)
        CHECK(out[bs + (long long)k] == want[k], "zre out[%lld] = %d, want %d",
              bs + (long long)k, out[bs + (long long)k], want[k]);
    CHECK(low_changed(out, (unsigned char)0xEE, 0) == 0, "zre scatter wrote low bytes");

    run_stride(threelc_zre_run_starts, (const unsigned char*)qb, m, start);
    for (long long i : stride_items(m)) {
        const bool begins = qb[i] == 121 && (i == 0 || qb[i - 1] != 121);
        CHECK(start[i] == (begins ? i : -1), "run start (stride) %lld", i);
    }
    CHECK(low_changed(start, (long long)-7, BLOCK) == 0, "run starts stride wrote low");
}

// qb must hold len + 14 * 400 bytes, out 5 times as many floats.
void test_zre_decode(unsigned char* body, unsigned char* lens, long long* incl,
                     unsigned char* qb, float* out, long long len)
{
    const long long ws = K32 - 100;
    for (long long i = ws; i < len; ++i) {
        const long long k = i % 23;
        body[i] = (unsigned char)(k < 10 ? 100 + k : k < 15 ? 243 + k - 10 : k == 15 ? 255 : 121);
    }
    body[len - 1] = 250;
    const long long bs = first_of_block(ws);
    fill_low(qb, (unsigned char)0xEE);
    fill_low(lens, (unsigned char)0xEE);

    run_range(threelc_zre_lengths, len, ws, len, (const unsigned char*)body, len, lens);
    for (long long j = bs; j < len; ++j) {
        const int want = body[j] >= 243 ? body[j] - 241 : 1;
        CHECK(lens[j] == want, "lens[%lld] = %d, want %d", j, lens[j], want);
    }
    CHECK(low_changed(lens, (unsigned char)0xEE, 0) == 0, "lengths wrote low bytes");
    long long acc = bs;
    for (long long j = bs; j < len; ++j) incl[j] = acc += lens[j];
    const long long total = acc;

    // Check kernel: right and wrong expected lengths.
    unsigned int state[HVD_STATE_WORDS] = {0};
    const long long n = 5 * total - 3;
    launch(threelc_zre_decode_check, 1u, 1u, (const unsigned char*)body, (const long long*)incl,
           len, n, state);
    long long got;
    memcpy(&got, state + HVD_ST_COUNT, sizeof got);
    CHECK(got == total && state[HVD_ST_ERROR] == 0, "decode check: %lld vs %lld, err %u", got,
          total, state[HVD_ST_ERROR]);
    memset(state, 0, sizeof state);
    launch(threelc_zre_decode_check, 1u, 1u, (const unsigned char*)body, (const long long*)incl,
           len, n + 5, state);
    CHECK(state[HVD_ST_ERROR] == HVD_ERR_LENGTH, "decode check missed a length mismatch");

    memset(state, 0, sizeof state);
    run_range(threelc_zre_expand, len, ws, len, (const unsigned char*)body,
              (const long long*)incl, len, (unsigned char)HVD_RUN_GROUP, qb, total, state);
    CHECK(state[HVD_ST_ERROR] == 0, "expand error bits %u", state[HVD_ST_ERROR]);
    long long p = bs;
    for (long long j = bs; j < len; ++j) {
        const int c = body[j] >= 243 ? body[j] - 241 : 1;
        const int v = body[j] >= 243 ? HVD_RUN_GROUP : body[j];
        for (int t = 0; t < c; ++t, ++p) CHECK(qb[p] == v, "expand qb[%lld]", p);
    }
    CHECK(p == total, "expand length");
    CHECK(low_changed(qb, (unsigned char)0xEE, 0) == 0, "expand wrote low bytes");

    // Scaled decode of the high groups (elements above 5 * 2^32), plain and accumulating.
    const float S = 0.75f;
    for (long long i = 5 * K32 - 5; i < n; ++i) out[i] = 1.0f;
    fill_low(out, -5.0f);
    for (int acc_mode = 0; acc_mode < 2; ++acc_mode) {
        run_range(threelc_quartic_decode_scale, total, K32, total, (const unsigned char*)qb, n,
                  S, out, acc_mode, state);
        CHECK(state[HVD_ST_ERROR] == 0, "decode_scale error bits %u", state[HVD_ST_ERROR]);
        for (long long j = first_of_block(K32); j < total; ++j) {
            for (int t = 0; t < 5 && 5 * j + t < n; ++t) {
                float want;
                if (qb[j] == HVD_RUN_GROUP) {
                    want = acc_mode ? 0.0f : 0.0f;  // written 0 then left as is
                } else {
                    static const int pow3[5] = {81, 27, 9, 3, 1};
                    const float v = S * (float)(qb[j] / pow3[t] % 3 - 1);
                    want = acc_mode ? v + v : v;
                }
                CHECK(bits(out[5 * j + t]) == bits(want), "decode_scale out[%lld] acc %d",
                      5 * j + t, acc_mode);
            }
        }
        CHECK(low_changed(out, -5.0f, 0) == 0, "decode_scale wrote low elements");
    }
}

void test_checksum(unsigned char* buf, long long len)
{
    for (long long i = K32 - 100; i < len; ++i) buf[i] = (unsigned char)(i * 31 % 256);
    for (unsigned long long offset : {12ull, (1ull << 40) + 3}) {
        unsigned int state[HVD_STATE_WORDS] = {0};
        run_range(hvd_checksum, len, K32, len, (const unsigned char*)buf, len, offset, state);
        unsigned int want = 0;
        for (long long j = K32; j < len; ++j) {
            const unsigned long long p = offset + (unsigned long long)j;
            want += (buf[j] + 1u) * ((unsigned int)((p * 0x9E3779B97F4A7C15ull) >> 32) | 1u);
        }
        CHECK(state[HVD_ST_SUM] == want, "checksum high blocks, offset %llu", offset);

        memset(state, 0, sizeof state);
        run_stride(hvd_checksum, (const unsigned char*)buf, len, offset, state);
        want = 0;
        for (long long j : stride_items(len)) {
            const unsigned long long p = offset + (unsigned long long)j;
            want += (buf[j] + 1u) * ((unsigned int)((p * 0x9E3779B97F4A7C15ull) >> 32) | 1u);
        }
        CHECK(state[HVD_ST_SUM] == want, "checksum stride, offset %llu", offset);
    }
}

// ---------------------------------------------------------------------------------------
// kernels/primitives.cu

unsigned long long ref_mix64(unsigned long long z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Uniform number i of the stream `key` (SplitMix64 output i + 1, top 24 bits, times 2^-24).
float ref_uniform(unsigned long long key, long long i)
{
    const unsigned long long c = (unsigned long long)i + 1ull;
    return (float)(unsigned int)(ref_mix64(key + c * 0x9E3779B97F4A7C15ull) >> 40) * 0x1p-24f;
}

// Bit b of the LSB-first packing of `codes` (n codes of `bits` bits).
unsigned int ref_packed_bit(const unsigned char* codes, long long n, int bits, long long b)
{
    const long long i = b / bits;
    if (i >= n) return 0u;
    return ((unsigned int)codes[i] >> (b % bits)) & 1u;
}

// x (n floats) gets the uniforms; the chunk sums (chunk 1) of x are then checked too.
void test_uniform_and_chunk_sums(float* x, double* sums, long long n)
{
    const unsigned long long key = 0x0123456789ABCDEFull;
    fill_low(x, -1.0f);
    run_range(primitives_uniform, n, K32, n, key, 0ll, n, x);
    for (long long i = first_of_block(K32); i < n; ++i)
        CHECK(bits(x[i]) == bits(ref_uniform(key, i)), "uniform x[%lld]", i);
    CHECK(low_changed(x, -1.0f, 0) == 0, "uniform wrote low elements");
    run_stride(primitives_uniform, key, 0ll, n, x);
    for (long long i : stride_items(n))
        CHECK(bits(x[i]) == bits(ref_uniform(key, i)), "uniform (stride) x[%lld]", i);
    CHECK(low_changed(x, -1.0f, BLOCK) == 0, "uniform stride wrote low elements");

    for (int square = 0; square < 2; ++square) {
        fill_low(sums, -2.0);
        run_range(primitives_chunk_sums, n, K32, n, (const float*)x, n, 1ll, square, sums);
        for (long long c = first_of_block(K32); c < n; ++c) {
            const double v = (double)x[c];
            CHECK(sums[c] == (square ? v * v : fabs(v)), "chunk_sums[%lld] square %d", c, square);
        }
        CHECK(low_changed(sums, -2.0, 0) == 0, "chunk_sums wrote low sums");
        run_stride(primitives_chunk_sums, (const float*)x, n, 1ll, square, sums);
        for (long long c : stride_items(n)) {
            const double v = (double)x[c];
            CHECK(sums[c] == (square ? v * v : fabs(v)), "chunk_sums (stride) %lld", c);
        }
    }
}

// Packs n codes of 3 bits into nbytes > 2^32 bytes (output bytes and code indices above
// 2^32).
void test_bitpack(unsigned char* codes, unsigned char* packed, long long n, long long nbytes)
{
    const int b = 3;
    for (long long i = K32 * 8 / b - 64; i < n; ++i) codes[i] = (unsigned char)(i * 37 % 251);
    for (long long i = 0; i < LOW; ++i) codes[i] = (unsigned char)(i * 11 % 256);
    fill_low(packed, (unsigned char)0xEE);
    run_range(primitives_bitpack, nbytes, K32, nbytes, (const unsigned char*)codes, n, b,
              packed, nbytes);
    std::vector<long long> bytes;
    for (long long j = first_of_block(K32); j < nbytes; ++j) bytes.push_back(j);
    for (long long j : bytes) {
        unsigned int want = 0u;
        for (int t = 0; t < 8; ++t) want |= ref_packed_bit(codes, n, b, 8 * j + t) << t;
        CHECK(packed[j] == want, "bitpack packed[%lld] = %d, want %u", j, packed[j], want);
    }
    CHECK(low_changed(packed, (unsigned char)0xEE, 0) == 0, "bitpack wrote low bytes");
    run_stride(primitives_bitpack, (const unsigned char*)codes, n, b, packed, nbytes);
    for (long long j : stride_items(nbytes)) {
        unsigned int want = 0u;
        for (int t = 0; t < 8; ++t) want |= ref_packed_bit(codes, n, b, 8 * j + t) << t;
        CHECK(packed[j] == want, "bitpack (stride) packed[%lld]", j);
    }
    CHECK(low_changed(packed, (unsigned char)0xEE, BLOCK) == 0, "bitpack stride wrote bytes");
}

// Unpacks n > 2^32 codes of 5 bits (code indices and bit offsets above 2^32).
void test_bitunpack(unsigned char* in, unsigned char* codes, long long n)
{
    const int b = 5;
    const long long nbytes = (n * b + 7) / 8;
    for (long long j = K32 * b / 8 - 64; j < nbytes; ++j) in[j] = (unsigned char)(j * 29 % 256);
    for (long long j = 0; j < LOW; ++j) in[j] = (unsigned char)(j * 13 % 256);
    if ((n * b) % 8) in[nbytes - 1] &= (unsigned char)((1u << ((n * b) % 8)) - 1u);
    fill_low(codes, (unsigned char)0xEE);
    unsigned int state[HVD_STATE_WORDS] = {0};
    run_range(primitives_bitunpack, n, K32, n, (const unsigned char*)in, nbytes, n, b, codes,
              state);
    auto want_code = [&](long long i) {
        unsigned int v = 0u;
        for (int t = 0; t < b; ++t) {
            const long long bit = i * b + t;
            v |= (((unsigned int)in[bit >> 3] >> (bit & 7)) & 1u) << t;
        }
        return v;
    };
    for (long long i = first_of_block(K32); i < n; ++i)
        CHECK(codes[i] == want_code(i), "bitunpack codes[%lld] = %d", i, codes[i]);
    CHECK(low_changed(codes, (unsigned char)0xEE, 0) == 0, "bitunpack wrote low codes");
    run_stride(primitives_bitunpack, (const unsigned char*)in, nbytes, n, b, codes, state);
    for (long long i : stride_items(n))
        CHECK(codes[i] == want_code(i), "bitunpack (stride) codes[%lld]", i);
    CHECK(state[HVD_PRIM_ST_ERROR] == 0, "bitunpack error bits %u", state[HVD_PRIM_ST_ERROR]);
}

// signSGD encode / decode and DQSG's deltas, quantiser and reconstruction on n > 2^32
// elements (element indices above 2^32; sign bytes 8 j and bucket starts b * bucket formed
// in 64 bits).
void test_sign_and_dqsg(float* x, unsigned char* bytes, float* deltas, unsigned char* q,
                        float* out, long long n)
{
    const long long lo = K32 - 64;
    for (long long i = lo; i < n; ++i) x[i] = pattern(i) * 0.5f;
    for (long long i = 0; i < LOW; ++i) x[i] = 1e30f;
    const long long nbytes = (n + 7) / 8;
    unsigned int state[HVD_STATE_WORDS] = {0};
    run_range(sign_encode, nbytes, K32 / 8, nbytes, (const float*)x, n, bytes, state);
    for (long long j = first_of_block(K32 / 8); j < nbytes; ++j) {
        unsigned int want = 0u;
        for (long long i = 8 * j; i < 8 * j + 8 && i < n; ++i) want |= (x[i] < 0.0f ? 1u : 0u) << (i - 8 * j);
        CHECK(bytes[j] == want, "sign_encode byte %lld = %d, want %u", j, bytes[j], want);
    }
    CHECK(state[HVD_SIGN_ST_NONFINITE] == 0, "sign_encode flagged finite input");
    fill_low(out, -5.0f);
    run_range(sign_decode, nbytes, K32 / 8, nbytes, (const unsigned char*)bytes, n, 0.25f, out, 0,
              state);
    for (long long i = first_of_block(K32 / 8) * 8; i < n; ++i)
        CHECK(out[i] == (x[i] < 0.0f ? -0.25f : 0.25f), "sign_decode out[%lld]", i);
    CHECK(low_changed(out, -5.0f, 0) == 0, "sign_decode wrote low elements");

    const long long bucket = 512;
    const long long nb = (n + bucket - 1) / bucket;
    const long long b_lo = lo / bucket + 1;  // the first bucket whose elements are all set
    run_range(quant_dqsg_deltas, nb, b_lo, nb, (const float*)x, n, 3, bucket, deltas, state);
    for (long long b = first_of_block(b_lo); b < nb; ++b) {
        if (b < b_lo) continue;
        float m = 0.0f;
        for (long long i = b * bucket; i < n && i < (b + 1) * bucket; ++i) m = std::max(m, fabsf(x[i]));
        CHECK(bits(deltas[b]) == bits(m / 3.0f), "dqsg delta %lld", b);
    }
    const unsigned long long key = 77ull;
    const long long i_lo = b_lo * bucket;
    run_range(quant_dqsg_quantize, n, i_lo, n, (const float*)x, n, 3, bucket, key, 3,
              (const float*)deltas, q);
    for (long long i = i_lo; i < n; ++i) {
        const float d = deltas[i / bucket];
        const float safe = d > 0.0f ? d : 1.0f;
        float t = rintf(x[i] / safe + (ref_uniform(key, i) - 0.5f));
        t = t > 3.0f ? 3.0f : (t < -3.0f ? -3.0f : t);
        CHECK(q[i] == (unsigned char)((int)t + 3), "dqsg q[%lld]", i);
    }
    for (long long i = i_lo; i < n; ++i) q[i] = (unsigned char)((int)q[i] - 3);  // int8 q
    fill_low(out, -5.0f);
    run_range(quant_dqsg_dequantize, n, i_lo, n, (const signed char*)q, n,
              (const unsigned char*)deltas, bucket, key, out, 0);
    for (long long i = i_lo; i < n; ++i) {
        const float want = deltas[i / bucket] * ((float)(signed char)q[i] - (ref_uniform(key, i) - 0.5f));
        CHECK(bits(out[i]) == bits(want), "dqsg dequantize out[%lld]", i);
    }
    CHECK(low_changed(out, -5.0f, 0) == 0, "dqsg dequantize wrote low elements");
}


// A bucket's segment kernels (threelc.cu section 7): a tiny segment, then one of n > 2^32
// elements; only the block of the last tile runs, so every index it forms is past 2^32
// (a tile's first element is (t - first tile) * tile * 5, formed in 64 bits).
void test_segments(float* g, float* e, unsigned char* quartic, unsigned char* bytes, long long n)
{
    const long long tile = 4096;
    const long long m = (n + 4) / 5;
    const long long tiles1 = (m + tile - 1) / tile;
    const long long ntiles = 1 + tiles1;
    float g0[7] = {1, 2, 3, 4, 5, 6, 7};
    long long seg[2 * HVD_SEG_COLS] = {0};
    seg[HVD_SEG_IN] = (long long)g0;
    seg[HVD_SEG_N] = 7;
    seg[HVD_SEG_QOFF] = m;  // after the big one's bytes
    seg[HVD_SEG_F32] = bits(1.0f);
    long long* big = seg + HVD_SEG_COLS;
    big[HVD_SEG_IN] = (long long)g;
    big[HVD_SEG_AUX] = (long long)e;
    big[HVD_SEG_N] = n;
    big[HVD_SEG_TILE] = 1;
    big[HVD_SEG_F32] = bits(1.5f);
    const long long j_lo = (tiles1 - 1) * tile;  // the last tile's first group
    for (long long i = 5 * j_lo; i < n; ++i) {
        g[i] = pattern(i) * 0.25f;
        e[i] = (i % 3 == 0) ? 0.125f : 0.0f;
    }
    g[n - 7] = 5.0f;
    std::vector<float> e_before(e + 5 * j_lo, e + n);
    unsigned int states[2 * HVD_STATE_WORDS] = {0};
    const unsigned int grid = (unsigned int)ntiles;
    launch_blocks(threelc_absmax_segments, grid, BLOCK, (unsigned long long)ntiles - 1, 1ull,
                  (const long long*)seg, 2ll, ntiles, tile, states);
    unsigned int want = 0;
    for (long long i = 5 * j_lo; i < n; ++i) want = std::max(want, bits(g[i] + e[i]) & 0x7fffffffu);
    CHECK(states[HVD_STATE_WORDS + HVD_ST_ABSMAX] == want, "absmax_segments: got %g want %g",
          f_of(states[HVD_STATE_WORDS + HVD_ST_ABSMAX]), f_of(want));
    CHECK(states[HVD_ST_ABSMAX] == 0, "absmax_segments wrote the small segment's state");
    fill_low(quartic, (unsigned char)0xEE);
    launch_blocks(threelc_quantize_quartic_segments, grid, BLOCK, (unsigned long long)ntiles - 1,
                  1ull, (const long long*)seg, 2ll, ntiles, tile, states, quartic);
    const float S = 1.5f * f_of(want);
    for (long long j = j_lo; j < m; ++j) {
        int byte = 0;
        for (int t = 0; t < 5; ++t) {
            const long long i = 5 * j + t;
            int d = 1;
            if (i < n) {
                const float a = g[i] + e_before[i - 5 * j_lo];
                const int qi = ref_q(a, S);
                d = qi + 1;
                CHECK(bits(e[i]) == bits(a - S * (float)qi), "quantize_segments e[%lld]", i);
            }
            byte = 3 * byte + d;
        }
        CHECK(quartic[j] == byte, "quantize_segments quartic[%lld] = %d, want %d", j, quartic[j],
              byte);
    }
    CHECK(low_changed(quartic, (unsigned char)0xEE, 0) == 0, "quantize_segments wrote low bytes");

    // checksum of a segment of K32 + 5000 bytes: the last tile's positions are past 2^32
    const long long len = K32 + 5000;
    long long cseg[2 * HVD_SEG_COLS] = {0};
    unsigned char small[3] = {1, 2, 3};
    cseg[HVD_SEG_IN] = (long long)small;
    cseg[HVD_SEG_N] = 3;
    cseg[HVD_SEG_COLS + HVD_SEG_IN] = (long long)bytes;
    cseg[HVD_SEG_COLS + HVD_SEG_N] = len;
    cseg[HVD_SEG_COLS + HVD_SEG_TILE] = 1;
    const long long ctiles = 1 + (len + tile - 1) / tile;
    const long long b_lo = (ctiles - 2) * tile;
    for (long long j = b_lo; j < len; ++j) bytes[j] = (unsigned char)(j * 131 % 251);
    unsigned int cstates[2 * HVD_STATE_WORDS] = {0};
    launch_blocks(hvd_checksum_segments, (unsigned int)ctiles, BLOCK,
                  (unsigned long long)ctiles - 1, 1ull, (const long long*)cseg, 2ll, ctiles, tile,
                  cstates);
    unsigned int sum = 0u;
    for (long long j = b_lo; j < len; ++j) {
        const unsigned long long p = (unsigned long long)j;
        sum += ((unsigned int)bytes[j] + 1u) * ((unsigned int)((p * 0x9E3779B97F4A7C15ull) >> 32) | 1u);
    }
    CHECK(cstates[HVD_STATE_WORDS + HVD_ST_SUM] == sum, "checksum_segments: got %u want %u",
          cstates[HVD_STATE_WORDS + HVD_ST_SUM], sum);
}

}  // namespace

int main()
{
    const long long m = K32 + 300;  // quartic bytes (groups)
    const long long n = 5 * m - 2;  // elements: the last group has 2 padding digits
    float* g = vmap<float>(n);
    float* e = vmap<float>(n);
    signed char* q = vmap<signed char>(n);
    unsigned char* qb = vmap<unsigned char>(m);
    long long* start = vmap<long long>(m);
    unsigned char* emit = vmap<unsigned char>(m);
    long long* incl = vmap<long long>(m);
    unsigned char* out = vmap<unsigned char>(m);
    unsigned char* expanded = vmap<unsigned char>(m + 14 * 400);
    float* dec = vmap<float>(5 * (m + 14 * 400));

    test_absmax(g, e, n);
    test_quantize(g, e, q, qb, n);
    test_zre_encode(qb, start, emit, incl, out, m);
    test_zre_decode(out, emit, incl, expanded, dec, m);
    test_checksum(out, m);
    test_segments(g, e, vmap<unsigned char>(m + 8), vmap<unsigned char>(K32 + 5000), n);

    const long long nu = K32 + 600;  // uniforms and chunk sums
    float* x = vmap<float>(nu);
    double* sums = vmap<double>(nu);
    test_uniform_and_chunk_sums(x, sums, nu);
    const long long np = (K32 + 600) * 8 / 3;  // 3-bit codes: 2^32 + 600 bytes, last partial
    const long long npb = (np * 3 + 7) / 8;
    unsigned char* pcodes = vmap<unsigned char>(np);
    unsigned char* packed = vmap<unsigned char>(npb);
    test_bitpack(pcodes, packed, np, npb);
    const long long nun = K32 + 2051;  // 5-bit codes, a partial last byte
    unsigned char* pin = vmap<unsigned char>((nun * 5 + 7) / 8);
    unsigned char* ucodes = vmap<unsigned char>(nun);
    test_bitunpack(pin, ucodes, nun);
    const long long ns = K32 + 1000;  // sign and DQSG elements
    test_sign_and_dqsg(vmap<float>(ns), vmap<unsigned char>((ns + 7) / 8),
                       vmap<float>(ns / 512 + 1), vmap<unsigned char>(ns), vmap<float>(ns), ns);

    if (failures) {
        fprintf(stderr, "index64: %d checks failed\n", failures);
        return 1;
    }
    printf("index64: all 64-bit index checks passed (n = %lld elements)\n", n);
    return 0;
}
