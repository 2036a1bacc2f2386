"""What the ``--model`` argument of ``lowp doctor`` and ``lowp memory`` names, and the model built from it.

A ``--model`` argument is read as the first of these that fits (:func:`resolve`):

1. ``demo``: lowp's built-in demo model (each command has its own; the command builds it);
2. ``module:factory`` (``mypkg.models:build``; the factory may be a dotted attribute,
   ``mypkg.models:Net.small``): the module is imported (``PYTHONPATH``, then the current folder,
   are searched) and the factory is called with no arguments; it must return a ``torch.nn.Module``;
3. a Hugging Face ``transformers`` model type, any case (a key of ``transformers.CONFIG_MAPPING``:
   ``gpt2``, ``llama``, ``t5``...), built from its config class's defaults (write ``./llama`` for a
   folder of that name);
4. a path to a ``config.json`` (any JSON file transformers' ``AutoConfig`` reads), or to a folder
   holding one, such as a downloaded checkpoint;
5. a Hugging Face hub id (``meta-llama/Llama-3.2-1B``) whose ``config.json`` is already in the
   local Hugging Face cache (``HF_HUB_CACHE``, by default ``~/.cache/huggingface/hub``).

Nothing is downloaded: transformers and huggingface_hub are called with ``HF_HUB_OFFLINE=1`` and
``local_files_only``, and a hub id whose config is not cached is refused with what to pass instead.
Models from a config are the sequence-to-sequence LM of an encoder-decoder, else the causal LM,
else the base model (:func:`build_from_config`): on the meta device where only shapes matter
(``lowp memory``), with random fp32 weights where the model must run (``lowp doctor``).

Every failure is a :class:`ModelSpecError` whose ``option`` is the command-line option to blame and
whose message says what was expected, for :func:`lowp.cli_args.usage_error`.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ModelSpecError", "ModelSource", "KINDS", "DEMO", "EXPECTED", "resolve", "load_config", "set_layers",
           "build_from_config", "call_factory", "config_origin", "describe", "build", "offline", "cached_config",
           "parameter_count"]

#: What :func:`resolve` returns as :attr:`ModelSource.kind`.
KINDS = ("demo", "factory", "type", "config", "hub")
#: The name of the built-in demo model.
DEMO = "demo"
#: What a ``--model`` argument may be, for messages.
EXPECTED = ("'demo', module:factory (e.g. mypkg.models:build), a transformers model type such as gpt2 or llama, "
            "a path to a config.json or a folder holding one, or a Hugging Face hub id whose config.json is in "
            "the local cache")

_NAME = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_FACTORY = re.compile(rf"^(?P<module>{_NAME}):(?P<attr>{_NAME})$")
_MODEL_TYPE = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?$")
#: Config attributes that count layers; ``--layers`` sets every one of them that the config has.
_LAYER_KEYS = ("num_hidden_layers", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers")


class ModelSpecError(ValueError):
    """A ``--model`` argument (or an option that goes with it) that names no model lowp can build.

    Args:
        message: what is wrong and what was expected.
        option: the command-line option to name in the usage error (default ``"--model"``).
    """

    def __init__(self, message: str, option: str = "--model") -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class ModelSource:
    """What a ``--model`` argument names.

    Args:
        kind: one of :data:`KINDS`.
        text: the argument, without surrounding spaces.
        target: ``"demo"``; ``"module:attr"`` of a factory; the lowercase model type; or the path of
            the ``config.json`` to read (for ``config`` and ``hub``).
    """

    kind: str
    text: str
    target: str

    @property
    def from_config(self) -> bool:
        """Whether the model is built from a transformers config (a model type, a file or a hub id)."""
        return self.kind in ("type", "config", "hub")

    @property
    def label(self) -> str:
        """The name of the model for reports: the demo's and a model type's in lowercase, else the argument."""
        return self.target if self.kind in ("demo", "type") else self.text


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """``HF_HUB_OFFLINE=1`` inside the block (the previous value is restored after): huggingface_hub
    reads it when first imported, and refuses every request from then on."""
    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = before


def _transformers(text: str) -> Any:
    """The ``transformers`` module (imported offline), or a :class:`ModelSpecError` naming ``text``."""
    try:
        with offline():
            import transformers
    except ImportError:
        raise ModelSpecError(f"{text!r} needs Hugging Face transformers, which is not installed "
                             f"(pip install transformers); without it --model takes 'demo' or "
                             f"module:factory") from None
    return transformers


def _model_types() -> frozenset[str]:
    """The model types transformers knows (empty when it is not installed)."""
    try:
        with offline():
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        return frozenset()
    return frozenset(CONFIG_MAPPING_NAMES)


def _path_like(text: str) -> bool:
    """Whether ``text`` can only be meant as a path (not a hub id ``org/name`` nor a bare name)."""
    return text.startswith((".", "/", "~")) or text.endswith(".json") or text.count("/") > 1 or "\\" in text


def cached_config(repo_id: str) -> str | None:
    """The path of ``repo_id``'s ``config.json`` in the local Hugging Face cache, or ``None`` (not
    cached, not a valid hub id, or huggingface_hub not installed). Never touches the network."""
    try:
        with offline():
            from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:   # huggingface_hub's HFValidationError: not a valid repo id
        return None
    return found if isinstance(found, str) and os.path.isfile(found) else None


def _hub_cache() -> str:
    """Where huggingface_hub looks for cached files, for messages."""
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except ImportError:
        return "~/.cache/huggingface/hub"


def resolve(text: str) -> ModelSource:
    """What the ``--model`` argument ``text`` names (see the module docstring for the order); reads
    the file system and the local Hugging Face cache, imports nothing but transformers' table of
    model types. ``ModelSpecError`` for anything else: an empty argument, a path that does not exist
    or a folder without ``config.json``, a hub id that is not cached (saying how to pass a local
    config.json instead), or a string that is none of these."""
    if not isinstance(text, str) or not text.strip():
        raise ModelSpecError(f"expected {EXPECTED}; got {text!r}")
    text = text.strip()
    if text.lower() == DEMO:
        return ModelSource("demo", text, DEMO)
    factory = _FACTORY.match(text)
    if factory and not os.path.exists(text):
        return ModelSource("factory", text, text)
    if _MODEL_TYPE.match(text.lower()) and text.lower() in _model_types():
        return ModelSource("type", text, text.lower())
    path = os.path.expanduser(text)
    if os.path.isdir(path):
        config = os.path.join(path, "config.json")
        if not os.path.isfile(config):
            raise ModelSpecError(f"the folder {text!r} holds no config.json (expected a config.json file or a "
                                 f"folder holding one, such as a downloaded checkpoint)")
        return ModelSource("config", text, config)
    if os.path.exists(path):
        if not os.path.isfile(path):
            raise ModelSpecError(f"{text!r} is not a regular file (expected a config.json file or a folder "
                                 f"holding one)")
        return ModelSource("config", text, path)
    if _path_like(text):
        raise ModelSpecError(f"no such file or folder: {text!r} (expected a path to a config.json or a folder "
                             f"holding one)")
    if not _HUB_ID.match(text) or ".." in text or "--" in text or len(text) > 96:
        raise ModelSpecError(f"expected {EXPECTED}; got {text!r}")
    found = cached_config(text)
    if found is None:
        missing = "" if importlib.util.find_spec("transformers") else (
            " (transformers is not installed: model types, config files and hub ids need it)")
        raise ModelSpecError(
            f"{text!r} is not 'demo', module:factory, a transformers model type or a local path{missing}, and as a "
            f"Hugging Face hub id its config.json is not in the local cache ({_hub_cache()}); lowp never downloads "
            f"(it runs with HF_HUB_OFFLINE=1: there may be no network). Fetch the config where there is a network "
            f"(hf download {text} config.json --local-dir DIR, or save config.json from the model's page) and pass "
            f"its path: --model DIR/config.json")
    return ModelSource("hub", text, found)


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """transformers' logging at error level inside the block (its warnings about defaults are noise here)."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)


