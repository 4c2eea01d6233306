// fabric-moe's kernels, part 2 of 4 (kernels.rs concatenates common, dispatch, combine,
// misc in that order): the route and the dispatch stages.

// Experts counted in shared memory by the route (the global counts otherwise).
#define ROUTE_SMEM_EXPERTS 4096
// Warps of a block that computes its own slots (block_slots): THREADS / 32.
#define BLOCK_SLOTS_WARPS 8
// Experts up to which the route gives places in a fixed order (route_tokens).
#define ORDER_EXPERTS 512
// The route's shared words: the counts, or ordered, the counts then the warps' places.
#define ROUTE_SMEM_WORDS \
    (ROUTE_SMEM_EXPERTS > ORDER_EXPERTS * (1 + BLOCK_SLOTS_WARPS) ? ROUTE_SMEM_EXPERTS \
                                                                   : ORDER_EXPERTS * (1 + BLOCK_SLOTS_WARPS))

// An exclusive scan down one column of a table of per-warp counts: col[w * stride] becomes
// `run` plus the counts of the warps before w; returns the column's total plus `run`.
__device__ __forceinline__ int scan_warps(int* col, u32 stride, u32 nwarps, int run) {
    for (u32 w = 0; w < nwarps; ++w) {
        int c = col[w * stride];
        col[w * stride] = run;
        run += c;
    }
    return run;
}

