"""Quantized bases (QLoRA): model.quantization loads the base through bitsandbytes, and the captured gradients equal
the naive one-example-per-backward reference through the same quantized model."""

from __future__ import annotations

import builtins

import pytest
import torch

from gradian.config import config_from_dict
from gradian.errors import ModelError
from gradian.grads.capture import GradientCapture
from gradian.setup.model import load_model, lora_sites

from helpers_models import save_adapter, save_base
from test_capture import _batch, _naive_grads, _rel

torch.set_num_threads(1)
bnb = pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def base_and_adapter(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    base = save_base(root / "base", hidden=64)  # bitsandbytes quantizes in blocks of 64
    return base, save_adapter(root / "adapter", base)


def _cfg(base, adapter, q):
    return config_from_dict({"model": {"base": str(base), "adapter": str(adapter), "device": "cpu",
                                       "quantization": q}, "data": {"train": "t.jsonl"}})


@pytest.mark.parametrize("q, layer", [("nf4", "Linear4bit"), ("int8", "Linear8bitLt")])
def test_quantized_capture_equals_the_naive_reference(base_and_adapter, q, layer):
    base, adapter = base_and_adapter
    model = load_model(_cfg(base, adapter, q))
    attn_q = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer
    assert type(attn_q).__name__ == layer
    sites, _ = lora_sites(model)
    assert len(sites) == 14
    ids, attn, sup = _batch(vocab=250)
    vecs, losses = GradientCapture(model, sites, chunk=5).vectors(ids, attn, sup)
    ref, ref_losses = _naive_grads(model, sites, ids, attn, sup, with_losses=True)
    torch.testing.assert_close(losses.double(), ref_losses, rtol=1e-5, atol=1e-5)
    off = 0
    for s in sites:  # every site separately, through the same quantized weights
        assert _rel(vecs[:, off : off + s.numel], ref[:, off : off + s.numel]) < 1e-4, (q, s.name)
        off += s.numel
    # and it is a quantized model: its gradients are not those of the full-precision base
    full = load_model(_cfg(base, adapter, "none"))
    fsites, _ = lora_sites(full)
    fvecs, _ = GradientCapture(full, fsites, chunk=5).vectors(ids, attn, sup)
    assert _rel(vecs, fvecs) > 1e-3


def test_nf4_kernel_path_does_not_depend_on_what_ran_first(base_and_adapter):
    """bitsandbytes repacks 4-bit weights for AVX512-BF16 CPUs on the first forward without grad; the loader keeps
    one path, so a generation before the capture (attribute) or none (index) gives the same gradients."""
    base, adapter = base_and_adapter
    ids, attn, sup = _batch(vocab=250)
    runs = []
    for warm in (False, True):
        model = load_model(_cfg(base, adapter, "nf4"))
        if warm:
            with torch.no_grad():
                model(input_ids=ids, attention_mask=attn)
        sites, _ = lora_sites(model)
        runs.append(GradientCapture(model, sites).vectors(ids, attn, sup)[0])
    assert torch.equal(runs[0], runs[1])


def test_missing_bitsandbytes_names_the_extra(base_and_adapter, monkeypatch):
    base, adapter = base_and_adapter
    real_import = builtins.__import__

    def no_bnb(name, *a, **kw):
        if name == "bitsandbytes" or name.startswith("bitsandbytes."):
            raise ImportError("No module named 'bitsandbytes'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_bnb)
    with pytest.raises(ModelError, match=r"pip install 'gradian\[quant\]'") as e:
        load_model(_cfg(base, adapter, "nf4"))
    assert e.value.check == "model.load_failed" and "model.quantization" in str(e.value)


def test_quantization_is_part_of_the_index_key(base_and_adapter):
    from gradian.projection import Projector
    from gradian.store.build import cache_key

    base, adapter = base_and_adapter
    model = load_model(_cfg(base, adapter, "none"))
    sites, _ = lora_sites(model)
    proj = Projector([])
    keys = {q: cache_key(_cfg(base, adapter, q), sites, proj, str(adapter)) for q in ("none", "nf4", "int8")}
    assert len(set(keys.values())) == 3


def test_adapter_quantized_check_asks_for_model_quantization(tmp_path, base_and_adapter):
    """A QLoRA adapter: with model.quantization none the check says to set nf4; with nf4 it passes."""
    import json

    import yaml

    from gradian.checks import Context, run_checks
    from gradian.config import load_config

    base, adapter = base_and_adapter
    ad = tmp_path / "qlora"
    import shutil

    shutil.copytree(adapter, ad)
    cfg_file = ad / "adapter_config.json"
    d = json.loads(cfg_file.read_text())
    d["base_model_name_or_path"] = "unsloth/tiny-llama-bnb-4bit"
    cfg_file.write_text(json.dumps(d))
    (tmp_path / "train.jsonl").write_text('{"text": "Paris is in France."}\n')
    for q, status in (("none", "fail"), ("nf4", "pass"), ("int8", "fail")):
        p = tmp_path / f"{q}.yaml"
        p.write_text(yaml.safe_dump({"model": {"base": str(base), "adapter": str(ad), "device": "cpu",
                                               "quantization": q}, "data": {"train": "train.jsonl"}}))
        (r,) = run_checks(Context(load_config(p)), ["adapter.quantized"])
        assert r.status == status, (q, r.message)
        if q == "none":
            assert "model.quantization: nf4" in r.message and r.level == "warning"
        if q == "int8":
            assert "set it to nf4" in r.message
