"""Per-example LoRA gradients against the naive reference: one example per backward pass, full fp32 logits."""

import torch

from gradian.grads.capture import GradientCapture
from gradian.grads.objectives import naive_per_example_loss, per_example_loss
from gradian.setup.model import lora_sites

from conftest import make_random_lora_model


def _batch(seed=1, B=4, vocab=97):
    g = torch.Generator().manual_seed(seed)
    lengths = [12, 7, 15, 9][:B]
    T = max(lengths)
    ids = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    sup = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, vocab, (n,), generator=g)
        attn[i, :n] = 1
        # a chat-like mask: a prompt, a supervised answer, another unsupervised turn, another answer
        sup[i, n // 3 : n // 2] = True
        sup[i, n - 2 : n] = True
    return ids, attn, sup


def _naive_grads(model, sites, ids, attn, sup, *, with_losses: bool = False):
    out, losses = [], []
    for i in range(ids.shape[0]):
        n = int(attn[i].sum())
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids[i : i + 1, :n]).logits
        loss = naive_per_example_loss(logits, ids[i : i + 1, :n], sup[i : i + 1, :n]).sum()
        loss.backward()
        losses.append(float(loss.detach()))
        out.append(torch.cat([torch.cat([s.A.weight.grad.flatten(), s.B.weight.grad.flatten()]) for s in sites]))
    return (torch.stack(out), torch.tensor(losses, dtype=torch.float64)) if with_losses else torch.stack(out)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_hooked_grads_equal_naive_reference_per_site():
    model = make_random_lora_model()
    sites, _ = lora_sites(model)
    assert len(sites) == 14
    ids, attn, sup = _batch()
    cap = GradientCapture(model, sites, chunk=5)
    vecs, losses = cap.vectors(ids, attn, sup)
    ref = _naive_grads(model, sites, ids, attn, sup)
    assert vecs.shape == ref.shape
    # every site, separately: a bug confined to one module type must not hide in the global norm
    off = 0
    for s in sites:
        n = s.numel
        assert _rel(vecs[:, off : off + n], ref[:, off : off + n]) < 1e-6, s.name
        off += n
    # and the per-example grads sum to the batch gradient
    model.zero_grad(set_to_none=True)
    per_example_loss(model, ids, attn, sup).sum().backward()
    batch = torch.cat([torch.cat([s.A.weight.grad.flatten(), s.B.weight.grad.flatten()]) for s in sites])
    assert _rel(vecs.sum(0), batch) < 1e-6


def test_padding_does_not_change_an_examples_gradient():
    model = make_random_lora_model()
    sites, _ = lora_sites(model)
    ids, attn, sup = _batch()
    cap = GradientCapture(model, sites)
    full, _ = cap.vectors(ids, attn, sup)
    n = int(attn[1].sum())
    alone, _ = cap.vectors(ids[1:2, :n], attn[1:2, :n], sup[1:2, :n])
    assert _rel(full[1], alone[0]) < 1e-6


def test_capture_is_bit_identical_across_runs():
    ids, attn, sup = _batch()
    runs = []
    for _ in range(2):
        model = make_random_lora_model()
        sites, _ = lora_sites(model)
        runs.append(GradientCapture(model, sites).vectors(ids, attn, sup)[0])
    assert torch.equal(runs[0], runs[1])


def test_chunked_loss_matches_naive_loss_and_grads():
    model = make_random_lora_model()
    ids, attn, sup = _batch()
    naive = torch.stack([
        naive_per_example_loss(model(input_ids=ids[i : i + 1]).logits, ids[i : i + 1], sup[i : i + 1])[0]
        for i in range(ids.shape[0])
    ])
    for chunk in (1, 3, 1024):
        got = per_example_loss(model, ids, attn, sup, chunk=chunk)
        assert torch.allclose(got, naive, rtol=1e-6, atol=1e-6)


def test_module_filter_keeps_only_named_types():
    model = make_random_lora_model()
    sites, _ = lora_sites(model, ["down_proj"])
    assert [s.module_type for s in sites] == ["down_proj", "down_proj"]


