// fabric-moe's kernels: MoE dispatch and combine over NVLink (CUDA IPC mappings of every
// rank's window). Compiled at run time by NVRTC (no headers: everything used is a builtin).
//
// Per step, on every rank, on the caller's stream:
//   moe_dispatch_send  block 0 routes: topk_idx -> send_slot[t][d] (slot of token t in rank
//                      d's rows from us, or -1), send_count[d], send_pos[t][j] (the token's
//                      place among our rows for expert j), send_ecount[e] (our rows per
//                      expert); then every block: token rows + meta (token index, experts,
//                      weights, places) into each peer's window, a (row, segment) per warp;
//                      the last block writes our rows per expert into each peer's ecount
//                      and raises flag[d][me] = (seq << 32) | count
//   moe_dispatch_recv  waits for every source's flag, then copies each received row segment
//                      into the expert-major x_expert[le][pos]: pos = the rows of earlier
//                      sources for that expert plus the row's place (no atomics)
//   moe_combine_send   per received row: sum_k w_k * expert_out[le_k][pos_k] in f32, as bf16
//                      into the source's window; the last block raises the combine flags
//   moe_combine_recv   waits for the combine flags, then out[t] = sum over ranks of the
//                      partial sums (f32), as bf16
//
// Ranks in the proxy mask (proxy.rs; another host, or Transport::Proxy) are reached through
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
// The step whose route block 0 of moe_dispatch_send finished (the other blocks wait for it).
#define ST_ROUTED 6
// Done-block counters of the kernels that end with a "last block" step.
#define ST_DONE_DSEND 8
#define ST_DONE_DRECV 9
#define ST_DONE_CSEND 10
#define ST_DONE_CRECV 11

// Error kinds in `status[0]` (kind << 32 | detail); see `Status` in alltoall.rs.
#define ERR_DISPATCH_TIMEOUT 1ull
#define ERR_COMBINE_TIMEOUT 2ull
#define ERR_CAPACITY 3ull
#define ERR_BAD_EXPERT 4ull
#define ERR_BARRIER_TIMEOUT 5ull
// 6 (a failed proxy write) is written by the host's proxy thread (proxy.rs).

#define MAX_RANKS 64

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

// ---- The proxy transport (proxy.rs, docs/moe.md "Phase 2") ----
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
    u32 want = rows == 0 ? 1 : (warps + rows - 1) / rows;
    u32 len = (chunks + want - 1) / want;
    len = (len + 31) / 32 * 32;
    return len < 32 ? 32 : len;
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

// The "last block" step: the block's writes are made visible system-wide, then one thread
// per block counts the block done. Returns true in the block that came last (in all of its
// threads); that block resets the counter for the next launch.
__device__ bool last_block(u64* done) {
    __shared__ int last;
    // The block's writes happen before thread 0's (bar.sync), whose system-scope fence then
    // orders them, cumulatively, before its count (as cooperative groups' grid sync does at
    // device scope): one fence per block, not one per thread.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        last = atomicAdd(done, 1ull) == (u64)(gridDim.x - 1);
        // And in the last block, every other block's writes before what follows.
        if (last) __threadfence_system();
    }
    __syncthreads();
    return last;
}

// Experts counted in shared memory by the route (the global counts otherwise).
#define ROUTE_SMEM_EXPERTS 4096

