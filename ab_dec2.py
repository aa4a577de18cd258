import sys, os, time
sys.path.insert(0, os.getcwd())
import torch
from sudu import kernels
ext = kernels.load()
none = torch.empty(0)
L = 2048
k = (torch.randn(L, 2, 64) * 2).half(); v = torch.randn(L, 2, 64).half()
slots = torch.arange(L)
qd, od = torch.randn(1, 14, 64), torch.empty(1, 14, 64)
rows, mask = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, L, dtype=torch.bool)
t = time.time()
while time.time() - t < 8:
    ext.decode_attention(qd, k, v, none, none, rows, slots[None], mask, 0.125, od, True)