def test_a_module_called_twice_in_one_forward_contributes_both_calls():
    """Weight sharing (a LoRA Linear run twice per forward) sums both calls' outer products, as autograd does."""
    model = make_random_lora_model()
    sites, _ = lora_sites(model)
    mlp = model.get_base_model().model.layers[0].mlp
    orig = mlp.forward
    mlp.forward = lambda x: orig(x) + orig(0.5 * x)  # gate/up/down of layer 0 each run twice
    ids, attn, sup = _batch()
    vecs, _ = GradientCapture(model, sites, chunk=5).vectors(ids, attn, sup)
    ref = _naive_grads(model, sites, ids, attn, sup)
    off = 0
    for s in sites:
        n = s.numel
        assert _rel(vecs[:, off : off + n], ref[:, off : off + n]) < 1e-6, s.name
        off += n
    mlp.forward = orig
    single, _ = GradientCapture(model, sites, chunk=5).vectors(ids, attn, sup)
    assert _rel(single, vecs) > 1e-3  # the second call really contributed


def _naive_segment_grads(model, sites, ids, n, mask):
    """Naive reference of one segment of one row: the row's summed supervised loss, one plain backward, with every
    LoRA A and B Linear replaced at the segment's positions by a copy of its weight; the copies' .grad is the
    segment's part of the row's gradient."""
    import torch.nn.functional as F

    copies, handles = [], []
    m = torch.as_tensor(mask[:n], dtype=torch.bool)[None, :, None]

    def hook(w):
        def fn(module, args, out):
            return torch.where(m, F.linear(args[0], w), out)

        return fn

    for s in sites:
        a = s.A.weight.detach().clone().requires_grad_(True)
        b = s.B.weight.detach().clone().requires_grad_(True)
        copies.append((a, b))
        handles.append(s.A.register_forward_hook(hook(a)))
        handles.append(s.B.register_forward_hook(hook(b)))
    try:
        logits = model(input_ids=ids[None, :n]).logits
        return logits, copies, handles
    except Exception:
        for h in handles:
            h.remove()
        raise


def test_segment_grads_are_the_positions_share_of_the_naive_gradient():
    """`segment_vectors`: each segment's vector equals the naive reference (weights copied at its positions, one
    example per plain backward); a row's segments that cover its positions add up to its vector; the row vectors
    are bit-identical to `vectors`."""
    from gradian.grads.capture import Segments

    model = make_random_lora_model()
    sites, _ = lora_sites(model)
    ids, attn, sup = _batch()
    T = ids.shape[1]
    # rows 0 and 2 in three segments (positions thirds), row 1 whole, row 3 in two
    labels = []
    for i in range(ids.shape[0]):
        n = int(attn[i].sum())
        k = {0: 3, 2: 3, 3: 2}.get(i)
        labels.append(None if k is None else [min(t * k // n, k - 1) for t in range(n)])
    seg = Segments.from_labels(labels, T)
    assert seg.owner.tolist() == [0, 0, 0, 2, 2, 2, 3, 3] and seg.index == [0, 1, 2, 0, 1, 2, 0, 1]
    cap = GradientCapture(model, sites, chunk=5)
    rows, segs, _ = cap.segment_vectors(ids, attn, sup, seg)
    plain, _ = cap.vectors(ids, attn, sup)
    assert torch.equal(rows, plain)
    for m, b in enumerate(seg.owner.tolist()):
        n = int(attn[b].sum())
        logits, copies, handles = _naive_segment_grads(model, sites, ids[b], n, seg.mask[m].bool())
        try:
            loss = naive_per_example_loss(logits, ids[b : b + 1, :n], sup[b : b + 1, :n]).sum()
            grads = torch.autograd.grad(loss, [w for ab in copies for w in ab])
        finally:
            for h in handles:
                h.remove()
        ref = torch.cat([g.flatten() for g in grads])
        off = 0
        for s in sites:  # every site apart, as the whole-row test does
            assert _rel(segs[m, off : off + s.numel], ref[off : off + s.numel]) < 1e-5, (m, s.name)
            off += s.numel
    for b in (0, 2, 3):
        own = [m for m, o in enumerate(seg.owner.tolist()) if o == b]
        assert _rel(segs[own].sum(0), rows[b]) < 1e-5