// The route of a step, by one block (block 0 of moe_dispatch_send): send_slot[t][d] (slot of
// token t in rank d's rows from us, or -1), send_count[d], send_pos[t][j] (the token's place
// among our rows for its j-th expert) and send_ecount[e] (our rows per expert); notes
// num_tokens in the state.
__device__ void route_tokens(const void* topk_idx, u32 idx64, u32 num_tokens, u32 k, u32 ranks,
                             u32 experts_per_rank, int* send_slot, int* send_count, int* send_pos,
                             int* send_ecount, u64* state, u64* status) {
    __shared__ int wcount[32][MAX_RANKS];
    __shared__ int carry[MAX_RANKS];
    __shared__ int scount[ROUTE_SMEM_EXPERTS];
    u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    i64 total = (i64)ranks * experts_per_rank;
    bool smem = total <= ROUTE_SMEM_EXPERTS;
    int* counts = smem ? scount : send_ecount;
    for (i64 e = tid; e < total; e += blockDim.x) counts[e] = 0;
    if (tid < ranks) carry[tid] = 0;
    if (tid == 0) state[ST_TOKENS] = num_tokens;
    __syncthreads();
    u32 below = (1u << lane) - 1u;
    for (u32 base = 0; base < num_tokens; base += blockDim.x) {
        u32 t = base + tid;
        u64 mask = 0;
        if (t < num_tokens) {
            for (u32 j = 0; j < k; ++j) {
                i64 e = expert_of(topk_idx, idx64, (u64)t * k + j);
                int pos = -1;
                if (e >= total) {
                    report(status, ERR_BAD_EXPERT, t);
                } else if (e >= 0) {
                    mask |= 1ull << (u32)(e / experts_per_rank);
                    // The token's place among this rank's rows for expert e (any order, each
                    // place once): where the receiver puts it, after the earlier sources'.
                    pos = atomicAdd(&counts[e], 1);
                }
                send_pos[(u64)t * k + j] = pos;
            }
        }
        for (u32 d = 0; d < ranks; ++d) {
            u32 ballot = __ballot_sync(0xffffffffu, (u32)(mask >> d) & 1u);
            if (lane == 0) wcount[warp][d] = __popc(ballot);
        }
        __syncthreads();
        if (tid < ranks) {
            int run = carry[tid];
            for (u32 w = 0; w < nwarps; ++w) {
                int c = wcount[w][tid];
                wcount[w][tid] = run;
                run += c;
            }
            carry[tid] = run;
        }
        __syncthreads();
        for (u32 d = 0; d < ranks; ++d) {
            u32 bit = (u32)(mask >> d) & 1u;
            u32 ballot = __ballot_sync(0xffffffffu, bit);
            if (t < num_tokens) {
                send_slot[(u64)t * ranks + d] = bit ? wcount[warp][d] + __popc(ballot & below) : -1;
            }
        }
        __syncthreads();
    }
    if (tid < ranks) send_count[tid] = carry[tid];
    if (smem) {
        for (i64 e = tid; e < total; e += blockDim.x) send_ecount[e] = scount[e];
    }
}

// One warp copies chunks [c0, c1) (16 B each) of `src` to each non-null dst[j] (j < FAST_K):
// each chunk is loaded once and stored to every destination.
__device__ __forceinline__ void copy_seg_multi(char* const* dst, const char* __restrict__ src, u32 c0, u32 c1,
                                               u32 lane) {
    const V16* s = (const V16*)src;
#pragma unroll 4
    for (u32 i = c0 + lane; i < c1; i += 32) {
        V16 v = s[i];
#pragma unroll
        for (int j = 0; j < FAST_K; ++j) {
            if (dst[j]) ((V16*)dst[j])[i] = v;
        }
    }
}

