"""Failures a user can act on: out of memory in any stage is one paragraph naming the stage and the setting to lower
(exit 2, nothing half written), and `diagnose` runs one row through the capture before anything costly."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from gradian.checks import Context, run_checks
from gradian.cli import app
from gradian.config import load_config
from gradian.errors import ResourceError
from gradian.memory import is_out_of_memory, memory_guard

from helpers_models import GOOD_TRAIN, session_zoo, write_run

torch.set_num_threads(1)
runner = CliRunner()


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return session_zoo(tmp_path_factory)


def test_out_of_memory_kinds_become_a_resource_error():
    class OutOfMemoryError(RuntimeError):  # torch.cuda.OutOfMemoryError's name
        pass

    for e in (MemoryError("Unable to allocate 37.3 GiB for an array with shape (4884480, 1024)"),
              OutOfMemoryError("CUDA out of memory. Tried to allocate 2.10 GiB"),
              RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")):
        assert is_out_of_memory(e)
        with pytest.raises(ResourceError) as ei:
            with memory_guard("clusters"):
                raise e
        msg = str(ei.value)
        assert "clusters stage" in msg and "grads.projection_dim" in msg and ei.value.exit_code == 2
        assert ei.value.__suppress_context__ and ei.value.__context__.__traceback__ is None  # frames released
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        with memory_guard("index"):
            raise RuntimeError("shape mismatch")


def test_a_full_disk_becomes_a_resource_error_naming_the_file():
    import errno

    with pytest.raises(ResourceError) as ei:
        with memory_guard("score"):
            raise OSError(errno.ENOSPC, "No space left on device", "/cache/rows/rows-1/ref.f32")
    msg = str(ei.value)
    assert "disk filled up in the score stage" in msg and "/cache/rows/rows-1/ref.f32" in msg
    assert "grads.cache_dir" in msg and ei.value.exit_code == 2
    with pytest.raises(FileNotFoundError):  # other OS errors are not this
        with memory_guard("score"):
            raise FileNotFoundError(errno.ENOENT, "No such file", "/x")


def test_cli_full_disk_is_exit_2_naming_the_file(tmp_path, zoo, monkeypatch):
    import errno

    cfg = write_run(tmp_path / "run", zoo.base, zoo.adapter)

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "out" / "index" / "shard.npy"))

    monkeypatch.setattr("gradian.pipeline.measure_capability", full)
    r = runner.invoke(app, ["attribute", str(cfg)])
    text = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert "disk filled up in the evaluate stage" in text and "shard.npy" in text and "Traceback" not in text
    assert not (tmp_path / "run" / "out" / "report.json").exists()


@pytest.mark.parametrize("verb, target, stage, setting", [
    ("index", "gradian.pipeline.open_index", "index", "grads.batch_size"),
    ("attribute", "gradian.pipeline.measure_capability", "evaluate", "evaluation.batch_size"),
])
def test_cli_out_of_memory_is_exit_2_naming_stage_and_setting(tmp_path, zoo, monkeypatch, verb, target, stage,
                                                                  setting):
    cfg = write_run(tmp_path / "run", zoo.base, zoo.adapter)

    def boom(*a, **kw):
        raise MemoryError("Unable to allocate 37.3 GiB for an array with shape (4884480, 1024) and data type float64")

    monkeypatch.setattr(target, boom)
    r = runner.invoke(app, [verb, str(cfg)])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert f"out of host memory in the {stage} stage" in text and setting in text and "Traceback" not in text
    out = tmp_path / "run" / "out"
    assert not (out / "report.json").exists() and not list(out.rglob("shard-*.npy"))


def test_dry_run_passes_on_a_good_setup_and_checks_forward_mode(tmp_path, zoo):
    cfg = load_config(write_run(tmp_path / "run", zoo.base, zoo.adapter))
    (r,) = run_checks(Context(cfg), ["capture.dry_run"])
    assert r.status == "pass", r.message
    assert "14 LoRA sites" in r.message and "add up to the gradient norm" in r.message


class _NoForwardAD(torch.autograd.Function):
    """A fused kernel with a backward but no forward-mode rule (as custom CUDA/Triton ops often are)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.nn.functional.silu(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s * (1 + x * (1 - s)))


class _FusedAct(torch.nn.Module):
    def forward(self, x):
        return _NoForwardAD.apply(x)


def test_dry_run_catches_an_architecture_the_capture_cannot_follow(tmp_path, zoo):
    cfg = load_config(write_run(tmp_path / "run", zoo.base, zoo.adapter))
    ctx = Context(cfg)
    for layer in ctx.model.get_base_model().model.layers:
        layer.mlp.act_fn = _FusedAct()
    (r,) = run_checks(ctx, ["capture.dry_run"])
    assert (r.status, r.level) == ("fail", "error"), r.message
    assert "forward-mode contributions" in r.message and "training row" in r.message
    # a model whose LoRA branch never reaches the loss (a wrapper that detaches it): the backward fails here
    ctx = Context(cfg)
    for s in ctx.sites[0]:
        s.B.register_forward_hook(lambda m, a, out: out.detach())
    (r,) = run_checks(ctx, ["capture.dry_run"])
    assert (r.status, r.level) == ("fail", "error") and "the hooked backward failed" in r.message


def test_dry_run_out_of_memory_is_a_failed_check(tmp_path, zoo, monkeypatch):
    cfg = load_config(write_run(tmp_path / "run", zoo.base, zoo.adapter, train=GOOD_TRAIN))
    import gradian.grads.capture as C

    def boom(self, *a, **kw):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 167772160 bytes")

    monkeypatch.setattr(C.GradientCapture, "iter_site_grads", boom)
    (r,) = run_checks(Context(cfg), ["capture.dry_run"])
    assert (r.status, r.level) == ("fail", "error") and "out of memory" in r.message
    assert "grads.max_seq_length" in r.fix
