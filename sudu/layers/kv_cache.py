"""One layer's KV pool: [num_slots, num_kv_heads, head_dim], stored as float32, float16, bfloat16, or int8
with static per-channel scales. Which one `--kv-cache-dtype auto` picks is measured at load
(engine/kv_choice.py).

int8 (`--kv-cache-dtype int8`) stores one byte per value and nothing per token: each (kv head, channel) of
a layer has one float32 scale for K and one for V, fixed when the engine loads (calibrate_int8_kv in
engine/model_runner.py). So a token costs exactly half its bf16 bytes (a quarter of float32), and the
scales a few KiB per layer whatever the pool's size.

Why per channel and not per token: K's channels differ by orders of magnitude (Qwen2.5's k_proj bias puts
a few channels far above the rest), so one scale per token vector spends its 8 bits on the outliers and
rounds the small channels away; a scale per channel keeps each channel's own range (the two compared:
docs/cpu_speed.md, "int8 KV and hybrid attention memory").

The scales come from a calibration pass: the model runs a fixed chat turn, code and prose (CALIBRATION_*
below, distinct from the accuracy test's texts) over a float pool while every layer's K and V ranges are
recorded, and each scale covers KV_SCALE_MARGIN times the largest value seen. Other texts reach past the
calibration's range in some channels (Chinese prose, a list of numbers), so the margin trades resolution
for headroom (margins compared: docs/cpu_speed.md, "int8 KV and hybrid attention memory"). K is recorded after rotary
embedding, as the norm of each rotate-half channel pair (i, i + D/2): a rotation moves a value between the
two channels of its pair but never above the pair's norm, so the range holds at every position. Values
past the range saturate at +-127 (never wrap).

K is stored around a centre: a pair that a bias holds far from zero and that RoPE turns by less than half a
circle over the model's positions (Qwen2.5's lowest-frequency K channels, up to ~150 against a variation of
a few units) is stored as k - centre, with a half-range that covers the variation and the arc the bias
sweeps (KVRangeRecorder.int8_range). The centre is one vector per (layer, kv head), so q . centre is the same
for every key a query sees and softmax drops it: the attention kernels read the stored values unchanged.
What it gains, and where it does not help (Gemma 3's normalized K): docs/cpu_speed.md, "int8 KV: K around
a centre".
"""
from __future__ import annotations

import math
import mmap

import torch

# auto: chosen at load (engine/kv_choice.py); below the engine, auto means the compute dtype
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")
FLOAT_POOL_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# pools the native attention kernel and decode stack read (kernels/attention.cpp load8)
NATIVE_POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)
KV_SCALE_MARGIN = 2.0  # headroom over the calibration text's largest K / V values (why 2: the docstring)

CALIBRATION_CHAT = [{"role": "user", "content": "Write a JavaScript function that debounces another function, "
                                                 "and explain when to use it."}]
CALIBRATION_TEXT = (
    "import os\nimport json\n\nclass Config:\n    def __init__(self, path):\n        with open(path) as f:\n"
    "            self.data = json.load(f)\n\n    def get(self, key, default=None):\n"
    "        return self.data.get(key, default)\n\n"
    "#include <stdio.h>\nint main(void) {\n    for (int i = 0; i < 10; i++) printf(\"%d\\n\", i * i);\n"
    "    return 0;\n}\n\n"
    "SELECT name, COUNT(*) AS n FROM orders GROUP BY name HAVING n > 5 ORDER BY n DESC;\n\n"
    "A hash table stores keys and values in an array of buckets. A hash function maps each key to a bucket; "
    "collisions are resolved by chaining or open addressing. Lookups take constant time on average, but a "
    "poor hash function or a high load factor makes them slow. Resizing doubles the array and rehashes every "
    "key.\nfn main() { let v: Vec<i32> = (1..=5).map(|x| x * 2).collect(); println!(\"{:?}\", v); }\n"
)