extern "C" __global__ void moe_dispatch_send(const char* x, const void* topk_idx, u32 idx64,
                                             const float* topk_weights, int* send_slot, int* send_count,
                                             int* send_pos, int* send_ecount, const u64* peers, u64* state,
                                             u64* status, u32 num_tokens, u32 rank, u32 ranks, u32 max_tokens,
                                             u32 k, u32 experts_per_rank, u32 row_bytes, u64 off_dflag,
                                             u64 off_ecount, u64 off_meta, u64 off_rx, u64 timeout_ns,
                                             const u64* proxy) {
    u32 lane = threadIdx.x & 31;
    u32 warps = gridDim.x * (blockDim.x >> 5);
    // Block 0 routes the step's tokens; the other blocks wait for its word (blocks start in
    // order, so block 0 is running or done by then; the wait is bounded all the same).
    __shared__ int unrouted;
    u64 seq = (state[ST_DSEND] + 1) & 0xffffffffull;
    if (blockIdx.x == 0) {
        route_tokens(topk_idx, idx64, num_tokens, k, ranks, experts_per_rank, send_slot, send_count, send_pos,
                     send_ecount, state, status);
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            unrouted = 0;
            st_release_sys(&state[ST_ROUTED], seq);
        }
        __syncthreads();
    } else {
        if (threadIdx.x == 0) {
            unrouted = 0;
            u64 start = now_ns();
            while (ld_acquire_sys(&state[ST_ROUTED]) != seq) {
                if (now_ns() - start > timeout_ns) {
                    unrouted = 1;
                    report(status, ERR_DISPATCH_TIMEOUT, 0);
                    break;
                }
            }
        }
        __syncthreads();
    }
    u32 meta_words = 1 + 3 * k;
    // Work items: (token, destination, segment: row_seg_len) where rows move 16 B a lane;
    // whole rows otherwise.
    bool vec = ((row_bytes | (u32)(u64)x) & 15u) == 0;
    u32 chunks = row_bytes / 16;
    u32 seg_len = vec ? row_seg_len(chunks, warps, num_tokens * ranks) : chunks;
    u32 segs = vec ? (chunks + seg_len - 1) / seg_len : 1;
    u64 items = unrouted ? 0 : (u64)num_tokens * ranks * segs;
    for (u64 it = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); it < items; it += warps) {
        u32 i = (u32)(it / segs), seg = (u32)(it % segs);
        u32 t = i / ranks, d = i % ranks;
        int slot = send_slot[i];
        if (slot < 0) continue;
        u32 sec;
        char* base = px_base(peers, proxy, d, rank, &sec);
        u64 row = (u64)sec * max_tokens + (u32)slot;
        char* dst = base + off_rx + row * row_bytes;
        const char* src = x + (u64)t * row_bytes;
        if (vec) {
            const V16* s4 = (const V16*)src;
            V16* d4 = (V16*)dst;
            u32 end = min(chunks, (seg + 1) * seg_len);
#pragma unroll 4
            for (u32 c = seg * seg_len + lane; c < end; c += 32) d4[c] = s4[c];
        } else {
            copy_row(dst, src, row_bytes, lane);
        }
        if (seg != 0) continue;
        int* meta = (int*)(base + off_meta) + row * meta_words;
        if (lane == 0) meta[0] = (int)t;
        for (u32 j = lane; j < k; j += 32) {
            i64 e = expert_of(topk_idx, idx64, (u64)t * k + j);
            meta[1 + j] = (e < 0 || e > 0x7fffffffll) ? -1 : (int)e;
            meta[1 + k + j] = __float_as_int(topk_weights[(u64)t * k + j]);
            meta[1 + 2 * k + j] = send_pos[(u64)t * k + j];
        }
    }
    if (!last_block(&state[ST_DONE_DSEND])) return;
    // Our rows per expert of each destination, then (ordered after them) its flag.
    for (u32 q = threadIdx.x; q < ranks * experts_per_rank; q += blockDim.x) {
        u32 d = q / experts_per_rank, le = q % experts_per_rank;
        u32 sec;
        char* base = px_base(peers, proxy, d, rank, &sec);
        int* ecount = (int*)(base + off_ecount) + (u64)sec * experts_per_rank;
        ecount[le] = send_ecount[q];
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x < ranks) {
        u32 d = threadIdx.x;
        px_raise(peers, proxy, d, rank, off_dflag, PX_DISPATCH, (seq << 32) | (u32)send_count[d]);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        state[ST_DSEND] = seq;
        state[ST_DONE_DSEND] = 0;
    }
}

// Where a row of source s goes in local expert le, given its place p among s's rows for le:
// after every earlier source's rows for le (the caller checks it against the capacity).
__device__ __forceinline__ int place(const int* ecount, u32 s, u32 experts_per_rank, int le, int p) {
    int pos = p;
    for (u32 q = 0; q < s; ++q) pos += ecount[(u64)q * experts_per_rank + le];
    return pos;
}

