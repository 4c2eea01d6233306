// fabric-moe's kernels, part 1 of 4 (kernels.rs concatenates common, dispatch, combine, misc
// in that order; emu/run.sh likewise): MoE dispatch and combine over NVLink (CUDA IPC
// mappings of every rank's window) and the proxy. Compiled at run time by NVRTC (no
// headers: everything used is a builtin).
//
// Per step, on every rank, on the caller's stream:
//   moe_dispatch_send  block 0 routes: topk_idx -> send_slot[t][d] (slot of token t in rank
//                      d's rows from us, or -1), send_count[d], send_pos[t][j] (the token's
//                      place among our rows for expert j), send_ecount[e] (our rows per
//                      expert), publishing its progress per round, then writes our rows
//                      per expert into each peer's ecount; every block: token rows + meta
//                      (token index, experts, weights, places) of routed tokens into each
//                      peer's window, a (row, segment) per warp; the last block raises
//                      flag[d][me] = (seq << 32) | count
//   moe_dispatch_recv  waits for every source's flag, then copies each received row segment
//                      into the expert-major x_expert[le][pos]: pos = the rows of earlier
//                      sources for that expert plus the row's place (no atomics)
//   moe_combine_send   per received row: sum_k w_k * expert_out[le_k][pos_k] in f32, as bf16
//                      into the source's window; the last block raises the combine flags
//   moe_combine_recv   waits for the combine flags, then out[t] = sum over ranks of the
//                      partial sums (f32), as bf16
//   moe_dispatch, moe_combine: the two stages of each in one launch (NVLink only; every
//                      block resident at once)
//
// Ranks in the proxy mask (proxy/; another host, or Transport::Proxy) are reached through
// the proxy instead: see "The proxy transport" below; the stages call its three helpers
// where they would store into a peer's window, raise its flag, or wait for a flag.
//
// Sequence numbers live in device memory (`state`), so launches carry no per-step argument
// and can be captured in a CUDA graph and replayed. Every wait is bounded by timeout_ns; a
// timeout (or a capacity overflow, or an out-of-range expert id) is written into `status`,
// pinned host memory that the host reads.

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;

struct alignas(16) V16 {
    u32 a, b, c, d;
};

// Words of `state` (u64 each); the layout is shared with the host (`layout.rs`).
#define ST_DSEND 0
#define ST_DRECV 1
#define ST_CSEND 2
#define ST_CRECV 3
#define ST_BARRIER 4
#define ST_TOKENS 5
// How far block 0 of moe_dispatch_send has routed the step: seq << 32 | tokens routed (the
// other blocks copy the rows of routed tokens).
#define ST_ROUTED 6
// Done-block counters of the kernels that end with a "last block" step.
#define ST_DONE_DSEND 8
#define ST_DONE_DRECV 9
#define ST_DONE_CSEND 10
#define ST_DONE_CRECV 11

// Error kinds in `status[0]` (kind << 32 | detail); see `AllToAll::check` (alltoall/readback.rs).
#define ERR_DISPATCH_TIMEOUT 1ull
#define ERR_COMBINE_TIMEOUT 2ull
#define ERR_CAPACITY 3ull
#define ERR_BAD_EXPERT 4ull
#define ERR_BARRIER_TIMEOUT 5ull
// 6 (a failed proxy write) is written by the host's proxy thread (proxy/worker.rs).

#define MAX_RANKS 64

// Probes (kernels.rs prepends `#define MOE_PROBE` when FABRIC_MOE_PROBE is set): thread 0 of
// the calling block stamps the GPU clock into status[8 + i] (pinned host memory), for the
// harness's breakdown of a step. Nothing is compiled in otherwise.
#ifdef MOE_PROBE
#define PROBE(status, i)                                                 \
    do {                                                                 \
        if (threadIdx.x == 0) ((volatile u64*)(status))[8 + (i)] = now_ns(); \
    } while (0)
#else
#define PROBE(status, i) \
    do {                 \
    } while (0)
#endif