// The route of a step, by one block (block 0 of moe_dispatch_send): send_slot[t][d] (slot of
// token t in rank d's rows from us, or -1), send_count[d], send_pos[t][j] (the token's place
// among our rows for its j-th expert) and send_ecount[e] (our rows per expert); notes
// num_tokens in the state. After each round of blockDim tokens it publishes how far it got,
// state[ST_ROUTED] = seq << 32 | tokens routed, so that the other blocks copy the rows of
// routed tokens while it routes the next ones (routed_upto).
//
// With `ordered` (Config::ordered_rows), at most ORDER_EXPERTS experts and BLOCK_SLOTS_WARPS warps, the places follow the
// tokens' order (token by token, and a token's experts by j): each warp ranks its lanes per
// expert (match_any, one j at a time) into warp counts, and the counts become offsets by a
// scan over the warps and the earlier rounds, so that the same inputs give the same places,
// and rows land in recv_x in the same order, every time. Past that, a shared atomic per
// place (each place once, in no fixed order).
//
// Compiled once per way (ORDERED), so that the default route carries none of the ordered
// one's code; route_tokens below picks one and gives it the shared memory (one copy for
// both).
template <bool ORDERED>
__device__ void route_way(const void* topk_idx, u32 idx64, u32 num_tokens, u32 k, u32 ranks, u32 experts_per_rank,
                          int* send_slot, int* send_count, int* send_pos, int* send_ecount, u64* state,
                          u64* status, u64 seq, int (*wcount)[MAX_RANKS], int* carry, int* scount) {
    int (*wplace)[ORDER_EXPERTS] = (int (*)[ORDER_EXPERTS])(scount + ORDER_EXPERTS);
    u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    i64 total = (i64)ranks * experts_per_rank;
    bool smem = total <= ROUTE_SMEM_EXPERTS;
    const bool ordered = ORDERED;
    int* counts = smem ? scount : send_ecount;
    for (i64 e = tid; e < total; e += blockDim.x) counts[e] = 0;
    if (tid < ranks) carry[tid] = 0;
    if (tid == 0) state[ST_TOKENS] = num_tokens;
    __syncthreads();
    u32 below = (1u << lane) - 1u;
    for (u32 base = 0; base < num_tokens; base += blockDim.x) {
        u32 t = base + tid;
        bool live = t < num_tokens;
        u64 mask = 0;
        // The token's first FAST_K ids loaded before any of them is placed (placing stores,
        // so the compiler would not move a later load above it), in registers (every index
        // known at compile time); ordered, their places within the warp too.
        i64 ids[FAST_K];
        int pos[FAST_K];
        if (!ordered && live) {
            // The token's place among this rank's rows for expert e (any order, each place
            // once): where the receiver puts it, after the earlier sources'.
            auto place_one = [&](u32 j, i64 e) {
                int pos = -1;
                if (e >= total) {
                    report(status, ERR_BAD_EXPERT, t);
                } else if (e >= 0) {
                    mask |= 1ull << (u32)(e / experts_per_rank);
                    pos = atomicAdd(&counts[e], 1);
                }
                send_pos[(u64)t * k + j] = pos;
            };
#pragma unroll
            for (u32 j = 0; j < FAST_K; ++j) ids[j] = j < k ? expert_of(topk_idx, idx64, (u64)t * k + j) : -1;
#pragma unroll
            for (u32 j = 0; j < FAST_K; ++j) {
                if (j < k) place_one(j, ids[j]);
            }
            for (u32 j = FAST_K; j < k; ++j) place_one(j, expert_of(topk_idx, idx64, (u64)t * k + j));
        } else if (ordered) {
            for (u32 q = tid; q < nwarps * (u32)total; q += blockDim.x) wplace[q / (u32)total][q % (u32)total] = 0;
            __syncthreads();
            // The place within the warp for now (the warp's offset is added below); every
            // lane of the warp calls it with the same j.
            auto place_ordered = [&](u32 j, i64 e) {
                bool valid = live && e >= 0 && e < total;
                if (live && e >= total) report(status, ERR_BAD_EXPERT, t);
                if (valid) mask |= 1ull << (u32)(e / experts_per_rank);
                int pos = -1;
                // Lanes without a place get keys of their own (no match).
                u32 m = __match_any_sync(0xffffffffu, valid ? (int)e : -1 - (int)lane);
                if (valid) pos = wplace[warp][e] + __popc(m & below);
                __syncwarp();
                if (valid && (m & below) == 0) wplace[warp][e] += __popc(m);
                __syncwarp();
                if (live) send_pos[(u64)t * k + j] = pos;
                return pos;
            };
#pragma unroll
            for (u32 j = 0; j < FAST_K; ++j) ids[j] = live && j < k ? expert_of(topk_idx, idx64, (u64)t * k + j) : -1;
#pragma unroll
            for (u32 j = 0; j < FAST_K; ++j) pos[j] = j < k ? place_ordered(j, ids[j]) : -1;
            for (u32 j = FAST_K; j < k; ++j) place_ordered(j, live ? expert_of(topk_idx, idx64, (u64)t * k + j) : -1);
        }
        for (u32 d = 0; d < ranks; ++d) {
            u32 ballot = __ballot_sync(0xffffffffu, (u32)(mask >> d) & 1u);
            if (lane == 0) wcount[warp][d] = __popc(ballot);
        }
        __syncthreads();
        if (tid < ranks) carry[tid] = scan_warps(&wcount[0][tid], MAX_RANKS, nwarps, carry[tid]);
        if (ordered) {
            // Each warp's count of an expert becomes its offset: after the earlier rounds'
            // rows and the earlier warps'.
            for (u32 e = tid; e < (u32)total; e += blockDim.x) {
                counts[e] = scan_warps(&wplace[0][e], ORDER_EXPERTS, nwarps, counts[e]);
            }
        }
        __syncthreads();
        if (ordered && live) {
            // The places within the warp plus the warp's offsets.
#pragma unroll
            for (u32 j = 0; j < FAST_K; ++j) {
                if (pos[j] >= 0) send_pos[(u64)t * k + j] = pos[j] + wplace[warp][ids[j]];
            }
            for (u32 j = FAST_K; j < k; ++j) {
                int p = send_pos[(u64)t * k + j];
                if (p >= 0) send_pos[(u64)t * k + j] = p + wplace[warp][expert_of(topk_idx, idx64, (u64)t * k + j)];
            }
        }
        for (u32 d = 0; d < ranks; ++d) {
            u32 bit = (u32)(mask >> d) & 1u;
            u32 ballot = __ballot_sync(0xffffffffu, bit);
            if (t < num_tokens) {
                send_slot[(u64)t * ranks + d] = bit ? wcount[warp][d] + __popc(ballot & below) : -1;
            }
        }
        __syncthreads();
        if (tid == 0) {
            // The block's slots and places of this round (ordered before thread 0's fence by
            // the barrier), then how far the route got.
            __threadfence();
            u32 upto = min(num_tokens, base + blockDim.x);
            st_release_gpu(&state[ST_ROUTED], (seq << 32) | upto);
        }
    }
    if (tid < ranks) send_count[tid] = carry[tid];
    if (smem) {
        for (i64 e = tid; e < total; e += blockDim.x) send_ecount[e] = scount[e];
    }
}

