"""``lowp doctor``: run the precision monitor on a model's forward and backward and print its report.

Without ``--model`` (or with ``--model demo``) the model is the built-in demo
(:mod:`lowp.audit.demo`). Otherwise ``--model`` names a model as :mod:`lowp.model_spec` reads it:
``module:factory``, a transformers model type, a local ``config.json`` or a cached hub id. A model
from a config is built with random fp32 weights (``--layers`` builds fewer layers), after its
parameter count, read on the meta device, has been checked against the memory available. The
model runs one forward and backward in fp32 on a random batch: token ids for a transformers model
or a model whose first layer is an ``nn.Embedding``, ``--scale`` times normal features for one whose
first layer is an ``nn.Linear``; the loss is the cross-entropy of the output's last dimension
against random labels, times ``--loss-factor``. Progress goes to stderr (``--quiet``: nothing).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lowp.cli_args import SEED_MAX, float_in, format_spec, int_in

if TYPE_CHECKING:
    import torch
    from torch import nn

    from lowp.progress import Progress

HELP = "run the overflow/underflow monitor on a model (the demo or --model) and print per-module advice for a format"

#: ``--scale`` when it is not given (the demo's inputs are this many standard deviations wide)
DEFAULT_SCALE = 300.0


def _checkable_format(text: str) -> str:
    """A format narrower than fp32: the models compute in fp32, so only those can be checked against."""
    from lowp.formats import get_format
    from lowp.rounding import fits_in

    name = format_spec(text)
    fmt, fp32 = get_format(name), get_format("fp32")
    if fmt == fp32 or not fits_in(fmt, fp32):
        raise argparse.ArgumentTypeError(f"expected a format narrower than fp32 (doctor computes in fp32), "
                                         f"such as fp16, bf16 or fp8_e4m3fn; got {text!r}")
    return name


def _model_text(text: str) -> str:
    """``--model`` as given, refused when empty (what it names is found in ``run``, with progress)."""
    if not text.strip():
        from lowp.model_spec import EXPECTED

        raise argparse.ArgumentTypeError(f"expected {EXPECTED}; got {text!r}")
    return text.strip()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``lowp doctor`` to ``parser``."""
    parser.add_argument("--model", type=_model_text, default=None, metavar="MODEL",
                        help="the model to check (default: the demo): 'demo'; module:factory (a function called "
                             "with no arguments that returns an nn.Module); a transformers model type such as gpt2; "
                             "a path to a config.json or a folder holding one; or a Hugging Face hub id whose "
                             "config.json is in the local cache. Configs get random fp32 weights; nothing is "
                             "downloaded")
    parser.add_argument("--layers", type=int_in(1, 4096), default=None, metavar="N",
                        help="build a model from a config with N layers instead of its own count (smaller and "
                             "faster; the per-layer report is the same kind)")
    parser.add_argument("--format", type=_checkable_format, default="fp16",
                        help="target format to check against, narrower than fp32 (default fp16)")
    parser.add_argument("--scale", type=float_in(0, 1e30, low_open=True), default=None,
                        help=f"input scale in (0, 1e30] for models that take features (the demo, a first layer "
                             f"nn.Linear; large values overflow fp16; default {DEFAULT_SCALE:g}); token models "
                             f"refuse it")
    parser.add_argument("--loss-factor", type=float_in(0, 1e30, low_open=True), default=1e-6,
                        help="loss multiplier in (0, 1e30] (small values underflow grads)")
    parser.add_argument("--batch", type=int_in(1, 4096), default=4, help="sequences in the batch (default 4)")
    parser.add_argument("--tokens", type=int_in(1, 65536), default=8, help="tokens per sequence (default 8)")
    parser.add_argument("--seed", type=int_in(0, SEED_MAX, " (a 64-bit seed)"), default=0,
                        help="random seed for weights and inputs, in [0, 2**64) (default 0)")
    parser.add_argument("--quiet", action="store_true", help="print no progress lines on stderr")