def calibration_ids(tokenizer, config) -> list[int]:
    """The calibration pass's tokens: a chat turn, then code and prose (ids the network's vocabulary has, at
    most the model's positions)."""
    ids = tokenizer.encode_chat(CALIBRATION_CHAT) + tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)
    return network_ids(ids, config)


def network_ids(ids: list[int], config) -> list[int]:
    """The ids the network's vocabulary has, at most the model's positions."""
    return [i for i in ids if i < config.vocab_size][:config.max_position_embeddings]


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero tensor whose host memory is committed only as it is written: on the CPU, anonymous pages from
    mmap, which the kernel hands out zeroed on first touch (torch.zeros writes every page up front, so a
    4 GiB pool would be resident before its first token). Elsewhere plain zeros."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes)  # the tensor keeps the mapping alive
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


def kv_pool(num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
            device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed pool [num_slots, num_kv_heads, head_dim]. On the CPU each kv head's rows lie together (the
    storage is [heads, slots, dim], the tensor a view of it): a decode thread attends one kv head, and its
    keys are then one dense run of memory that the hardware prefetchers follow, where slot-major rows would
    interleave the heads and each core would fetch the other head's lines too (docs/cpu_speed.md "Decode at
    depth: each kv head's rows together"). Elsewhere slot-major (the CUDA kernels' layout)."""
    if torch.device(device).type != "cpu":
        return zeroed_pool((num_slots, num_kv_heads, head_dim), dtype, device)
    return zeroed_pool((num_kv_heads, num_slots, head_dim), dtype, device).permute(1, 0, 2)


def pool_bytes(pool: torch.Tensor) -> torch.Tensor:
    """All the bytes of a pool's storage, flat (whatever its layout)."""
    return torch.empty(0, dtype=torch.uint8, device=pool.device).set_(pool.untyped_storage())