def _reason(exc: BaseException) -> str:
    """The first line of an exception's message, or its class name."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def load_config(source: ModelSource, layers: int | None = None) -> Any:
    """The transformers config of ``source`` (``from_config``: a model type's defaults, or a
    ``config.json`` read with ``AutoConfig.from_pretrained(path, local_files_only=True)``), with
    ``layers`` layers when given (:func:`set_layers`). ``ModelSpecError`` when transformers is
    missing or cannot read the file."""
    if not source.from_config:
        raise ValueError(f"source: expected a model type, a config.json or a hub id, got a {source.kind}")
    transformers = _transformers(source.text)
    with offline(), _quiet(transformers):
        if source.kind == "type":
            config = transformers.CONFIG_MAPPING[source.target]()
        else:
            try:
                config = transformers.AutoConfig.from_pretrained(source.target, local_files_only=True)
            except Exception as exc:   # OSError, ValueError, JSON errors, KeyError: all mean a bad file
                where = source.target if source.kind == "config" else f"{source.text}'s cached {source.target}"
                raise ModelSpecError(f"cannot read a transformers config from {where!r}: {_reason(exc)} "
                                     f"(expected a config.json with a model_type that transformers "
                                     f"{transformers.__version__} knows)") from None
    if layers is not None:
        set_layers(config, layers)
    return config


def set_layers(config: Any, layers: int) -> None:
    """Give ``config`` ``layers`` layers: every layer count it has (``num_hidden_layers``, ``n_layer``
    through its alias, ``num_layers``, ``num_decoder_layers``, ``encoder_layers``, ``decoder_layers``)
    is set, and a per-layer ``layer_types`` list is cut or repeated to that length.
    ``ModelSpecError`` naming ``--layers`` when the config has no layer count."""
    changed = False
    for key in _LAYER_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(config, key, layers)
            changed = True
    if not changed:
        raise ModelSpecError(f"{type(config).__name__} has no layer count ({', '.join(_LAYER_KEYS)}), so the "
                             f"number of layers cannot be set", option="--layers")
    kinds = getattr(config, "layer_types", None)
    if isinstance(kinds, list) and kinds:
        config.layer_types = [kinds[i % len(kinds)] for i in range(layers)]


def build_from_config(config: Any, *, meta: bool, what: str = "its config") -> nn.Module:
    """The training model of ``config``: the sequence-to-sequence LM of an encoder-decoder, else the
    causal LM, falling back to the base model when the architecture has no such head; fp32, on the
    meta device with ``meta`` (shapes only, nothing allocated), else with random weights drawn from
    torch's global generator. ``ModelSpecError`` when the constructor fails (missing packages,
    required sub-configs...), saying ``what`` it was built from."""
    import transformers

    head = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM
    device = torch.device("meta") if meta else contextlib.nullcontext()
    try:
        with offline(), _quiet(transformers), device:
            try:
                return head.from_config(config, dtype=torch.float32)
            except ValueError:   # no such head for this architecture
                return transformers.AutoModel.from_config(config, dtype=torch.float32)
    except Exception as exc:   # a third-party constructor: any failure becomes a usage error
        raise ModelSpecError(f"cannot build a model from {what}: {_reason(exc)}") from None


@contextlib.contextmanager
def _current_folder_importable() -> Iterator[None]:
    """The current folder on ``sys.path`` (after everything else) inside the block, as ``python -m``
    would have it: the ``lowp`` script does not."""
    here = os.getcwd()
    added = here not in sys.path and "" not in sys.path
    if added:
        sys.path.append(here)
    try:
        yield
    finally:
        if added and here in sys.path:
            sys.path.remove(here)


def _factory(target: str) -> Any:
    """The callable named by ``module:attr``."""
    module_name, attr = target.split(":")
    expected = "expected module:factory naming a callable that returns a torch.nn.Module"
    try:
        with _current_folder_importable():
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ModelSpecError(f"cannot import the module {module_name!r} of {target!r}: {_reason(exc)} "
                                 f"(PYTHONPATH and the current folder are searched; {expected})") from None
        raise ModelSpecError(f"importing {module_name!r} of {target!r} raised ModuleNotFoundError: "
                             f"{_reason(exc)}") from None
    except Exception as exc:
        raise ModelSpecError(f"importing {module_name!r} of {target!r} raised {type(exc).__name__}: "
                             f"{_reason(exc)}") from None
    found: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(found, part):
            owner = module_name if i == 0 else f"{module_name}:{'.'.join(attr.split('.')[:i])}"
            raise ModelSpecError(f"{owner!r} has no attribute {part!r} ({expected})")
        found = getattr(found, part)
    if not callable(found):
        raise ModelSpecError(f"{target!r} is not callable (it is of type {type(found).__name__}; {expected})")
    return found


def call_factory(target: str, *, meta: bool = False) -> nn.Module:
    """Import the module of ``target`` (``"module:attr"``) and call the factory with no arguments;
    with ``meta`` the call runs inside ``torch.device("meta")`` so that no weight memory is
    allocated, and, should it fail there (a factory that loads or computes real data), runs again
    plainly. ``ModelSpecError`` when the module cannot be imported, the attribute is missing or not
    callable, the call raises, or what it returns is not a ``torch.nn.Module``."""
    factory = _factory(target)
    model: Any = None
    if meta:
        try:
            with torch.device("meta"):
                model = factory()
        except Exception:
            model = None
    if model is None:
        try:
            model = factory()
        except Exception as exc:
            raise ModelSpecError(f"{target}() raised {type(exc).__name__}: {_reason(exc)} (expected it to return "
                                 f"a torch.nn.Module when called with no arguments)") from None
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"{target}() returned {type(model).__name__}, expected a torch.nn.Module")
    return model


def parameter_count(model: nn.Module) -> int:
    """Elements of the model's parameters (tied weights once)."""
    return sum(p.numel() for p in model.parameters())


