"""The training recipe: what `gradian train` records beside an adapter and what `verify`, `fidelity` and checkpoint
replays retrain from (`gradian_recipe.json`), as a typed `Recipe`.

Where an adapter has no `gradian_recipe.json`, `load_recipe` reads the recipe of a TRL / HF Trainer output dir from
what the Trainer wrote (`training.trainer_dir`: training_args.bin, never executed, adapter_config.json,
trainer_state.json). A recipe written by hand for an adapter trained elsewhere needs `seed` and the
`RECIPE_REQUIRED` hyperparameters; the `RECIPE_OPTIONAL` ones default to the config's (`load_recipe` says which are
missing and shows an example).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import DataError, VerifyError

RECIPE_FILE = "gradian_recipe.json"
SCHEMA = "gradian.recipe/1"
RECIPE_REQUIRED = {
    "seed": "integer seed of the data order and the LoRA initialisation",
    "hyperparameters.learning_rate": "constant AdamW learning rate",
    "hyperparameters.epochs": "number of passes over the data",
    "hyperparameters.batch_size": "rows per optimizer step",
    "hyperparameters.lora_r": "LoRA rank",
    "hyperparameters.lora_alpha": "LoRA alpha",
    "hyperparameters.target_modules": "list of module names the LoRA wraps, e.g. [q_proj, v_proj]",
}
# Optional fields and their defaults; a string default names the config key the value comes from.
RECIPE_OPTIONAL = {
    "hyperparameters.lora_dropout": 0.0,
    "hyperparameters.weight_decay": 0.0,
    "hyperparameters.max_seq_length": "train.max_seq_length",
    "hyperparameters.max_grad_norm": "train.max_grad_norm",
}


class Hyperparameters(BaseModel):
    """The `train.*` settings a run used (the keys of `TrainConfig` but `output`); more are kept as given."""

    model_config = ConfigDict(extra="allow")

    learning_rate: float
    epochs: int
    batch_size: int
    lora_r: int
    lora_alpha: float
    lora_dropout: float = 0.0
    target_modules: list[str]
    weight_decay: float = 0.0
    max_grad_norm: Optional[float] = None
    max_seq_length: int = 512
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    gradient_accumulation_steps: int = 1
    loss: str = "supervised"


class Recipe(BaseModel):
    """Everything a retrain needs to reproduce an adapter, and what it was trained on."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    schema_id: str = Field(default=SCHEMA, alias="schema")
    backend: str = "hf"
    seed: int
    hyperparameters: Hyperparameters
    schedule: Optional[str] = None
    data: Optional[str] = None
    dataset_fingerprint: Optional[str] = None
    n_examples: Optional[int] = None
    excluded_positions: list[int] = Field(default_factory=list)
    removal: Optional[str] = None
    data_order: Optional[str] = None
    base: Optional[str] = None
    base_fingerprint: Optional[str] = None
    train_seconds: Optional[float] = None
    # The run's optimizer steps: the rate of each (index s-1 for step s), the loss curve [[step, loss], ...] and
    # the checkpoints saved along the way [{name, step, epoch, learning_rate}]; `step` is where this adapter was saved.
    total_steps: Optional[int] = None
    step: Optional[int] = None
    learning_rates: Optional[list[float]] = None
    loss_curve: Optional[list[list[float]]] = None
    checkpoints: Optional[list[dict]] = None
    # A checkpoint of a scheduled run: the full run's recipe, stopped after this epoch (the schedule spans them all).
    stop_epoch: Optional[int] = None
    # TRL / HF Trainer runs (GradianCallback): the training arguments that matter, the LoRA weights before the first
    # step (a file beside the recipe) and a fingerprint of the tokenized training set the Trainer iterated.
    trainer_args: Optional[dict[str, Any]] = None
    lora_config: Optional[dict[str, Any]] = None
    init_adapter: Optional[str] = None
    tokenized_fingerprint: Optional[str] = None
    # A recipe read from a Trainer output dir without a recorded one (`training.trainer_dir`): origin "trainer_dir",
    # the files it was read from and the class of the pickled arguments (SFTConfig, TrainingArguments).
    origin: Optional[str] = None
    origin_files: Optional[list[str]] = None
    trainer_class: Optional[str] = None

    @property
    def hp(self) -> dict[str, Any]:
        """The hyperparameters as the plain dict the training loop reads."""
        return self.hyperparameters.model_dump()

    def with_epochs(self, epochs: int) -> "Recipe":
        """The same recipe trained for `epochs` (a checkpoint's recipe), nothing excluded."""
        return self.model_copy(update={"hyperparameters": self.hyperparameters.model_copy(update={"epochs": epochs}),
                                       "excluded_positions": []}, deep=True)

    def up_to_epoch(self, epoch: int) -> "Recipe":
        """The recipe of the run's adapter after `epoch`, nothing excluded: a constant rate makes that a shorter
        run (`with_epochs`); a schedule spans the whole run, so it is the full recipe stopped after that epoch."""
        hp = self.hyperparameters
        if hp.lr_scheduler == "constant" or epoch >= hp.epochs:
            return self.with_epochs(epoch)
        return self.model_copy(update={"stop_epoch": int(epoch), "excluded_positions": []}, deep=True)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json", by_alias=True, exclude_unset=True), indent=2)


