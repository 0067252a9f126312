"""K/V hooks for the compact models, installed per model instance and removed by the returned handle.

* :class:`CompressedKVHook`: K and V of every layer go through ``kvbound.compress_kv(...).decompress()``
  (in bfloat16, the dtype the models run in on the GPU, so ratios are against bf16 storage); the measured
  error is checked against the certified bound ``tau`` on the exact values returned.
* :class:`LowRankOnlyHook`: the ablation "low-rank part only, residual dropped": ``x P^T P`` with the same
  calibrated per-head basis ``P`` (or a per-block truncated SVD without one). No bound.
* :class:`RoundingHook`: K and V rounded to bfloat16 only (ratio 1): the floor every setting shares.
* :class:`RecordingHook`: keeps K and V per layer (for :func:`calibrate_bases`).
* :class:`LogitProbe`: wraps a :class:`CompressedKVHook` and the attention function to measure, per layer,
  the largest query 1-norm and the largest change of a logit caused by the compressed K, next to the Hoelder
  bound ``|q . (k - k_hat)| <= ||q||_1 * max |k - k_hat| <= ||q||_1 * tau``.

``install(model, hook, attention_fn=None)`` sets the hook (and optionally a replacement attention function,
e.g. a fused kernel with the same signature as the model's eager one) on every attention layer and returns a
:class:`HookHandle`; ``handle.remove()`` (or leaving its ``with`` block) restores what was there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvbound.eval.models import TrackModel, _HookedAttention

__all__ = [
    "CompressedKVHook",
    "HookHandle",
    "KVStats",
    "LogitProbe",
    "LowRankOnlyHook",
    "RecordingHook",
    "RoundingHook",
    "calibrate_bases",
    "install",
]

STORAGE_DTYPE = torch.bfloat16


@dataclass
class HookHandle:
    layers: list[_HookedAttention]
    previous: list[tuple[object, Callable]]

    def remove(self) -> None:
        for layer, (hook, attention_fn) in zip(self.layers, self.previous, strict=True):
            layer.kv_hook = hook
            layer.attention_fn = attention_fn
        self.layers, self.previous = [], []

    def __enter__(self) -> HookHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def install(model: TrackModel, hook, attention_fn: Callable | None = None) -> HookHandle:
    """Set ``hook`` (and ``attention_fn`` if given) on every attention layer of this model instance."""
    layers = [module for module in model.modules() if isinstance(module, _HookedAttention)]
    if not layers:
        raise ValueError("model: expected attention layers to hook, found none")
    previous = [(layer.kv_hook, layer.attention_fn) for layer in layers]
    for layer in layers:
        layer.kv_hook = hook
        if attention_fn is not None:
            layer.attention_fn = attention_fn
    return HookHandle(layers, previous)


@dataclass
class KVStats:
    """Bytes and errors accumulated over every call, per tensor kind ("k", "v")."""

    dense_bytes: dict[str, int] = field(default_factory=lambda: {"k": 0, "v": 0})
    stored_bytes: dict[str, int] = field(default_factory=lambda: {"k": 0, "v": 0})
    max_abs_error: dict[str, float] = field(default_factory=lambda: {"k": 0.0, "v": 0.0})
    calls: int = 0
    bound_violations: int = 0
    encoder_fallback: str = ""  # why impl="auto" fell back to the eager encoder, if it did
    # blocks per storage mode (codec only): lowrank, packed, promoted, raw
    mode_blocks: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("lowrank", "packed", "promoted", "raw"), 0)
    )

    def mode_shares(self) -> dict[str, float]:
        total = sum(self.mode_blocks.values())
        return {name: (count / total if total else float("nan")) for name, count in self.mode_blocks.items()}

    def add(self, name: str, dense: int, stored: int, error: float) -> None:
        self.dense_bytes[name] += dense
        self.stored_bytes[name] += stored
        self.max_abs_error[name] = max(self.max_abs_error[name], error)

    def ratio(self, name: str | None = None) -> float:
        names = ("k", "v") if name is None else (name,)
        stored = sum(self.stored_bytes[n] for n in names)
        return sum(self.dense_bytes[n] for n in names) / stored if stored else float("nan")


def _dense_bytes(x: torch.Tensor) -> int:
    return x.numel() * torch.empty((), dtype=STORAGE_DTYPE).element_size()


class CompressedKVHook:
    """Replace K and V by ``compress_kv(x.to(bf16), config, basis).decompress()`` (``storage``: another dtype to
    encode from instead of bfloat16, e.g. float32 to encode a float32 forward's K/V as they are; the compression
    ratio is still counted against bfloat16 K/V).

    ``anchored`` ("codes" or "changes"): while ``anchor_index`` is set (one entry per batch item: the item of the
    same batch whose encoding it follows, -1 for a reference), each item is encoded against its reference item's
    blocks (``kvbound.codec.anchored``): "codes" keeps the reference's codes wherever they still certify the item
    (no change below the bound's slack survives), "changes" follows the change of the K/V (the reference's values
    are in the batch): coefficients moved by the change projected on the basis, codes by the rounded remainder.
    Same format, same certified bound.

    ``bases``: ``{(layer_index, "k" | "v"): kvbound.Basis}`` from :func:`calibrate_bases` (shared per-head
    projections); missing entries use the codec's per-block SVD. ``strict``: raise if an element misses the
    bound (otherwise count it in ``stats.bound_violations``). ``impl``: the encoder, passed to ``compress_kv``;
    ``"auto"``: Triton on CUDA with a basis and rank >= 1, else eager; if Triton raises, the eager encoder
    (same format, same certificate) takes over and ``stats.encoder_fallback`` records why.
    """

    def __init__(
        self,
        config,
        bases: dict | None = None,
        *,
        strict: bool = True,
        impl: str = "eager",
        anchored: str = "",
        storage: torch.dtype | None = None,
    ):
        if anchored not in ("", "codes", "changes"):
            raise ValueError(f"anchored: expected '', 'codes' or 'changes', got {anchored!r}")
        if storage is not None and storage not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"storage: expected float16, bfloat16 or float32, got {storage}")
        self.storage = STORAGE_DTYPE if storage is None else storage
        self.config = config
        self.bases = bases or {}
        self.strict = strict
        self.impl = impl
        # anchored: batches of paired forwards encode each item against its reference item's blocks
        # (``kvbound.codec.anchored``); ``anchor_index`` ([B], -1 for a reference) says which, per batch
        self.anchored = anchored
        self.anchor_index: list[int] | None = None
        self.stats = KVStats()
        # the decoded values of the last call (float32, before the cast to the model's dtype): the values
        # the bound is certified on
        self.last_decoded: dict[str, torch.Tensor] = {}
        # max |x - x_hat| of the last call per tensor (x in ``storage``, against ``last_decoded``; NaN propagates)
        self.last_error: dict[str, float] = {}

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.stats.calls += 1
        return self._one(layer, "k", k), self._one(layer, "v", v)

    def _one(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
        import kvbound

        stored = x.detach().to(self.storage)
        basis = self.bases.get((layer, name))
        impl = self.impl
        if impl == "auto":  # the fused encoder where it applies, as kvbound.patch chooses
            impl = "triton" if stored.is_cuda and basis is not None and self.config.rank > 0 else "eager"
        try:
            compressed = kvbound.compress_kv(stored, self.config, basis=basis, impl=impl)
        except Exception as error:  # "auto" only: the eager encoder stores the same format; say so, once
            if self.impl != "auto" or impl == "eager":
                raise
            self.impl = "eager"
            self.stats.encoder_fallback = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            print(f"CompressedKVHook: the Triton encoder failed ({self.stats.encoder_fallback}); using the eager one")
            compressed = kvbound.compress_kv(stored, self.config, basis=basis, impl="eager")
        if self.anchored and self.anchor_index is not None:
            from kvbound.codec.anchored import encode_anchored

            index = torch.tensor(self.anchor_index, dtype=torch.int64, device=stored.device)
            source = stored if self.anchored == "changes" else None
            try:
                compressed = encode_anchored(stored, compressed, compressed, index, source, check_fresh=False)
            except ValueError as error:
                raise ValueError(f"layer {layer} {name}: {error}") from error
        restored = compressed.decompress().to(x.device)
        self.last_decoded[name] = restored
        error = float((restored.double() - stored.double()).abs().max().item())
        self.last_error[name] = error
        if not error <= self.config.tau:  # also catches NaN
            self.stats.bound_violations += 1
            if self.strict:
                raise ValueError(f"layer {layer} {name}: max |x - x_hat| = {error} exceeds tau = {self.config.tau}")
        self.stats.add(name, _dense_bytes(stored), compressed.nbytes, error)
        blocks = compressed.mode.numel()
        for mode, share in compressed.mode_fractions().items():
            self.stats.mode_blocks[mode] += round(share * blocks)
        return restored.to(x.dtype)


class LowRankOnlyHook:
    """Keep only the rank-``rank`` part: ``x P^T P`` with a calibrated basis, else a per-block truncated SVD.

    Stored bytes count fp16 coefficients (``N x r`` per head) plus the basis (``r x D`` per head, or per
    block without a calibrated basis). There is no error bound.
    """

    def __init__(self, rank: int, block_size: int = 128, bases: dict | None = None):
        if rank < 1:
            raise ValueError(f"rank: expected >= 1, got {rank}")
        self.rank = rank
        self.block_size = block_size
        self.bases = bases or {}
        self.stats = KVStats()

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.stats.calls += 1
        return self._one(layer, "k", k), self._one(layer, "v", v)

    def _one(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
        stored = x.detach().to(STORAGE_DTYPE).float()
        b, h, n, d = stored.shape
        basis = self.bases.get((layer, name))
        if basis is not None:
            projection = basis.projection.to(device=x.device, dtype=torch.float32)  # [H, r, D]
            restored = torch.einsum("bhnd,hrd,hre->bhne", stored, projection, projection)
            stored_bytes = 2 * (b * h * n * self.rank) + 2 * h * self.rank * d
        else:
            restored = torch.empty_like(stored)
            blocks = 0
            for start in range(0, n, self.block_size):
                block = stored[:, :, start : start + self.block_size].double()
                u, s, vh = torch.linalg.svd(block, full_matrices=False)
                r = min(self.rank, s.shape[-1])
                restored[:, :, start : start + self.block_size] = (
                    (u[..., :r] * s[..., None, :r]) @ vh[..., :r, :]
                ).float()
                blocks += 1
            stored_bytes = 2 * (b * h * n * self.rank) + 2 * b * h * blocks * self.rank * d
        error = float((restored - stored).abs().max().item())
        self.stats.add(name, _dense_bytes(stored), stored_bytes, error)
        return restored.to(x.dtype)


class RoundingHook:
    """K and V rounded to bfloat16 (what every compressed setting starts from)."""

    def __init__(self):
        self.stats = KVStats()

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.stats.calls += 1
        out = []
        for name, x in (("k", k), ("v", v)):
            rounded = x.to(STORAGE_DTYPE)
            self.stats.add(
                name,
                _dense_bytes(rounded),
                _dense_bytes(rounded),
                float((rounded.double() - x.double()).abs().max().item()),
            )
            out.append(rounded.to(x.dtype))
        return out[0], out[1]


class RecordingHook:
    """Keep (bf16 copies of) K and V per layer, unchanged."""

    def __init__(self):
        self.samples: dict[tuple[int, str], list[torch.Tensor]] = {}

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for name, x in (("k", k), ("v", v)):
            self.samples.setdefault((layer, name), []).append(x.detach().to(STORAGE_DTYPE))
        return k, v


@torch.no_grad()
def calibrate_bases(model: TrackModel, inputs: list[torch.Tensor], config) -> dict:
    """``{(layer, "k" | "v"): kvbound.Basis}`` fitted with ``kvbound.calibrate`` on K/V of ``inputs``."""
    import kvbound

    if config.rank == 0:
        return {}
    recorder = RecordingHook()
    with install(model, recorder):
        for batch in inputs:
            model(batch)
    return {key: kvbound.calibrate(samples, config) for key, samples in recorder.samples.items()}


class LogitProbe:
    """Measure what compressed K does to the logits, layer by layer, under ``hook`` (a :class:`CompressedKVHook`).

    Install ``probe.kv_hook`` as the K/V hook and ``probe.attention_fn(model)`` as the attention function. For
    each call the effective query ``q_eff`` (the vector that multiplies K inside the logits, softmax scale
    included) is compared, in float64, against the bf16 K the codec stored and the K it returned:

    * Enformer: ``q_eff = q * dk**-0.5 + u`` (the content term; the position term does not involve K);
    * AlphaGenome: ``q_eff = q * dk**-0.5``; the logit error is measured before the soft-cap, which is
      1-Lipschitz, so the capped logits move by no more.

    The bound is certified on the decoded values (float32, ``hook.last_decoded``); the model then consumes
    them in its own dtype (bf16 under autocast), whose rounding is a separate, uncertified error:
    ``max_logit_error_consumed`` measures the logit change with the K the model actually used.

    ``records[layer]`` keeps the maxima over all calls: ``max_q_l1`` (``max ||q_eff||_1`` over rows),
    ``max_abs_error_k``, ``max_abs_error_v``, ``max_logit_error``, ``max_logit_error_consumed``, and two counts:
    ``bound_violations`` (decoded K and V tensors with an element beyond tau, as ``hook.stats`` counts them) and
    ``logit_violations`` (calls whose logit error exceeds ``||q_eff||_1 * tau`` in some row; a K beyond tau need
    not cause one, since it depends on the queries). The model then runs on the compressed K and V, as with
    ``hook`` alone.
    """

    def __init__(self, hook: CompressedKVHook, kind: str):
        if kind not in ("enformer", "alphagenome"):
            raise ValueError(f"kind: expected 'enformer' or 'alphagenome', got {kind!r}")
        self.hook = hook
        self.kind = kind
        self.records: dict[int, dict] = {}
        self._pending: tuple[int, torch.Tensor] | None = None

    def kv_hook(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_hat, v_hat = self.hook(layer, k, v)
        self._pending = (layer, k.detach().to(self.hook.storage), self.hook.last_decoded["k"])
        record = self._record(layer, k.shape[-1])
        tau = self.hook.config.tau
        for name in ("k", "v"):
            error = self.hook.last_error[name]
            record[f"max_abs_error_{name}"] = max(record[f"max_abs_error_{name}"], error)
            record["bound_violations"] += int(not error <= tau)  # also counts NaN
        return k_hat, v_hat

    def _record(self, layer: int, dk: int) -> dict:
        return self.records.setdefault(
            layer,
            {
                "max_q_l1": 0.0,
                "max_abs_error_k": 0.0,
                "max_abs_error_v": 0.0,
                "max_logit_error": 0.0,
                "max_logit_error_consumed": 0.0,
                "bound_violations": 0,
                "logit_violations": 0,
                "softmax_scale": dk**-0.5,
            },
        )

    def attention_fn(self, model: TrackModel) -> Callable:
        layers = [module for module in model.modules() if isinstance(module, _HookedAttention)]
        if not layers:
            raise ValueError("model: expected attention layers to probe, found none")
        original = layers[0].attention_fn

        def probed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest):
            if self._pending is None:
                raise RuntimeError("LogitProbe: attention ran without its K/V hook; install probe.kv_hook too")
            layer, k_stored, k_decoded = self._pending
            self._pending = None
            self._measure(layer, q, k_stored, k_decoded, k, rest)
            return original(q, k, v, *rest)

        return probed

    @torch.no_grad()
    def _measure(self, layer, q, k_stored, k_decoded, k_consumed, rest) -> None:
        dk = q.shape[-1]
        if self.kind == "enformer":
            query = q.double() + rest[1].double()[:, None]  # q arrives scaled by dk**-0.5; + content bias u
            pattern = "bhid,bhjd->bhij"
        else:
            query = q.double() * dk**-0.5
            pattern = "bhid,bjd->bhij"  # one K head, shared by all query heads
            k_stored, k_decoded, k_consumed = k_stored[:, 0], k_decoded[:, 0], k_consumed[:, 0]
        delta = k_stored.double() - k_decoded.double()
        row_error = torch.einsum(pattern, query, delta).abs().amax(-1)  # [B, H, N]
        consumed = torch.einsum(pattern, query, k_stored.double() - k_consumed.double()).abs().amax(-1)
        q_l1 = query.abs().sum(-1)  # [B, H, N]
        if not bool(torch.isfinite(row_error).all() and torch.isfinite(consumed).all()):
            raise FloatingPointError(f"layer {layer}: logit error has NaN or Inf")
        tau = self.hook.config.tau
        record = self._record(layer, dk)
        record["max_q_l1"] = max(record["max_q_l1"], float(q_l1.max()))
        record["max_logit_error"] = max(record["max_logit_error"], float(row_error.max()))
        record["max_logit_error_consumed"] = max(record["max_logit_error_consumed"], float(consumed.max()))
        # the bound holds row by row: |q_i . (k_j - k_hat_j)| <= ||q_i||_1 * tau (tiny slack for float64 sums)
        record["logit_violations"] += int((row_error > q_l1 * tau * (1 + 1e-12) + 1e-12).any())
