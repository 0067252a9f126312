"""kvbound.models.load: the ports' trained models from a checkpoint, offline when HF_HUB_OFFLINE=1 says so, and an
error that names what is missing when a checkpoint cannot be found. CPU only: tiny Enformer and Borzoi models are
written with ``save_pretrained`` and read back; AlphaGenome's full model is not built (its loader is stood in for)."""

from __future__ import annotations

import re
import socket

import pytest
import torch

from kvbound.models import checkpoints, hub_offline, load


def _no_network(monkeypatch) -> list:
    """Every socket connection attempt raises, and is recorded."""
    attempts = []

    def refuse(self, address, *args, **kwargs):
        attempts.append(address)
        raise OSError(f"network access attempted: {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


def _tiny_enformer():
    enformer_pytorch = pytest.importorskip("enformer_pytorch")
    torch.manual_seed(0)
    return enformer_pytorch.Enformer.from_hparams(dim=96, depth=1, heads=4, attn_dim_key=16, num_downsamples=3,
                                                  dim_divisible_by=8, target_length=-1, output_heads=dict(human=8))


def test_enformer_and_borzoi_round_trip_through_save_pretrained(tmp_path, monkeypatch):
    attempts = _no_network(monkeypatch)
    model = _tiny_enformer().train()
    model.save_pretrained(tmp_path / "enformer", safe_serialization=False)  # its trunk shares tensors by name
    loaded = load("enformer", tmp_path / "enformer")
    assert type(loaded) is type(model) and not loaded.training
    expected = model.state_dict()
    got = loaded.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)

    borzoi_pytorch = pytest.importorskip("borzoi_pytorch")
    from borzoi_pytorch.config_borzoi import BorzoiConfig

    borzoi = borzoi_pytorch.Borzoi(BorzoiConfig(dim=64, depth=1, heads=2, attn_dim_key=8, attn_dim_value=16,
                                                bins_to_return=64))  # fmt: skip
    borzoi.save_pretrained(str(tmp_path / "borzoi"))
    again = load("borzoi", str(tmp_path / "borzoi"), device="cpu")
    assert type(again) is type(borzoi) and not again.training
    assert all(torch.equal(again.state_dict()[k], v) for k, v in borzoi.state_dict().items())
    assert attempts == []


def test_offline_repository_id_not_in_the_cache_names_what_is_missing(tmp_path, monkeypatch):
    pytest.importorskip("enformer_pytorch")
    attempts = _no_network(monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_offline()
    with pytest.raises(FileNotFoundError) as info:
        load("enformer", "EleutherAI/enformer-official-rough", cache_dir=str(tmp_path / "empty-cache"))
    text = str(info.value)
    assert "'EleutherAI/enformer-official-rough'" in text and "HF_HUB_OFFLINE=1" in text
    assert str(tmp_path / "empty-cache") in text and "save_pretrained" in text
    assert attempts == []  # nothing was asked of the network


def test_offline_reads_the_cache_only(monkeypatch):
    """With HF_HUB_OFFLINE set, a repository id goes to ``from_pretrained`` with ``local_files_only=True``; without
    it, as given."""
    enformer_pytorch = pytest.importorskip("enformer_pytorch")
    calls = []

    def from_pretrained(name, **kwargs):
        calls.append((name, kwargs))
        return torch.nn.Linear(2, 2).train()

    monkeypatch.setattr(enformer_pytorch.Enformer, "from_pretrained", staticmethod(from_pretrained))
    for value, offline in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        model = load("enformer", "EleutherAI/enformer-official-rough", use_tf_gamma=False)
        assert not model.training
        assert calls[-1] == ("EleutherAI/enformer-official-rough",
                             {"use_tf_gamma": False, **({"local_files_only": True} if offline else {})})  # fmt: skip


def test_missing_and_malformed_checkpoints_are_named(tmp_path):
    pytest.importorskip("enformer_pytorch")
    with pytest.raises(FileNotFoundError, match=r"enformer checkpoint '.*nowhere/at/all': no such directory"):
        load("enformer", tmp_path / "nowhere" / "at" / "all")
    (tmp_path / "bare").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no config.json in this directory"):
        load("enformer", tmp_path / "bare")
    (tmp_path / "weights.pth").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"expected a directory written by save_pretrained .*got a file"):
        load("enformer", tmp_path / "weights.pth")
    with pytest.raises(ValueError, match=r"port: expected one of \['alphagenome', 'borzoi', 'enformer'\], got 'gpt'"):
        load("gpt", tmp_path)


def test_alphagenome_reads_a_weights_file_only(tmp_path, monkeypatch):
    alphagenome_pytorch = pytest.importorskip("alphagenome_pytorch")
    calls = []

    def from_pretrained(path, device=None, **kwargs):
        calls.append((path, device, kwargs))
        return torch.nn.Linear(2, 2).train()

    monkeypatch.setattr(alphagenome_pytorch.AlphaGenome, "from_pretrained", staticmethod(from_pretrained))
    with pytest.raises(FileNotFoundError, match=r"expected a weights file \(\.pth, \.pt, \.safetensors\).*no such"):
        load("alphagenome", tmp_path / "model.pth")
    with pytest.raises(FileNotFoundError, match=r"got a directory"):
        load("alphagenome", tmp_path)
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"expected a suffix in \('\.pth', '\.pt', '\.safetensors'\), got '\.bin'"):
        load("alphagenome", tmp_path / "model.bin")
    assert calls == []
    (tmp_path / "model.safetensors").write_bytes(b"")
    model = load("alphagenome", tmp_path / "model.safetensors", device="cpu", num_organisms=2)
    assert not model.training
    assert calls == [(str(tmp_path / "model.safetensors"), "cpu", {"num_organisms": 2})]


