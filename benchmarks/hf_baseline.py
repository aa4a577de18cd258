"""The transformers baseline, loaded offline from the same GGUF file sudu runs (benchmark use only:
transformers is never part of sudu's runtime)."""
from __future__ import annotations

import time
from pathlib import Path

import torch


def load_hf(model: str, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a sudu catalog name or .gguf path; dequantized by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sudu.weights.catalog import resolve_model_path

    path = Path(resolve_model_path(model))
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    print(f"[transformers] loaded {path.name} in {time.perf_counter() - t0:.0f} s", flush=True)
    return hf, tok


@torch.inference_mode()
def hf_generate(hf, prompts: list[list[int]], max_new_tokens: int, pad_id: int) -> tuple[list[list[int]], float]:
    """Greedy batched generate with left padding, exactly max_new_tokens each. Returns (outputs, seconds)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                      do_sample=False, pad_token_id=pad_id)
    return out[:, width:].tolist(), time.perf_counter() - t0