extern "C" __global__ void moe_dispatch_recv(const char* window, char* x_expert, int* expert_count,
                                             int* src_info, int* recv_pos, int* recv_count, u64* state,
                                             u64* status, u32 rank, u32 ranks, u32 max_tokens, u32 k,
                                             u32 experts_per_rank, u32 capacity, u32 row_bytes,
                                             u64 off_dflag, u64 off_ecount, u64 off_meta, u64 off_rx,
                                             u64 timeout_ns, float* expert_w, u32 rank_major,
                                             const u64* proxy) {
    __shared__ int cnt[MAX_RANKS];
    __shared__ int failed;
    if (threadIdx.x == 0) failed = 0;
    __syncthreads();
    if (threadIdx.x < ranks) {
        u32 s = threadIdx.x;
        u32 want = (u32)(state[ST_DRECV] + 1);
        u64 w = px_wait(proxy, PX_DISPATCH, s, want, PX_WRITES_DISPATCH, timeout_ns, &failed)
                    ? wait_seq((const u64*)(window + off_dflag) + s, want, timeout_ns, &failed)
                    : 0;
        cnt[s] = (int)(u32)w;
        if (blockIdx.x == 0) recv_count[s] = (int)(u32)w;
    }
    __syncthreads();
    __threadfence();
    const int* ecount = (const int*)(window + off_ecount);
    if (failed) {
        if (threadIdx.x == 0) report(status, ERR_DISPATCH_TIMEOUT, blockIdx.x);
    } else {
        u32 lane = threadIdx.x & 31;
        u32 warps = gridDim.x * (blockDim.x >> 5);
        u32 meta_words = 1 + 3 * k;
        int first = (int)(rank * experts_per_rank);
        bool vec = ((row_bytes | (u32)(u64)x_expert) & 15u) == 0;
        u32 chunks = row_bytes / 16;
        u32 rows = 0;
        for (u32 q = 0; q < ranks; ++q) rows += (u32)cnt[q];
        // Rank-major: rows stay in the window; only their places, indices and weights.
        bool copy = !rank_major;
        u32 seg_len = vec && copy ? row_seg_len(chunks, warps, rows) : chunks;
        u32 segs = vec && copy ? (chunks + seg_len - 1) / seg_len : 1;
        u64 items = (u64)ranks * max_tokens * segs;
        for (u64 it = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); it < items; it += warps) {
            u32 i = (u32)(it / segs), seg = (u32)(it % segs);
            u32 s = i / max_tokens, slot = i % max_tokens;
            if ((int)slot >= cnt[s]) continue;
            const int* meta = (const int*)(window + off_meta) + (u64)i * meta_words;
            const char* src = window + off_rx + (u64)i * row_bytes;
            // src_info of the row is s * max_tokens + tok: its source token, or (rank-major)
            // its slot, which makes it the row's index in the window's rows.
            int tok = rank_major ? (int)slot : meta[0];
            if (k <= FAST_K) {
                // Lane j places the row's j-th expert; the warp then copies its segment once
                // into every place.
                int pos = -1, le = -1;
                if (lane < k) {
                    int e = meta[1 + lane];
                    if (e >= first && e < first + (int)experts_per_rank) {
                        le = e - first;
                        pos = place(ecount, s, experts_per_rank, le, meta[1 + 2 * k + lane]);
                        if (pos < 0 || pos >= (int)capacity) {
                            if (seg == 0) report(status, ERR_CAPACITY, (u64)le);
                            pos = -1;
                        } else if (seg == 0) {
                            src_info[(u64)le * capacity + pos] = (int)(s * max_tokens) + tok;
                            expert_w[(u64)le * capacity + pos] = __int_as_float(meta[1 + k + lane]);
                        }
                    }
                    if (seg == 0) recv_pos[(u64)i * k + lane] = pos;
                }
                char* dsts[FAST_K];
#pragma unroll
                for (int j = 0; j < FAST_K; ++j) {
                    int p = __shfl_sync(0xffffffffu, pos, j);
                    int l = __shfl_sync(0xffffffffu, le, j);
                    dsts[j] = ((u32)j < k && p >= 0) ? x_expert + ((u64)l * capacity + p) * row_bytes : (char*)0;
                }
                if (!copy) continue;
                if (vec) {
                    copy_seg_multi(dsts, src, seg * seg_len, min(chunks, (seg + 1) * seg_len), lane);
                } else {
                    copy_row_multi(dsts, src, row_bytes, lane);
                }
                continue;
            }
            for (u32 j = 0; j < k; ++j) {
                int e = meta[1 + j];
                int pos = -1;
                if (e >= first && e < first + (int)experts_per_rank) {
                    int le = e - first;
                    pos = place(ecount, s, experts_per_rank, le, meta[1 + 2 * k + j]);
                    if (pos < 0 || pos >= (int)capacity) {
                        if (seg == 0 && lane == 0) report(status, ERR_CAPACITY, (u64)le);
                        pos = -1;
                    } else {
                        if (seg == 0 && lane == 0) {
                            src_info[(u64)le * capacity + pos] = (int)(s * max_tokens) + tok;
                            expert_w[(u64)le * capacity + pos] = __int_as_float(meta[1 + k + j]);
                        }
                        char* dst = x_expert + ((u64)le * capacity + pos) * row_bytes;
                        if (!copy) {
                        } else if (vec) {
                            u32 end = min(chunks, (seg + 1) * seg_len);
                            for (u32 c = seg * seg_len + lane; c < end; c += 32) ((V16*)dst)[c] = ((const V16*)src)[c];
                        } else {
                            copy_row(dst, src, row_bytes, lane);
                        }
                    }
                }
                if (seg == 0 && lane == 0) recv_pos[(u64)i * k + j] = pos;
            }
        }
    }
    if (!last_block(&state[ST_DONE_DRECV])) return;
    // Rows per local expert: every source's, clamped to what fits (an overflow was reported).
    if (!failed) {
        for (u32 le = threadIdx.x; le < experts_per_rank; le += blockDim.x) {
            long long n = 0;
            for (u32 q = 0; q < ranks; ++q) n += ecount[(u64)q * experts_per_rank + le];
            expert_count[le] = n > (long long)capacity ? (int)capacity : (int)n;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        state[ST_DRECV] = (state[ST_DRECV] + 1) & 0xffffffffull;
        state[ST_DONE_DRECV] = 0;
    }
}

