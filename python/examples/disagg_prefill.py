"""Disaggregated prefill on a real transformer: each layer's KV leaves as soon as prefill wrote it.

A decoder-only transformer in torch (seeded random weights, no download: RMSNorm, rotary
embeddings, grouped-query attention, SwiGLU) runs prefill in one process and decode in
``--decoders`` others. Prefill writes each layer's K and V of a prompt into the decode
process's paged KV pool (``write_paged``, one immediate per request) right after that layer's
attention produced them; on a GPU the write is ordered after the layer's kernels
(``after=`` the prefill stream) and the decoder's attention waits on its own stream
(``counter.wait_on_stream``), so neither side calls ``synchronize`` for it. The first token
goes with a message; the decoder then generates ``--decode-tokens`` tokens greedily.

Checked: every decoder's tokens and final logits equal, bit for bit, a run of the same model
in one process (the reference computes the same KV and attends through the same paged pool).
Measured, per prompt length: the time from the start of prefill until the decoder holds the
first token and every layer's KV (ready to generate), with the layer-streamed transfer and
with the transfer after the whole prefill, beside prefill alone (no transfer).

    python python/examples/disagg_prefill.py --device cuda:0 --prompts 1024,2048,4096,8192
    python python/examples/disagg_prefill.py --device cpu --layers 4 --hidden 256 --prompts 64,128

Exits non-zero on any mismatch.
"""

import argparse
import multiprocessing as mp
import statistics
import sys
import time

PIPE_SECONDS = 300
IMM_BASE = 1000  # request r counts arrivals of IMM_BASE + r


def recv(conn, what):
    if not conn.poll(PIPE_SECONDS):
        raise TimeoutError(f"no {what} within {PIPE_SECONDS} s")
    return conn.recv()


class Model:
    """Seeded random weights; the same seed gives the same model in every process."""

    def __init__(self, a, torch, device):
        self.t, self.a, self.device = torch, a, device
        self.dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        g = torch.Generator().manual_seed(a.seed)
        h, kvh, hd = a.hidden, a.kv_heads, a.hidden // a.heads

        def w(*shape):
            return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(device, self.dtype)

        self.embed = w(a.vocab, h)
        self.layers = [
            dict(wq=w(h, h), wk=w(kvh * hd, h), wv=w(kvh * hd, h), wo=w(h, h),
                 w1=w(4 * h, h), w3=w(4 * h, h), w2=w(h, 4 * h))
            for _ in range(a.layers)
        ]
        self.head = w(a.vocab, h)
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.outer(torch.arange(a.max_tokens, dtype=torch.float32), inv)
        self.cos, self.sin = ang.cos().to(device, self.dtype), ang.sin().to(device, self.dtype)

    def norm(self, x):
        return x * self.t.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

    def rope(self, x, pos):  # x: (T, heads, hd)
        c, s = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return self.t.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2)

    def qkv(self, layer, x, pos):
        a, L = self.a, self.layers[layer]
        hd = a.hidden // a.heads
        y = self.norm(x)
        q = self.rope((y @ L["wq"].T).view(-1, a.heads, hd), pos)
        k = self.rope((y @ L["wk"].T).view(-1, a.kv_heads, hd), pos)
        v = (y @ L["wv"].T).view(-1, a.kv_heads, hd)
        return q, k, v

    def finish(self, layer, x, q, k, v, causal):
        """Attention of q over k, v (all tokens so far), the output projection and the MLP."""
        F, L, a = self.t.nn.functional, self.layers[layer], self.a
        rep = a.heads // a.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=causal)
        x = x + o.transpose(0, 1).reshape(-1, a.hidden) @ L["wo"].T
        y = self.norm(x)
        return x + (F.silu(y @ L["w1"].T) * (y @ L["w3"].T)) @ L["w2"].T

    def logits(self, x):
        return self.norm(x[-1:]) @ self.head.T


