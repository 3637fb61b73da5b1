"""What every verb loads once: config, data, tokenizer, the model with its adapter, the LoRA sites.

`open_session` is the one loader: `attribute`, `evaluate`, `index`, `fidelity` and the setup checks all start from
it (or, for `diagnose`, from the same loaders one by one). Earlier checkpoints load onto the same base
(`Session.checkpoint`), so N checkpoints cost one base load.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

from ..config import Config
from ..capability.metrics import Metric, metric_from_config
from ..runlog import RunLog
from ..runtime import configure_threads, seed_everything
from .model import (
    ADAPTER_NAME, LoraSite, add_adapter, adapter_ref, drop_adapter, load_model, load_tokenizer, lora_sites,
    no_sites_error, use_adapter,
)
from .records import DataLocation, EvalItem, Example, data_location, load_eval, load_train
from .tokenize import Tokenized, tokenize_example, uses_chat


@dataclass
class Session:
    """The loaded inputs of one run, and `log`, the run's record of itself (report flags, seconds per stage)."""

    cfg: Config
    tokenizer: object
    examples: list[Example]
    eval_items: Optional[list[EvalItem]]
    model: object
    sites: list[LoraSite]
    skipped: list[str]
    adapter_path: str
    chat: bool
    log: RunLog = field(default_factory=RunLog)  # report flags, stage lines and seconds (wall and CPU) per stage
    metric: Optional[Metric] = None  # evaluation.metric resolved (a Python metric imported)
    _toks: Optional[list[Tokenized]] = None
    # data.train / data.eval as `records.data_location` resolved them when they were read (the setup checks reuse
    # them: the place read is the place checked); None where nothing was read
    train_location: Optional[DataLocation] = None
    eval_location: Optional[DataLocation] = None

    def __post_init__(self):
        if self.metric is None:
            self.metric = metric_from_config(self.cfg)

    @property
    def loss(self) -> str:
        """Which tokens the fine-tune trained on: the recipe's `loss` (recorded by gradian train or GradianCallback
        from what the trainer masked), else `train.loss`."""
        return training_loss(self.cfg, self.adapter_path)

    @property
    def toks(self) -> list[Tokenized]:
        if self._toks is None:
            loss = self.loss
            self._toks = [tokenize_example(self.tokenizer, e, self.cfg.grads.max_seq_length, loss=loss)
                          for e in self.examples]
        return self._toks

    @property
    def one_line(self) -> bool:
        """Whether generated answers end at their first line break (`capability.evaluate.one_line_answers`)."""
        from ..capability.evaluate import one_line_answers

        return one_line_answers(self.examples, self.chat)

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else 0

    @property
    def device(self):
        return next(self.model.parameters()).device

    @contextmanager
    def checkpoint(self, path: str, name: str) -> Iterator["Session"]:
        """A view of this session with the adapter at `path` (an earlier checkpoint) loaded onto the same base under
        `name` and active: its own LoRA sites and adapter path, the same data, tokenizer and model object. The
        adapter is unloaded afterwards."""
        add_adapter(self.model, path, name, self.cfg)
        try:
            with use_adapter(self.model, name):
                sites, skipped = lora_sites(self.model, self.cfg.grads.module_filter, name)
                if not sites:
                    raise no_sites_error(path, self.cfg.grads.module_filter, skipped)
                # the same run log: what a stage at this checkpoint raises and takes is the run's
                view = Session(self.cfg, self.tokenizer, self.examples, self.eval_items, self.model, sites, skipped,
                               str(path), self.chat, log=self.log, metric=self.metric, _toks=self.toks,
                               train_location=self.train_location, eval_location=self.eval_location)
                yield view
        finally:
            drop_adapter(self.model, name)


def training_loss(cfg: Config, adapter_path: Optional[str]) -> str:
    """"supervised" (completions / assistant turns) or "all" (every token), as the adapter was trained: its recipe's
    hyperparameters.loss when it has one, else the config's train.loss."""
    from ..training.recipe import read_recipe

    try:
        recipe = read_recipe(adapter_path) if adapter_path else None
    except Exception:  # an unreadable recipe is reported by the checks that need it
        recipe = None
    if recipe is not None and recipe.hyperparameters.loss in ("supervised", "all"):
        return recipe.hyperparameters.loss
    return cfg.train.loss


def open_session(cfg: Config, *, need_eval: bool = True, load_model_: bool = True) -> Session:
    """Data, tokenizer and (unless `load_model_` is false: verify re-measures retrains, each loaded on its own)
    the model with its adapter and LoRA sites. Every failure is a `GradianError` carrying its check id."""
    configure_threads(cfg.model.threads)
    seed_everything(cfg.seed)
    t0 = time.time()
    train_at = data_location(cfg, cfg.data.train)
    examples = load_train(train_at)
    metric = metric_from_config(cfg)  # a Python metric is imported here: a failing import stops before any work
    eval_at = data_location(cfg, cfg.data.eval) if (cfg.data.eval and need_eval) else None
    eval_items = load_eval(eval_at, need_answer=metric.needs_answer) if eval_at is not None else None
    if eval_items:
        metric.check_items(eval_items)
    tok = load_tokenizer(cfg)
    adapter = adapter_ref(cfg)
    model, sites, skipped = None, [], []
    if load_model_:
        model = load_model(cfg, adapter)
        sites, skipped = lora_sites(model, cfg.grads.module_filter, ADAPTER_NAME)
        if not sites:
            raise no_sites_error(adapter, cfg.grads.module_filter, skipped)
    s = Session(cfg, tok, examples, eval_items, model, sites, skipped, str(adapter), uses_chat(examples),
                metric=metric, train_location=train_at, eval_location=eval_at)
    s.log.timings["load"] = round(time.time() - t0, 3)
    return s