// 8 bf16 of `v` times `w`, added into acc.
__device__ __forceinline__ void fma8(float* acc, V16 v, float w) {
    u32 words[4] = {v.a, v.b, v.c, v.d};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        acc[2 * q] += w * bf16_to_f32(words[q]);
        acc[2 * q + 1] += w * bf16_to_f32(words[q] >> 16);
    }
}

__device__ __forceinline__ V16 pack8(const float* acc) {
    V16 o;
    o.a = f32_to_bf16(acc[0]) | (f32_to_bf16(acc[1]) << 16);
    o.b = f32_to_bf16(acc[2]) | (f32_to_bf16(acc[3]) << 16);
    o.c = f32_to_bf16(acc[4]) | (f32_to_bf16(acc[5]) << 16);
    o.d = f32_to_bf16(acc[6]) | (f32_to_bf16(acc[7]) << 16);
    return o;
}

extern "C" __global__ void moe_combine_send(const char* expert_out, const char* window, const int* recv_pos,
                                            const int* recv_count, const u64* peers, u64* state, u32 rank,
                                            u32 ranks, u32 max_tokens, u32 k, u32 experts_per_rank,
                                            u32 capacity, u32 hidden, u64 off_cflag, u64 off_meta,
                                            u64 off_cx, u32 rank_major, const u64* proxy) {
    u32 lane = threadIdx.x & 31;
    u32 warps = gridDim.x * (blockDim.x >> 5);
    u32 meta_words = 1 + 3 * k;
    u64 row_bytes = (u64)hidden * 2;
    int first = (int)(rank * experts_per_rank);
    bool vec = (hidden % 8 == 0) && (((u64)expert_out & 15ull) == 0);
    // Work items: (row, segment), so that few rows still use many warps (row_seg_len).
    u32 chunks = hidden / 8;
    u32 rows = 0;
    for (u32 q = 0; q < ranks; ++q) rows += (u32)recv_count[q];
    u32 seg_len = vec ? row_seg_len(chunks, warps, rows) : chunks;
    u32 segs = vec ? (chunks + seg_len - 1) / seg_len : 1;
    u64 items = (u64)ranks * max_tokens * segs;
    for (u64 it = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); it < items; it += warps) {
        u32 i = (u32)(it / segs), seg = (u32)(it % segs);
        u32 s = i / max_tokens, slot = i % max_tokens;
        if ((int)slot >= recv_count[s]) continue;
        const int* meta = (const int*)(window + off_meta) + (u64)i * meta_words;
        u32 sec;
        char* dst = px_base(peers, proxy, s, rank, &sec) + off_cx + ((u64)sec * max_tokens + slot) * row_bytes;
        if (rank_major) {
            // The caller's row for this received row is already weighted and summed over
            // this rank's experts: it goes back as it is.
            const char* src = expert_out + (u64)i * row_bytes;
            if (vec) {
                u32 end = min(chunks, (seg + 1) * seg_len);
#pragma unroll 4
                for (u32 c = seg * seg_len + lane; c < end; c += 32) ((V16*)dst)[c] = ((const V16*)src)[c];
            } else {
                copy_row(dst, src, (u32)row_bytes, lane);
            }
        } else if (vec && k <= FAST_K) {
            // The row's expert outputs and weights first, in registers: the loads of one chunk
            // are then independent of each other.
            const V16* rows[FAST_K];
            float ws[FAST_K];
#pragma unroll
            for (int j = 0; j < FAST_K; ++j) {
                rows[j] = (const V16*)0;
                ws[j] = 0.f;
                if ((u32)j < k) {
                    int pos = recv_pos[(u64)i * k + j];
                    if (pos >= 0) {
                        int le = meta[1 + j] - first;
                        rows[j] = (const V16*)(expert_out + ((u64)le * capacity + pos) * row_bytes);
                        ws[j] = __int_as_float(meta[1 + k + j]);
                    }
                }
            }
            u32 end = min(chunks, (seg + 1) * seg_len);
            for (u32 c = seg * seg_len + lane; c < end; c += 32) {
                float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int j = 0; j < FAST_K; ++j) {
                    if (rows[j]) fma8(acc, rows[j][c], ws[j]);
                }
                ((V16*)dst)[c] = pack8(acc);
            }
        } else if (vec) {
            u32 end = min(chunks, (seg + 1) * seg_len);
            for (u32 c = seg * seg_len + lane; c < end; c += 32) {
                float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                for (u32 j = 0; j < k; ++j) {
                    int pos = recv_pos[(u64)i * k + j];
                    if (pos < 0) continue;
                    int le = meta[1 + j] - first;
                    float w = __int_as_float(meta[1 + k + j]);
                    const V16* row = (const V16*)(expert_out + ((u64)le * capacity + pos) * row_bytes);
                    fma8(acc, row[c], w);
                }
                ((V16*)dst)[c] = pack8(acc);
            }
        } else {
            for (u32 h = lane; h < hidden; h += 32) {
                float acc = 0.f;
                for (u32 j = 0; j < k; ++j) {
                    int pos = recv_pos[(u64)i * k + j];
                    if (pos < 0) continue;
                    int le = meta[1 + j] - first;
                    float w = __int_as_float(meta[1 + k + j]);
                    const u16* row = (const u16*)(expert_out + ((u64)le * capacity + pos) * row_bytes);
                    acc += w * bf16_to_f32(row[h]);
                }
                ((u16*)dst)[h] = (u16)f32_to_bf16(acc);
            }
        }
    }
    if (!last_block(&state[ST_DONE_CSEND])) return;
    u64 seq = (state[ST_CSEND] + 1) & 0xffffffffull;
    if (threadIdx.x < ranks) {
        u32 d = threadIdx.x;
        px_raise(peers, proxy, d, rank, off_cflag, PX_COMBINE, (seq << 32) | (u32)recv_count[d]);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        state[ST_CSEND] = seq;
        state[ST_DONE_CSEND] = 0;
    }
}