def read_recipe(adapter_dir: str | Path) -> Optional[Recipe]:
    """The recipe beside an adapter, or None when there is none; DataError when it is not a recipe."""
    p = Path(adapter_dir) / RECIPE_FILE
    if not p.exists():
        return None
    try:
        rec = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{p}: unreadable recipe ({e}); delete it or fix the JSON") from None
    if not isinstance(rec, dict):
        raise DataError(f"{p}: a recipe must be a JSON object")
    try:
        return Recipe.model_validate(rec)
    except ValidationError as e:
        raise DataError(f"{p}: not a Gradian recipe ({_first_error(e)}); {recipe_help(p.parent)}") from None


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    return f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}"


def recipe_help(adapter: str | Path) -> str:
    req = "; ".join(f"{k} ({v})" for k, v in RECIPE_REQUIRED.items())
    opt = ", ".join(f"{k} (default {v})" for k, v in RECIPE_OPTIONAL.items())
    example = json.dumps({"seed": 0, "hyperparameters": {"learning_rate": 2e-4, "epochs": 3, "batch_size": 8, "lora_r": 16,
                                                          "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]}})
    return (f"point model.adapter at the output dir of the TRL / HF Trainer run (its training_args.bin and "
            f"adapter_config.json hold the recipe), or write {Path(adapter) / RECIPE_FILE} with the recipe it was "
            f"trained with. Required: {req}. Optional: "
            f"{opt}, dataset_fingerprint (refuses a different training file), base. Example: {example}. verify retrains "
            "with gradian's own loop (AdamW, constant learning rate, token-weighted loss over assistant tokens); a "
            "reference retrain with nothing dropped shows how close that comes to your adapter")


def load_recipe(cfg) -> tuple[Recipe, Path]:
    """The recipe beside model.adapter for a retrain, validated, with the optional fields' defaults from the config;
    VerifyError naming what is missing (and how to write one) otherwise. Retrains call it through
    `trainer_dir.recipe_for_retrain`, which reads a Trainer output dir's recipe where there is no recorded one."""
    from ..io import dir_fingerprint

    if not cfg.model.adapter:
        raise VerifyError("model.adapter is not set: verify retrains a LoRA adapter and needs the one to check")
    adapter = cfg.local_or_hub(cfg.model.adapter, "model.adapter")
    path = Path(adapter) / RECIPE_FILE
    if not Path(adapter).is_dir():
        raise VerifyError(f"model.adapter '{adapter}' is not a local directory, so it has no {RECIPE_FILE}; download "
                          f"it and {recipe_help(adapter)}")
    if not path.exists():  # (a Trainer dir's training_args.bin is read before this: trainer_dir.recipe_for_retrain)
        raise VerifyError(f"{path}: not found, nor a Trainer's training_args.bin (in the dir or a checkpoint-* "
                          "folder), so the recipe that trained model.adapter is unknown (an adapter trained outside "
                          f"`gradian train`, saved without its Trainer's files). To verify, {recipe_help(adapter)}")
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise VerifyError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("hyperparameters"), dict):
        raise VerifyError(f"{path}: expected an object with 'seed' and 'hyperparameters'; {recipe_help(adapter)}")
    hp = dict(rec["hyperparameters"])
    missing = [k for k in RECIPE_REQUIRED if (k == "seed" and "seed" not in rec)
               or (k.startswith("hyperparameters.") and k.split(".", 1)[1] not in hp)]
    if missing:
        raise VerifyError(f"{path}: missing recipe field(s) {', '.join(missing)}; {recipe_help(adapter)}")
    for k, v in RECIPE_OPTIONAL.items():
        if isinstance(v, str):  # the config's value
            v = getattr(cfg.train, v.split(".", 1)[1], None)
        hp.setdefault(k.split(".", 1)[1], v)
    try:
        recipe = Recipe.model_validate({**rec, "hyperparameters": hp, "seed": int(rec["seed"])})
    except (ValidationError, TypeError, ValueError) as e:
        why = _first_error(e) if isinstance(e, ValidationError) else str(e)
        raise VerifyError(f"{path}: invalid recipe ({why}); {recipe_help(adapter)}") from None
    if recipe.base_fingerprint:
        now = dir_fingerprint(cfg.local_or_hub(cfg.model.base, "model.base"))
        if now != recipe.base_fingerprint:
            raise VerifyError(f"{path}: the adapter was trained on a base with fingerprint {recipe.base_fingerprint}, "
                              f"but model.base '{cfg.model.base}' has {now}; retraining needs the same base")
    return recipe, path