__device__ void route_tokens(const void* topk_idx, u32 idx64, u32 num_tokens, u32 k, u32 ranks,
                             u32 experts_per_rank, int* send_slot, int* send_count, int* send_pos,
                             int* send_ecount, u64* state, u64* status, u64 seq, u32 ordered_rows) {
    __shared__ int wcount[32][MAX_RANKS];
    __shared__ int carry[MAX_RANKS];
    // The counts per expert; ordered (at most ORDER_EXPERTS of them), the warps' table
    // after them (each block's static shared memory is the kernel's largest: this keeps the
    // dispatch kernels' at about 30 KB).
    __shared__ int scount[ROUTE_SMEM_WORDS];
    if (ordered_rows && (i64)ranks * experts_per_rank <= ORDER_EXPERTS && (blockDim.x >> 5) <= BLOCK_SLOTS_WARPS) {
        route_way<true>(topk_idx, idx64, num_tokens, k, ranks, experts_per_rank, send_slot, send_count, send_pos,
                        send_ecount, state, status, seq, wcount, carry, scount);
    } else {
        route_way<false>(topk_idx, idx64, num_tokens, k, ranks, experts_per_rank, send_slot, send_count, send_pos,
                         send_ecount, state, status, seq, wcount, carry, scount);
    }
}

// Lane 0 of a warp waits until block 0's route of step `seq` has routed token t (its word
// state[ST_ROUTED], see route_tokens); returns how far the route got (the warp's cache), or
// 0 and a report on timeout.
__device__ u32 routed_upto(u64* state, u64* status, u64 seq, u32 t, u64 timeout_ns) {
    u32 lane = threadIdx.x & 31;
    u32 upto = 0;
    if (lane == 0) {
        u64 start = now_ns();
        for (;;) {
            u64 w = ld_acquire_gpu(&state[ST_ROUTED]);
            if ((w >> 32) == seq && (u32)w > t) {
                upto = (u32)w;
                break;
            }
            if (now_ns() - start > timeout_ns) {
                report(status, ERR_DISPATCH_TIMEOUT, 0);
                break;
            }
            __nanosleep(64);
        }
    }
    upto = (u32)__shfl_sync(0xffffffffu, (int)upto, 0);
    // Lane 0's acquire orders the route's writes before the warp's reads after this.
    __syncwarp();
    return upto;
}

// The slots of a step of at most blockDim tokens (one round of route_tokens), computed by a
// block for itself: the same ballots and scan as the route, without its places and counts,
// so that the blocks other than block 0 copy rows at once instead of waiting for the route
// (they still wait for it before the metas, which carry its places). Token t goes to rank d
// in slot block_slot(ballots, prefix, t, d).
__device__ void block_slots(const void* topk_idx, u32 idx64, u32 num_tokens, u32 k, u32 ranks,
                            u32 experts_per_rank, u32 (*ballots)[MAX_RANKS], int (*prefix)[MAX_RANKS]) {
    u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    i64 total = (i64)ranks * experts_per_rank;
    u64 mask = 0;
    if (tid < num_tokens) {
        i64 ids[FAST_K];
#pragma unroll
        for (u32 j = 0; j < FAST_K; ++j) ids[j] = j < k ? expert_of(topk_idx, idx64, (u64)tid * k + j) : -1;
#pragma unroll
        for (u32 j = 0; j < FAST_K; ++j) {
            if (ids[j] >= 0 && ids[j] < total) mask |= 1ull << (u32)(ids[j] / experts_per_rank);
        }
        for (u32 j = FAST_K; j < k; ++j) {
            i64 e = expert_of(topk_idx, idx64, (u64)tid * k + j);
            if (e >= 0 && e < total) mask |= 1ull << (u32)(e / experts_per_rank);
        }
    }
    for (u32 d = 0; d < ranks; ++d) {
        u32 ballot = __ballot_sync(0xffffffffu, (u32)(mask >> d) & 1u);
        if (lane == 0) ballots[warp][d] = ballot;
    }
    __syncthreads();
    if (tid < ranks) {
        int run = 0;
        for (u32 w = 0; w < nwarps; ++w) {
            prefix[w][tid] = run;
            run += __popc(ballots[w][tid]);
        }
    }
    __syncthreads();
}

__device__ __forceinline__ int block_slot(u32 (*ballots)[MAX_RANKS], int (*prefix)[MAX_RANKS], u32 t, u32 d) {
    u32 b = ballots[t >> 5][d], bit = t & 31;
    return (b >> bit) & 1u ? prefix[t >> 5][d] + __popc(b & ((1u << bit) - 1u)) : -1;
}

