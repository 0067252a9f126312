"""Loading the ports' trained models from a checkpoint, offline when asked to, with errors that say what is missing.

``load("enformer" | "borzoi", checkpoint)``: a local directory written by ``save_pretrained`` (``config.json`` and
the weights) or a Hugging Face repository id (``"EleutherAI/enformer-official-rough"``,
``"johahi/borzoi-replicate-0"``). With ``HF_HUB_OFFLINE=1`` a repository id is read from the local Hugging Face cache
only (``local_files_only=True``): nothing is downloaded, and a checkpoint that is not in the cache raises
``FileNotFoundError`` naming the repository, the cache looked in and how to fill it.

``load("alphagenome", checkpoint)``: a weights file (``.pth``, ``.pt`` or ``.safetensors``) written by the port's
``convert_weights.py``; alphagenome-pytorch loads no repository id.

The model comes back in eval mode, on ``device`` when given, ready for :func:`kvbound.patch`.
"""

from __future__ import annotations

import importlib
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

from torch import nn

__all__ = ["PORT_CHECKPOINTS", "hub_offline", "load"]


@dataclass(frozen=True)
class _Loader:
    package: str
    class_name: str
    install: str
    hub: bool  # loads Hugging Face repository ids (save_pretrained directories) rather than a weights file


