// Host build of kernels/threelc.cu and kernels/frame.cu (through kernels/cuda_host.h) behind
// a small C ABI for ctypes, used by tests/host_kernels/test_threelc_kernels.py. Each host_*
// function runs the same kernel sequence as hvdcompress/backends/cuda, with the scans
// (torch.cummax / torch.cumsum there) done sequentially here; host_launch (host_launch.h)
// runs one kernel for the stand-in for CuPy.
//
// Build (tests/host_kernels/conftest.py): g++ with HOST_CXX_FLAGS of hvdcompress/_native.py
//     -shared -fPIC -I kernels tests/host_kernels/host_threelc.cpp -o libhost_threelc.so
#include "threelc.cu"
#include "frame.cu"

#include "host_launch.h"

#include <stdint.h>

#include <vector>

namespace {

long long state_count(const unsigned int* state)
{
    long long v;
    memcpy(&v, state + HVD_ST_COUNT, sizeof v);
    return v;
}

// ZRE of m quartic bytes into out (cap bytes): run starts, cummax, flags, cumsum, scatter.
// Returns the output length (from state, as the GPU path reads it).
long long zre_encode(const unsigned char* qb, long long m, unsigned char* out, long long cap,
                     unsigned int* state)
{
    if (m == 0) return 0;
    std::vector<long long> start(m), incl(m);
    std::vector<unsigned char> emit(m);
    launch(threelc_zre_run_starts, grid_for(m), g_block, qb, m, start.data());
    for (long long i = 1; i < m; ++i) start[i] = start[i] > start[i - 1] ? start[i] : start[i - 1];
    launch(threelc_zre_flags, grid_for(m), g_block, qb, (const long long*)start.data(), m,
           emit.data(), state);
    long long acc = 0;
    for (long long i = 0; i < m; ++i) incl[i] = acc += emit[i];
    launch(threelc_zre_scatter, grid_for(m), g_block, qb, (const long long*)start.data(),
           (const long long*)incl.data(), m, out, cap, state);
    return state_count(state);
}

// Lengths, cumsum and the check kernel; leaves incl for the expansion. Returns error bits.
unsigned int zre_decode_prepare(const unsigned char* body, long long len, long long n,
                                std::vector<long long>& incl, unsigned int* state)
{
    std::vector<unsigned char> lens(len);
    incl.resize(len);
    launch(threelc_zre_lengths, grid_for(len), g_block, body, len, lens.data());
    long long acc = 0;
    for (long long j = 0; j < len; ++j) incl[j] = acc += lens[j];
    launch(threelc_zre_decode_check, 1u, 1u, body, (const long long*)incl.data(), len, n, state);
    return state[HVD_ST_ERROR];
}

}  // namespace

