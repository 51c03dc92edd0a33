"""Weights of a KDA layer in the layouts of flash-linear-attention and of the Kimi Linear checkpoints.

kda_cp's :class:`kda_cp.layers.KDALayer` stacks W_q, W_k, W_v into one projection and their three
short convolutions into one; the other layouts keep them apart and name the low-rank gates
differently. The math is the same, so a state dict converts both ways without loss:

    kda_cp            fla (KimiDeltaAttention)        kimi (Kimi Linear / HF)
    qkv_proj          q_proj, k_proj, v_proj           q_proj, k_proj, v_proj
    qkv_conv [C, W]   q/k/v_conv1d [C, 1, W]           q/k/v_conv1d [C, 1, W]
    g_down, g_up      f_proj.0, f_proj.1               f_a_proj, f_b_proj
    g_up.bias         dt_bias                          dt_bias
    A_log [HV]        A_log [HV]                       A_log [1, 1, HV, 1]
    b_proj            b_proj                           b_proj
    og_proj.0, .1     g_proj.0, g_proj.1 (with bias)   g_a_proj, g_b_proj (no bias: zero)
    o_norm, o_proj    o_norm, o_proj                   o_norm, o_proj

The gate form is the layer config's (``KDAConfig.g_min``): a bound for the peer's
``safe_gate=True, lower_bound=g_min`` layers, None for the softplus gate of the released Kimi
Linear models; the weights do not say which, so set it to the checkpoint's. The layer config must
have ``output_gate_rank`` set to the checkpoint's output-gate rank (fla: head_v_dim; Kimi Linear:
head_dim), ``gate_rank`` to its decay gate's rank (fla: head_v_dim; None means head_dim), and
``num_v_heads`` to the checkpoint's value heads HV (fla's num_v_heads; HV = H without GVA).

    sd = import_kda_state_dict(fla_layer.state_dict(), config, layout="fla")
    KDALayer(config).load_state_dict(sd)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kda_cp.layers import KDAConfig

__all__ = ["LAYOUTS", "import_kda_state_dict", "export_kda_state_dict"]

LAYOUTS = ("fla", "kimi")

_GATES = {  # kda_cp name -> layout name of the two low-rank gates (and the decay gate's bias)
    "fla": {"g_down.weight": "f_proj.0.weight", "g_up.weight": "f_proj.1.weight", "g_up.bias": "dt_bias",
            "og_proj.0.weight": "g_proj.0.weight", "og_proj.1.weight": "g_proj.1.weight",
            "og_proj.1.bias": "g_proj.1.bias"},
    "kimi": {"g_down.weight": "f_a_proj.weight", "g_up.weight": "f_b_proj.weight", "g_up.bias": "dt_bias",
             "og_proj.0.weight": "g_a_proj.weight", "og_proj.1.weight": "g_b_proj.weight"},
}
_SAME = ("b_proj.weight", "o_norm.weight", "o_proj.weight")
# the config field that sets a low-rank factor's inner size, named when its shape does not fit
_RANK_FIELD = {"g_down.weight": "gate_rank", "g_up.weight": "gate_rank", "og_proj.0.weight": "output_gate_rank",
               "og_proj.1.weight": "output_gate_rank"}


def _shapes(config: KDAConfig) -> dict[str, tuple[int, ...]]:
    """The kda_cp layer's parameter shapes (the checks of both directions)."""
    c = config
    if c.output_gate_rank is None:
        raise ValueError("the fla and kimi layouts have a low-rank output gate: set KDAConfig.output_gate_rank "
                         "to its rank (fla: head_v_dim; Kimi Linear: head_dim)")
    D, H, HV, K, V = c.d_model, c.num_heads, c.v_heads, c.head_dim, c.v_dim
    R, Ro = (K if c.gate_rank is None else c.gate_rank), c.output_gate_rank
    C = 2 * H * K + HV * V
    return {"qkv_proj.weight": (C, D), "qkv_conv.weight": (C, c.conv_size),
            "g_down.weight": (R, D), "g_up.weight": (HV * K, R), "g_up.bias": (HV * K,), "A_log": (HV,),
            "b_proj.weight": (HV, D), "og_proj.0.weight": (Ro, D), "og_proj.1.weight": (HV * V, Ro),
            "og_proj.1.bias": (HV * V,), "o_norm.weight": (V,), "o_proj.weight": (D, HV * V)}


def _take(sd: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...], problems: list[str],
          ours: str | None = None):
    """sd[name] if present, a floating-point tensor of ``shape``; else None, with the problem
    appended to ``problems``. ``ours``: the kda_cp name, whose config field a shape error names."""
    if name not in sd:
        problems.append(f"missing {name!r}")
        return None
    t = sd[name]
    if not isinstance(t, torch.Tensor):
        problems.append(f"{name!r} is a {type(t).__name__}, expected a tensor")
        return None
    if not t.is_floating_point():  # load_state_dict would cast ints and bools silently
        problems.append(f"{name!r} is {t.dtype}, expected a floating-point tensor")
        return None
    if tuple(t.shape) != tuple(shape):
        field = _RANK_FIELD.get(ours or name)
        hint = f" (its rank is KDAConfig.{field}{', None: head_dim' if field == 'gate_rank' else ''})" if field else ""
        problems.append(f"{name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}{hint}")
        return None
    return t


