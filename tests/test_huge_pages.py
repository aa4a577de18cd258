"""Weights in huge pages (host/huge_pages.py): every large storage moves into one mapping, tensors that
shared a storage still share it, views keep their offsets, the old storages are freed, and the network
computes the same values. The decode speed this buys is measured by benchmarks/huge_pages.py."""
import gc

import pytest
import torch
from torch import nn

from sudu.host import huge_pages

THP = huge_pages.huge_page_size()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(512, 64)
        self.body = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.head = nn.Linear(64, 512, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter in two modules
        table = torch.arange(4096, dtype=torch.int32)
        self.register_buffer("table", table)
        self.other = nn.Module()
        self.other.register_buffer("table", table)  # one tensor, buffers of two modules
        self.other.register_buffer("upper", table[2048:])  # a view into the same storage
        self.register_buffer("small", torch.ones(4))  # under the size floor: stays

    def forward(self, ids):
        x = self.embed(ids)
        return self.head(self.body(x)) + self.other.upper[:512].float()


def storages(model):
    return {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}


@pytest.mark.skipif(THP is None, reason="transparent huge pages are off or unknown here")
def test_weights_move_into_one_mapping_shared_storages_stay_shared_and_values_are_the_same():
    torch.manual_seed(0)
    net = Net()
    ids = torch.randint(0, 512, (3, 5))
    with torch.no_grad():
        before = net(ids)
    tensors = list(net.named_parameters(remove_duplicate=False)) + list(net.named_buffers(remove_duplicate=False))
    big = {name for name, t in tensors if t.untyped_storage().nbytes() >= 1024}
    assert "small" not in big and "body.2.bias" not in big and "other.upper" in big
    old = {t.untyped_storage().data_ptr() for name, t in tensors if name in big}
    kept = storages(net) - old
    del tensors
    moved, arena = huge_pages.move_to_huge_pages(net, min_bytes=1024)
    assert arena is not None and moved >= 512 * 64 * 4 + 4096 * 4
    lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel()
    for name, t in list(net.named_parameters(remove_duplicate=False)) + list(net.named_buffers(remove_duplicate=False)):
        inside = lo <= t.data_ptr() < hi
        assert inside == (name in big), name
    assert net.head.weight is net.embed.weight and isinstance(net.head.weight, nn.Parameter)
    assert net.table.data_ptr() == net.other.table.data_ptr()
    assert net.other.upper.data_ptr() == net.table.data_ptr() + 2048 * 4
    assert torch.equal(net.other.upper, torch.arange(2048, 4096, dtype=torch.int32))
    with torch.no_grad():
        assert torch.equal(net(ids), before)
    gc.collect()
    alive = {o.untyped_storage().data_ptr() for o in gc.get_objects() if isinstance(o, torch.Tensor)}
    assert not (alive & old)  # no tensor holds an old storage: they were freed
    assert storages(net) == {arena.untyped_storage().data_ptr()} | kept


def test_nothing_moves_without_huge_pages(monkeypatch):
    monkeypatch.setattr(huge_pages, "huge_page_size", lambda: None)
    net = Net()
    ptrs = storages(net)
    assert huge_pages.move_to_huge_pages(net, min_bytes=0) == (0, None)
    assert storages(net) == ptrs
    assert huge_pages.huge_page_bytes(None) == 0


@pytest.mark.skipif(THP is None, reason="transparent huge pages are off or unknown here")
def test_a_written_buffer_is_backed_by_huge_pages():
    buf = huge_pages.huge_page_buffer(8 << 20, THP)
    assert buf.data_ptr() % THP == 0 and buf.numel() == 8 << 20
    assert huge_pages.huge_page_bytes(buf) == 0  # nothing committed before it is written
    buf.fill_(1)
    assert huge_pages.huge_page_bytes(buf) >= THP


@pytest.mark.skipif(THP is None, reason="transparent huge pages are off or unknown here")
@pytest.mark.parametrize("arch,quantization", [("qwen2", "auto"), ("gemma3", "auto"), ("gemma3", "int8")])
def test_engine_weights_in_huge_pages_give_the_same_tokens(tiny_model_dirs, monkeypatch, arch, quantization):
    from sudu.engine.llm import LLM
    from sudu.sampling import SamplingParams

    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 13] * 7, [2, 4] * 11]
    llm = LLM(str(tiny_model_dirs[arch]), progress=False, kv_cache_memory=64 << 20, quantization=quantization)
    net = llm.engine.runner.model
    assert net.huge_page_weights is not None
    # the kernel may back none of the arena with huge pages (memory pressure), but what it reports is whole
    # huge pages of the arena's mapping (its bytes plus the one page of alignment slack)
    arena, page = net.huge_page_weights, huge_pages.huge_page_size()
    backed = llm.engine.memory["memory_weights_huge_page_bytes"]
    assert backed % page == 0 and backed <= arena.numel() + page
    moved = [o.token_ids for o in llm.generate(prompts, params)]
    llm.close()
    monkeypatch.setattr(huge_pages, "huge_page_size", lambda: None)
    llm = LLM(str(tiny_model_dirs[arch]), progress=False, kv_cache_memory=64 << 20, quantization=quantization)
    assert llm.engine.runner.model.huge_page_weights is None
    assert [o.token_ids for o in llm.generate(prompts, params)] == moved
    llm.close()
