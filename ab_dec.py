import sys, os, time
sys.path.insert(0, os.getcwd())
import torch
from sudu import kernels
ext = kernels.load()
none = torch.empty(0)
def median(f, n):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2]
for L in (2048, 8192, 24576):
    k = (torch.randn(L, 2, 64) * 2).half(); v = torch.randn(L, 2, 64).half()
    slots = torch.arange(L)
    qd, od = torch.randn(1, 14, 64), torch.empty(1, 14, 64)
    rows, mask = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, L, dtype=torch.bool)
    d = min(median(lambda: ext.decode_attention(qd, k, v, none, none, rows, slots[None], mask, 0.125, od, True), 31) for _ in range(3))
    print(L, f"{d*1e6:.0f} us per layer; {d*1e9/(L/64):.0f} ns per block (2 threads, one kv head each)")
