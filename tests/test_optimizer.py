"""Optimizer-aware scores (`attribution.optimizer: adamw`): the recorder's forward sums against the backward
recursion of bench/optimizer_aware.py, and the replayed scores against one-example-per-backward gradients."""

import numpy as np
import pytest
import torch

from gradian.attribution import optimizer as opt_mod
from gradian.grads.objectives import naive_per_example_loss, per_example_loss
from gradian.setup.batches import collate
from gradian.setup.model import lora_sites
from gradian.setup.tokenize import Tokenized

from conftest import make_random_lora_model

B1, B2, EPS = 0.9, 0.999, 1e-8


def _toks(n=12, vocab=97, seed=2):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = 6 + (i * 5) % 9
        ids = torch.randint(3, vocab, (L,), generator=g).tolist()
        out.append(Tokenized(ids, [False] * (L // 2) + [True] * (L - L // 2), ""))
    return out


def _train(model, toks, epochs=3, batch=4, lr=5e-3, max_norm=0.05):
    """A small AdamW run like `training.loop` (token-weighted loss, clipping), recorded; with the reference
    per-step updates and bias-corrected second moments."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rec = opt_mod.TrajectoryRecorder()
    rec.start(model, params, opt)
    ref = {"u": [], "v": [], "g": [], "epoch": [], "init": [p.detach().clone() for p in rec.params], "ends": {}}
    for e in range(1, epochs + 1):
        order = np.random.default_rng([0, e]).permutation(len(toks)).tolist()
        for s in range(0, len(toks), batch):
            rows = order[s : s + batch]
            ids, attn, sup = collate([toks[i] for i in rows], 0)
            n_tok = float(sup[:, 1:].sum())
            loss = per_example_loss(model, ids, attn, sup).sum() / n_tok
            opt.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            before = [p.detach().clone() for p in rec.params]
            ref["g"].append([p.grad.detach().clone() for p in rec.params])  # clipped
            opt.step()
            rec.step(opt, epoch=e, positions=rows, n_tok=n_tok, grad_norm=norm, max_grad_norm=max_norm)
            step = float(opt.state[rec.params[0]]["step"])
            ref["u"].append([p.detach() - b for p, b in zip(rec.params, before)])
            ref["v"].append([opt.state[p]["exp_avg_sq"] / (1 - B2 ** step) for p in rec.params])
            ref["epoch"].append(e)
        ref["ends"][e] = [p.detach().clone() for p in rec.params]
    model.eval()
    return rec, ref, lr


@pytest.fixture(scope="module")
def run():
    model = make_random_lora_model(seed=4)
    toks = _toks()
    rec, ref, lr = _train(model, toks)
    return model, toks, rec, ref, lr


def test_recorded_epoch_means_equal_the_backward_recursion(run):
    """K1_t = sum_{s>=t} lr a_s b1^(s-t) / (sqrt(v_s)+eps) and K2_t = sum_{s>=t} u_s b_s b2^(s-t) / (v_s+eps^2),
    computed backward over the recorded steps as bench/optimizer_aware.py does, averaged over each epoch's steps
    (K2 weighted by the squared clipped batch gradient g_t^2, per coordinate), equal what the recorder summed
    forward; each epoch starts from the weights the previous one ended with."""
    _, _, rec, ref, lr = run
    T = len(ref["u"])
    k1 = [[torch.zeros_like(x) for x in ref["u"][0]] for _ in range(T)]
    k2 = [[torch.zeros_like(x) for x in ref["u"][0]] for _ in range(T)]
    a1 = [torch.zeros_like(x) for x in ref["u"][0]]
    a2 = [torch.zeros_like(x) for x in ref["u"][0]]
    for t in range(T - 1, -1, -1):
        st = t + 1
        for k in range(len(a1)):
            v = ref["v"][t][k]
            a1[k] = lr * (1 - B1) / (1 - B1 ** st) / (v.sqrt() + EPS) + B1 * a1[k]
            a2[k] = ref["u"][t][k] * (1 - B2) / ((1 - B2 ** st) * (v + EPS ** 2)) + B2 * a2[k]
            k1[t][k], k2[t][k] = a1[k].clone(), a2[k].clone()
    got = rec.tensors()
    for e in (1, 2, 3):
        ts = [t for t in range(T) if ref["epoch"][t] == e]
        start = ref["init"] if e == 1 else ref["ends"][e - 1]
        for k, (site, side) in enumerate(rec.names):
            want1 = sum(k1[t][k] for t in ts) / len(ts)
            w = [ref["g"][t][k].square() for t in ts]
            want2 = sum(wt * k2[t][k] for wt, t in zip(w, ts)) / sum(w)
            torch.testing.assert_close(got[f"k1|{e}|{site}|{side}"], want1, rtol=1e-4, atol=1e-12)
            # the reference's u is a float32 difference of the weights, coarser than the recorder's Adam update
            assert float((got[f"k2|{e}|{site}|{side}"] - want2).norm() / want2.norm()) < 1e-3, (e, site, side)
            torch.testing.assert_close(got[f"start|{e}|{site}|{side}"], start[k].float())
    assert [s["epoch"] for s in rec.steps] == ref["epoch"]
    assert all(0 < s["clip"] <= 1 for s in rec.steps) and any(s["clip"] < 1 for s in rec.steps)


def test_scores_replay_the_epochs_with_exact_per_example_gradients(run, tmp_path):
    """trajectory_scores against a direct sum over the recorded steps with one-example-per-backward gradients at
    each epoch's start weights: -(c_t/n_t) q . ((K1_e + g_t o K2_e) o g_z), g_t = c_t/n_t sum of the step's g_z.
    The model's own weights are back afterwards."""
    from types import SimpleNamespace

    model, toks, rec, _, _ = run
    path = rec.save(tmp_path, n_rows=len(toks), dataset_fingerprint=None)
    sites, _ = lora_sites(model, None)
    traj, why = opt_mod.read_trajectory(tmp_path, n_rows=len(toks), dataset_fingerprint=None, sites=sites)
    assert traj is not None, why
    width = sum(s.numel for s in sites)
    Q = np.random.default_rng(3).normal(size=(2, width))
    before = [s.B.weight.detach().clone() for s in sites]
    grads = SimpleNamespace(model=model, sites=sites, toks=toks, chunk=1024, pad_id=0)
    got = opt_mod.trajectory_scores(grads, traj, Q, "regression")
    assert all(torch.equal(s.B.weight, b) for s, b in zip(sites, before))

    qh = Q / np.linalg.norm(Q, axis=1, keepdims=True)
    want = np.zeros_like(got)
    saved = [(s.A.weight.detach().clone(), s.B.weight.detach().clone()) for s in sites]
    for e in traj.epochs:
        with torch.no_grad():
            for s, (a, b) in zip(sites, traj.tensors("start", e, sites)):
                s.A.weight.copy_(a)
                s.B.weight.copy_(b)
        k1 = np.concatenate([torch.cat([a.flatten(), b.flatten()]).double().numpy() for a, b in traj.tensors("k1", e, sites)])
        k2 = np.concatenate([torch.cat([a.flatten(), b.flatten()]).double().numpy() for a, b in traj.tensors("k2", e, sites)])
        G = {}
        for z in range(len(toks)):
            ids, sup = torch.tensor([toks[z].input_ids]), torch.tensor([toks[z].supervised])
            model.zero_grad(set_to_none=True)
            naive_per_example_loss(model(input_ids=ids).logits, ids, sup).sum().backward()
            G[z] = np.concatenate([torch.cat([s.A.weight.grad.flatten(), s.B.weight.grad.flatten()]).double().numpy()
                                   for s in sites])
        for st in [x for x in traj.steps if x["epoch"] == e]:
            c = st["clip"] / st["tokens"]
            g_hat = c * sum(G[z] for z in st["rows"])
            for z in st["rows"]:
                want[:, z] += -c * ((qh * (k1 + g_hat * k2)) @ G[z])
    with torch.no_grad():
        for s, (a, b) in zip(sites, saved):
            s.A.weight.copy_(a)
            s.B.weight.copy_(b)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-6 * np.abs(want).max())
    np.testing.assert_allclose(opt_mod.trajectory_scores(grads, traj, Q, "improvement"), -got)
    assert path.name == opt_mod.TRAJECTORY_FILE


def test_a_trajectory_of_another_training_set_or_adapter_is_refused(run, tmp_path):
    model, toks, rec, _, _ = run
    rec.save(tmp_path, n_rows=len(toks), dataset_fingerprint="abc")
    sites, _ = lora_sites(model, None)
    ok, _ = opt_mod.read_trajectory(tmp_path, n_rows=len(toks), dataset_fingerprint="abc", sites=sites)
    assert ok is not None
    for kw, msg in (({"n_rows": 5, "dataset_fingerprint": "abc"}, "another training set"),
                    ({"n_rows": len(toks), "dataset_fingerprint": "xyz"}, "another training set")):
        t, why = opt_mod.read_trajectory(tmp_path, sites=sites, **kw)
        assert t is None and msg in why
    t, why = opt_mod.read_trajectory(tmp_path / "nowhere", n_rows=len(toks), dataset_fingerprint=None, sites=sites)
    assert t is None and "has no optimizer_trajectory.safetensors" in why
    (tmp_path / opt_mod.TRAJECTORY_FILE).write_bytes(b"garbage")
    t, why = opt_mod.read_trajectory(tmp_path, n_rows=len(toks), dataset_fingerprint="abc", sites=sites)
    assert t is None and "not a readable safetensors file" in why