extern "C" {

// Launch kernel `name` like cuLaunchKernel (used by the stand-in for CuPy that runs
// hvdcompress/backends/cuda/ on the host). Returns -1 for an unknown name.
int host_launch(const char* name, unsigned int grid, unsigned int block, void** params)
{
    HOST_THREELC_KERNELS
    HOST_FRAME_KERNELS
    return -1;
}

// Fused encode. state (8 words, zeroed here) comes back as the GPU leaves it. Returns the
// body length (body must hold ceil(n / 5) bytes), or -1 when the input is non-finite.
long long host_threelc_encode(const float* g, float* e, long long n, float sparsity,
                              unsigned char* body, unsigned int* state)
{
    memset(state, 0, HVD_STATE_WORDS * sizeof(unsigned int));
    if (n == 0) return 0;
    const long long m = (n + 4) / 5;
    std::vector<unsigned char> quartic(m);
    launch(threelc_absmax, grid_for(n), g_block, g, (const float*)e, n, state);
    launch(threelc_quantize_quartic, grid_for(m), g_block, g, e, n, sparsity, state,
           quartic.data(), (signed char*)nullptr);
    const long long len = zre_encode(quartic.data(), m, body, m, state);
    return state[HVD_ST_NONFINITE] ? -1 : len;
}

// quantize building block: q (n int8) and the state (S bits, nonfinite flag).
void host_quantize(const float* x, long long n, float sparsity, signed char* q,
                   unsigned int* state)
{
    memset(state, 0, HVD_STATE_WORDS * sizeof(unsigned int));
    if (n == 0) return;
    const long long m = (n + 4) / 5;
    std::vector<unsigned char> quartic(m);
    launch(threelc_absmax, grid_for(n), g_block, x, (const float*)nullptr, n, state);
    launch(threelc_quantize_quartic, grid_for(m), g_block, x, (float*)nullptr, n, sparsity,
           state, quartic.data(), q);
}

// Returns the error bits (HVD_ERR_INPUT for q outside {-1, 0, 1}).
unsigned int host_quartic_encode(const signed char* q, long long n, unsigned char* out)
{
    unsigned int state[HVD_STATE_WORDS] = {0};
    const long long m = (n + 4) / 5;
    if (m) launch(threelc_quartic_encode, grid_for(m), g_block, q, n, out, state);
    return state[HVD_ST_ERROR];
}

// Returns the output length; *err gets the error bits (HVD_ERR_INPUT for bytes > 242).
long long host_zre_encode(const unsigned char* in, long long m, unsigned char* out,
                          long long cap, unsigned int* err)
{
    unsigned int state[HVD_STATE_WORDS] = {0};
    const long long len = zre_encode(in, m, out, cap, state);
    *err = state[HVD_ST_ERROR];
    return len;
}

// Zero-run decode into out (cap bytes). n >= 0 asks for exactly ceil(n / 5) bytes with
// valid padding; n < 0 for none. *total gets the expanded length. With force, the
// expansion runs even after a failed check (to test its bounds checks). Returns error bits.
unsigned int host_zre_decode(const unsigned char* body, long long len, long long n,
                             unsigned char* out, long long cap, long long* total, int force)
{
    unsigned int state[HVD_STATE_WORDS] = {0};
    *total = 0;
    if (len == 0) return n > 0 ? HVD_ERR_LENGTH : 0u;
    std::vector<long long> incl;
    unsigned int err = zre_decode_prepare(body, len, n, incl, state);
    *total = state_count(state);
    if (err && !force) return err;
    launch(threelc_zre_expand, grid_for(len), g_block, body, (const long long*)incl.data(), len,
           (unsigned char)HVD_ZERO_GROUP, out, cap, state);
    return state[HVD_ST_ERROR];
}

// Fused decode as the CUDA backend runs it: returns error bits, out untouched on error.
unsigned int host_threelc_decode(const unsigned char* body, long long len, long long n,
                                 float scale, float* out, int accumulate)
{
    unsigned int state[HVD_STATE_WORDS] = {0};
    const long long m = (n + 4) / 5;
    if (len == 0) return m ? HVD_ERR_LENGTH : 0u;
    std::vector<long long> incl;
    unsigned int err = zre_decode_prepare(body, len, n, incl, state);
    if (err) return err;
    std::vector<unsigned char> qb(m);
    launch(threelc_zre_expand, grid_for(len), g_block, body, (const long long*)incl.data(), len,
           (unsigned char)HVD_RUN_GROUP, qb.data(), m, state);
    launch(threelc_quartic_decode_scale, grid_for(m), g_block, (const unsigned char*)qb.data(),
           n, scale, out, accumulate, state);
    return state[HVD_ST_ERROR];
}

// The decode kernels alone on given quartic bytes (validation flags). Return error bits.
unsigned int host_quartic_decode(const unsigned char* qb, long long n, signed char* q)
{
    unsigned int state[HVD_STATE_WORDS] = {0};
    const long long m = (n + 4) / 5;
    if (m) launch(threelc_quartic_decode, grid_for(m), g_block, qb, n, q, state);
    return state[HVD_ST_ERROR];
}

unsigned int host_quartic_decode_scale(const unsigned char* qb, long long n, float scale,
                                       float* out, int accumulate)
{
    unsigned int state[HVD_STATE_WORDS] = {0};
    const long long m = (n + 4) / 5;
    if (m) {
        launch(threelc_quartic_decode_scale, grid_for(m), g_block, qb, n, scale, out,
               accumulate, state);
    }
    return state[HVD_ST_ERROR];
}

unsigned int host_checksum(const unsigned char* buf, long long len, unsigned long long offset)
{
    unsigned int state[HVD_STATE_WORDS] = {0};
    if (len) launch(hvd_checksum, grid_for(len), g_block, buf, len, offset, state);
    return state[HVD_ST_SUM];
}

}  // extern "C"