extern "C" __global__ void moe_combine_recv(char* out, const char* window, const int* send_slot, u64* state,
                                            u64* status, u32 ranks, u32 max_tokens, u32 hidden,
                                            u64 off_cflag, u64 off_cx, u64 timeout_ns, const u64* proxy) {
    __shared__ int failed;
    if (threadIdx.x == 0) failed = 0;
    __syncthreads();
    if (threadIdx.x < ranks) {
        u32 want = (u32)(state[ST_CRECV] + 1);
        if (px_wait(proxy, PX_COMBINE, threadIdx.x, want, PX_WRITES_COMBINE, timeout_ns, &failed)) {
            wait_seq((const u64*)(window + off_cflag) + threadIdx.x, want, timeout_ns, &failed);
        }
    }
    __syncthreads();
    __threadfence();
    if (failed) {
        if (threadIdx.x == 0) report(status, ERR_COMBINE_TIMEOUT, blockIdx.x);
    } else {
        u32 lane = threadIdx.x & 31;
        u32 warps = gridDim.x * (blockDim.x >> 5);
        u32 num_tokens = (u32)state[ST_TOKENS];
        u64 row_bytes = (u64)hidden * 2;
        bool vec = (hidden % 8 == 0) && (((u64)out & 15ull) == 0);
        u32 chunks = hidden / 8;
        u32 seg_len = vec ? row_seg_len(chunks, warps, num_tokens) : chunks;
        u32 segs = vec ? (chunks + seg_len - 1) / seg_len : 1;
        u64 items = (u64)num_tokens * segs;
        for (u64 it = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); it < items; it += warps) {
            u32 t = (u32)(it / segs), seg = (u32)(it % segs);
            char* dst = out + (u64)t * row_bytes;
            const int* slots = send_slot + (u64)t * ranks;
            if (vec && ranks <= FAST_R) {
                const V16* rows[FAST_R];
#pragma unroll
                for (int d = 0; d < FAST_R; ++d) {
                    int slot = (u32)d < ranks ? slots[d] : -1;
                    rows[d] = slot < 0 ? (const V16*)0
                                       : (const V16*)(window + off_cx + ((u64)d * max_tokens + slot) * row_bytes);
                }
                u32 end = min(chunks, (seg + 1) * seg_len);
                for (u32 c = seg * seg_len + lane; c < end; c += 32) {
                    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
                    for (int d = 0; d < FAST_R; ++d) {
                        if (rows[d]) fma8(acc, rows[d][c], 1.0f);
                    }
                    ((V16*)dst)[c] = pack8(acc);
                }
            } else if (vec) {
                u32 end = min(chunks, (seg + 1) * seg_len);
                for (u32 c = seg * seg_len + lane; c < end; c += 32) {
                    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                    for (u32 d = 0; d < ranks; ++d) {
                        int slot = slots[d];
                        if (slot < 0) continue;
                        const V16* row = (const V16*)(window + off_cx + ((u64)d * max_tokens + slot) * row_bytes);
                        fma8(acc, row[c], 1.0f);
                    }
                    ((V16*)dst)[c] = pack8(acc);
                }
            } else {
                for (u32 h = lane; h < hidden; h += 32) {
                    float acc = 0.f;
                    for (u32 d = 0; d < ranks; ++d) {
                        int slot = slots[d];
                        if (slot < 0) continue;
                        const u16* row = (const u16*)(window + off_cx + ((u64)d * max_tokens + slot) * row_bytes);
                        acc += bf16_to_f32(row[h]);
                    }
                    ((u16*)dst)[h] = (u16)f32_to_bf16(acc);
                }
            }
        }
    }
    if (!last_block(&state[ST_DONE_CRECV])) return;
    if (threadIdx.x == 0) {
        state[ST_CRECV] = (state[ST_CRECV] + 1) & 0xffffffffull;
        state[ST_DONE_CRECV] = 0;
    }
}

