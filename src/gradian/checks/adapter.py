"""Checks of the adapter: a readable PEFT LoRA adapter for causal LM that fits the base, and what it covers."""

from __future__ import annotations

import json

from pathlib import Path

from .estimates import QUANT_NAME, dtype_bytes, human, param_estimate, quant_bits, same_model_ref, weights_bytes
from .registry import Outcome, Unavailable, check, failed, passed, skipped

# adapter.base_mismatch compares the recorded base fingerprint only when the base's weights are at most this big.
FINGERPRINT_MAX_BYTES = 1 << 30


@check("model.full_finetune", "error",
       meaning="There is no LoRA adapter to attribute over: model.adapter is unset, or it points at a full model "
               "(config.json, no adapter_config.json).",
       fix="set model.adapter to the PEFT LoRA adapter directory, or run `gradian train CONFIG` to create one")
def _full_finetune(ctx) -> Outcome:
    return passed(f"model.adapter '{ctx.adapter_path}'")


@check("adapter.unreadable", "error",
       meaning="The adapter directory has no readable adapter_config.json (missing, invalid JSON, not an object).",
       fix="point model.adapter at the directory PEFT's save_pretrained wrote")
def _adapter_unreadable(ctx) -> Outcome:
    d = ctx.adapter_config
    p = Path(ctx.adapter_path)
    if p.is_dir() and not any((p / f).exists() for f in ("adapter_model.safetensors", "adapter_model.bin")):
        return failed(f"{p}: adapter_config.json but no adapter_model.safetensors (or .bin) weights")
    return passed(f"{d['__file__']}")


@check("adapter.not_lora", "error",
       meaning="The adapter is a PEFT adapter of another type (prefix tuning, IA3, prompt tuning, ...): gradian "
               "attributes over LoRA parameters only.",
       fix="train a LoRA adapter (peft.LoraConfig), e.g. with `gradian train CONFIG`")
def _not_lora(ctx) -> Outcome:
    d = ctx.adapter_config
    if d.get("peft_type") not in (None, "LORA"):
        return failed(f"{d['__file__']}: peft_type is {d.get('peft_type')!r}, not LORA")
    return passed(f"peft_type {d.get('peft_type') or 'unset (LoRA assumed)'}")


@check("adapter.task_type", "error",
       meaning="The LoRA adapter was trained for another task (e.g. SEQ_CLS): its head and loss are not the causal-LM "
               "next-token loss gradian differentiates.",
       fix="use an adapter trained with task_type CAUSAL_LM")
def _task_type(ctx) -> Outcome:
    d = ctx.adapter_config
    if d.get("task_type") not in (None, "CAUSAL_LM"):
        return failed(f"{d['__file__']}: task_type is {d.get('task_type')!r}, not CAUSAL_LM")
    return passed(f"task_type {d.get('task_type') or 'unset'}")


@check("adapter.quantized", "warning",
       meaning="The adapter was trained on a 4-/8-bit quantized base (QLoRA) or model.base is quantized, and "
               "model.quantization does not match: with model.quantization none the analysis runs against the "
               "base in model.dtype (more memory, gradients slightly unlike those of quantized training).",
       fix="set model.quantization to how the adapter was trained (nf4 for 4-bit QLoRA, int8 for 8-bit; "
           "pip install 'gradian[quant]'), or keep none and point model.base at the full-precision checkpoint the "
           "quantized one came from (see memory.logit_upcast); the LoRA weights apply unchanged")
def _quantized(ctx) -> Outcome:
    found, have_any = [], False
    mcfg = None
    try:
        mcfg = ctx.base_config
        have_any = True
        bits, method = quant_bits(getattr(mcfg, "quantization_config", None))
        if bits:
            found.append((f"model.base '{ctx.cfg.model.base}' config.json has a quantization_config ({method}, {bits}-bit)",
                          bits))
    except Unavailable:
        pass
    try:
        d = ctx.adapter_config
        have_any = True
        f = d["__file__"]
        for k in ("quantization_config", "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type"):
            if d.get(k):
                bits, method = quant_bits(d[k] if isinstance(d[k], dict) else {k: d[k]})
                found.append((f"{f}: {k} is set ({bits}-bit)", bits or 4))
        loftq = d.get("loftq_config") or {}
        if isinstance(loftq, dict) and loftq.get("loftq_bits"):
            found.append((f"{f}: loftq_config with {loftq['loftq_bits']}-bit base", int(loftq["loftq_bits"])))
        name = str(d.get("base_model_name_or_path") or "")
        if QUANT_NAME.search(name):
            found.append((f"{f}: trained on '{name}', a quantized checkpoint by its name",
                          8 if "8bit" in name.lower() or "int8" in name.lower() else 4))
    except Unavailable:
        pass
    q = ctx.cfg.model.quantization
    q_bits = {"nf4": 4, "int8": 8}.get(q)
    if not have_any:
        return skipped("neither the base config nor the adapter config loaded")
    if not found:
        return passed("no quantization in the base config or the adapter config"
                      + (f"; the base is loaded with model.quantization {q}" if q_bits else ""))
    bits = min(b for _, b in found)
    what = "; ".join(m_ for m_, _ in found)
    if q_bits == bits:
        return passed(f"{what}; model.quantization {q} loads the base at {bits}-bit, as the adapter was trained")
    if q_bits is not None:
        return failed(f"{what}; but model.quantization is {q} ({q_bits}-bit): set it to "
                      f"{'nf4' if bits == 4 else 'int8'} to analyse against the base the adapter was trained on")
    params = param_estimate(mcfg) if mcfg is not None else None  # from the config: packed 4-bit tensors undercount
    if params is None and ctx.peek("base_model") is not None:
        params = sum(p.numel() for p in ctx.peek("base_model").parameters())
    cost = ""
    if params:
        nb = dtype_bytes(ctx.cfg, mcfg)
        cost = (f"; unquantized in model.dtype {ctx.cfg.model.dtype} the base takes ~{human(params * nb)} (~{params / 1e9:.2f}B "
                f"parameters x {nb} bytes) instead of ~{human(params * bits / 8)} at {bits}-bit, and gradients through "
                "it differ slightly from those of quantized training")
    return failed(f"{what}; model.quantization is none{cost}: set model.quantization: "
                  f"{'nf4' if bits == 4 else 'int8'} to analyse against the {bits}-bit base it was trained on")


