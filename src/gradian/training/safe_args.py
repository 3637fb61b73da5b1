"""`training_args.bin` read without executing it: the fields of a Trainer run's `TrainingArguments` / `SFTConfig`.

`Trainer.save_model` writes `training_args.bin` with `torch.save`: a zip whose `*/data.pkl` is a pickle of the
arguments object. A pickle can name any importable callable and call it while it loads (`__reduce__`), so a run dir
from somebody else could run code through `torch.load(weights_only=False)` or `pickle.load`. This reader never
imports or calls anything the file names:

* every global the pickle names is checked against `ALLOWED`: module prefixes of the libraries whose classes a
  TrainingArguments pickle holds (transformers, trl, accelerate, peft, torch's `device`/`dtype`, pathlib's paths)
  and a few harmless builtins (containers, `_codecs.encode` for bytes); anything else (`os.system`, `builtins.eval`, `subprocess.*`, ...)
  stops the load with `UnsafePickle`, which names the global, before it is called;
* an allowed library global is never imported either: `find_class` hands the unpickler an inert stand-in class
  (`Stub`) that keeps the arguments and state the pickle gives it. A `SchedulerType("linear")` becomes the string
  "linear", the `SFTConfig` object becomes the dict of its fields; no constructor, `__setstate__` or `__post_init__`
  of the real class runs, and fields of another transformers/TRL version read the same way;
* tensors (persistent storage ids) are refused: training arguments hold none.

`torch.load(weights_only=True)` with an allowlist would instantiate the real classes (accelerate's `PartialState`
among them) and fail on a field type another version added; stand-ins need neither.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

# Library modules whose globals come back as inert stand-ins (never imported).
STUB_MODULES = ("transformers", "trl", "accelerate", "peft")
# torch globals a TrainingArguments pickle holds (`device`, dtypes such as `torch.float32`): stand-ins too, and the
# path classes of an output_dir / logging_dir given as a Path.
TORCH_STUBS = {"device", "dtype", "float32", "float16", "bfloat16", "float64", "int64", "int32"}
PATH_STUBS = {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}
# Real objects the unpickler may call: containers and the codec pickle protocol 2 writes bytes with.
SAFE_BUILTINS = {("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "list"): list,
                 ("builtins", "dict"): dict, ("builtins", "tuple"): tuple, ("collections", "OrderedDict"): dict}
ALLOWED = "transformers.*, trl.*, accelerate.*, peft.*, torch's device and dtypes and pathlib's paths (read as " \
          "plain values), and the builtin containers"
MAX_BYTES = 64 << 20  # a TrainingArguments pickle is a few kB


class UnsafePickle(Exception):
    """The file names a global outside `ALLOWED` (or holds tensors): nothing was called; the message says which."""


class Stub:
    """An allowed library global as the unpickler sees it: a class whose instances keep what the pickle passed to
    them (constructor arguments, `BUILD` state). Nothing of the real class runs."""

    _global = ("?", "?")

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args, obj.kwargs, obj.state = args, kwargs, None
        return obj

    def __init__(self, *args, **kwargs):  # a REDUCE call: the arguments are kept by __new__
        pass

    def __setstate__(self, state):
        self.state = state

    def __reduce__(self):  # a stand-in is never written back
        raise TypeError("a Stub cannot be pickled")

    def __repr__(self) -> str:
        return f"Stub({'.'.join(self._global)})"


def _stub(module: str, name: str) -> type:
    return type(name, (Stub,), {"_global": (module, name), "__module__": "gradian.training.safe_args"})


def allowed(module: str, name: str) -> bool:
    root = module.split(".", 1)[0]
    return ((module, name) in SAFE_BUILTINS or (root in STUB_MODULES and not name.startswith("__"))
            or (module == "torch" and name in TORCH_STUBS) or (module == "pathlib" and name in PATH_STUBS)
            or (module, name) == ("_codecs", "encode"))


class _Restricted(pickle.Unpickler):
    def __init__(self, f, where: str):
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str):
        if not allowed(module, name):
            raise UnsafePickle(f"it names {module}.{name}, which a training-arguments file never holds (allowed: "
                               f"{ALLOWED}); nothing was executed")
        if (module, name) in SAFE_BUILTINS:
            return SAFE_BUILTINS[(module, name)]
        if (module, name) == ("_codecs", "encode"):
            return _latin1
        return _stub(module, name)

    def persistent_load(self, pid):
        raise UnsafePickle("it holds tensor data, which a training-arguments file never holds; nothing was executed")


def _latin1(text: str, encoding: str = "latin1") -> bytes:
    """`_codecs.encode` as protocol-2 pickles use it for bytes (a str in latin-1), and nothing else."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise UnsafePickle("it calls _codecs.encode other than to write bytes; nothing was executed")
    return text.encode("latin1")


def plain(obj: Any) -> Any:
    """A loaded value as JSON-like data: a stand-in becomes its state (a dict of fields) or, for an enum, a device
    or a dtype, its single argument (or its name); containers recursively."""
    if isinstance(obj, Stub):
        if isinstance(obj.state, tuple) and len(obj.state) == 2:  # (state, slotstate)
            st = {**(obj.state[0] or {}), **(obj.state[1] or {})}
            return {str(k): plain(v) for k, v in st.items()}
        if isinstance(obj.state, dict):
            return {str(k): plain(v) for k, v in obj.state.items()}
        if len(obj.args) == 1 and not obj.kwargs:
            return plain(obj.args[0])
        if obj._global[0] == "pathlib":  # a path pickles as its parts; a pure path joins them (no file access)
            pure = PureWindowsPath if "Windows" in obj._global[1] else PurePosixPath
            return str(pure(*[str(a) for a in obj.args]))
        if obj.args:
            return [plain(a) for a in obj.args]
        return obj._global[1]
    if isinstance(obj, dict):
        return {str(plain(k)): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((plain(v) for v in obj), key=repr)
    if isinstance(obj, (bytes, bytearray)):
        return bytes(obj).decode("latin1")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return repr(obj)


def _pickle_bytes(path: Path) -> bytes:
    """The pickle inside a `torch.save` zip (`<name>/data.pkl`), or the file itself when it is a bare pickle."""
    if path.stat().st_size > MAX_BYTES:
        raise UnsafePickle(f"it is {path.stat().st_size} bytes, far more than training arguments take")
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(names) != 1:
                raise UnsafePickle("it is a zip but not one torch.save wrote (no single data.pkl in it)")
            info = z.getinfo(names[0])
            if info.file_size > MAX_BYTES:
                raise UnsafePickle(f"its data.pkl is {info.file_size} bytes, far more than training arguments take")
            return z.read(names[0])
    return path.read_bytes()


def read_training_args(path: str | Path) -> dict[str, Any]:
    """The fields of the arguments object in `training_args.bin` as plain data, plus `__class__` (e.g.
    "trl.trainer.sft_config.SFTConfig"). `UnsafePickle` when the file names anything outside `ALLOWED`;
    ValueError when it is not a pickle of an arguments object."""
    path = Path(path)
    data = _pickle_bytes(path)
    try:
        obj = _Restricted(io.BytesIO(data), str(path)).load()
    except UnsafePickle:
        raise
    except Exception as e:  # a truncated or foreign file: pickle's own errors, not a crash
        raise ValueError(f"not a readable pickle ({type(e).__name__}: {e})") from None
    if not isinstance(obj, Stub) or not isinstance(plain(obj), dict):
        raise ValueError(f"it holds {type(obj).__name__}, not a TrainingArguments object")
    fields = plain(obj)
    fields["__class__"] = ".".join(obj._global)
    return fields