// Every rank raises its flag in every peer's window, then waits for every peer's: a barrier
// on the GPU, for timing (one block).
extern "C" __global__ void moe_barrier(const char* window, const u64* peers, u64* state, u64* status,
                                       u32 rank, u32 ranks, u64 off_bflag, u64 timeout_ns, const u64* proxy) {
    __shared__ int failed;
    if (threadIdx.x == 0) failed = 0;
    __syncthreads();
    u64 seq = (state[ST_BARRIER] + 1) & 0xffffffffull;
    if (threadIdx.x < ranks) {
        px_raise(peers, proxy, threadIdx.x, rank, off_bflag, PX_BARRIER, seq << 32);
        wait_seq((const u64*)(window + off_bflag) + threadIdx.x, (u32)seq, timeout_ns, &failed);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (failed) report(status, ERR_BARRIER_TIMEOUT, rank);
        state[ST_BARRIER] = seq;
    }
}

// The GPU's clock (ns) into *dst: stamps between stages, for timing without the host.
extern "C" __global__ void moe_clock(u64* dst) {
    *dst = now_ns();
    __threadfence_system();
}

// A stand-in for the experts (tests, examples): expert_out[le][i] = bf16(x_expert[le][i] *
// (1 + (e % 8) / 8)) for the rows each local expert received, e the global expert id.
extern "C" __global__ void moe_toy_experts(const char* x_expert, char* expert_out, const int* expert_count,
                                           u32 rank, u32 experts_per_rank, u32 capacity, u32 hidden) {
    u32 lane = threadIdx.x & 31;
    u32 warps = gridDim.x * (blockDim.x >> 5);
    u64 rows = (u64)experts_per_rank * capacity;
    for (u64 r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
        u32 le = (u32)(r / capacity), i = (u32)(r % capacity);
        if ((int)i >= expert_count[le]) continue;
        float scale = 1.0f + (float)((rank * experts_per_rank + le) % 8) / 8.0f;
        const u16* src = (const u16*)(x_expert + r * hidden * 2);
        u16* dst = (u16*)(expert_out + r * hidden * 2);
        for (u32 h = lane; h < hidden; h += 32) dst[h] = (u16)f32_to_bf16(bf16_to_f32(src[h]) * scale);
    }
}

