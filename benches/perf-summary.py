#!/usr/bin/env python3
"""Per-thread summaries of `perf` recordings of fabric-bench (docs/performance-2core.md, "Profile").

usage: perf script -i FILE -F tid,comm,event,trace | perf-summary.py syscalls
       perf script -i FILE -F tid,comm,time,ip,sym,dso | perf-summary.py cpu
       perf sched timehist -i FILE | perf-summary.py timeline

syscalls  (perf record -e raw_syscalls:sys_enter -e sched:sched_switch): system calls by
          name and sched_switch-outs by state (S: went to sleep, R: preempted) per thread.
cpu       (perf record -e cpu-clock -g): samples per thread, split by the system call they
          were in (the libc wrapper above entry_SYSCALL) or by user-space library.
timeline  (perf sched record): milliseconds of CPU per 100 ms per fabric thread.

Threads: fabric-reactor (engine reactor), tokio-rt-worker (the raw loop, on a blocking
thread), fabric-bench (main thread: the engine's caller). The leader writes, the peer
receives.
"""

import collections
import re
import sys

NR = {0: "read", 1: "write", 3: "close", 7: "poll", 9: "mmap", 11: "munmap", 230: "clock_nanosleep", 233: "epoll_ctl", 257: "openat", 44: "sendto", 45: "recvfrom", 46: "sendmsg", 47: "recvmsg",
      202: "futex", 232: "epoll_wait", 270: "pselect6", 271: "ppoll", 281: "epoll_pwait"}
MIN = 100  # threads with fewer events are left out


def syscalls(lines):
    sc = collections.defaultdict(collections.Counter)
    sw = collections.defaultdict(collections.Counter)
    comm = {}
    for line in lines:
        m = re.match(r"\s*(.*?)\s+(\d+)\s+(\S+):\s*(.*)", line)
        if not m:
            continue
        c, tid, ev, tr = m.groups()
        if ev == "raw_syscalls:sys_enter":
            comm[tid] = c
            nr = int(tr.split()[1])
            sc[tid][NR.get(nr, f"nr{nr}")] += 1
        elif ev == "sched:sched_switch":
            s = re.search(r"prev_comm=(.*?) prev_pid=(\d+) .*prev_state=(\S+)", tr)
            if s and s.group(2) == tid:
                sw[tid][s.group(3)] += 1
    for tid in sorted(sc, key=lambda t: -sum(sc[t].values())):
        n = sum(sc[tid].values())
        if n < MIN:
            continue
        top = ", ".join(f"{k} {v}" for k, v in sc[tid].most_common(8))
        print(f"{tid} {comm[tid]}: {n} syscalls ({top}); switched out {dict(sw[tid])}")


def cpu(lines):
    cnt = collections.defaultdict(collections.Counter)
    comm = {}

    def flush(tid, frames):
        if tid is None or not frames:
            return
        cat = None
        for i, (sym, _) in enumerate(frames):
            if sym.startswith("entry_SYSCALL"):
                nxt = frames[i + 1][0] if i + 1 < len(frames) else "?"
                cat = "syscall " + re.sub(r"@.*", "", nxt)
                break
        if cat is None:
            sym, dso = frames[0]
            if "kernel" in dso:
                cat = "kernel, no syscall (irq, softirq, fault)"
            elif "fabric_runtime" in sym:
                cat = "user: fabric-runtime"
            else:
                cat = "user: " + dso.split("/")[-1]
        cnt[tid][cat] += 1

    tid, frames = None, []
    for line in lines:
        if not line.strip():
            flush(tid, frames)
            tid, frames = None, []
            continue
        if not line[0].isspace():
            m = re.match(r"(.*?)\s+(\d+)\s+[\d.]+:", line)
            if m:
                tid, frames = m.group(2), []
                comm[tid] = m.group(1).strip()
            continue
        m = re.match(r"\s+[0-9a-f]+\s+(.*?)\s+\((.*)\)\s*$", line)
        if m:
            frames.append((m.group(1), m.group(2)))
    flush(tid, frames)
    for t in sorted(cnt, key=lambda t: -sum(cnt[t].values())):
        n = sum(cnt[t].values())
        if n < MIN:
            continue
        print(f"{t} {comm[t]}: {n} samples")
        for k, v in cnt[t].most_common(10):
            print(f"    {v:6} {100 * v / n:5.1f}%  {k}")


def timeline(lines):
    run = collections.defaultdict(collections.Counter)
    t0 = None
    for line in lines:
        p = line.split()
        if len(p) < 6 or not re.match(r"[\d.]+$", p[0]):
            continue
        m = re.search(r"(fabric-reactor|tokio-rt-worker|fabric-bench)\[(\d+)", line)
        if not m:
            continue
        t = float(p[0])
        t0 = t if t0 is None else t0
        run[f"{m.group(1)}[{m.group(2)}]"][int((t - t0) * 10)] += float(p[-1])
    names = sorted(run)
    print("t (s) " + " ".join(f"{n:>24}" for n in names))
    for b in range(max((max(r) for r in run.values()), default=-1) + 1):
        if any(run[n][b] for n in names):
            print(f"{b / 10:5.1f} " + " ".join(f"{run[n][b]:21.0f} ms" for n in names))


if __name__ == "__main__":
    modes = {"syscalls": syscalls, "cpu": cpu, "timeline": timeline}
    if len(sys.argv) != 2 or sys.argv[1] not in modes:
        sys.exit(__doc__.strip())
    modes[sys.argv[1]](sys.stdin)