def run(args: argparse.Namespace) -> int:
    """Run ``lowp doctor`` with the parsed ``args``; returns the exit status."""
    from lowp.cli_args import usage_error

    if args.model is None or args.model.lower() == "demo":
        if args.layers is not None:
            usage_error("doctor", "--layers", "applies to models built from a transformers config (a model type, "
                                              "a config.json or a cached hub id), not to the demo model")
        return _run_demo(args)
    return _run_model(args)


def _run_demo(args: argparse.Namespace) -> int:
    """``lowp doctor`` on the built-in demo model."""
    import torch

    from lowp.audit.demo import DemoModel, demo_batch, run_demo
    from lowp.audit.monitor import PrecisionMonitor
    from lowp.cli_args import check_memory

    scale = DEFAULT_SCALE if args.scale is None else args.scale
    # fp32 activations, their gradients and the monitor's temporaries: the block's tokens x tokens
    # attention scores and some 256 values per token
    check_memory("doctor", "--tokens", 48 * args.batch * args.tokens * (args.tokens + 256),
                 f"the demo model on {args.batch} x {args.tokens} tokens")
    torch.manual_seed(args.seed)
    model = DemoModel()
    x, y = demo_batch(batch=args.batch, tokens=args.tokens, scale=scale, seed=args.seed)
    monitor = PrecisionMonitor(model, args.format)
    with monitor:
        loss = run_demo(model, x, y, args.loss_factor)
    print(f"demo model: {sum(p.numel() for p in model.parameters())} parameters, input scale {scale:g}, "
          f"loss {float(loss):.3g} (x{args.loss_factor:g}); computed in fp32, checked against {monitor.format.name}\n")
    print(monitor.report())
    return 0


def _run_model(args: argparse.Namespace) -> int:
    """``lowp doctor --model``: build the model, feed it a random batch under the monitor, print the report."""
    from lowp.audit.monitor import PrecisionMonitor
    from lowp.cli_args import usage_error
    from lowp.progress import Progress
    from lowp.model_spec import ModelSpecError

    with Progress("lowp doctor", enabled=not args.quiet) as progress:
        try:
            model, description = _build(args, progress)
        except ModelSpecError as exc:
            usage_error("doctor", exc.option, str(exc))
        batch = _example(model, args)
        count = sum(p.numel() for p in model.parameters())
        monitor = PrecisionMonitor(model, args.format)
        progress.stage(f"running forward and backward of {description} on {batch.description}, with the "
                       f"monitor's hooks on {sum(1 for _ in model.modules())} modules")
        with monitor:
            loss = _forward_backward(model, batch, args, description)
    print(f"{description}: {count:,} parameters, input {batch.description}, loss {loss:.3g} "
          f"(x{args.loss_factor:g}); computed in fp32, checked against {monitor.format.name}\n")
    print(monitor.report())
    return 0


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3g} GiB"


def _check_memory(count: int, largest: int, inputs: int, description: str, allocated: bool) -> None:
    """A usage error naming ``--model`` when the run needs more memory than is available, by an
    estimate (not a bound): fp32 weights (unless ``allocated`` already) and gradients, 32 bytes per
    element of the largest parameter (the monitor's temporaries) and ``inputs`` bytes for what the
    batch makes (activations, logits and their temporaries)."""
    import lowp.cli_args

    need = (4 if allocated else 8) * count + 32 * largest + inputs
    have = lowp.cli_args.available_memory()
    if need > have:
        hints = [] if allocated else ["--layers N builds fewer layers"]
        hints += ["a smaller --batch or --tokens makes smaller activations"] if inputs > 32 * largest else []
        lowp.cli_args.usage_error("doctor", "--model", f"{description} has {count:,} parameters: fp32 weights, "
                                  f"gradients, activations and the monitor's temporaries need about {_gib(need)} of "
                                  f"memory, {_gib(have)} is available" + "".join(f"; {h}" for h in hints))


def _activation_bytes(config: Any, batch: int, tokens: int) -> int:
    """About what one forward and backward of a transformers ``config``'s model on ``batch`` x ``tokens``
    token ids keeps and makes, in fp32: per layer and token 8 hidden vectors, 2 MLP vectors and one row of
    attention scores per head; the logits and the monitor's temporaries of them (32 bytes per logit)."""
    def size(*names: str, default: int = 0) -> int:
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return default

    hidden = size("hidden_size", "d_model")
    per_token = 8 * hidden + 2 * size("intermediate_size", "d_ff", default=4 * hidden)
    per_token += size("num_attention_heads", default=1) * tokens
    layers = size("num_hidden_layers", "num_layers", default=1) + size("num_decoder_layers", "decoder_layers")
    return 4 * batch * tokens * per_token * layers + 32 * batch * tokens * size("vocab_size")