class Pool:
    """A paged KV pool, (layers, 2, blocks, block_tokens, kv_heads, head_dim), one tensor."""

    def __init__(self, a, torch, device, blocks):
        hd = a.hidden // a.heads
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.t, self.a = torch, a
        self.kv = torch.zeros((a.layers, 2, blocks, a.block, a.kv_heads, hd), dtype=dtype, device=device)
        self.page = a.block * a.kv_heads * hd * self.kv.element_size()
        self.blocks = blocks

    def offset(self, layer, which):
        return (layer * 2 + which) * self.blocks * self.page

    def put(self, layer, k, v, table, start):
        """Tokens start.. of k, v into the blocks of `table` (the decoder's own appends)."""
        for i in range(k.shape[0]):
            t = start + i
            self.kv[layer, 0, table[t // self.a.block], t % self.a.block] = k[i]
            self.kv[layer, 1, table[t // self.a.block], t % self.a.block] = v[i]

    def gather(self, layer, table, n):
        """The first n tokens' K and V through the block table."""
        k = self.kv[layer, 0, table].flatten(0, 1)[:n]
        v = self.kv[layer, 1, table].flatten(0, 1)[:n]
        return k, v


def decode_steps(model, pool, table, first, n_prompt, steps):
    """Greedy decode from the prompt's KV in `pool` (`table`), the first token given.
    Returns the generated tokens and the last step's logits."""
    t = model.t
    tokens, tok, n = [first], first, n_prompt
    out = None
    for step in range(steps):
        x = model.embed[t.tensor([tok], device=pool.kv.device)]
        pos = t.tensor([n], device=pool.kv.device)
        for layer in range(model.a.layers):
            q, k, v = model.qkv(layer, x, pos)
            pool.put(layer, k, v, table, n)
            kk, vv = pool.gather(layer, table, n + 1)
            x = model.finish(layer, x, q, kk, vv, causal=False)
        out = model.logits(x)
        tok = int(out.argmax())
        tokens.append(tok)
        n += 1
    return tokens, out


def prefill_layers(model, prompt, on_layer):
    """Prefill's forward pass; on_layer(l, k, v) right after layer l's K and V exist."""
    t = model.t
    x = model.embed[prompt]
    pos = t.arange(prompt.shape[0], device=prompt.device)
    for layer in range(model.a.layers):
        q, k, v = model.qkv(layer, x, pos)
        on_layer(layer, k, v)
        x = model.finish(layer, x, q, k, v, causal=True)
    return int(model.logits(x).argmax())


def decoder(a, conn, rank):
    import torch

    import fabric_rdma

    device = a.decode_device or a.device
    engine = fabric_rdma.Engine(a.provider, cuda_ipc=a.cuda_ipc)
    model = Model(a, torch, device)
    pool = Pool(a, torch, device, a.blocks)
    region = engine.register(pool.kv)
    conn.send((engine.address, region.descriptor))
    cuda = device.startswith("cuda")
    while True:
        job = recv(conn, "a job")
        if job is None:
            return
        req, n_prompt, table, arrivals_per_layer = job
        counter = engine.imm_counter(IMM_BASE + req)
        peer, msg = engine.recv().wait(timeout=60)  # the first token, sent after the last write
        first = int.from_bytes(msg[:4], "little")
        if cuda:
            # The stream waits for each layer's K and V, this thread does not; an event
            # after the waits says when everything has landed (for the time to first token).
            stream = torch.cuda.current_stream(device)
            for _ in range(a.layers):
                counter.wait_on_stream(stream, arrivals_per_layer)
            ready = torch.cuda.Event()
            ready.record(stream)
            ready.synchronize()
        else:
            counter.wait_for(arrivals_per_layer * a.layers).wait(timeout=60)
        ttft_at = time.monotonic()  # the decoder holds the first token and every layer's KV
        tokens, logits = decode_steps(model, pool, table, first, n_prompt, a.decode_tokens)
        conn.send((req, tokens, logits.float().cpu().numpy().tobytes(), ttft_at))
        engine.retire_counter(IMM_BASE + req).wait(timeout=10)


def prefill(a, mode, decoders, conns, model, torch, engine, results):
    """Runs every prompt length once in `mode` ("streamed", "after", "none")."""
    import fabric_rdma

    device = a.device
    cuda = device.startswith("cuda")
    stream = torch.cuda.current_stream(device) if cuda else None
    layout_cache = {}
    for i, n in enumerate(a.prompts):
        req = len(results)
        d = req % len(decoders)
        dst, _ = decoders[d]
        pages = (n + a.block - 1) // a.block
        table = list(range(pages + (a.decode_tokens + a.block) // a.block + 1))
        g = torch.Generator().manual_seed(a.seed + n)
        prompt = torch.randint(0, a.vocab, (n,), generator=g).to(device)
        hd = a.hidden // a.heads
        dtype = torch.bfloat16 if cuda else torch.float32
        # Prefill's own KV of this prompt, padded to whole blocks, registered (a view of a pool
        # registered once would do the same): (layers, 2, pages * block, kv_heads, hd).
        kv = torch.zeros((a.layers, 2, pages * a.block, a.kv_heads, hd), dtype=dtype, device=device)
        src = engine.register(kv)
        page = a.block * a.kv_heads * hd * kv.element_size()
        per_layer = 2 * engine.paged_arrivals(dst, pages)
        if mode != "none":
            conns[d].send((req, n, table, per_layer))
        pending = []

        def send_layer(layer):
            for which in (0, 1):
                key = (layer, which, pages)
                layout = layout_cache.get(key) or fabric_rdma.PageLayout(
                    page, src_offset=(layer * 2 + which) * pages * page,
                    dst_offset=(layer * 2 + which) * a.blocks * page)
                layout_cache[key] = layout
                pending.append(engine.write_paged(src, dst, layout, list(range(pages)), table[:pages],
                                                  IMM_BASE + req, after=stream))

        def on_layer(layer, k, v):
            kv[layer, 0, :n] = k
            kv[layer, 1, :n] = v
            if mode == "streamed":
                send_layer(layer)

        t0 = time.monotonic()
        first = prefill_layers(model, prompt, on_layer)
        if mode == "after":
            for layer in range(a.layers):
                send_layer(layer)
        if mode == "none":
            if cuda:
                torch.cuda.synchronize(device)
            results.append((mode, n, time.monotonic() - t0, None))
            continue
        for p in pending:
            p.wait(timeout=60)
        engine.send(dst.peer, first.to_bytes(4, "little")).wait(timeout=30)
        got_req, tokens, logits, ttft_at = recv(conns[d], "the decoder's tokens")
        assert got_req == req
        results.append((mode, n, ttft_at - t0, (prompt.cpu(), tokens, logits)))


def reference(a, torch, prompt, device):
    """The same model in one process: prefill, the KV into a paged pool, decode."""
    model = Model(a, torch, device)
    pool = Pool(a, torch, device, a.blocks)
    n = prompt.shape[0]
    pages = (n + a.block - 1) // a.block
    table = list(range(pages + (a.decode_tokens + a.block) // a.block + 1))

    def on_layer(layer, k, v):
        for which, x in ((0, k), (1, v)):
            padded = torch.zeros((pages * a.block,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
            padded[:n] = x
            pool.kv[layer, which, table[:pages]] = padded.view(pages, a.block, *x.shape[1:])

    first = prefill_layers(model, prompt.to(device), on_layer)
    tokens, logits = decode_steps(model, pool, table, first, n, a.decode_tokens)
    return tokens, logits.float().cpu().numpy().tobytes()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--provider", default="tcp")
    ap.add_argument("--device", default="cuda:0", help="prefill's device: cuda:N or cpu")
    ap.add_argument("--decode-device", default=None, help="the decoders' (default: --device)")
    ap.add_argument("--decoders", type=int, default=1)
    ap.add_argument("--prompts", default="1024,2048,4096,8192", help="prompt lengths, tokens")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--block", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each mode; the median is printed")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--no-cuda-ipc", dest="cuda_ipc", action="store_false")
    a = ap.parse_args()
    a.prompts = [int(p) for p in a.prompts.split(",")]
    a.max_tokens = max(a.prompts) + a.decode_tokens + a.block
    a.blocks = a.max_tokens // a.block + 2
    try:
        import torch
    except ImportError:
        print("skipped: torch is not installed")
        return 0
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("skipped: no CUDA device (use --device cpu)")
        return 0
    import fabric_rdma

    ctx = mp.get_context("spawn")
    conns, procs, decoders = [], [], []
    engine = fabric_rdma.Engine(a.provider, cuda_ipc=a.cuda_ipc)
    for r in range(a.decoders):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=decoder, args=(a, theirs, r), daemon=True)
        p.start()
        conns.append(mine)
        procs.append(p)
        address, desc = recv(mine, "a decoder's descriptor")
        decoders.append((engine.remote_region(desc).wait(timeout=60), address))
    model = Model(a, torch, a.device)
    results = []
    prefill(a, "streamed", decoders, conns, model, torch, engine, results)  # warm-up, checked too
    for _ in range(a.rounds):
        for mode in ("streamed", "after", "none"):
            prefill(a, mode, decoders, conns, model, torch, engine, results)
    for c in conns:
        c.send(None)
    bad = 0
    checked = {}
    for mode, n, secs, got in results:
        if got is None:
            continue
        prompt, tokens, logits = got
        if n not in checked:
            checked[n] = reference(a, torch, prompt, a.decode_device or a.device)
        want_tokens, want_logits = checked[n]
        if tokens != want_tokens or logits != want_logits:
            bad += 1
            print(f"MISMATCH: {mode} prompt {n}: tokens {tokens[:8]}... want {want_tokens[:8]}...")
    print(f"disagg_prefill: {a.layers} layers, hidden {a.hidden}, {a.heads} heads / {a.kv_heads} KV heads, "
          f"{a.device} -> {a.decode_device or a.device}, {a.provider}, {a.decoders} decoder(s)")
    print("| prompt tokens | TTFT layer-streamed | TTFT after prefill | prefill alone | streamed overhead | after overhead |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in a.prompts:
        med = {m: statistics.median(s for mm, nn, s, _ in results[len(a.prompts):] if mm == m and nn == n)
               for m in ("streamed", "after", "none")}
        s, f, z = med["streamed"], med["after"], med["none"]
        print(f"| {n} | {s * 1e3:.2f} ms | {f * 1e3:.2f} ms | {z * 1e3:.2f} ms | "
              f"{(s / z - 1) * 100:+.1f}% | {(f / z - 1) * 100:+.1f}% |")
    print(f"checked: {sum(1 for r in results if r[3] is not None)} requests, {bad} mismatched")
    for p in procs:
        p.join(timeout=30)
    engine.shutdown()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