// One warp copies chunks [c0, c1) (16 B each) of `src` to each non-null dst[j] (j < FAST_K):
// each chunk is loaded once and stored to every destination.
__device__ __forceinline__ void copy_seg_multi(char* const* dst, const char* __restrict__ src, u32 c0, u32 c1,
                                               u32 lane) {
    const V16* s = (const V16*)src;
    u32 i = c0 + lane;
    // Two loads in flight before the stores (which may alias them as far as the compiler
    // knows).
    for (; i + 32 < c1; i += 64) {
        V16 v = s[i], w = s[i + 32];
#pragma unroll
        for (int j = 0; j < FAST_K; ++j) {
            if (dst[j]) {
                ((V16*)dst[j])[i] = v;
                ((V16*)dst[j])[i + 32] = w;
            }
        }
    }
    for (; i < c1; i += 32) {
        V16 v = s[i];
#pragma unroll
        for (int j = 0; j < FAST_K; ++j) {
            if (dst[j]) ((V16*)dst[j])[i] = v;
        }
    }
}

// Where a row of source s goes in local expert le, given its place p among s's rows for le:
// after the rows for le of every source before s in the order rank, rank + 1, ..., ranks - 1,
// 0, ... (this rank's own rows first, so that dispatch_send can place them itself without
// any peer's count; the caller checks it against the capacity).
__device__ __forceinline__ int place(const int* ecount, u32 s, u32 rank, u32 ranks, u32 experts_per_rank, int le,
                                     int p) {
    int pos = p;
    for (u32 q = rank; q != s; q = q + 1 == ranks ? 0 : q + 1) pos += ecount[(u64)q * experts_per_rank + le];
    return pos;
}

// A row's j-th expert, as place_row reads it: the global id (-1 for none), the weight, and
// the row's place among its source's rows for that expert.
struct RowExpert {
    int e;
    float w;
    int p;
};

// Segment [c0, c1) (16 B chunks; the whole row where !vec) of one row, by one warp, into
// this rank's local experts: the j-th expert (`get(j)`) that is local (le) gets the row at
// `base(le) + p` of x_expert (no copy where !copy: rank-major), with `info` in src_info and
// its weight in expert_w (seg 0 only); recv_pos_row[j] is that place, or -1 (seg 0). A
// place past the capacity is reported (ERR_CAPACITY) and dropped.
template <typename Get, typename Base>
__device__ __forceinline__ void place_row(Get get, Base base, const char* src, int info, int* recv_pos_row,
                                          char* x_expert, int* src_info, float* expert_w, u64* status, u32 k,
                                          int first, u32 experts_per_rank, u32 capacity, u32 row_bytes, bool copy,
                                          bool vec, u32 c0, u32 c1, u32 seg) {
    u32 lane = threadIdx.x & 31;
    // Lane j places the row's j-th expert (j < k), or (general k) one lane the lot.
    auto place_one = [&](u32 j, int* le_out) {
        RowExpert x = get(j);
        int pos = -1;
        if (x.e >= first && x.e < first + (int)experts_per_rank) {
            int le = x.e - first;
            pos = base(le) + x.p;
            if (x.p < 0 || pos < 0 || pos >= (int)capacity) {
                if (seg == 0) report(status, ERR_CAPACITY, (u64)le);
                pos = -1;
            } else {
                *le_out = le;
                if (seg == 0) {
                    src_info[(u64)le * capacity + pos] = info;
                    expert_w[(u64)le * capacity + pos] = x.w;
                }
            }
        }
        if (seg == 0) recv_pos_row[j] = pos;
        return pos;
    };
    if (k <= FAST_K) {
        int pos = -1, le = -1;
        if (lane < k) pos = place_one(lane, &le);
        char* dsts[FAST_K];
#pragma unroll
        for (int j = 0; j < FAST_K; ++j) {
            int p = __shfl_sync(0xffffffffu, pos, j);
            int l = __shfl_sync(0xffffffffu, le, j);
            dsts[j] = ((u32)j < k && p >= 0) ? x_expert + ((u64)l * capacity + p) * row_bytes : (char*)0;
        }
        if (!copy) return;
        if (vec) {
            copy_seg_multi(dsts, src, c0, c1, lane);
        } else {
            copy_row_multi(dsts, src, row_bytes, lane);
        }
        return;
    }
    for (u32 j = 0; j < k; ++j) {
        int le = -1, pos = -1;
        if (lane == 0) pos = place_one(j, &le);
        pos = __shfl_sync(0xffffffffu, pos, 0);
        le = __shfl_sync(0xffffffffu, le, 0);
        if (pos < 0 || !copy) continue;
        char* dst = x_expert + ((u64)le * capacity + pos) * row_bytes;
        if (vec) {
            copy_seg((V16*)dst, (const V16*)src, c0, c1, lane);
        } else {
            copy_row(dst, src, row_bytes, lane);
        }
    }
}