// The stand-in experts for RecvLayout::RankMajor: for each received row (source s, slot),
// out[s][slot] = bf16(sum over the row's experts e on this rank of w_e * bf16(x * (1 + (e % 8)
// / 8))), f32 sums: what moe_toy_experts then moe_combine_send compute for the expert-major
// layout, so the combined rows are the same.
extern "C" __global__ void moe_toy_experts_rank(const char* window, char* expert_out, const int* recv_count,
                                                u32 rank, u32 ranks, u32 max_tokens, u32 k,
                                                u32 experts_per_rank, u32 hidden, u64 off_meta, u64 off_rx) {
    u32 lane = threadIdx.x & 31;
    u32 warps = gridDim.x * (blockDim.x >> 5);
    u32 meta_words = 1 + 3 * k;
    int first = (int)(rank * experts_per_rank);
    for (u64 i = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); i < (u64)ranks * max_tokens; i += warps) {
        u32 s = (u32)(i / max_tokens), slot = (u32)(i % max_tokens);
        if ((int)slot >= recv_count[s]) continue;
        const int* meta = (const int*)(window + off_meta) + i * meta_words;
        const u16* src = (const u16*)(window + off_rx + i * hidden * 2);
        u16* dst = (u16*)(expert_out + i * hidden * 2);
        for (u32 h = lane; h < hidden; h += 32) {
            float x = bf16_to_f32(src[h]);
            float acc = 0.f;
            for (u32 j = 0; j < k; ++j) {
                int e = meta[1 + j];
                if (e < first || e >= first + (int)experts_per_rank) continue;
                float scale = 1.0f + (float)(e % 8) / 8.0f;
                acc += __int_as_float(meta[1 + k + j]) * bf16_to_f32(f32_to_bf16(x * scale));
            }
            dst[h] = (u16)f32_to_bf16(acc);
        }
    }
}