def _build(args: argparse.Namespace, progress: Progress) -> tuple[nn.Module, str]:
    """(model with real fp32 weights, description) of ``--model``; the parameter count of a model
    from a config is read on the meta device and checked against the memory available first."""
    import torch

    from lowp.model_spec import ModelSpecError, build, build_from_config, config_origin, describe, load_config, resolve

    progress.stage(f"looking up --model {args.model!r}")
    source = resolve(args.model)
    torch.manual_seed(args.seed)
    if not source.from_config:
        progress.stage(f"calling {source.target}()")
        model, description = build(source, meta=False, layers=args.layers)
        params = list(model.parameters())
        if any(p.is_meta for p in params):
            raise ModelSpecError(f"{description} has parameters on the meta device (expected real weights to run)")
        _check_memory(sum(p.numel() for p in params), max(p.numel() for p in params), 0, description,
                      allocated=True)
        return model.float(), description
    progress.stage(f"reading the config of {source.label}")
    config = load_config(source, args.layers)
    _check_tokens(config, args.tokens)
    progress.stage(f"building {source.label} on the meta device to count its parameters")
    shapes = build_from_config(config, meta=True, what=config_origin(source, config))
    description = describe(source, shapes, config, args.layers)
    count = sum(p.numel() for p in shapes.parameters())
    inputs = _activation_bytes(config, args.batch, args.tokens)
    _check_memory(count, max(p.numel() for p in shapes.parameters()), inputs, description, allocated=False)
    del shapes
    progress.stage(f"building {description}: {count:,} parameters with random fp32 weights")
    model = build_from_config(config, meta=False, what=config_origin(source, config))
    return model.float(), description


@dataclass
class _Batch:
    """The inputs of one forward pass.

    Args:
        args: positional inputs.
        kwargs: keyword inputs.
        description: what they are, for the report.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    description: str


def _example(model: nn.Module, args: argparse.Namespace) -> _Batch:
    """A random batch for ``model``: token ids for a transformers model that takes ``input_ids`` or a
    model whose first layer is an ``nn.Embedding``; ``--scale`` times N(0, 1) features for one whose first
    layer is an ``nn.Linear``. A usage error naming the option to blame otherwise."""
    import torch
    from torch import nn

    from lowp.cli_args import usage_error

    params = list(model.parameters())
    device = params[0].device
    g = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, args.tokens)
    name = type(model).__name__
    config = getattr(model, "config", None)
    takes = getattr(model, "main_input_name", None)
    if config is not None and takes is not None:   # a transformers model
        if takes != "input_ids":
            usage_error("doctor", "--model", f"{name} takes {takes}, and doctor feeds token ids (expected a "
                                             f"transformers model whose main input is input_ids)")
        vocab = _vocab_size(model, config)
        _check_tokens(config, args.tokens)
        _no_scale(args, name)
        ids = torch.randint(0, vocab, shape, generator=g).to(device)
        kwargs: dict[str, Any] = {"input_ids": ids}
        if getattr(config, "is_encoder_decoder", False):
            kwargs["decoder_input_ids"] = ids
        if getattr(config, "use_cache", None) is not None and _accepts(model, "use_cache"):
            kwargs["use_cache"] = False   # no key/value cache: one pass, nothing to keep
        return _Batch((), kwargs, f"{args.batch}x{args.tokens} random token ids in [0, {vocab})")
    first = next((m for m in model.modules() if any(True for _ in m.parameters(recurse=False))), None)
    if isinstance(first, nn.Embedding):
        _no_scale(args, name)
        ids = torch.randint(0, first.num_embeddings, shape, generator=g).to(device)
        return _Batch((ids,), {}, f"{args.batch}x{args.tokens} random token ids in [0, {first.num_embeddings})")
    if isinstance(first, nn.Linear):
        scale = DEFAULT_SCALE if args.scale is None else args.scale
        x = scale * torch.randn(*shape, first.in_features, generator=g)
        return _Batch((x.to(device),), {}, f"{args.batch}x{args.tokens}x{first.in_features} features, "
                                           f"{scale:g} x N(0, 1)")
    usage_error("doctor", "--model", f"cannot make an input for {name}: doctor feeds token ids to a model whose "
                                     f"first layer is an nn.Embedding (or a transformers model) and features of "
                                     f"shape (batch, tokens, in_features) to one whose first layer is an nn.Linear; "
                                     f"its first layer is {type(first).__name__}")


def _vocab_size(model: nn.Module, config: Any) -> int:
    """The number of token ids a transformers model takes: its input embeddings' rows, else the
    config's ``vocab_size``; a usage error naming ``--model`` when neither is known."""
    from lowp.cli_args import usage_error

    try:
        return int(model.get_input_embeddings().num_embeddings)  # type: ignore[operator]
    except (AttributeError, NotImplementedError, TypeError):
        pass
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        usage_error("doctor", "--model", f"{type(model).__name__} has neither input embeddings nor a vocab_size "
                                         f"(expected a model that takes token ids)")
    return vocab


