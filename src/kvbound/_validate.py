"""Input checks shared by the public functions. Errors name the tensor, what was expected and what was given."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# What float64 references, biases and measurements also accept.
FLOAT_DTYPES_AND_64 = (*FLOAT_DTYPES, torch.float64)


def check_tensor(
    x: object,
    name: str,
    *,
    ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    allow_empty: bool = False,
    check_finite: bool = True,
) -> torch.Tensor:
    """Validate ``x`` and return it unchanged."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got {x.dim()} (shape {tuple(x.shape)})")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name}: expected dtype in ({names}), got {str(x.dtype).removeprefix('torch.')}")
    if not allow_empty and x.numel() == 0:
        raise ValueError(f"{name}: expected a non-empty tensor, got shape {tuple(x.shape)}")
    if check_finite:
        check_finite_values(x, name)
    return x


def check_finite_values(x: torch.Tensor, name: str) -> None:
    """Raise ValueError naming the first NaN/Inf element of ``x``."""
    if not x.is_floating_point():
        return
    finite = torch.isfinite(x)
    if bool(finite.all()):
        return
    first = torch.nonzero(~finite.reshape(-1), as_tuple=False)[0, 0].item()
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), x.shape))
    value = x.reshape(-1)[first].item()
    count = int((~finite).sum().item())
    raise ValueError(f"{name}: expected finite values, found {value} at index {index} ({count} non-finite in all)")

