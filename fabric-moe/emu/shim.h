// CPU emulation of the CUDA features the kernels (../src/kernels/) use, for run.sh (no GPU needed): each block
// runs its threads as OS threads, warps exchange ballots and shuffles through per-warp
// barriers, atomics and fences are the host's. `launch` runs a grid one block at a time;
// `launch_together` runs every block of several ranks' grids at once, as the fused kernels
// need (their blocks wait for flags that other blocks, and the peers' kernels, raise).
// __shared__ variables become per-block storage (run.sh rewrites each declaration into
// `emu_shared`), so that blocks running at once do not share them.
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>
#include <chrono>
#include <memory>
struct Dim { unsigned x, y, z; };
thread_local Dim threadIdx, blockIdx, blockDim, gridDim;
// What the threads of a block share: its barrier, its warps' barriers and exchange slots.
struct BlockCtx {
  std::barrier<> bar;
  std::vector<std::unique_ptr<std::barrier<>>> warp_bars;
  unsigned vals[64][32];
  explicit BlockCtx(unsigned block) : bar(block) {
    for (unsigned w = 0; w < (block + 31) / 32; ++w) warp_bars.emplace_back(new std::barrier<>(32));
  }
};
thread_local BlockCtx* g_block;
// The index of the thread's block's __shared__ storage (0 for blocks run one at a time).
thread_local unsigned g_slot;
// The blocks that may run at once (their __shared__ storage).
constexpr unsigned EMU_SLOTS = 64;
// A __shared__ variable of type T (run.sh: one Site per declaration) in the thread's block.
template <typename T, int Site>
T& emu_shared() {
  static T s[EMU_SLOTS];
  return s[g_slot];
}
#define __global__
#define __launch_bounds__(...)
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
inline void __syncthreads() { g_block->bar.arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned __ballot_sync(unsigned, int pred) {
  unsigned w = threadIdx.x / 32, l = threadIdx.x % 32;
  g_block->vals[w][l] = pred ? 1 : 0;
  g_block->warp_bars[w]->arrive_and_wait();
  unsigned b = 0;
  for (int i = 0; i < 32; ++i) if (g_block->vals[w][i]) b |= 1u << i;
  g_block->warp_bars[w]->arrive_and_wait();
  return b;
}
inline int __shfl_sync(unsigned, int v, int src) {
  unsigned w = threadIdx.x / 32, l = threadIdx.x % 32;
  g_block->vals[w][l] = (unsigned)v;
  g_block->warp_bars[w]->arrive_and_wait();
  int r = (int)g_block->vals[w][src];
  g_block->warp_bars[w]->arrive_and_wait();
  return r;
}
inline unsigned __match_any_sync(unsigned, int v) {
  unsigned w = threadIdx.x / 32, l = threadIdx.x % 32;
  g_block->vals[w][l] = (unsigned)v;
  g_block->warp_bars[w]->arrive_and_wait();
  unsigned m = 0;
  for (int i = 0; i < 32; ++i) if (g_block->vals[w][i] == (unsigned)v) m |= 1u << i;
  g_block->warp_bars[w]->arrive_and_wait();
  return m;
}
inline void __syncwarp() { g_block->warp_bars[threadIdx.x / 32]->arrive_and_wait(); }
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
  for (unsigned b = 0; b < grid; ++b) {
    BlockCtx ctx(block);
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < block; ++t)
      ts.emplace_back([=, &ctx] {
        threadIdx = {t, 0, 0}; blockIdx = {b, 0, 0}; blockDim = {block, 1, 1}; gridDim = {grid, 1, 1};
        g_block = &ctx; g_slot = 0;
        f(args...);
      });
    for (auto& t : ts) t.join();
  }
}
// Every block of each kernel in `kernels` (one per rank, a closure over its arguments) at
// once, `grid` blocks of `block` threads each.
inline void launch_together(unsigned grid, unsigned block, const std::vector<std::function<void()>>& kernels) {
  unsigned n = grid * (unsigned)kernels.size();
  if (n > EMU_SLOTS) { fprintf(stderr, "launch_together: %u blocks, at most %u\n", n, EMU_SLOTS); abort(); }
  std::vector<std::unique_ptr<BlockCtx>> ctxs;
  for (unsigned i = 0; i < n; ++i) ctxs.emplace_back(new BlockCtx(block));
  std::vector<std::thread> ts;
  for (unsigned k = 0; k < kernels.size(); ++k)
    for (unsigned b = 0; b < grid; ++b)
      for (unsigned t = 0; t < block; ++t) {
        unsigned slot = k * grid + b;
        BlockCtx* ctx = ctxs[slot].get();
        const std::function<void()>* f = &kernels[k];
        ts.emplace_back([=] {
          threadIdx = {t, 0, 0}; blockIdx = {b, 0, 0}; blockDim = {block, 1, 1}; gridDim = {grid, 1, 1};
          g_block = ctx; g_slot = slot;
          (*f)();
        });
      }
  for (auto& t : ts) t.join();
}
