"""Sliding windows as trained, per layer, to and from HF config.json keys (`layer_types`, `sliding_window`, Qwen2's
`use_sliding_window` / `max_window_layers`, the window on every layer of Mistral-like families)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from leanlm.config.values import check_bool, check_list, optional, to_int

if TYPE_CHECKING:
    from leanlm.config.architectures import Architecture


def hf_layer_windows(arch: Architecture, cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's attention window from an HF config.json, as transformers reads it: `layer_types` where the
    config lists them ("sliding_attention" layers get `sliding_window`); else Qwen2's use_sliding_window from layer
    max_window_layers on; else, for Mistral and Mixtral, `sliding_window` on every layer. () when every layer is
    full (HF leaves qwen2's window off unless use_sliding_window is set)."""
    window = cfg.get("sliding_window")
    window = None if window is None else to_int(window, "sliding_window", minimum=0) or None  # 0: no window
    types = cfg.get("layer_types")
    if types is not None:
        types = check_list(types, "layer_types")
        if len(types) != num_layers:
            raise ValueError(f"config.json layer_types lists {len(types)} layers, the model has {num_layers}")
        unknown = [t for t in types if t not in ("full_attention", "sliding_attention")]
        if unknown:
            raise ValueError(f"config.json layer_types has {unknown[:3]}; leanlm runs full and sliding attention")
        windows = tuple(window if t == "sliding_attention" and window else None for t in types)
    elif arch.model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        start = to_int(optional(cfg, "max_window_layers", num_layers), "max_window_layers", minimum=0)
        on = check_bool(optional(cfg, "use_sliding_window", False), "use_sliding_window") and window
        windows = tuple(window if on and i >= start else None for i in range(num_layers)) if on else ()
    elif arch.window_every_layer and window:
        windows = (window,) * num_layers
    else:
        windows = ()
    return windows if any(w is not None for w in windows) else ()


def layer_windows_to_hf(architecture: str, windows: tuple[int | None, ...]) -> dict[str, Any]:
    """The config.json keys that give an HF loader these windows: `sliding_window` and `layer_types`."""
    if not windows:
        return {}
    sizes = {w for w in windows if w is not None}
    if len(sizes) > 1:
        raise ValueError(f"HF configs hold one sliding_window size; these layers have {sorted(sizes)}")
    types = ["sliding_attention" if w is not None else "full_attention" for w in windows]
    extra = {"use_sliding_window": True} if architecture in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe") else {}
    return {"sliding_window": sizes.pop(), "layer_types": types} | extra
