"""Per-example LoRA gradients from one batched backward, via hooks on the LoRA A and B Linear modules.

For a LoRA Linear, y += B(A(x)) * s. With x the A input, h = A(x) the B input, and gh = dL/dh, gz = dL/dB(h),
each example's gradients are dA = sum_t gh_t x_t^T and dB = sum_t gz_t h_t^T. The backward asks autograd only for
gh and gz (never for parameter .grad), so the weight-gradient matmuls a plain backward would do are replaced by
per-example ones of the same cost.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..projection import Projector
from ..setup.model import LoraSite
from .layout import site_shapes
from .objectives import margin_losses, per_example_loss


class _Recorder:
    """Forward hooks that keep each site's inputs and outputs for the duration of one forward."""

    def __init__(self, sites: Sequence[LoraSite]):
        self.sites = list(sites)
        self.a_in: list[list[Tensor]] = [[] for _ in self.sites]
        self.a_out: list[list[Tensor]] = [[] for _ in self.sites]
        self.b_in: list[list[Tensor]] = [[] for _ in self.sites]
        self.b_out: list[list[Tensor]] = [[] for _ in self.sites]
        self._handles = []

    def __enter__(self):
        for i, s in enumerate(self.sites):
            self._handles.append(s.A.register_forward_hook(self._hook(self.a_in[i], self.a_out[i])))
            self._handles.append(s.B.register_forward_hook(self._hook(self.b_in[i], self.b_out[i])))
        return self

    @staticmethod
    def _hook(ins: list, outs: list):
        def fn(module, args, output):
            ins.append(args[0].detach())
            outs.append(output)

        return fn

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()


def per_example_site_grads(x: Tensor, gh: Tensor, h: Tensor, gz: Tensor) -> tuple[Tensor, Tensor]:
    """dA [B, r, d_in] and dB [B, d_out, r] from inputs/output-grads [B, T, .] (float32 accumulation)."""
    dA = torch.einsum("btr,bti->bri", gh.float(), x.float())
    dB = torch.einsum("bto,btr->bor", gz.float(), h.float())
    return dA, dB


class Segments:
    """Parts of a batch's rows by position: segment m is row `owner[m]`'s positions where `mask[m]` is 1 (float
    [n, T]). A position's contribution to the weight gradients (its input times its output gradient) goes to the
    segments that hold it; the backward itself is the row's (every token's loss flows through every position)."""

    def __init__(self, owner: Sequence[int], mask: Tensor, index: Optional[Sequence[int]] = None):
        self.owner = torch.as_tensor(list(owner), dtype=torch.long)
        self.mask = mask
        self.n = int(self.owner.numel())
        self.index = list(index) if index is not None else [0] * self.n  # each segment's label within its row

    @classmethod
    def from_labels(cls, labels: Sequence[Optional[Sequence[int]]], T: int, device=None) -> "Segments":
        """Segments of a right-padded batch from per-row position labels (segment index per position, -1: none;
        None: the row has no segments). Row b's segments are its labels 0..max, in order."""
        owner, index, masks = [], [], []
        for b, lab in enumerate(labels):
            if lab is None:
                continue
            lab = torch.as_tensor(list(lab), dtype=torch.long)
            for k in range(int(lab.max()) + 1 if lab.numel() else 0):
                m = torch.zeros(T)
                m[: lab.numel()] = (lab == k).float()
                owner.append(b)
                index.append(k)
                masks.append(m)
        mask = torch.stack(masks) if masks else torch.zeros(0, T)
        return cls(owner, mask.to(device) if device is not None else mask, index)


def segment_site_grads(x: Tensor, gh: Tensor, h: Tensor, gz: Tensor, seg: Segments) -> tuple[Tensor, Tensor]:
    """dA [n, r, d_in] and dB [n, d_out, r] of each segment: `per_example_site_grads` with the sum over positions
    restricted to the segment's (float32 accumulation)."""
    m = seg.mask[:, : x.shape[1], None].float()
    o = seg.owner.to(x.device)
    dA = torch.einsum("mtr,mti->mri", gh.float()[o] * m, x.float()[o])
    dB = torch.einsum("mto,mtr->mor", gz.float()[o] * m, h.float()[o])
    return dA, dB