// The send stage (moe_dispatch_send, and the first half of moe_dispatch, which passes
// `fused`); returns the step's sequence number.
__device__ u64 dispatch_send_body(const char* x, const void* topk_idx, u32 idx64, const float* topk_weights,
                                   int* send_slot, int* send_count, int* send_pos, int* send_ecount,
                                   const u64* peers, u64* state, u64* status, u32 num_tokens, u32 rank,
                                   u32 ranks, u32 max_tokens, u32 k, u32 experts_per_rank, u32 row_bytes,
                                   u64 off_dflag, u64 off_ecount, u64 off_meta, u64 off_rx, u64 timeout_ns,
                                   const u64* proxy, char* x_expert, int* src_info, int* recv_pos,
                                   float* expert_w, u32 capacity, u32 rank_major, u32 ordered_rows, u32 fused) {
    u32 lane = threadIdx.x & 31;
    u32 warps = gridDim.x * (blockDim.x >> 5);
    // Block 0 routes the step's tokens, a round of blockDim tokens at a time; the other
    // blocks' warps copy the rows of every token it has routed so far (routed_upto: blocks
    // start in order, so block 0 is running or done by then; the wait is bounded all the
    // same).
    u64 seq = (state[ST_DSEND] + 1) & 0xffffffffull;
    if (blockIdx.x == 0) PROBE(status, 0);
    u32 routed = 0;
    // A step of one round (decode): the other blocks compute the slots themselves and copy
    // rows at once; only their metas wait for block 0's route.
    __shared__ u32 own_ballots[BLOCK_SLOTS_WARPS][MAX_RANKS];
    __shared__ int own_prefix[BLOCK_SLOTS_WARPS][MAX_RANKS];
    bool own = blockIdx.x != 0 && num_tokens <= blockDim.x && blockDim.x <= 32 * BLOCK_SLOTS_WARPS;
    if (own) {
        block_slots(topk_idx, idx64, num_tokens, k, ranks, experts_per_rank, own_ballots, own_prefix);
    }
    if (blockIdx.x == 0) {
        route_tokens(topk_idx, idx64, num_tokens, k, ranks, experts_per_rank, send_slot, send_count, send_pos,
                     send_ecount, state, status, seq, ordered_rows);
        routed = num_tokens;
        __syncthreads();
        // Our rows per expert into each destination's ecount, now (ordered before the flag by
        // this block's fence in last_block, whichever block raises it).
        for (u32 q = threadIdx.x; q < ranks * experts_per_rank; q += blockDim.x) {
            u32 d = q / experts_per_rank, le = q % experts_per_rank;
            u32 sec;
            char* base = px_base(peers, proxy, d, rank, &sec);
            int* ecount = (int*)(base + off_ecount) + (u64)sec * experts_per_rank;
            ecount[le] = send_ecount[q];
        }
        PROBE(status, 1);
    }
    u32 meta_words = 1 + 3 * k;
    // Expert-major, this rank's own rows go straight to their places in x_expert (they come
    // first in every local expert, see place), with their src_info, weights and recv_pos:
    // no copy through the window and none in dispatch_recv.
    bool direct = !rank_major;
    int first = (int)(rank * experts_per_rank);
    // Work items: (token, destination, segment: row_seg_len) where rows move 16 B a lane;
    // whole rows otherwise.
    bool vec = ((row_bytes | (u32)(u64)x | (direct ? (u32)(u64)x_expert : 0u)) & 15u) == 0;
    u32 chunks = row_bytes / 16;
    u32 seg_len = vec ? row_seg_len(chunks, warps, num_tokens * ranks) : chunks;
    u32 segs = vec ? (chunks + seg_len - 1) / seg_len : 1;
    u64 items = (u64)num_tokens * ranks * segs;
    for (u64 it = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); it < items; it += warps) {
        u32 i = (u32)(it / segs), seg = (u32)(it % segs);
        u32 t = i / ranks, d = i % ranks;
        if (!own && t >= routed) {
            // (Warp-uniform: every lane has the same item.)
            routed = routed_upto(state, status, seq, t, timeout_ns);
            if (t >= routed) break;
        }
        int slot = own ? block_slot(own_ballots, own_prefix, t, d) : send_slot[i];
        if (slot < 0) continue;
        const char* src = x + (u64)t * row_bytes;
        u32 sec;
        char* base = px_base(peers, proxy, d, rank, &sec);
        u64 row = (u64)sec * max_tokens + (u32)slot;
        if (direct && d == rank) {
            // The places come from the route (send_pos). The meta still goes to the window
            // below: the combine reads a row's experts and weights there.
            if (own && t >= routed) {
                routed = routed_upto(state, status, seq, t, timeout_ns);
                if (t >= routed) break;
            }
            auto get = [&](u32 j) {
                i64 e = expert_of(topk_idx, idx64, (u64)t * k + j);
                return RowExpert{(e < 0 || e > 0x7fffffffll) ? -1 : (int)e, topk_weights[(u64)t * k + j],
                                 send_pos[(u64)t * k + j]};
            };
            place_row(get, [](int) { return 0; }, src, (int)(rank * max_tokens + t), recv_pos + row * k, x_expert,
                      src_info, expert_w, status, k, first, experts_per_rank, capacity, row_bytes, true, vec,
                      seg * seg_len, min(chunks, (seg + 1) * seg_len), seg);
        } else if (vec) {
            copy_seg((V16*)(base + off_rx + row * row_bytes), (const V16*)src, seg * seg_len,
                     min(chunks, (seg + 1) * seg_len), lane);
        } else {
            copy_row(base + off_rx + row * row_bytes, src, row_bytes, lane);
        }
        if (seg != 0) continue;
        if (own && t >= routed) {
            // The meta carries the route's places (send_pos).
            routed = routed_upto(state, status, seq, t, timeout_ns);
            if (t >= routed) break;
        }
        int* meta = (int*)(base + off_meta) + row * meta_words;
        if (lane == 0) meta[0] = (int)t;
        for (u32 j = lane; j < k; j += 32) {
            i64 e = expert_of(topk_idx, idx64, (u64)t * k + j);
            meta[1 + j] = (e < 0 || e > 0x7fffffffll) ? -1 : (int)e;
            meta[1 + k + j] = __float_as_int(topk_weights[(u64)t * k + j]);
            meta[1 + 2 * k + j] = send_pos[(u64)t * k + j];
        }
    }
    if (blockIdx.x == 0) PROBE(status, 2);
    if (!last_block(&state[ST_DONE_DSEND], true)) return seq;
    PROBE(status, 3);
    // Every block's rows, metas and (block 0's) ecounts are ordered before the flags by the
    // fences of last_block.
    raise_flags(peers, proxy, rank, ranks, off_dflag, PX_DISPATCH, seq, send_count);
    __syncthreads();
    PROBE(status, 4);
    if (threadIdx.x == 0) {
        state[ST_DSEND] = seq;
        // The fused kernel's receive has no last block of its own (see dispatch_recv_body):
        // its sequence moves here, where no block of the launch reads it.
        if (fused) state[ST_DRECV] = seq;
        state[ST_DONE_DSEND] = 0;
    }
    return seq;
}

