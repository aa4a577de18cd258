"""The network as the engine runs it: built on the meta device, loaded from a checkpoint's tensors, its linear
layers quantized to the resolved weight format, same-input projections fused, and moved to its device (huge
pages on the CPU). Model surgery lives here so that model files stay the network alone and layers never build a
model."""
from __future__ import annotations

import torch

from sudu.config import EngineConfig
from sudu.cuda.quant_linear import quantize_model_cuda
from sudu.host.huge_pages import move_to_huge_pages
from sudu.engine.placement import check_supported, resolve_device, resolve_dtype
from sudu.errors import SuduError
from sudu.layers.gguf_native import native_tensor_names
from sudu.layers.linear import quantize_model, resolve_format
from sudu.layers.rotary import RotaryEmbedding
from sudu.model_config import ModelConfig
from sudu.models import build_model


def load_network(model_cfg: ModelConfig, tensors, dtype: torch.dtype) -> torch.nn.Module:
    """Build the network without initialising its weights, then take the checkpoint's tensors."""
    with torch.device("meta"):
        model = build_model(model_cfg)
    state = {name: t.to(dtype) for name, t in tensors}
    if model_cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if model_cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise SuduError(
            f"checkpoint does not match the {model_cfg.architecture} network: "
            f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {unexpected[:3]}"
        )
    return model.eval()


def move_network(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The network's parameters and its rotary tables (plain tensors, not buffers) on device."""
    model.to(device)
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, RotaryEmbedding):
                value.to(device)
    return model


def prepare_network(ckpt, config: EngineConfig) -> tuple[torch.nn.Module, str]:
    """The checkpoint's network ready to run on config's device: loaded in its dtype, its linear layers
    quantized to the resolved format (on CUDA int8 / int4 only, quantized on the host before the move),
    projections that read the same input (q/k/v, gate/up) fused into one call each. Returns (network, weight
    format)."""
    check_supported(config)
    dtype = resolve_dtype(config)
    device = resolve_device(config.device)

    # off the CPU auto is "none", the weights in dtype, even for a quantized checkpoint (placement.py)
    if device.type == "cpu":
        fmt = resolve_format(config.quantization, ckpt)
    else:
        fmt = config.quantization if config.quantization in ("int8", "int4") else "none"
    placeholders, unwritten = frozenset(), []
    if fmt == "native":  # those weights come from the file's blocks, not floats
        with torch.device("meta"):
            placeholders = native_tensor_names(ckpt, build_model(ckpt.config))

    def tensors():
        for name, t in ckpt.tensors(dtype, placeholders):
            if name in placeholders:
                unwritten.append(t)  # held until the check below, so no allocation can reuse its address
            yield name, t

    model = load_network(ckpt.config, tensors(), dtype)
    if fmt != "none" and device.type == "cpu":
        quantize_model(model, ckpt, fmt)
    elif fmt != "none":
        quantize_model_cuda(model, ckpt, fmt)
    if unwritten:  # every placeholder must have been replaced: its memory was never written
        kept = {t.data_ptr() for t in list(model.parameters()) + list(model.buffers())}
        if kept & {t.data_ptr() for t in unwritten}:
            raise SuduError("internal error: a weight loaded as a placeholder was not replaced by its native layer")
        unwritten.clear()
    for module in model.modules():
        if hasattr(module, "fuse_projections"):
            module.fuse_projections()
    if device.type != "cpu":
        return move_network(model, device), fmt
    ckpt.release_pages()  # the repacked file's pages out of the resident set before the weights' copy
    model.huge_page_weights = move_to_huge_pages(model)[1]  # before anything below takes the weights' pointers
    if hasattr(model, "prepare_native_decode"):  # llama family: the one-call decode stack (kernels/decoder.cpp)
        model.prepare_native_decode()
    return model, fmt