def test_alphagenome_weights_file_that_cannot_be_read_is_named(tmp_path):
    pytest.importorskip("alphagenome_pytorch")
    for name in ("model.safetensors", "model.pt"):
        (tmp_path / name).write_bytes(b"garbage")
        with pytest.raises(ValueError, match=rf"^alphagenome checkpoint '.*{name}': not a readable weights file \("):
            load("alphagenome", tmp_path / name)


def test_a_port_that_is_not_installed_says_how_to_install_it(monkeypatch):
    real = checkpoints.importlib.import_module

    def missing(name, *args, **kwargs):
        if name == "borzoi_pytorch":
            raise ModuleNotFoundError("No module named 'borzoi_pytorch'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(checkpoints.importlib, "import_module", missing)
    with pytest.raises(ImportError, match=r"borzoi: the port borzoi_pytorch is not installed \(pip install --no-deps"):
        load("borzoi", "johahi/borzoi-replicate-0")


def test_models_suite_runs_trained_weights_from_a_checkpoint(tmp_path):
    """``kvbound bench --suite models --checkpoint enformer=DIR``: the suite loads the model through ``load``
    (its output is the saved model's, not a random one's) and says so in the note; a missing checkpoint gives
    ``error`` rows that name it."""
    pytest.importorskip("enformer_pytorch")
    import kvbound
    from kvbound.bench import cli, ports

    spec = next(s for s in ports.port_models(cpu_smoke=True) if s.name == "enformer-tiny")
    torch.manual_seed(123)
    saved = spec.build()
    saved.save_pretrained(tmp_path / "tiny", safe_serialization=False)
    options = ports.ModelOptions(warmup=0, repeats=1, batches=(1,), variants=("unpatched", "patch-dense"),
                                 checkpoints={"enformer-tiny": str(tmp_path / "tiny")})  # fmt: skip
    config = kvbound.CompressionConfig(block_size=16, rank=4, bits=4)
    rows = list(ports.model_rows((spec,), torch.device("cpu"), config, options))
    assert [(r["provider"], r["status"]) for r in rows] == [("unpatched", "ok"), ("patch-dense", "ok")]
    assert rows[0]["note"] == f"trained weights: {tmp_path / 'tiny'} (kvbound.models.load)"
    expected = ports._forward(spec, saved.eval(), spec.make_input(1, options.seed + 1, torch.device("cpu")),
                              torch.device("cpu"))  # fmt: skip
    assert rows[0]["ref_max_abs"] == float(expected.abs().max())
    missing = ports.ModelOptions(warmup=0, repeats=1, batches=(1,), variants=("unpatched",),
                                 checkpoints={"enformer-tiny": str(tmp_path / "absent")})  # fmt: skip
    (row,) = ports.model_rows((spec,), torch.device("cpu"), config, missing)
    assert row["status"] == "error" and "building the model: FileNotFoundError" in row["reason"]
    assert "absent" in row["reason"]
    out = tmp_path / "m.csv"
    for bad in ("enformer-tiny", "gpt=x", "enformer-tiny="):
        assert cli.main(["--suite", "models", "--cpu-smoke", "--only", "enformer*", "--out", str(out),
                         "--checkpoint", bad]) == 2  # fmt: skip
    assert not out.exists()


def test_a_checkpoint_that_is_not_a_path_is_named():
    for bad, got in ((None, "None"), (3, "int"), (b"dir", "bytes"), (["dir"], "list")):
        with pytest.raises(TypeError, match=rf"^checkpoint: expected a path or repository id, got {got}$"):
            load("enformer", bad)
    with pytest.raises(ValueError, match=r"^checkpoint: expected a path or repository id, got ''$"):
        load("enformer", "")


def test_a_directory_with_config_but_no_weights_names_the_files_looked_for(tmp_path, monkeypatch):
    enformer_pytorch = pytest.importorskip("enformer_pytorch")
    _no_network(monkeypatch)
    enformer_pytorch.EnformerConfig(dim=96, depth=1, heads=4, attn_dim_key=16, num_downsamples=3,
                                    dim_divisible_by=8, target_length=-1, output_heads=dict(human=8)
                                    ).save_pretrained(tmp_path)  # fmt: skip
    with pytest.raises(FileNotFoundError) as info:
        load("enformer", tmp_path)
    assert re.fullmatch(
        rf"enformer checkpoint '{re.escape(str(tmp_path))}': config.json but no weights in this directory \(looked "
        r"for model.safetensors, model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json; "
        r"expected a directory written by save_pretrained\)", str(info.value))
    assert isinstance(info.value.__cause__, OSError)  # transformers' own error, kept as the cause
    with pytest.raises(FileNotFoundError, match=r"looked for model.safetensors, model.safetensors.index.json;"):
        load("enformer", tmp_path, use_safetensors=True)
    with pytest.raises(FileNotFoundError, match=r"looked for model.fp16.safetensors, .*pytorch_model.fp16.bin"):
        load("enformer", tmp_path, variant="fp16")