__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// The same at device scope: for words only this GPU's blocks read (cheaper than a
// system-scope fence, which also waits for writes to peers and the host).
__device__ __forceinline__ u64 ld_acquire_gpu(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_gpu(u64* p, u64 v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void report(u64* status, u64 kind, u64 detail) {
    *(volatile u64*)status = (kind << 32) | (detail & 0xffffffffull);
    __threadfence_system();
}

// Spins until the 32-bit sequence in the high half of *flag reaches `want` (wrap-safe), or
// the timeout passes. Returns the word, or sets *failed.
__device__ u64 wait_seq(const u64* flag, u32 want, u64 timeout_ns, int* failed) {
    u64 start = now_ns();
    u64 w = ld_acquire_sys(flag);
    while ((int)((u32)(w >> 32) - want) < 0) {
        if (now_ns() - start > timeout_ns) {
            *failed = 1;
            return w;
        }
        w = ld_acquire_sys(flag);
    }
    return w;
}

// ---- The proxy transport (proxy/, docs/moe.md "Phase 2") ----
// For a rank d in proxy[PX_MASK], a send kernel writes what would go to section `rank` of
// d's window into section d of this rank's outbox (the window's layout), and raises the flag
// there and in doorbell[stage][d] (pinned host memory the proxy thread polls). The proxy
// writes the sections with the engine; each write is an arrival of an immediate at d, whose
// GpuCounter (proxy[PX_COUNTER + stage][source]) the receive kernel waits on before it reads
// the flag in its window as for NVLink. The words of `proxy` are layout.rs's.
#define PX_MASK 0
#define PX_OUTBOX 1
#define PX_DOORBELL 2
#define PX_COUNTER 3
#define PX_BASE (3 + 2 * MAX_RANKS)
#define PX_DISPATCH 0u
#define PX_COMBINE 1u
#define PX_BARRIER 2u
// Writes (arrivals) per step of a stage: proxy::Stage::writes.
#define PX_WRITES_DISPATCH 4u
#define PX_WRITES_COMBINE 2u

__device__ __forceinline__ bool px_is(const u64* proxy, u32 d) {
    return (proxy[PX_MASK] >> d) & 1ull;
}

// Where the rows for rank d go, and the section (source index) to use there: d's window and
// section `rank`, or our outbox and section d.
__device__ __forceinline__ char* px_base(const u64* peers, const u64* proxy, u32 d, u32 rank, u32* sec) {
    if (px_is(proxy, d)) {
        *sec = d;
        return (char*)proxy[PX_OUTBOX];
    }
    *sec = rank;
    return (char*)peers[d];
}

// Raises this rank's flag (of stage `stage`, at `off_flag`) for rank d: a release store into
// d's window, or into our outbox, then the doorbell (after every write of the kernel, made
// visible system-wide by the caller's last_block, and this one).
__device__ __forceinline__ void px_raise(const u64* peers, const u64* proxy, u32 d, u32 rank, u64 off_flag,
                                         u32 stage, u64 v) {
    if (px_is(proxy, d)) {
        *(volatile u64*)((u64*)((char*)proxy[PX_OUTBOX] + off_flag) + d) = v;
        __threadfence_system();
        st_release_sys((u64*)proxy[PX_DOORBELL] + stage * MAX_RANKS + d, v);
    } else {
        st_release_sys((u64*)((char*)peers[d] + off_flag) + rank, v);
    }
}

// The flags of a send stage, raised at every rank (v(d) = seq << 32 | counts[d]) by thread 0
// of the block that last_block(.., true) found last: its second system-scope fence ordered
// every block's writes before what follows, so an NVLink flag is a relaxed store (a fence
// then a store: a release pattern) instead of a release store of its own, which fences
// again; a proxy rank's goes through px_raise.
__device__ void raise_flags(const u64* peers, const u64* proxy, u32 rank, u32 ranks, u64 off_flag, u32 stage,
                            u64 seq, const int* counts) {
    if (threadIdx.x != 0) return;
    for (u32 d = 0; d < ranks; ++d) {
        u64 v = (seq << 32) | (u32)counts[d];
        if (px_is(proxy, d)) {
            px_raise(peers, proxy, d, rank, off_flag, stage, v);
        } else {
            *(volatile u64*)((u64*)((char*)peers[d] + off_flag) + rank) = v;
        }
    }
}

// For a proxy source s: spins until its counter of `stage` holds `writes` arrivals for every
// step up to `want` (wrap-safe in the step). Returns false (and sets *failed) on timeout;
// true at once for an NVLink source.
__device__ bool px_wait(const u64* proxy, u32 stage, u32 s, u32 want, u32 writes, u64 timeout_ns, int* failed) {
    if (!px_is(proxy, s)) return true;
    const u64* c = (const u64*)proxy[PX_COUNTER + stage * MAX_RANKS + s];
    u64 base = proxy[PX_BASE + stage * MAX_RANKS + s];
    u64 start = now_ns();
    while ((int)((u32)((ld_acquire_sys(c) - base) / writes) - want) < 0) {
        if (now_ns() - start > timeout_ns) {
            *failed = 1;
            return false;
        }
    }
    return true;
}
// ---- end of the proxy transport ----

__device__ __forceinline__ float bf16_to_f32(u32 h) {
    return __uint_as_float((h & 0xffffu) << 16);
}

// Round to nearest even, as `reference::f32_to_bf16` on the host.
__device__ __forceinline__ u32 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return ((u >> 16) | 0x40u) & 0xffffu;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
}

__device__ __forceinline__ i64 expert_of(const void* topk_idx, u32 idx64, u64 i) {
    return idx64 ? ((const i64*)topk_idx)[i] : (i64)((const int*)topk_idx)[i];
}

// One warp copies `bytes` from src to dst: 16 B per lane and four loads in flight where both
// ends and the length allow, 2 B per lane otherwise.
__device__ __forceinline__ void copy_row(char* __restrict__ dst, const char* __restrict__ src, u32 bytes,
                                         u32 lane) {
    if ((((u64)dst | (u64)src | (u64)bytes) & 15ull) == 0) {
        const V16* s = (const V16*)src;
        V16* d = (V16*)dst;
        u32 n = bytes / 16, i = lane;
        for (; i + 96 < n; i += 128) {
            V16 a = s[i], b = s[i + 32], c = s[i + 64], e = s[i + 96];
            d[i] = a;
            d[i + 32] = b;
            d[i + 64] = c;
            d[i + 96] = e;
        }
        for (; i < n; i += 32) d[i] = s[i];
    } else {
        const u16* s = (const u16*)src;
        u16* d = (u16*)dst;
        for (u32 i = lane; i < bytes / 2; i += 32) d[i] = s[i];
    }
}

// Top-k and rank counts up to these take the register paths below (every index known at
// compile time, so the arrays stay in registers); larger ones the general loops.
#define FAST_K 8
#define FAST_R 8
// Chunks (16 B) per segment when `rows` rows of `chunks` are split so that they keep about
// `warps` warps busy: whole rows when there are enough of them (a warp's setup per item, its
// meta and places, is then paid once a row), down to 32 chunks (512 B, one per lane) when
// few; always a multiple of 32, so that no lane idles inside a segment.
__device__ __forceinline__ u32 row_seg_len(u32 chunks, u32 warps, u32 rows) {
    // Segments per row: as many as fit in one round of the warps (rounding up would give
    // some warps a second item and double the stage's time).
    u32 want = rows == 0 || rows >= warps ? 1 : warps / rows;
    u32 len = (chunks + want - 1) / want;
    len = (len + 31) / 32 * 32;
    return len < 32 ? 32 : len;
}

// One warp copies chunks [c0, c1) (16 B each) of src to dst: four loads issued before their
// stores (the pointers may alias as far as the compiler knows, so a plain loop would wait
// for each load), then the rest one by one.
__device__ __forceinline__ void copy_seg(V16* dst, const V16* src, u32 c0, u32 c1, u32 lane) {
    u32 i = c0 + lane;
    for (; i + 96 < c1; i += 128) {
        V16 a = src[i], b = src[i + 32], c = src[i + 64], e = src[i + 96];
        dst[i] = a;
        dst[i + 32] = b;
        dst[i + 64] = c;
        dst[i + 96] = e;
    }
    for (; i < c1; i += 32) dst[i] = src[i];
}

// Copies `bytes` of `src` to each non-null dst[j] (j < FAST_K), one warp: every chunk is
// loaded once and stored to each destination, so a row that goes to several experts costs
// one read, and the loads of successive chunks are independent (no wait per destination).
__device__ __forceinline__ void copy_row_multi(char* const* dst, const char* __restrict__ src, u32 bytes,
                                               u32 lane) {
    u64 bits = (u64)src | (u64)bytes;
#pragma unroll
    for (int j = 0; j < FAST_K; ++j) bits |= (u64)dst[j];
    if ((bits & 15ull) == 0) {
        const V16* s = (const V16*)src;
        u32 n = bytes / 16;
#pragma unroll 4
        for (u32 i = lane; i < n; i += 32) {
            V16 v = s[i];
#pragma unroll
            for (int j = 0; j < FAST_K; ++j) {
                if (dst[j]) ((V16*)dst[j])[i] = v;
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < FAST_K; ++j) {
            if (dst[j]) copy_row(dst[j], src, bytes, lane);
        }
    }
}

// The "last block" step: the block's writes are made visible (system-wide with `sys`, for
// writes that peers read; else on this GPU), then one thread per block counts the block
// done. Returns true in the block that came last (in all of its threads); that block resets
// the counter for the next launch.
__device__ bool last_block(u64* done, bool sys) {
    __shared__ int last;
    // The block's writes happen before thread 0's (bar.sync), whose fence then orders them,
    // cumulatively, before its count (as cooperative groups' grid sync does at device
    // scope): one fence per block, not one per thread.
    __syncthreads();
    if (threadIdx.x == 0) {
        if (sys) {
            __threadfence_system();
        } else {
            __threadfence();
        }
        last = atomicAdd(done, 1ull) == (u64)(gridDim.x - 1);
        // And in the last block, every other block's writes before what follows.
        if (last) {
            if (sys) {
                __threadfence_system();
            } else {
                __threadfence();
            }
        }
    }
    __syncthreads();
    return last;
}
