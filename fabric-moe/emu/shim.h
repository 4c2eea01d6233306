// CPU emulation of the CUDA features the kernels (../src/kernels/) use, for run.sh (no GPU needed): each block
// runs its threads as OS threads (one block at a time), warps exchange ballots and shuffles
// through per-warp barriers, __shared__ is static, atomics and fences are the host's.
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
#include <chrono>
#include <memory>
struct Dim { unsigned x, y, z; };
thread_local Dim threadIdx, blockIdx;
Dim blockDim, gridDim;
std::barrier<>* g_block_bar;
std::vector<std::unique_ptr<std::barrier<>>> g_warp_bars;
unsigned g_warp_vals[64][32];
unsigned long long g_warp_vals64[64][32];
#define __global__
#define __launch_bounds__(...)
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __restrict__ __restrict
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned __ballot_sync(unsigned, int pred) {
  unsigned w = threadIdx.x / 32, l = threadIdx.x % 32;
  g_warp_vals[w][l] = pred ? 1 : 0;
  g_warp_bars[w]->arrive_and_wait();
  unsigned b = 0;
  for (int i = 0; i < 32; ++i) if (g_warp_vals[w][i]) b |= 1u << i;
  g_warp_bars[w]->arrive_and_wait();
  return b;
}
inline int __shfl_sync(unsigned, int v, int src) {
  unsigned w = threadIdx.x / 32, l = threadIdx.x % 32;
  g_warp_vals[w][l] = (unsigned)v;
  g_warp_bars[w]->arrive_and_wait();
  int r = (int)g_warp_vals[w][src];
  g_warp_bars[w]->arrive_and_wait();
  return r;
}
inline unsigned __match_any_sync(unsigned, int v) {
  unsigned w = threadIdx.x / 32, l = threadIdx.x % 32;
  g_warp_vals[w][l] = (unsigned)v;
  g_warp_bars[w]->arrive_and_wait();
  unsigned m = 0;
  for (int i = 0; i < 32; ++i) if (g_warp_vals[w][i] == (unsigned)v) m |= 1u << i;
  g_warp_bars[w]->arrive_and_wait();
  return m;
}
inline void __syncwarp() { g_warp_bars[threadIdx.x / 32]->arrive_and_wait(); }
inline void __nanosleep(unsigned) { std::this_thread::yield(); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }

template <typename F, typename... A>
void launch(F f, unsigned grid, unsigned block, A... args) {
  blockDim = {block, 1, 1};
  gridDim = {grid, 1, 1};
  for (unsigned b = 0; b < grid; ++b) {
    std::barrier<> bar(block);
    g_block_bar = &bar;
    g_warp_bars.clear();
    for (unsigned w = 0; w < (block + 31) / 32; ++w) g_warp_bars.emplace_back(new std::barrier<>(32));
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < block; ++t)
      ts.emplace_back([=] { threadIdx = {t, 0, 0}; blockIdx = {b, 0, 0}; f(args...); });
    for (auto& t : ts) t.join();
  }
}
