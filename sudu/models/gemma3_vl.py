"""Gemma 3 (4B and up) as a vision-language model: the SigLIP vision tower (patch embedding, learned position
embeddings, pre-norm transformer blocks with full attention over the image's patches, a final LayerNorm), the
multi-modal projector (average pooling of the patch grid down to mm_tokens_per_image embeddings, Gemma's RMSNorm,
a projection into the text width) and the Gemma 3 text decoder (models/gemma3.py), in which the tokens of one
image attend to each other both ways (BIDIRECTIONAL_IMAGES: the attention metadata carries each image's span and
the scheduler never ends a prompt chunk inside one). Network only: pixels arrive preprocessed
(sudu/media/gemma3_vl.py) and an image's embeddings replace its placeholder rows, unscaled (the text embeddings
are scaled by sqrt(hidden_size), the image embeddings are not)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sudu.layers.attention import AttentionMetadata
from sudu.layers.mlp import ACTIVATIONS
from sudu.layers.norm import RMSNorm
from sudu.layers.vision import EncodeStages, run_stages, segment_attention
from sudu.model_config import ModelConfig
from sudu.models.gemma3 import Gemma3ForCausalLM


class SiglipAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (p(x).view(n, self.num_heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(segment_attention(q, k, v, [0, n], self.head_dim ** -0.5).reshape(n, -1))


class SiglipMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.act = ACTIVATIONS[act]
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, v: dict):
        super().__init__()
        dim, eps = v["hidden_size"], v.get("layer_norm_eps", 1e-6)
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.self_attn = SiglipAttention(dim, v["num_attention_heads"])
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = SiglipMLP(dim, v["intermediate_size"], v.get("hidden_act", "gelu_pytorch_tanh"))

    def forward(self, x):
        return run_stages(self.stages(x))

    def stages(self, x) -> EncodeStages:
        """forward, paused between its attention and its MLP."""
        x = x + self.self_attn(self.layer_norm1(x))
        yield
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, v: dict):
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(v) for _ in range(v["num_hidden_layers"]))


class SiglipEmbeddings(nn.Module):
    def __init__(self, v: dict):
        super().__init__()
        p, side = v.get("patch_size", 14), v.get("image_size", 896)
        self.patch_embedding = nn.Conv2d(v.get("num_channels", 3), v["hidden_size"], p, stride=p)
        self.position_embedding = nn.Embedding((side // p) ** 2, v["hidden_size"])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[C, H, W] -> [patches, hidden], patches row by row."""
        w = self.patch_embedding.weight
        patches = self.patch_embedding(pixels[None].to(w.dtype))[0].flatten(1).transpose(0, 1)
        return patches + self.position_embedding.weight


class SiglipVisionModel(nn.Module):
    def __init__(self, v: dict):
        super().__init__()
        self.embeddings = SiglipEmbeddings(v)
        self.encoder = SiglipEncoder(v)
        self.post_layernorm = nn.LayerNorm(v["hidden_size"], eps=v.get("layer_norm_eps", 1e-6))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return run_stages(self.stages(pixels))

    def stages(self, pixels: torch.Tensor) -> EncodeStages:
        """forward, paused after each encoder layer's attention and after its MLP."""
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = yield from layer.stages(x)
            yield
        return self.post_layernorm(x)


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, cfg: ModelConfig):
        v = cfg.vision_config
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(v["hidden_size"], cfg.hidden_size))
        self.mm_soft_emb_norm = RMSNorm(v["hidden_size"], v.get("layer_norm_eps", 1e-6), unit_offset=True)
        self.patches_per_side = v.get("image_size", 896) // v.get("patch_size", 14)
        tokens_per_side = int(cfg.mm_tokens_per_image ** 0.5)
        if tokens_per_side ** 2 != cfg.mm_tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ValueError(f"mm_tokens_per_image {cfg.mm_tokens_per_image} is not a square that divides the "
                             f"{self.patches_per_side} x {self.patches_per_side} patch grid")
        self.kernel = self.patches_per_side // tokens_per_side

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[patches, vision hidden] -> [mm_tokens_per_image, text hidden]."""
        side = self.patches_per_side
        grid = patches.transpose(0, 1).reshape(1, -1, side, side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel)[0].flatten(1).transpose(0, 1)
        return self.mm_soft_emb_norm(pooled.contiguous()) @ self.mm_input_projection_weight


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    BIDIRECTIONAL_IMAGES = True  # an image's tokens attend to each other both ways (layers/attention.py)

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.vision_tower = SiglipVisionModel(cfg.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(cfg)

    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """One image's pixels [C, H, W] -> its embeddings [mm_tokens_per_image, hidden_size]."""
        return run_stages(self.encode_stages(pixels, grids))

    def encode_stages(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> EncodeStages:
        """encode_images, paused after each tower layer."""
        patches = yield from self.vision_tower.stages(pixels)
        return self.multi_modal_projector(patches)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                image_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """image_rows: (row indices, their image embeddings) replacing those rows' scaled token embeddings."""
        if image_rows is None:
            return super().forward(input_ids, positions, meta)
        # a placeholder id past the vocabulary (the released checkpoints' soft token) reads row 0; replaced below
        x = self.model.embed_tokens(input_ids.masked_fill(input_ids >= self.config.vocab_size, 0))
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        rows, embeds = image_rows
        x[rows] = embeds.to(x.dtype)
        return self.decode_layers(x, positions, meta, native=False)  # the stack knows no image rows