def describe(source: ModelSource, model: nn.Module, config: Any = None, layers: int | None = None) -> str:
    """One line naming the model built from ``source``, e.g. ``LlamaForCausalLM from path/config.json``."""
    name = type(model).__name__
    if source.kind == "type":
        text = f"{name}({type(config).__name__}())"
    elif source.kind == "config":
        text = f"{name} from {source.target}"
    elif source.kind == "hub":
        text = f"{name} from {source.text} (cached config.json)"
    elif source.kind == "factory":
        text = f"{name} from {source.target}()"
    else:
        text = name
    return text + ("" if layers is None else f", {layers} layer{'' if layers == 1 else 's'}")


def config_origin(source: ModelSource, config: Any) -> str:
    """What the config of ``source`` came from, for messages: ``LlamaConfig()'s defaults``, the path
    of the ``config.json``, or ``org/name's cached config.json``."""
    if source.kind == "type":
        return f"{type(config).__name__}()'s defaults"
    return source.target if source.kind == "config" else f"{source.text}'s cached config.json"


def build(source: ModelSource, *, meta: bool, layers: int | None = None) -> tuple[nn.Module, str]:
    """(model, description) of a factory or config ``source`` (the demo models belong to the
    commands): the factory's module (:func:`call_factory`), or the model of the config
    (:func:`load_config`, :func:`build_from_config`) on the meta device with ``meta``. ``layers``
    applies to configs only (``ModelSpecError`` naming ``--layers`` for a factory).
    ``ModelSpecError`` also for a model without parameters."""
    if source.kind == "demo":
        raise ValueError("source: the demo model is built by each command")
    if source.kind == "factory":
        if layers is not None:
            raise ModelSpecError("applies to models built from a transformers config (a model type, a config.json "
                                 "or a cached hub id), not to module:factory", option="--layers")
        model = call_factory(source.target, meta=meta)
        config = None
    else:
        config = load_config(source, layers)
        model = build_from_config(config, meta=meta, what=config_origin(source, config))
    description = describe(source, model, config, layers)
    if parameter_count(model) == 0:
        raise ModelSpecError(f"{description} has no parameters (expected a model with at least one parameter)")
    return model, description