class GradientCapture:
    """Turns batches into per-example gradient vectors [B, dim] in the projector's space."""

    def __init__(self, model, sites: Sequence[LoraSite], projector: Optional[Projector] = None, *, chunk: int = 1024):
        self.model = model
        self.sites = list(sites)
        self.projector = projector or Projector(site_shapes(self.sites))
        self.chunk = chunk

    @property
    def dim(self) -> int:
        return self.projector.dim

    @contextmanager
    def _recording(self):
        with _Recorder(self.sites) as rec:
            yield rec

    def site_grads(self, input_ids: Tensor, attention_mask: Tensor, supervised: Tensor, weights: Optional[Tensor] = None):
        """Per-site exact (dA, dB) of each example's summed supervised loss, and the per-example losses."""
        it, losses = self.iter_site_grads(input_ids, attention_mask, supervised, weights)
        return [g for _, g in it], losses

    def iter_site_grads(self, input_ids: Tensor, attention_mask: Tensor, supervised: Tensor,
                        weights: Optional[Tensor] = None):
        """(an iterator of (site index, (dA, dB)), per-example losses): like `site_grads`, one site at a time, so a
        caller that reduces each site (a projection, a fit) never holds batch x exact width at once."""
        with self._recording() as rec:
            losses = per_example_loss(self.model, input_ids, attention_mask, supervised, chunk=self.chunk)
        total = (losses * weights).sum() if weights is not None else losses.sum()
        return self.iter_grads_from_recording(rec, total, input_ids.shape[0]), losses.detach()

    def grads_from_recording(self, rec: "_Recorder", total: Tensor, batch: int) -> list[tuple[Tensor, Tensor]]:
        """Per-site exact (dA, dB) of `total` (a sum of per-example objectives) from one recorded forward."""
        return [g for _, g in self.iter_grads_from_recording(rec, total, batch)]

    def iter_grads_from_recording(self, rec: "_Recorder", total: Tensor, batch: int,
                                  segments: Optional["Segments"] = None):
        """(site index, (dA, dB)) for each site, from one backward; each site's recorded tensors and output
        gradients are released once its per-example gradients are formed. With `segments`, (site index, (dA, dB),
        (sA, sB)): the segments' gradients too (`segment_site_grads`), from the same backward."""
        targets, spans = [], []
        for i in range(len(self.sites)):
            spans.append((len(targets), len(rec.a_out[i]), len(rec.b_out[i])))
            targets.extend(rec.a_out[i])
            targets.extend(rec.b_out[i])
        grads = list(torch.autograd.grad(total, targets, allow_unused=True)) if targets else []
        del targets
        for i, s in enumerate(self.sites):
            start, na, nb = spans[i]
            ga, gb = grads[start : start + na], grads[start + na : start + na + nb]
            calls = [c for c in zip(rec.a_in[i], ga, rec.b_in[i], gb) if c[1] is not None and c[3] is not None]
            device = rec.a_in[i][0].device if rec.a_in[i] else None
            grads[start : start + na + nb] = [None] * (na + nb)
            rec.a_in[i], rec.b_in[i], rec.a_out[i], rec.b_out[i] = [], [], [], []
            del ga, gb
            seg = None
            if segments is not None:
                seg = (torch.zeros(segments.n, s.r, s.d_in, device=device),
                       torch.zeros(segments.n, s.d_out, s.r, device=device))
                for x, gh, h, gz in calls:
                    a, b = segment_site_grads(x, gh, h, gz, segments)
                    seg[0].add_(a)
                    seg[1].add_(b)
            if len(calls) == 1:  # the usual case: no zero-fill and accumulation copy of the full gradient
                g = per_example_site_grads(*calls[0])
                yield (i, g) if seg is None else (i, g, seg)
                continue
            dA = torch.zeros(batch, s.r, s.d_in, device=device)
            dB = torch.zeros(batch, s.d_out, s.r, device=device)
            # A module called several times in one forward contributes once per call.
            for x, gh, h, gz in calls:
                a, b = per_example_site_grads(x, gh, h, gz)
                dA += a
                dB += b
            del calls
            yield (i, (dA, dB)) if seg is None else (i, (dA, dB), seg)

    def segment_vectors(self, input_ids: Tensor, attention_mask: Tensor, supervised: Tensor, segments: "Segments"):
        """([B, dim] row vectors, [segments.n, dim] segment vectors, [B] losses) from one forward and backward: a
        segment's vector is the part of its row's gradient that the row's positions in it contribute, so a row's
        segments add up to its vector when they cover its positions (`Segments`)."""
        with self._recording() as rec:
            losses = per_example_loss(self.model, input_ids, attention_mask, supervised, chunk=self.chunk)
        B = input_ids.shape[0]
        rows, segs, a = None, None, 0
        for i, (dA, dB), (sA, sB) in self.iter_grads_from_recording(rec, losses.sum(), B, segments):
            v = self.projector.project(i, dA, dB)
            u = self.projector.project(i, sA, sB)
            del dA, dB, sA, sB
            if rows is None:
                rows, segs = v.new_empty(B, self.dim), u.new_empty(segments.n, self.dim)
            rows[:, a : a + v.shape[1]] = v
            segs[:, a : a + v.shape[1]] = u
            a += v.shape[1]
        if rows is None:
            rows, segs = torch.zeros(B, self.dim), torch.zeros(segments.n, self.dim)
        return rows, segs, losses.detach()

    def _project_all(self, site_iter, batch: int) -> Tensor:
        """[B, dim]: each site's projection written into one buffer as its gradients arrive."""
        out, a = None, 0
        for i, (dA, dB) in site_iter:
            v = self.projector.project(i, dA, dB)
            del dA, dB
            if out is None:
                out = v.new_empty(batch, self.dim)
            out[:, a : a + v.shape[1]] = v
            a += v.shape[1]
        if out is None:
            out = torch.zeros(batch, self.dim)
        return out

    def vectors(self, input_ids: Tensor, attention_mask: Tensor, supervised: Tensor, weights: Optional[Tensor] = None):
        """[B, dim] float32 gradient vectors (projected if the projector projects) and [B] losses."""
        it, losses = self.iter_site_grads(input_ids, attention_mask, supervised, weights)
        return self._project_all(it, input_ids.shape[0]), losses

    def margin_vectors(self, input_ids: Tensor, attention_mask: Tensor, supervised: Tensor):
        """[B, dim] gradients of each example's margin-query loss (`objectives.margin_losses`) in the capture's space,
        and the losses: the same per-example hook algebra as `site_grads`, with the margin loss in place of the summed
        token loss."""
        with self._recording() as rec:
            losses, _ = margin_losses(self.model, input_ids, attention_mask, supervised)
        it = self.iter_grads_from_recording(rec, losses.sum(), input_ids.shape[0])
        return self._project_all(it, input_ids.shape[0]), losses.detach()
