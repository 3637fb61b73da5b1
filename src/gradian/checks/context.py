"""What the checks look at, loaded lazily and at most once, through the same loaders every verb uses (`setup`).

A loader's `GradianError` carries the id of the check that owns the failure (`error.check`); the context remembers
it as an `Unavailable` for that check, so the owner fails with the loader's own message and every other check that
needed the resource is skipped. Nothing here builds an index or runs the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from ..config import Config
from ..errors import ConfigError, DataError, GradianError
from .registry import Unavailable

_LABELS = {
    "train_path": "data.train", "eval_path": "data.eval", "train_rows": "the training file",
    "eval_rows": "the eval file", "examples": "the training records", "eval_items": "the eval records",
    "tokenizer": "the tokenizer", "base_config": "the base model config", "causal": "a causal-LM base",
    "adapter_path": "the adapter directory", "adapter_config": "adapter_config.json", "lora": "a LoRA CAUSAL_LM adapter",
    "device": "the device", "base_model": "the base model weights", "model": "the base with its adapter",
    "sites": "LoRA sites", "toks": "the tokenized training rows",
}


def _owner(e: GradianError, default: str) -> str:
    return e.check or ("config.paths" if isinstance(e, ConfigError) else default)


def quiet(fn, *args, **kwargs):
    """Call a transformers/PEFT loader without its progress bars and info chatter."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover
        return fn(*args, **kwargs)
    import warnings

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