def _raise(problems: list[str], layout: str, config: KDAConfig) -> None:
    if problems:
        raise ValueError(f"{layout} state dict does not fit the layer config (d_model={config.d_model}, num_heads="
                         f"{config.num_heads}, num_v_heads={config.v_heads}, head_dim={config.head_dim}): "
                         + "; ".join(problems))


def _check_layout(sd, layout: str, config: KDAConfig) -> None:
    if not isinstance(sd, Mapping):
        raise TypeError(f"sd must be a state dict (a mapping of names to tensors), got {type(sd).__name__}")
    if not isinstance(config, KDAConfig):
        raise TypeError(f"config must be a kda_cp.layers.KDAConfig, got {type(config).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if config.conv_size < 1:
        raise ValueError("the fla and kimi layouts have short convolutions: KDAConfig.conv_size must be >= 1")


def import_kda_state_dict(sd: Mapping[str, torch.Tensor], config: KDAConfig, layout: str = "fla"
                          ) -> dict[str, torch.Tensor]:
    """A KDALayer state dict from one layer's ``sd`` in ``layout`` ("fla" or "kimi", module
    docstring), keys without a prefix; tensors keep their dtype.

    Raises:
        TypeError: ``sd`` not a mapping or ``config`` not a KDAConfig.
        ValueError: an unknown layout; or, all in one message, missing keys, shapes that do not fit
            ``config``, tensors that are not floating point, a convolution bias (kda_cp's short
            convolution has none) and keys left over.
    """
    _check_layout(sd, layout, config)
    shapes = _shapes(config)
    c = config
    HK, HV, W = c.num_heads * c.head_dim, c.v_heads * c.v_dim, c.conv_size
    problems: list[str] = []
    used = set()

    def take(name, shape, ours=None):
        used.add(name)
        return _take(sd, name, shape, problems, ours)

    for part in ("q", "k", "v"):
        if f"{part}_conv1d.bias" in sd:
            used.add(f"{part}_conv1d.bias")
            problems.append(f"{part}_conv1d.bias is present: kda_cp's short convolution has no bias")
    parts = {"q": HK, "k": HK, "v": HV}
    proj = [take(f"{p}_proj.weight", (n, c.d_model)) for p, n in parts.items()]
    conv = [take(f"{p}_conv1d.weight", (n, 1, W)) for p, n in parts.items()]
    for what, ts in (("q/k/v_proj", proj), ("q/k/v_conv1d", conv)):  # stacked into one tensor: one dtype
        if len({x.dtype for x in ts if x is not None}) > 1:
            problems.append(f"{what} weights differ in dtype ({', '.join(str(x.dtype) for x in ts if x is not None)})")
    gates = {ours: take(theirs, shapes[ours], ours) for ours, theirs in _GATES[layout].items()}
    A_log = take("A_log", (1, 1, c.v_heads, 1) if layout == "kimi" else shapes["A_log"])
    same = {name: take(name, shapes[name]) for name in _SAME}
    left = sorted(set(sd) - used)
    if left:
        problems.append(f"keys this layer does not have: {left}")
    _raise(problems, layout, config)
    out = {"qkv_proj.weight": torch.cat(proj), "qkv_conv.weight": torch.cat([w[:, 0] for w in conv]), **gates, **same}
    out["A_log"] = A_log.reshape(c.v_heads)
    if layout == "kimi":  # no output-gate bias: zero
        out["og_proj.1.bias"] = torch.zeros(shapes["og_proj.1.bias"], dtype=out["og_proj.1.weight"].dtype)
    return {k: v.clone() for k, v in out.items()}


def export_kda_state_dict(sd: Mapping[str, torch.Tensor], config: KDAConfig, layout: str = "fla"
                          ) -> dict[str, torch.Tensor]:
    """The inverse of :func:`import_kda_state_dict`: a KDALayer state dict in ``layout``.

    Raises:
        TypeError: ``sd`` not a mapping or ``config`` not a KDAConfig.
        ValueError: an unknown layout; missing keys, shapes that do not fit ``config``, tensors
            that are not floating point or keys the layer does not have (all in one message); or
            (layout "kimi", which has no output-gate bias) a nonzero og_proj.1.bias.
    """
    _check_layout(sd, layout, config)
    shapes = _shapes(config)
    c = config
    HK = c.num_heads * c.head_dim
    problems: list[str] = []
    t = {name: _take(sd, name, shape, problems) for name, shape in shapes.items()}
    left = sorted(set(sd) - set(shapes))
    if left:
        problems.append(f"keys the layer does not have: {left}")
    _raise(problems, "kda_cp", config)
    q, k, v = t["qkv_proj.weight"].split([HK, HK, c.v_heads * c.v_dim])
    out = {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v}
    for p, w in zip("qkv", t["qkv_conv.weight"].split([HK, HK, c.v_heads * c.v_dim])):
        out[f"{p}_conv1d.weight"] = w[:, None, :]
    for ours, theirs in _GATES[layout].items():
        out[theirs] = t[ours]
    if layout == "kimi":
        if not bool((t["og_proj.1.bias"] == 0).all()):
            raise ValueError("the kimi layout has no output-gate bias, but og_proj.1.bias is not all zeros")
        out["A_log"] = t["A_log"].reshape(1, 1, c.v_heads, 1)
    else:
        out["A_log"] = t["A_log"]
    for name in _SAME:
        out[name] = t[name]
    return {k: v.clone() for k, v in out.items()}