PORT_CHECKPOINTS = {
    "enformer": _Loader("enformer_pytorch", "Enformer", 'pip install "kvbound[models]"', hub=True),
    "borzoi": _Loader("borzoi_pytorch", "Borzoi", "pip install --no-deps borzoi-pytorch==0.5.1", hub=True),
    "alphagenome": _Loader("alphagenome_pytorch", "AlphaGenome",
                           "pip install --no-deps --ignore-requires-python alphagenome-pytorch==0.3.1", hub=False),
}  # fmt: skip
_WEIGHT_SUFFIXES = (".pth", ".pt", ".safetensors")


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` asks for no hub access (``1``, ``true``, ``on``, ``yes``; read at each call)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "on", "yes"}


def _looks_like_repo_id(text: str) -> bool:
    """``owner/name``: one slash, neither part empty nor a path step (``.``, ``..``, ``~``)."""
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not any(p in {".", ".."} or p.startswith("~") for p in parts)


def _port_class(port: str) -> tuple[_Loader, type]:
    if port not in PORT_CHECKPOINTS:
        raise ValueError(f"port: expected one of {sorted(PORT_CHECKPOINTS)}, got {port!r}")
    loader = PORT_CHECKPOINTS[port]
    try:
        module = importlib.import_module(loader.package)
    except ImportError as err:
        raise ImportError(f"{port}: the port {loader.package} is not installed ({loader.install}; "
                          f"src/kvbound/models/README.md, 'Installing the ports'): {err}") from err  # fmt: skip
    return loader, getattr(module, loader.class_name)


def _weight_names(kwargs: dict) -> list[str]:
    """The weight files ``from_pretrained`` (transformers' ``PreTrainedModel``, which Enformer and Borzoi are) reads
    from a ``save_pretrained`` directory, given its ``variant``, ``use_safetensors``, ``from_tf`` and ``from_flax``."""
    variant = kwargs.get("variant")

    def named(name: str) -> str:  # transformers' _add_variant: "model.safetensors" -> "model.<variant>.safetensors"
        stem, _, suffix = name.rpartition(".")
        return f"{stem}.{variant}.{suffix}" if variant else name

    use_safetensors = kwargs.get("use_safetensors")
    names = []
    if kwargs.get("from_tf"):
        names += ["model.ckpt.index", "tf_model.h5"]
    if kwargs.get("from_flax"):
        names += ["flax_model.msgpack"]
    if use_safetensors is not False:
        names += [named("model.safetensors"), named("model.safetensors.index.json")]
    if not use_safetensors:
        names += [named("pytorch_model.bin"), named("pytorch_model.bin.index.json")]
    return names


def _hub_model(port: str, cls: type, checkpoint: str, kwargs: dict) -> nn.Module:
    path = Path(checkpoint).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(f"{port} checkpoint {str(path)!r}: expected a directory written by "
                                    f"save_pretrained (config.json and the weights), got a file")  # fmt: skip
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{port} checkpoint {str(path)!r}: no config.json in this directory (expected "
                                    f"one written by save_pretrained)")  # fmt: skip
        try:
            return cls.from_pretrained(str(path), **kwargs)
        except OSError as err:  # transformers raises OSError (EnvironmentError) for a directory without weights
            folder = path / kwargs.get("subfolder", "")
            names = _weight_names(kwargs)
            if any((folder / name).is_file() for name in names):
                raise
            raise FileNotFoundError(f"{port} checkpoint {str(folder)!r}: config.json but no weights in this "
                                    f"directory (looked for {', '.join(names)}; expected a directory written by "
                                    f"save_pretrained)") from err  # fmt: skip
    if not _looks_like_repo_id(checkpoint):
        raise FileNotFoundError(f"{port} checkpoint {checkpoint!r}: no such directory (and not a Hugging Face "
                                f"repository id of the form owner/name)")  # fmt: skip
    offline = hub_offline()
    if offline:
        kwargs = {**kwargs, "local_files_only": True}
    try:
        return cls.from_pretrained(checkpoint, **kwargs)
    except OSError as err:  # transformers raises OSError (EnvironmentError) for a repository it cannot resolve
        from huggingface_hub import constants

        cache = kwargs.get("cache_dir") or constants.HF_HUB_CACHE
        if offline:
            why = (f"not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE=1 forbids downloading it; "
                   f"run once with network access to fill the cache, or pass a directory written by save_pretrained")
        else:
            why = "could not be downloaded or found in the cache"
        raise FileNotFoundError(f"{port} checkpoint {checkpoint!r}: {why} ({type(err).__name__}: "
                                f"{str(err).splitlines()[0][:200] if str(err) else ''})") from err  # fmt: skip


def _weights_file_model(port: str, cls: type, checkpoint: str, device, kwargs: dict) -> nn.Module:
    path = Path(checkpoint).expanduser()
    if not path.is_file():
        where = "a directory" if path.is_dir() else "no such file"
        kinds = ", ".join(_WEIGHT_SUFFIXES)
        raise FileNotFoundError(f"{port} checkpoint {str(path)!r}: expected a weights file ({kinds}) written by the "
                                f"port's convert_weights.py, got {where}")  # fmt: skip
    if path.suffix not in _WEIGHT_SUFFIXES:
        raise ValueError(f"{port} checkpoint {str(path)!r}: expected a suffix in {_WEIGHT_SUFFIXES}, got "
                         f"{path.suffix!r}")  # fmt: skip
    from safetensors import SafetensorError

    try:
        return cls.from_pretrained(str(path), device=device, **kwargs)
    except (SafetensorError, EOFError, pickle.UnpicklingError) as err:  # (torch.load's errors on a damaged file)
        raise ValueError(f"{port} checkpoint {str(path)!r}: not a readable weights file ({type(err).__name__}: "
                         f"{err})") from None  # fmt: skip


def load(port: str, checkpoint: str | os.PathLike, *, device=None, **kwargs) -> nn.Module:
    """A port's trained model from ``checkpoint``, in eval mode (see the module's docstring for what each port reads).

    Args:
        port: ``"enformer"``, ``"borzoi"`` or ``"alphagenome"``.
        checkpoint: a ``save_pretrained`` directory or a repository id (Enformer, Borzoi), or a weights file
            (AlphaGenome).
        device: where the model goes (default: where the port puts it, the CPU).
        **kwargs: passed to the port's ``from_pretrained`` (``use_tf_gamma``, ``cache_dir``, ``dtype_policy``...).

    Raises:
        TypeError: ``checkpoint`` is not a path or a string.
        ValueError: an unknown port, an empty ``checkpoint``, a weights file of another kind, or one that cannot be
            read (damaged or not a weights file).
        ImportError: the port is not installed (the message says how to install it).
        FileNotFoundError: the checkpoint cannot be found, or, with ``HF_HUB_OFFLINE=1``, is not in the local cache.
    """
    if isinstance(checkpoint, os.PathLike):
        checkpoint = os.fspath(checkpoint)
    if not isinstance(checkpoint, str):
        got = "None" if checkpoint is None else type(checkpoint).__name__
        raise TypeError(f"checkpoint: expected a path or repository id, got {got}")
    if not checkpoint:
        raise ValueError("checkpoint: expected a path or repository id, got ''")
    loader, cls = _port_class(port)
    if loader.hub:
        model = _hub_model(port, cls, checkpoint, dict(kwargs))
        if device is not None:
            model = model.to(device)
    else:
        model = _weights_file_model(port, cls, checkpoint, device, dict(kwargs))
    return model.eval()
