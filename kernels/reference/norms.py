"""Reference RMSNorm and LayerNorm over the last dimension.

Numerics: statistics and the affine transform are computed in fp32 and the result is cast back to
x's dtype (transformers casts to the input dtype before multiplying by the weight; in fp32 both
agree, in bf16 ours is the more precise). With `residual`, the sum `x + residual` is rounded to
x's dtype first and that rounded sum is normalised, so the fused path equals the unfused
`h = x + residual; rms_norm(h)` a model would otherwise write.
"""
from typing import Optional, Union

import torch


def _check_weight(name: str, x: torch.Tensor, weight: Optional[torch.Tensor], what: str) -> None:
    if weight is not None and weight.shape != (x.shape[-1],):
        raise ValueError(f"{name}: {what} shape {tuple(weight.shape)} does not match hidden size {x.shape[-1]}")


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """y = x / sqrt(mean(x^2) + eps) * weight; with residual returns (rms_norm(x + residual), x + residual)."""
    _check_weight("rms_norm", x, weight, "weight")
    summed = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        summed = (x.float() + residual.float()).to(x.dtype)
        x = summed
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    out = out.to(x.dtype)
    return out if summed is None else (out, summed)


def layer_norm(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    """y = (x - mean) / sqrt(var + eps) * weight + bias (biased variance, as nn.LayerNorm); weight/bias may be None."""
    _check_weight("layer_norm", x, weight, "weight")
    _check_weight("layer_norm", x, bias, "bias")
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    out = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        out = out * weight.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