// Rows per local expert, by the calling block: every source's (ecount, in the window),
// clamped to what fits.
__device__ void expert_counts(const int* ecount, int* expert_count, u32 ranks, u32 experts_per_rank, u32 capacity) {
    for (u32 le = threadIdx.x; le < experts_per_rank; le += blockDim.x) {
        long long n = 0;
        for (u32 q = 0; q < ranks; ++q) n += ecount[(u64)q * experts_per_rank + le];
        expert_count[le] = n > (long long)capacity ? (int)capacity : (int)n;
    }
}

// The receive stage (moe_dispatch_recv, and the second half of moe_dispatch, which passes
// `fused` and the step's sequence number `seq`).
__device__ void dispatch_recv_body(const char* window, char* x_expert, int* expert_count, int* src_info,
                                   int* recv_pos, int* recv_count, u64* state, u64* status, u32 rank,
                                   u32 ranks, u32 max_tokens, u32 k, u32 experts_per_rank, u32 capacity,
                                   u32 row_bytes, u64 off_dflag, u64 off_ecount, u64 off_meta, u64 off_rx,
                                   u64 timeout_ns, float* expert_w, u32 rank_major, const u64* proxy, u32 fused,
                                   u64 seq) {
    __shared__ int cnt[MAX_RANKS];
    __shared__ int failed;
    if (threadIdx.x == 0) failed = 0;
    if (blockIdx.x == 0) PROBE(status, 5);
    __syncthreads();
    if (threadIdx.x < ranks) {
        u32 s = threadIdx.x;
        u32 want = fused ? (u32)seq : (u32)(state[ST_DRECV] + 1);
        u64 w = px_wait(proxy, PX_DISPATCH, s, want, PX_WRITES_DISPATCH, timeout_ns, &failed)
                    ? wait_seq((const u64*)(window + off_dflag) + s, want, timeout_ns, &failed)
                    : 0;
        cnt[s] = (int)(u32)w;
        if (blockIdx.x == 0) recv_count[s] = (int)(u32)w;
    }
    __syncthreads();
    if (blockIdx.x == 0) PROBE(status, 6);
    __threadfence();
    const int* ecount = (const int*)(window + off_ecount);
    if (fused && blockIdx.x == gridDim.x - 1 && !failed) {
        // Fused, one block writes the rows per local expert as soon as the flags are in (the
        // counts came before them), so that no last-block step follows the placing: its
        // fence and count cost about 1.5 us at the end of a decode step.
        expert_counts(ecount, expert_count, ranks, experts_per_rank, capacity);
    }
    if (failed) {
        if (threadIdx.x == 0) report(status, ERR_DISPATCH_TIMEOUT, blockIdx.x);
    } else {
        u32 warps = gridDim.x * (blockDim.x >> 5);
        u32 meta_words = 1 + 3 * k;
        int first = (int)(rank * experts_per_rank);
        bool vec = ((row_bytes | (u32)(u64)x_expert) & 15u) == 0;
        u32 chunks = row_bytes / 16;
        // Rank-major: rows stay in the window; only their places, indices and weights.
        // Expert-major: this rank's own rows were placed by dispatch_send; the peers' are
        // taken here, source rank + 1 first.
        bool copy = !rank_major;
        u32 from = copy ? 1 : 0, sources = ranks - from;
        u32 rows = 0;
        for (u32 q = from; q < ranks; ++q) rows += (u32)cnt[(rank + q) % ranks];
        u32 seg_len = vec && copy ? row_seg_len(chunks, warps, rows) : chunks;
        u32 segs = vec && copy ? (chunks + seg_len - 1) / seg_len : 1;
        u64 items = (u64)sources * max_tokens * segs;
        for (u64 it = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); it < items; it += warps) {
            u32 q = (u32)(it / segs), seg = (u32)(it % segs);
            u32 s = (rank + from + q / max_tokens) % ranks, slot = q % max_tokens;
            u32 i = s * max_tokens + slot;
            if ((int)slot >= cnt[s]) continue;
            const int* meta = (const int*)(window + off_meta) + (u64)i * meta_words;
            const char* src = window + off_rx + (u64)i * row_bytes;
            // src_info of the row is s * max_tokens + tok: its source token, or (rank-major)
            // its slot, which makes it the row's index in the window's rows.
            int tok = rank_major ? (int)slot : meta[0];
            auto get = [&](u32 j) {
                return RowExpert{meta[1 + j], __int_as_float(meta[1 + k + j]), meta[1 + 2 * k + j]};
            };
            auto base = [&](int le) { return place(ecount, s, rank, ranks, experts_per_rank, le, 0); };
            place_row(get, base, src, (int)(s * max_tokens) + tok, recv_pos + (u64)i * k, x_expert, src_info,
                      expert_w, status, k, first, experts_per_rank, capacity, row_bytes, copy, vec, seg * seg_len,
                      min(chunks, (seg + 1) * seg_len), seg);
        }
    }
    if (blockIdx.x == 0) PROBE(status, 7);
    if (fused) return;
    if (!last_block(&state[ST_DONE_DRECV], false)) return;
    PROBE(status, 8);
    // Rows per local expert: every source's, clamped to what fits (an overflow was reported).
    if (!failed) expert_counts(ecount, expert_count, ranks, experts_per_rank, capacity);
    __syncthreads();
    if (threadIdx.x == 0) {
        state[ST_DRECV] = (state[ST_DRECV] + 1) & 0xffffffffull;
        state[ST_DONE_DRECV] = 0;
    }
}

