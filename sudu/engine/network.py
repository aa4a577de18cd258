"""The network as the engine runs it: built on the meta device, loaded from a checkpoint's tensors, its linear
layers quantized to the resolved weight format, same-input projections fused, and moved to its device (huge
pages on the CPU). Model surgery lives here so that model files stay the network alone and layers never build a
model."""
from __future__ import annotations

import logging

import torch
from torch import nn

from sudu import kernels
from sudu.config import EngineConfig
from sudu.cuda.quant_linear import TritonQuantizedLinear
from sudu.engine.placement import check_supported, resolve_device, resolve_dtype
from sudu.errors import SuduError
from sudu.host.huge_pages import move_to_huge_pages
from sudu.layers.gguf_native import native_tensor_names, quantize_native
from sudu.layers.linear import QuantizedLinear
from sudu.layers.rotary import RotaryEmbedding
from sudu.model_config import ModelConfig
from sudu.models import build_model
from sudu.quant.formats import FORMATS, GROUP_SIZE, q8_0_blocks

log = logging.getLogger(__name__)


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


# What `--quantization auto` (the default) picks for a checkpoint whose weights are already quantized (GGUF
# files such as the catalog's Q4_K_M): the file's own blocks (layers/gguf_native.py), the file's exact
# values. int8 and int4 re-quantize them and stay as explicit choices (docs/cpu_speed.md compares the three).
# Float checkpoints stay float.
AUTO_FORMAT = "native"
FLOAT_GGML_TYPES = {"F32", "F16", "BF16"}


def resolve_format(requested: str, ckpt) -> str:
    """The weight format an engine runs: `requested`, or for "auto" AUTO_FORMAT when the checkpoint's
    linear weights come quantized and "none" when they come as floats."""
    if requested != "auto":
        return requested
    if ckpt is None or getattr(ckpt, "format", None) != "gguf":
        return "none"
    for name in ckpt.tensor_names():
        qt = ckpt.quantized(name)
        if name.endswith("proj.weight") and qt is not None and qt.ggml_type not in FLOAT_GGML_TYPES:
            return AUTO_FORMAT
    return "none"


def replace_linears(model: nn.Module, ckpt, fmt: str, group_size: int, build) -> int:
    """Every nn.Linear whose input width is a multiple of group_size (itself a multiple of 32) replaced in place
    by build(module, its GGUF tensor or None); the others stay float (a warning names them). Returns how many
    were replaced."""
    replaced, kept = 0, []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        if module.in_features % group_size != 0 or group_size % 32 != 0:
            kept.append(name)
            continue
        qt = ckpt.quantized(f"{name}.weight") if ckpt is not None else None
        with torch.no_grad():
            new = build(module, qt)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        replaced += 1
    if kept:
        log.warning("quantization %s: kept %d linear layers in float (input width not a multiple of %d): %s",
                    fmt, len(kept), group_size, ", ".join(kept[:3]))
    return replaced


def quantize_model(model: nn.Module, ckpt, fmt: str, group_size: int = GROUP_SIZE) -> nn.Module:
    """Replace every nn.Linear whose input width is a multiple of the group size with a QuantizedLinear,
    in place, in format `fmt` (native: layers/gguf_native.py quantize_native). Q8_0
    tensors in a GGUF checkpoint become int8 by copying their blocks; everything else is quantized from
    the loaded float weights. Layers that do not fit the group size stay float."""
    if fmt == "native":
        return quantize_native(model, ckpt)
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization {fmt!r}; expected none, native, {', '.join(FORMATS)}")

    def build(module: nn.Linear, qt) -> nn.Module:
        if fmt == "int8" and group_size == 32 and qt is not None and qt.ggml_type == "Q8_0":
            q, s = q8_0_blocks(qt)
            return QuantizedLinear("int8", q, s, None, module.bias, module.in_features, group_size)
        return QuantizedLinear.from_float(fmt, module.weight, module.bias, group_size)

    replaced = replace_linears(model, ckpt, fmt, group_size, build)
    log.info("quantization %s: %d linear layers, native kernels %s", fmt, replaced,
             "on" if kernels.load() is not None else f"off ({kernels.disabled_reason() or 'compile failed'})")
    return model


def quantize_model_cuda(model: nn.Module, ckpt, fmt: str, group_size: int = GROUP_SIZE) -> nn.Module:
    """quantize_model for the CUDA path: every nn.Linear whose input width is a multiple of
    the group size becomes a TritonQuantizedLinear in `fmt`, in place (on the host; the caller moves the
    network). Q8_0 tensors in a GGUF checkpoint become int8 by copying their blocks; everything else is
    quantized from the loaded float weights. Layers that do not fit the group size stay float."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization {fmt!r} on CUDA; expected none, {', '.join(FORMATS)}")
    if group_size != GROUP_SIZE:
        raise ValueError(f"the CUDA kernels take groups of {GROUP_SIZE}, not {group_size}")
    def build(module: nn.Linear, qt) -> nn.Module:
        if fmt == "int8" and qt is not None and qt.ggml_type == "Q8_0":
            return TritonQuantizedLinear.from_q8_0(qt, module.bias)
        return TritonQuantizedLinear.from_float(fmt, module.weight, module.bias)

    replaced = replace_linears(model, ckpt, fmt, group_size, build)
    log.info("quantization %s: %d linear layers, Triton kernels", fmt, replaced)
    return model
