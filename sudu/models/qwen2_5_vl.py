"""Qwen2.5-VL: a vision transformer (patch embedding, 2D rotary, window attention with full attention at the
configured blocks, RMSNorm, SwiGLU MLPs, a 2x2 patch merger into the language model's width) and the Qwen2
decoder with multimodal rotary positions (M-RoPE). Network only: the image's pixels arrive preprocessed
(sudu/media/qwen_vl.py), its embeddings replace the prompt's placeholder rows, and mrope_positions gives the
(temporal, height, width) position of every prompt token."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from sudu.layers.attention import AttentionMetadata
from sudu.layers.mlp import ACTIVATIONS
from sudu.layers.norm import RMSNorm
from sudu.layers.rotary import MRotaryEmbedding, apply_rotary
from sudu.layers.vision import EncodeStages, run_stages, segment_attention
from sudu.model_config import ModelConfig
from sudu.models.llama import LlamaForCausalLM

VISION_NORM_EPS = 1e-6


def mrope_positions(num_tokens: int, images, merge_size: int) -> tuple[torch.Tensor, int]:
    """The (temporal, height, width) positions [3, num_tokens] of a prompt whose images (with .offset,
    .num_tokens, .grid_thw) sit at their offsets, and the shift of every later token (position p + shift on all
    three). Text counts on from the last position; an image's tokens share its start position, plus their
    frame, row and column in the merged grid; the text after an image starts past its largest coordinate."""
    parts, current, cursor = [], 0, 0
    for image in images:
        text = image.offset - cursor
        parts.append(torch.arange(text).expand(3, text) + current)
        current += text
        t, h, w = image.grid_thw
        gt, gh, gw = torch.meshgrid(torch.arange(t), torch.arange(h // merge_size), torch.arange(w // merge_size),
                                    indexing="ij")
        parts.append(torch.stack([gt, gh, gw]).reshape(3, -1) + current)
        current += max(h, w) // merge_size
        cursor = image.offset + image.num_tokens
    tail = num_tokens - cursor
    parts.append(torch.arange(tail).expand(3, tail) + current)
    positions = torch.cat(parts, dim=1)
    return positions, int(positions.max()) + 1 - num_tokens


def patch_positions(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """Each patch's (row, column) in its image, patches listed merge x merge group by group: [N, 2]."""
    out = []
    for t, h, w in grids:
        shape = (h // merge, merge, w // merge, merge)

        def grouped(grid: torch.Tensor) -> torch.Tensor:  # row-major -> merge groups adjacent
            return grid.reshape(shape).transpose(1, 2).reshape(-1)

        rows, cols = torch.arange(h)[:, None].expand(h, w), torch.arange(w)[None, :].expand(h, w)
        out.append(torch.stack([grouped(rows), grouped(cols)], -1).repeat(t, 1))
    return torch.cat(out)


def window_order(grids: list[tuple[int, int, int]], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Merged patches regrouped window by window (windows of window x window merged patches, the last row and
    column of windows cut short), and the windows' boundaries in patches: (order [N / merge^2], bounds)."""
    order, bounds, base = [], [0], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        for f in range(t):
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    cell = index[f, r:r + window, c:c + window].reshape(-1)
                    order.append(cell + base)
                    bounds.append(bounds[-1] + cell.numel() * merge * merge)
        base += t * gh * gw
    return torch.cat(order), bounds


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, cos, sin, bounds):
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rotary(q.float(), cos, sin).to(x.dtype), apply_rotary(k.float(), cos, sin).to(x.dtype)
        return self.proj(segment_attention(q, k, v, bounds, self.head_dim ** -0.5).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.act = ACTIVATIONS[act]
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, v: dict):
        super().__init__()
        self.norm1 = RMSNorm(v["hidden_size"], VISION_NORM_EPS)
        self.norm2 = RMSNorm(v["hidden_size"], VISION_NORM_EPS)
        self.attn = VisionAttention(v["hidden_size"], v["num_heads"])
        self.mlp = VisionMLP(v["hidden_size"], v["intermediate_size"], v.get("hidden_act", "silu"))

    def forward(self, x, cos, sin, bounds):
        return run_stages(self.stages(x, cos, sin, bounds))

    def stages(self, x, cos, sin, bounds) -> EncodeStages:
        """forward, paused between its attention and its MLP."""
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        yield
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """A patch's pixels [C * T * P * P] -> its embedding: the checkpoint's Conv3d with stride = kernel, which on
    whole patches is one matrix product."""

    def __init__(self, v: dict):
        super().__init__()
        p, t = v.get("patch_size", 14), v.get("temporal_patch_size", 2)
        self.proj = nn.Conv3d(v.get("in_channels", 3), v["hidden_size"], (t, p, p), stride=(t, p, p), bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, dim: int, merge: int):
        super().__init__()
        self.width = dim * merge * merge
        self.ln_q = RMSNorm(dim, VISION_NORM_EPS)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim))

    def forward(self, x):
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTransformer(nn.Module):
    def __init__(self, v: dict):
        super().__init__()
        self.merge = v.get("spatial_merge_size", 2)
        self.window = v.get("window_size", 112) // self.merge // v.get("patch_size", 14)
        self.full_blocks = set(v.get("fullatt_block_indexes", ()))
        self.patch_embed = PatchEmbed(v)
        self.blocks = nn.ModuleList(VisionBlock(v) for _ in range(v["depth"]))
        self.merger = PatchMerger(v["out_hidden_size"], v["hidden_size"], self.merge)
        head_dim = v["hidden_size"] // v["num_heads"]
        theta = (v.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        spatial = head_dim // 2  # half the channel pairs turn with the row, half with the column
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device="cpu") / spatial))

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Patches of one or more images [N, C * T * P * P] and their grids -> one embedding per merged patch
        [N / merge^2, out_hidden_size], images in order."""
        return run_stages(self.stages(pixels, grids))

    def stages(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> EncodeStages:
        """forward, paused after each block's attention and after its MLP."""
        unit = self.merge * self.merge
        x = self.patch_embed(pixels)
        n = x.shape[0]
        order, window_bounds = window_order(grids, self.merge, self.window)
        full_bounds = [0]
        for t, h, w in grids:
            full_bounds += [full_bounds[-1] + h * w * (f + 1) for f in range(t)]
        x = x.view(n // unit, unit, -1)[order].reshape(n, -1)
        angles = patch_positions(grids, self.merge).to(x.device).float()[..., None] * self.inv_freq.to(x.device)
        angles = angles.flatten(1)  # [N, head_dim / 2]: rows' then columns' frequencies
        angles = angles.view(n // unit, unit, -1)[order].reshape(n, -1)
        emb = torch.cat((angles, angles), -1)
        cos, sin = emb.cos(), emb.sin()
        for i, block in enumerate(self.blocks):
            x = yield from block.stages(x, cos, sin, full_bounds if i in self.full_blocks else window_bounds)
            yield
        return self.merger(x)[torch.argsort(order)]


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    POSITION_AXES = 3  # positions are (temporal, height, width) triples: [3, T]

    def __init__(self, cfg: ModelConfig):
        super().__init__(dataclasses.replace(cfg, attention_bias=True))
        self.visual = VisionTransformer(cfg.vision_config)
        self.rotary = MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.mrope_section)

    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        return self.visual(pixels, grids)

    def encode_stages(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> EncodeStages:
        """encode_images, paused after each tower block."""
        return self.visual.stages(pixels, grids)

    def prompt_positions(self, num_tokens: int, images) -> tuple[torch.Tensor, int]:
        return mrope_positions(num_tokens, images, self.visual.merge)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                image_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """positions: [3, T]; image_rows: (row indices, their image embeddings) replacing those rows' token
        embeddings."""
        x = self.model.embed_tokens(input_ids)
        if image_rows is not None:
            rows, embeds = image_rows
            x[rows] = embeds.to(x.dtype)
        cos, sin = self.rotary.lookup(positions, x.dtype)
        return self.decode_layers(x, cos, sin, meta)