@check("adapter.base_mismatch", "error",
       meaning="The adapter was built for another base: its LoRA tensors do not fit model.base (error), or its "
               "recorded base (base_model_name_or_path, gradian_recipe.json) names another model (warning).",
       fix="set model.base to the model the adapter was trained on (adapter_config.json base_model_name_or_path)")
def _base_mismatch(ctx) -> Outcome:
    d = ctx.adapter_config
    try:
        ctx.lora
    except Unavailable:
        return skipped("not a LoRA causal-LM adapter; see adapter.not_lora / adapter.task_type")
    ctx.model  # raises Unavailable(owner=adapter.base_mismatch) when the LoRA tensors do not fit
    notes = []
    recorded = d.get("base_model_name_or_path")
    if recorded and not same_model_ref(recorded, ctx.base_ref, ctx.cfg.root):
        notes.append(f"{d['__file__']}: base_model_name_or_path is '{recorded}' but model.base is '{ctx.cfg.model.base}'")
    recipe_file = Path(ctx.adapter_path) / "gradian_recipe.json"
    if recipe_file.exists():
        try:
            recipe = json.loads(recipe_file.read_text())
        except (OSError, ValueError):
            recipe = {}
        fp = recipe.get("base_fingerprint") if isinstance(recipe, dict) else None
        base_dir = Path(ctx.base_ref)
        if fp and base_dir.is_dir() and weights_bytes(base_dir) <= FINGERPRINT_MAX_BYTES:
            from ..io import dir_fingerprint

            if dir_fingerprint(base_dir) != fp:
                notes.append(f"{recipe_file}: the adapter was trained on a base with fingerprint {fp}, model.base "
                             f"'{ctx.cfg.model.base}' has {dir_fingerprint(base_dir)} (other weights)")
    if notes:
        return failed("; ".join(notes) + "; the LoRA shapes fit, so this may be a copy of the same model",
                      level="warning")
    return passed(f"the adapter's LoRA tensors fit model.base '{ctx.cfg.model.base}'")


@check("adapter.skipped_modules", "warning",
       meaning="LoRA modules gradian cannot capture (LoRA on embeddings or convolutions, DoRA) are left out of the "
               "attribution, as are modules_to_save trained in full; an error when no LoRA Linear site remains "
               "(or grads.module_filter matches none).",
       fix="attribution covers the LoRA Linear layers only; to cover everything, train LoRA on Linear layers "
           "(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)")
def _skipped_modules(ctx) -> Outcome:
    sites, skipped_ = ctx.sites
    d = ctx.peek("adapter_config") or {}
    mts = d.get("modules_to_save") or []
    parts = []
    if skipped_:
        parts.append(f"{len(skipped_)} LoRA module(s) cannot be captured and are left out: {', '.join(skipped_[:5])}"
                     + (" ..." if len(skipped_) > 5 else ""))
    if mts:
        parts.append(f"modules_to_save {list(mts)} are trained in full and not attributed")
    if parts:
        return failed("; ".join(parts) + f"; {len(sites)} LoRA Linear sites remain")
    kinds = sorted({s.module_type for s in sites})
    return passed(f"{len(sites)} LoRA Linear sites ({', '.join(kinds)})")


@check("train.target_modules", "warning",
       meaning="Some of train.target_modules name no module of model.base: `gradian train` (and verify's retraining) "
               "puts no LoRA there, and fails when none matches.",
       fix="list module names of this architecture in train.target_modules (for Llama-like models: q_proj, k_proj, "
           "v_proj, o_proj, gate_proj, up_proj, down_proj)")
def _train_targets(ctx) -> Outcome:
    targets = list(ctx.cfg.train.target_modules)
    names = [n for n, _ in ctx.base_model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        none = len(missing) == len(targets)
        return failed(f"train.target_modules {missing} match no module of model.base '{ctx.cfg.model.base}'"
                      + (": `gradian train` would fail" if none else ""))
    return passed(f"train.target_modules {targets} all present in model.base")