class Context:
    """What the checks look at, loaded lazily and at most once; failures are remembered as `Unavailable`."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._memo: dict[str, tuple[Any, Optional[Unavailable]]] = {}
        self._session = None

    @classmethod
    def from_session(cls, s) -> "Context":
        """Reuse what `open_session` already loaded (data, tokenizer, model, sites)."""
        ctx = cls(s.cfg)
        m = ctx._memo
        m["train_path"] = (s.train_location, None)
        m["train_rows"] = ([(e.record, e.source) for e in s.examples], None)
        m["train_parse"] = ((s.examples, [], []), None)
        m["examples"] = (s.examples, None)
        if s.eval_items is not None:
            m["eval_path"] = (s.eval_location, None)
            m["eval_rows"] = ([({}, it.source) for it in s.eval_items], None)
            m["eval_parse"] = ((s.eval_items, None), None)
        m["tokenizer"] = (s.tokenizer, None)
        m["adapter_path"] = (s.adapter_path, None)
        m["model"] = (s.model, None)
        m["base_model"] = (s.model, None)
        m["sites"] = ((s.sites, s.skipped), None)
        ctx._session = s  # Session.toks is cached there and reused by the index
        return ctx

    def _get(self, name: str, make: Callable[[], Any], default_owner: str = "model.load_failed") -> Any:
        if name not in self._memo:
            try:
                self._memo[name] = (make(), None)
            except Unavailable as u:
                if not u.what:
                    u.what = _LABELS.get(name, name)
                self._memo[name] = (None, u)
            except GradianError as e:
                self._memo[name] = (None, Unavailable(_owner(e, default_owner), str(e), fix=e.fix,
                                                      what=_LABELS.get(name, name)))
        val, err = self._memo[name]
        if err is not None:
            raise err
        return val

    def peek(self, name: str) -> Any:
        """A resource if it already loaded, else None (never loads)."""
        val, err = self._memo.get(name, (None, None))
        return None if err else val

    # ------------------------------------------------------------------ paths and data

    def _existing(self, key: str, value: Optional[str]):
        from ..setup.records import HubDataset, data_location

        if not value:
            return None
        p = data_location(self.cfg, value)
        if not isinstance(p, HubDataset) and not p.exists():
            raise Unavailable("config.paths", f"{key}: {p} not found")
        return p

    @property
    def train_path(self) -> Path:
        return self._get("train_path", lambda: self._existing("data.train", self.cfg.data.train))

    @property
    def eval_path(self) -> Optional[Path]:
        return self._get("eval_path", lambda: self._existing("data.eval", self.cfg.data.eval))

    def _rows(self, path: Path):
        from ..setup.records import read_records

        return read_records(path)

    @property
    def train_rows(self) -> list:
        return self._get("train_rows", lambda: self._rows(self.train_path), "data.unreadable_record")

    @property
    def eval_rows(self) -> Optional[list]:
        return self._get("eval_rows", lambda: None if self.eval_path is None else self._rows(self.eval_path),
                         "data.unreadable_record")

    @property
    def train_parse(self) -> tuple[list, list[str], list[str]]:
        """(examples, unknown-shape messages, invalid-record messages) over every training record."""
        def make():
            from ..setup.records import UNKNOWN_SHAPE, parse_train

            examples, errors = parse_train(self.train_rows)
            unknown = [str(e) for e in errors if e.check == UNKNOWN_SHAPE]
            invalid = [str(e) for e in errors if e.check != UNKNOWN_SHAPE]
            return examples, unknown, invalid
        return self._get("train_parse", make)

    @property
    def examples(self) -> list:
        def make():
            rows = self.train_rows
            if not rows:
                raise Unavailable("data.empty", f"{self.train_path}: no records; the training set is empty")
            ex, unknown, invalid = self.train_parse
            if unknown:
                raise Unavailable("data.unknown_record_shape", unknown[0])
            if invalid:
                raise Unavailable("data.invalid_record", invalid[0])
            return ex
        return self._get("examples", make)

    @property
    def eval_parse(self) -> tuple[Optional[list], Optional[tuple[str, str]]]:
        """(eval items, None) or (None, (check id, message)) for the first bad eval record."""
        def make():
            from ..setup.records import load_eval

            if self.eval_rows is None or not self.eval_rows:
                return None, None
            from ..capability.metrics import metric_from_config
            from ..errors import GradianError

            try:
                need = metric_from_config(self.cfg).needs_answer
            except GradianError:  # evaluation.metric reports it
                need = True
            try:
                return load_eval(self.eval_path, need_answer=need), None
            except DataError as e:
                return None, (_owner(e, "data.invalid_record"), str(e))
        return self._get("eval_parse", make)

    @property
    def eval_items(self) -> Optional[list]:
        def make():
            if self.eval_rows is None:
                return None
            if not self.eval_rows:
                raise Unavailable("data.empty", f"{self.eval_path}: no records; the eval set is empty")
            items, problem = self.eval_parse
            if problem:
                raise Unavailable(problem[0], problem[1])
            return items
        return self._get("eval_items", make)

    # ------------------------------------------------------------------ tokenizer, model, adapter

    @property
    def base_ref(self) -> str:
        from ..setup.model import base_ref

        return self._get("base_ref", lambda: base_ref(self.cfg), "config.paths")

    @property
    def tokenizer(self):
        def make():
            from ..setup.model import load_tokenizer

            self.base_ref
            return quiet(load_tokenizer, self.cfg)
        return self._get("tokenizer", make, "tokenizer.load_failed")

    @property
    def base_config(self):
        def make():
            from ..setup.model import load_base_config

            self.base_ref
            return quiet(load_base_config, self.cfg)
        return self._get("base_config", make)

    @property
    def causal(self) -> bool:
        def make():
            from ..setup.model import check_causal

            check_causal(self.cfg, self.base_config)
            return True
        return self._get("causal", make, "model.not_causal_lm")

    @property
    def adapter_path(self) -> str:
        from ..setup.model import adapter_ref

        return self._get("adapter_path", lambda: adapter_ref(self.cfg), "model.full_finetune")

    @property
    def adapter_config(self) -> dict:
        from ..setup.model import read_adapter_config

        return self._get("adapter_config", lambda: read_adapter_config(self.adapter_path), "adapter.unreadable")

    @property
    def lora(self) -> bool:
        def make():
            from ..setup.model import check_lora_config

            check_lora_config(self.adapter_config)
            return True
        return self._get("lora", make, "adapter.not_lora")

    @property
    def device(self):
        from ..setup.model import device_of

        return self._get("device", lambda: device_of(self.cfg), "device.unavailable")

    @property
    def base_model(self):
        def make():
            from ..setup.model import load_base

            self.causal
            return quiet(load_base, self.cfg, self.device)
        return self._get("base_model", make)

    @property
    def model(self):
        def make():
            from ..setup.model import attach_adapter

            self.lora
            path = self.adapter_path
            return quiet(attach_adapter, self.base_model, path, self.cfg)
        return self._get("model", make, "adapter.base_mismatch")

    @property
    def sites(self) -> tuple[list, list[str]]:
        def make():
            from ..setup.model import lora_sites, no_sites_error

            sites, skipped_ = lora_sites(self.model, self.cfg.grads.module_filter)
            if not sites:
                e = no_sites_error(self.adapter_path, self.cfg.grads.module_filter, skipped_)
                raise Unavailable(e.check, str(e), fix=e.fix, level="error")
            return sites, skipped_
        return self._get("sites", make)

    @property
    def toks(self) -> list:
        def make():
            from ..setup.tokenize import tokenize_example

            examples = self.examples
            tok = self.tokenizer
            if self._session is not None:
                try:
                    return self._session.toks
                except DataError as e:
                    raise Unavailable("data.tokenize_failed", str(e)) from None
            from ..setup.session import training_loss

            try:
                loss = training_loss(self.cfg, self.cfg.path(self.cfg.model.adapter) if self.cfg.model.adapter else None)
            except Exception:
                loss = self.cfg.train.loss
            out = []
            for ex in examples:
                try:
                    out.append(tokenize_example(tok, ex, self.cfg.grads.max_seq_length, loss=loss))
                except Exception as e:  # DataError, or a chat template that raises (jinja2) on this record
                    if not isinstance(e, (DataError, ValueError, TypeError, KeyError)) and "jinja2" not in type(e).__module__:
                        raise
                    msg = str(e)
                    if ex.source and ex.source not in msg:
                        msg = f"{ex.source}: {msg}"
                    raise Unavailable("data.tokenize_failed", msg) from None
            return out
        return self._get("toks", make)