extern "C" __global__ void __launch_bounds__(256, 2) moe_dispatch_send(const char* x, const void* topk_idx, u32 idx64,
                                             const float* topk_weights, int* send_slot, int* send_count,
                                             int* send_pos, int* send_ecount, const u64* peers, u64* state,
                                             u64* status, u32 num_tokens, u32 rank, u32 ranks, u32 max_tokens,
                                             u32 k, u32 experts_per_rank, u32 row_bytes, u64 off_dflag,
                                             u64 off_ecount, u64 off_meta, u64 off_rx, u64 timeout_ns,
                                             const u64* proxy, char* x_expert, int* src_info, int* recv_pos,
                                             float* expert_w, u32 capacity, u32 rank_major, u32 ordered_rows) {
    dispatch_send_body(x, topk_idx, idx64, topk_weights, send_slot, send_count, send_pos, send_ecount, peers,
                       state, status, num_tokens, rank, ranks, max_tokens, k, experts_per_rank, row_bytes,
                       off_dflag, off_ecount, off_meta, off_rx, timeout_ns, proxy, x_expert, src_info, recv_pos,
                       expert_w, capacity, rank_major, ordered_rows, 0);
}

extern "C" __global__ void __launch_bounds__(256, 2) moe_dispatch_recv(const char* window, char* x_expert, int* expert_count,
                                             int* src_info, int* recv_pos, int* recv_count, u64* state,
                                             u64* status, u32 rank, u32 ranks, u32 max_tokens, u32 k,
                                             u32 experts_per_rank, u32 capacity, u32 row_bytes,
                                             u64 off_dflag, u64 off_ecount, u64 off_meta, u64 off_rx,
                                             u64 timeout_ns, float* expert_w, u32 rank_major,
                                             const u64* proxy) {
    dispatch_recv_body(window, x_expert, expert_count, src_info, recv_pos, recv_count, state, status, rank,
                       ranks, max_tokens, k, experts_per_rank, capacity, row_bytes, off_dflag, off_ecount,
                       off_meta, off_rx, timeout_ns, expert_w, rank_major, proxy, 0, 0);
}