def _accepts(model: nn.Module, name: str) -> bool:
    """Whether ``model.forward`` takes the keyword ``name`` (or any keyword)."""
    import inspect

    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _check_tokens(config: Any, tokens: int) -> None:
    """``--tokens`` may not exceed the config's ``max_position_embeddings``."""
    from lowp.cli_args import usage_error

    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and not isinstance(limit, bool) and tokens > limit:
        usage_error("doctor", "--tokens", f"expected at most {limit:,} (the model's max_position_embeddings), "
                                          f"got {tokens:,}")


def _no_scale(args: argparse.Namespace, name: str) -> None:
    """``--scale`` is refused for models that take token ids."""
    from lowp.cli_args import usage_error

    if args.scale is not None:
        usage_error("doctor", "--scale", f"applies to models that take features (the demo, a first layer "
                                         f"nn.Linear); {name} takes token ids")


def _output_tensor(out: Any) -> torch.Tensor | None:
    """The tensor to take the loss of: ``logits`` or ``last_hidden_state`` of a transformers output,
    the output itself, or the first floating-point tensor in a tuple, list or dict."""
    import torch

    for key in ("logits", "last_hidden_state"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(out, torch.Tensor):
        return out
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    for item in items:
        found = _output_tensor(item)
        if found is not None and found.is_floating_point():
            return found
    return None


def _forward_backward(model: nn.Module, batch: _Batch, args: argparse.Namespace, description: str) -> float:
    """One forward and backward pass; the loss is the cross-entropy of the output's last dimension
    against random labels (the output itself when it is a scalar), times ``--loss-factor``."""
    import warnings

    import torch

    from lowp.cli_args import usage_error

    model.train()
    with warnings.catch_warnings():  # full backward hooks warn on outputs that are not tensors (ModelOutput)
        warnings.simplefilter("ignore", UserWarning)
        try:
            out = model(*batch.args, **batch.kwargs)
        except Exception as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            usage_error("doctor", "--model", f"{description} raised {type(exc).__name__} on {batch.description}: "
                                             f"{reason} (expected a model that takes that input)")
    logits = _output_tensor(out)
    if logits is None or not logits.is_floating_point():
        usage_error("doctor", "--model", f"{description} returned {type(out).__name__} without a floating-point "
                                         f"tensor (expected logits, a tensor or a tuple holding one)")
    if logits.dim() == 0:
        loss = logits.float()
    else:
        g = torch.Generator().manual_seed(args.seed + 1 if args.seed < SEED_MAX else 0)
        classes = logits.shape[-1]
        labels = torch.randint(0, classes, logits.shape[:-1], generator=g).to(logits.device)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, classes).float(), labels.reshape(-1))
    loss = loss * args.loss_factor
    with warnings.catch_warnings():  # full backward hooks warn when the input needs no grad (token ids)
        warnings.simplefilter("ignore", UserWarning)
        loss.backward()
    return float(loss.detach())