class KVCache:
    """v_head_dim: V's width where it differs from K's (multi-head latent attention keeps the rotary key part
    as K and the compressed latent as V, layers/mla.py). The pools take memory as they fill (zeroed_pool),
    each kv head's rows together on the CPU (kv_pool)."""

    def __init__(self, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", v_head_dim: int | None = None):
        self.k = kv_pool(num_slots, num_kv_heads, head_dim, dtype, device)
        self.v = kv_pool(num_slots, num_kv_heads, v_head_dim or head_dim, dtype, device)
        # the native kernels' attention over this pool on AMX's bfloat16 tiles rather than in float32: a
        # numerics choice made for the whole model at load (engine/attention_choice.py), one recipe for every
        # row either way
        self.bf16_tiles = False

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype, v_head_dim: int | None = None) -> int:
        return num_kv_heads * (head_dim + (v_head_dim or head_dim)) * dtype.itemsize

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k.index_copy_(0, slots, k.to(self.k.dtype))
        self.v.index_copy_(0, slots, v.to(self.v.dtype))

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given slots (any shape S): [*S, num_kv_heads, head_dim] in dtype."""
        flat = slots.reshape(-1)
        k = self.k.index_select(0, flat).to(dtype)
        v = self.v.index_select(0, flat).to(dtype)
        return k.view(*slots.shape, *k.shape[1:]), v.view(*slots.shape, *v.shape[1:])

    def read_k(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """K alone (sparse attention ranks every key by it, then reads V of the chosen ones only)."""
        k = self.k.index_select(0, slots.reshape(-1)).to(dtype)
        return k.view(*slots.shape, *k.shape[1:])


class KVRangeRecorder(KVCache):
    """A float32 pool that records, over everything written to it, K's largest rotate-half pair norm and V's
    largest magnitude per (kv head, channel): the calibration pass's pool. Slots are positions (one sequence
    from position 0, engine/text_eval.py forward_text).

    k_rotary: the (start, width) spans of K rotated in halves (a pair's norm bounds both its channels at any
    position); K's other channels are bounded by their own magnitude. Default: all of K, one span.
    rotary: per span, its pairs' angles per position [width / 2] and the positions the model has; given, it
    also records each pair's range before rotation, from which int8_range centres the pairs that turn by less
    than half a circle over the model's positions."""

    def __init__(self, num_slots: int, num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu",
                 v_head_dim: int | None = None, k_rotary: list[tuple[int, int]] | None = None,
                 rotary: tuple[list[torch.Tensor], int] | None = None):
        super().__init__(num_slots, num_kv_heads, head_dim, torch.float32, device, v_head_dim)
        self.k_max = torch.zeros(num_kv_heads, head_dim, device=device)
        self.v_max = torch.zeros(num_kv_heads, v_head_dim or head_dim, device=device)
        self.k_rotary = k_rotary if k_rotary is not None else [(0, head_dim)]
        self.rotary = rotary
        self.u_min = torch.full((num_kv_heads, head_dim), math.inf, device=device)
        self.u_max = torch.full((num_kv_heads, head_dim), -math.inf, device=device)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k, v = k.float(), v.float()
        bound = k.abs()
        for i, (start, width) in enumerate(self.k_rotary):
            half = width // 2
            x1, x2 = k[..., start:start + half], k[..., start + half:start + width]
            pair = torch.hypot(x1, x2)
            bound[..., start:start + width] = torch.cat([pair, pair], dim=-1)
            if self.rotary is not None:  # undo the rotation: the pair as it was before RoPE turned it
                angle = slots.double()[:, None, None] * self.rotary[0][i].double().to(k.device)
                cos, sin = angle.cos().float(), angle.sin().float()
                u = torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)
                span = slice(start, start + width)
                torch.minimum(self.u_min[:, span], u.amin(0), out=self.u_min[:, span])
                torch.maximum(self.u_max[:, span], u.amax(0), out=self.u_max[:, span])
        torch.maximum(self.k_max, bound.amax(0), out=self.k_max)
        torch.maximum(self.v_max, v.abs().amax(0), out=self.v_max)
        super().write(slots, k, v)

    def int8_range(self, margin: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K's half-range around k_centre, V's half-range around 0, k_centre), each [kv heads, channels]: what
        Int8KVCache.set_range takes.

        By default a K pair is bounded by margin x its largest norm, around 0. A pair before rotation sits
        within rho of its centre u (rho: the corner of its recorded box); RoPE turns u through an arc of angle
        A = theta x (positions - 1). Where A < pi, every position's K lies within rho + |u| sin(A/2) of the
        arc's chord midpoint R(A/2) u cos(A/2), so that point becomes the pair's centre and margin x rho +
        |u| sin(A/2) its half-range, where this is the tighter bound (a pair that a large bias holds far from
        zero, such as Qwen2.5's low-frequency K channels, then spends its 8 bits on its variation)."""
        k_half, centre = self.k_max * margin, torch.zeros_like(self.k_max)
        if self.rotary is not None and bool(torch.isfinite(self.u_min).any()):
            thetas, positions = self.rotary
            for (start, width), theta in zip(self.k_rotary, thetas):
                half = width // 2
                lo, hi = self.u_min[:, start:start + width], self.u_max[:, start:start + width]
                mid, radius = (lo + hi) / 2, (hi - lo) / 2
                u1, u2 = mid[:, :half], mid[:, half:]
                rho = torch.hypot(radius[:, :half], radius[:, half:])
                arc = theta.float().to(mid.device) * (positions - 1)
                phi = (arc / 2).clamp(max=math.pi / 2)
                cos, sin = phi.cos(), phi.sin()
                c1, c2 = (u1 * cos - u2 * sin) * cos, (u2 * cos + u1 * sin) * cos
                bound = margin * rho + torch.hypot(u1, u2) * sin
                use = (arc < math.pi) & (bound < k_half[:, start:start + half])
                span = slice(start, start + width)
                k_half[:, span] = torch.where(use.repeat(1, 2), torch.cat([bound, bound], -1), k_half[:, span])
                centre[:, span] = torch.where(use.repeat(1, 2), torch.cat([c1, c2], -1), centre[:, span])
        return k_half, self.v_max * margin, centre


class Int8KVCache(KVCache):
    def __init__(self, num_slots: int, num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu",
                 v_head_dim: int | None = None):
        super().__init__(num_slots, num_kv_heads, head_dim, torch.int8, device, v_head_dim)
        self.k_scale: torch.Tensor | None = None  # float32 [num_kv_heads, head_dim], set by set_range
        self.v_scale: torch.Tensor | None = None
        # K is stored as k - k_centre (float32 [num_kv_heads, head_dim], zeros where nothing is centred): one
        # vector per head, so q . k_centre is the same for every key of a query and softmax drops it; the
        # attention kernels read the stored values as they are
        self.k_centre = torch.zeros(num_kv_heads, head_dim, device=device)

    def set_range(self, k_max: torch.Tensor, v_max: torch.Tensor, k_centre: torch.Tensor | None = None) -> None:
        """Scales that map k_centre +- k_max and +-v_max ([num_kv_heads, head_dim]) to +-127."""
        self.k_scale = (k_max.float() / 127.0).clamp_min(1e-8).contiguous().to(self.k.device)
        self.v_scale = (v_max.float() / 127.0).clamp_min(1e-8).contiguous().to(self.k.device)
        if k_centre is not None:
            self.k_centre = k_centre.float().contiguous().to(self.k.device)

    @staticmethod
    def quantize(x: torch.Tensor, scale: torch.Tensor, centre: torch.Tensor | None = None) -> torch.Tensor:
        """Round to nearest even, saturating (kernels/decoder.cpp's KV write computes the same)."""
        x = x.float() if centre is None else x.float() - centre
        return torch.round(x / scale).clamp_(-127, 127).to(torch.int8)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.k_scale is None:
            raise RuntimeError("int8 KV pool written before its scales were calibrated")
        self.k.index_copy_(0, slots, self.quantize(k, self.k_scale, self.k_centre))
        self.v.index_copy_(0, slots, self.quantize(v, self.v_scale))

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        flat = slots.reshape(-1)
        k = self.k.index_select(0, flat).to(dtype) * self.k_scale.to(dtype) + self.k_centre.to(dtype)
        v = self.v.index_select(0, flat).to(dtype) * self.v_scale.to(dtype)
        return k.view(*slots.shape, *k.shape[1:]), v.view(*slots.shape, *v.shape[1:])

    def read_k(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        k = self.k.index_select(0, slots.reshape(-1)).to(dtype) * self.k_scale.to(dtype) + self.k_centre.to(dtype)
        return k.view(*slots.shape, *k.shape[1:])


def pool_dtype(kind: str, dtype: torch.dtype) -> torch.dtype:
    """The element type of a `kind` pool (a KV_CACHE_DTYPES name; auto = the compute dtype `dtype`)."""
    if kind == "int8":
        return torch.int8
    if kind == "auto":
        return dtype
    if kind not in FLOAT_POOL_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kind!r}")
    return FLOAT_POOL_DTYPES[kind]


def make_kv_cache(kind: str, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device | str = "cpu", v_head_dim: int | None = None) -> KVCache:
    if kind == "int8":
        return Int8KVCache(num_slots, num_kv_heads, head_dim, device, v_head_dim)
    return KVCache(num_slots, num_kv_heads, head_dim, pool_dtype(kind, dtype), device, v_head_dim)


def layer_kv_bytes_per_token(kind: str, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                             v_head_dim: int | None = None) -> int:
    """Bytes one token's K and V take in one layer."""
    return KVCache.bytes_per_token(num_kv_heads, head_dim, pool_dtype(kind, dtype), v_head_dim)
