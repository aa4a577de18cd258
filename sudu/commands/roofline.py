"""`sudu roofline MODEL`: how close single-stream decode comes to this machine's memory-bandwidth limit.

Decode at batch 1 reads every weight once per token, so tokens/s can never beat
    bandwidth / bytes read per token.
It measures the CPU (the engine runs with --device cpu): the bandwidth (a timed sum over a 1 GiB tensor,
median of several, right after each format's decode measurement, since a VM's bandwidth can move during
the run), counts the bytes a decode step reads per weight format (every linear layer incl. lm_head at
that format's bytes per weight, plus one embedding row, norms and biases; the KV cache is left out: at
the short contexts measured here it is well under 1% of the weights; --depths adds rows whose context's K
and V, read every step, count too), and sets next to each limit the
decode tok/s sudu's engine achieves (greedy, ignore_eos, one stream) and the fraction of the limit. Each
format is measured as greedy decoding runs by default; where the bounded head serves it
(layers/bounded_head.py), that row counts the bytes it reads instead of the head's, and a second run with
the whole head (--greedy-head full) gives the format's own row.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from sudu.quant.formats import GROUP_SIZE

# weight format -> (engine settings, bytes per linear weight, bytes per other parameter)
FORMATS = {
    "fp32": (dict(device="cpu", dtype="float32", quantization="none"), 4.0, 4.0),
    "bf16": (dict(device="cpu", dtype="bfloat16", quantization="none"), 2.0, 2.0),
    "int8": (dict(device="cpu", dtype="float32", quantization="int8"), 1.0 + 2.0 / GROUP_SIZE, 4.0),  # + float16 scale per group
    "int4": (dict(device="cpu", dtype="float32", quantization="int4"), 0.5 + 4.0 / GROUP_SIZE, 4.0),  # + float16 scale and min
    # a GGUF file's own blocks (the default for quantized checkpoints): each linear layer at its bytes in the
    # file (layers/gguf_native.py; types without a native kernel at int8's)
    "native": (dict(device="cpu", dtype="float32", quantization="native"), None, 4.0),
}
PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and tests."


def measure_bandwidth_gbs(size_bytes: int = 1 << 30, repeats: int = 7, threads: int = 2,
                          huge_pages: bool = True) -> float:
    """Read bandwidth in GB/s: median over `repeats` timed sums of a `size_bytes` float32 tensor, by default
    held in the kind of pages the engine keeps its weights in (huge pages where the OS gives them:
    host/huge_pages.py), since that is the ceiling the weights' stream has; huge_pages=False: 4 KiB pages."""
    from sudu.host.huge_pages import huge_page_buffer, huge_page_size

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        page = huge_page_size() if huge_pages else None
        t = torch.ones(size_bytes // 4) if page is None else huge_page_buffer(size_bytes, page).view(torch.float32).fill_(1.0)
        t.sum()  # fault the pages in before timing
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            t.sum()
            times.append(time.perf_counter() - t0)
        return t.numel() * 4 / statistics.median(times) / 1e9
    finally:
        torch.set_num_threads(old)


def parameter_counts(model_config) -> tuple[int, int, int]:
    """(weights of linear layers incl. lm_head, elements of one embedding row, other parameters per step),
    counted on a meta-device build of the network, so it holds for every architecture."""
    from sudu.models import build_model

    with torch.device("meta"):
        model = build_model(model_config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    linear_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    other = 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in linear_ids or name.endswith("embed_tokens.weight"):
            continue
        other += p.numel()
    return linear, model_config.hidden_size, other


def native_linear_bytes(ckpt, only: str | None = None) -> float:
    """Bytes of the linear layers (incl. lm_head) as `native` runs them: the file's own bytes per tensor
    (only: that one layer's)."""
    from sudu.layers.gguf_native import native_blocks
    from sudu.models import build_model

    with torch.device("meta"):
        model = build_model(ckpt.config)
    total = 0.0
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and only in (None, name):
            qt = native_blocks(ckpt, name, m)
            total += qt.blocks.nbytes if qt is not None else m.weight.numel() * FORMATS["int8"][1]
    return total


def lm_head_bytes(model_config, fmt: str, ckpt=None) -> float:
    """Bytes of the output head in format fmt (native: from ckpt's tensor)."""
    _, per_linear, _ = FORMATS[fmt]
    if per_linear is None:
        return native_linear_bytes(ckpt, only="lm_head")
    return model_config.vocab_size * model_config.hidden_size * per_linear


def bytes_per_token(model_config, fmt: str, ckpt=None) -> float:
    """Bytes a decode step reads in format fmt (native: from ckpt's tensors)."""
    _, per_linear, per_other = FORMATS[fmt]
    linear, embed_row, other = parameter_counts(model_config)
    linear_bytes = native_linear_bytes(ckpt) if per_linear is None else linear * per_linear
    return linear_bytes + (embed_row + other) * per_other


def measure_decode(model: str, fmt: str, max_tokens: int = 64, threads: int = 2,
                   greedy_head: str = "full") -> tuple[float, float | None]:
    """Single-stream greedy decode speed of sudu's engine, (tokens - 1) / (last token - first token), and with
    greedy_head auto the bytes a token's output head read through the bounded head on average (the shadow and
    its constants, the candidate tiles, the whole head where it ran instead; None where there is none)."""
    from sudu.engine.llm import LLM
    from sudu.sampling import SamplingParams

    settings, _, _ = FORMATS[fmt]
    llm = LLM(model, speculative="none", progress=False, num_threads=threads, greedy_head=greedy_head, **settings)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    bounded = llm.engine.runner.bounded_head
    if bounded is not None:
        bounded.calls = bounded.whole_head = bounded.tiles_read = 0
    result = llm.generate(PROMPT + " ", params)[0]
    m = result.metrics
    n = len(result.token_ids)
    head_bytes = None
    if bounded is not None and bounded.calls:
        whole = llm.engine.runner.model.lm_head.weight_bytes()
        tile = whole / -(-bounded.vocab // 16)
        read = bounded.calls * bounded.shadow_bytes() + bounded.whole_head * whole + bounded.tiles_read * tile
        head_bytes = read / bounded.calls
    return (n - 1) / (m.finished_time - m.first_token_time), head_bytes


def measure_decode_at_depths(model: str, fmt: str, depths: list[int], max_tokens: int = 32, threads: int = 2
                             ) -> list[tuple[float, float]]:
    """Per depth, single-stream greedy decode speed after a `depth`-token prompt (its prefill not timed) and the
    KV bytes a decode step reads on average over the measured tokens (every layer's K and V of the context);
    one engine for all of them."""
    from sudu.engine.llm import LLM
    from sudu.sampling import SamplingParams

    settings, _, _ = FORMATS[fmt]
    llm = LLM(model, speculative="none", progress=False, num_threads=threads, greedy_head="full",
              enable_prefix_caching=False, **settings)
    words = llm.tokenizer.encode(PROMPT + " ")
    out = []
    for depth in depths:
        prompt = (words * (depth // len(words) + 1))[:depth]
        print(f"  decode after a {depth}-token prompt ({fmt}): prefilling...", flush=True)
        result = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))[0]
        m = result.metrics
        n = len(result.token_ids)
        out.append(((n - 1) / (m.finished_time - m.first_token_time),
                    llm.engine.runner.kv_bytes_for_context(depth + n // 2)))
    return out


def parse_depths(text: str) -> list[int]:
    """--depths: token counts, k = 1000 (as `sudu bench sweep` reads them)."""
    out = []
    for part in filter(None, (t.strip().lower() for t in text.split(","))):
        try:
            out.append(int(float(part[:-1]) * 1000) if part.endswith("k") else int(part))
        except ValueError:
            raise SystemExit(f"sudu roofline: --depths takes token counts such as 2k,24k, got {part!r}") from None
    return out


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from sudu.weights.loader import load_checkpoint

    depths = [] if args.no_measure else parse_depths(args.depths)  # a bad value is refused before any run
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(args.model, pull=True, progress=True)
    formats = [f.strip() for f in args.formats.split(",")]
    # A VM's bandwidth can move with its neighbours during the run (docs/benchmarks.md records such
    # shifts), so each format's decode measurement is paired with a bandwidth measurement right after it.
    table = Table(title=f"decode roofline: {ckpt.path.name}, {args.threads} threads; bandwidth measured "
                        f"right after each format's decode")
    for col in ("format", "MB read / token", "bandwidth GB/s", "limit tok/s", "sudu tok/s", "fraction of limit"):
        table.add_column(col, justify="right", no_wrap=col == "format")

    def row(name: str, nbytes: float, achieved: float | None) -> list[str]:
        """A table row, with the bandwidth measured now (right after its decode measurement)."""
        bandwidth_gbs = measure_bandwidth_gbs(threads=args.threads)
        limit = bandwidth_gbs * 1e9 / nbytes
        return [name, f"{nbytes / 1e6:.0f}", f"{bandwidth_gbs:.1f}", f"{limit:.1f}",
                "-" if achieved is None else f"{achieved:.1f}", "-" if achieved is None else f"{achieved / limit:.0%}"]

    for fmt in formats:
        nbytes = bytes_per_token(ckpt.config, fmt, ckpt)
        if args.no_measure:
            table.add_row(*row(fmt, nbytes, None))
            continue
        # the default greedy path first: without a bounded head it is the whole head's, measured once
        achieved, head_bytes = measure_decode(args.model, fmt, args.max_tokens, args.threads, greedy_head="auto")
        if head_bytes is None:
            table.add_row(*row(fmt, nbytes, achieved))
            continue
        # where the bounded head serves: its own bytes in place of the head's, and the whole head again
        bounded = row(f"{fmt}, bounded head", nbytes - lm_head_bytes(ckpt.config, fmt, ckpt) + head_bytes, achieved)
        table.add_row(*row(fmt, nbytes, measure_decode(args.model, fmt, args.max_tokens, args.threads)[0]))
        table.add_row(*bounded)
    # at depth a decode step reads the context's K and V too: the first format's rows, whole head
    if depths:
        fmt = formats[0]
        measured = measure_decode_at_depths(args.model, fmt, depths, args.max_tokens, args.threads)
        for depth, (achieved, kv) in zip(depths, measured):
            table.add_row(*row(f"{fmt}, {depth}-token context", bytes_per_token(ckpt.config, fmt, ckpt) + kv,
                               achieved))
    Console().print(table)
    return 0


def register_cli(sub) -> None:
    p = sub.add_parser("roofline", help="memory-bandwidth limit of decode per weight format vs achieved speed",
                       description=__doc__)
    p.add_argument("model", metavar="MODEL", help="model name or path (see `sudu models list`)")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated subset of fp32,bf16,int8,int4,native")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per measurement")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-measure", action="store_true", help="print the limits only, skip the engine runs")
    p.add_argument("--depths", default="", help="also decode after prompts of these lengths (e.g. 8k,24k; k = 1000), "
                   "the first format's weights plus the context's KV bytes per token (their prefill is not timed)")
    p.set_defaults(func=run)