// Both stages in one launch (AllToAll::dispatch without proxy ranks): a block that has sent
// its rows goes on to wait for the flags and place what arrived, so the chain has one kernel
// boundary and one last-block step less (the receive's: the send's last block moves both
// sequences on) and the waits overlap the last block's flag step. Every block must be
// resident at once (the host checks the occupancy): a block waits for this rank's own flag,
// which the last block to finish sending raises.
extern "C" __global__ void __launch_bounds__(256, 2) moe_dispatch(const char* x, const void* topk_idx, u32 idx64, const float* topk_weights,
                                        int* send_slot, int* send_count, int* send_pos, int* send_ecount,
                                        const u64* peers, u64* state, u64* status, u32 num_tokens, u32 rank,
                                        u32 ranks, u32 max_tokens, u32 k, u32 experts_per_rank, u32 row_bytes,
                                        u64 off_dflag, u64 off_ecount, u64 off_meta, u64 off_rx, u64 timeout_ns,
                                        const u64* proxy, char* x_expert, int* src_info, int* recv_pos,
                                        float* expert_w, u32 capacity, u32 rank_major, u32 ordered_rows,
                                        const char* window,
                                        int* expert_count, int* recv_count) {
    u64 seq = dispatch_send_body(x, topk_idx, idx64, topk_weights, send_slot, send_count, send_pos, send_ecount, peers,
                       state, status, num_tokens, rank, ranks, max_tokens, k, experts_per_rank, row_bytes,
                       off_dflag, off_ecount, off_meta, off_rx, timeout_ns, proxy, x_expert, src_info, recv_pos,
                       expert_w, capacity, rank_major, ordered_rows, 1);
    dispatch_recv_body(window, x_expert, expert_count, src_info, recv_pos, recv_count, state, status, rank,
                       ranks, max_tokens, k, experts_per_rank, capacity, row_bytes, off_dflag, off_ecount,
                       off_meta, off_rx, timeout_ns, expert_w, rank_major, proxy, 1, seq);
}
