"""The table of ``lowp memory``: every lowp configuration of one optimizer (measured,
:mod:`lowp.footprint.measure`) and the named baselines (:mod:`lowp.footprint.baselines`), with
bytes per parameter, the total for a parameter count and the ratio to torch's fp32 AdamW.

:func:`build_report` returns plain JSON types (``lowp memory --json`` prints it as is);
:func:`format_report` renders it as a text table sorted by bytes per parameter, with footnotes
naming the source of every number.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lowp.footprint.baselines import BASELINES, REFERENCE, measure_baseline
from lowp.footprint.measure import (DTYPE_NAMES, Footprint, configuration_name, lowp_footprints, lowp_optimizer,
                                    probe_model)

__all__ = ["build_report", "format_report", "DTYPE_NAMES"]

GIB = 2**30


def _row(name: str, kind: str, fp: Footprint, count: int, with_grads: bool, reference: float, source: int,
         measured: Footprint | None, config: dict[str, str | None]) -> dict[str, Any]:
    per_param = fp.total(with_grads)
    return {"name": name, "kind": kind, **config, "weights": fp.weights, "states": fp.states, "extra": fp.extra,
            "grads": fp.grads, "bytes_per_param": per_param, "total_bytes": round(per_param * count),
            "total_gib": per_param * count / GIB, "vs_torch_fp32_adamw": per_param / reference,
            "measured_bytes_per_param": None if measured is None else measured.total(with_grads), "source": source}


def build_report(optimizer: str, count: int | None = None, with_grads: bool = False, model: str | None = None,
                 target: torch.nn.Module | None = None, model_description: str | None = None,
                 progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
    """The memory report of lowp's ``optimizer`` for ``count`` parameters, or for the ``target``
    model (any device, meta included) called ``model``: one row per lowp configuration and per
    baseline, sorted by bytes per parameter (gradients included with ``with_grads``), the
    sources (footnote number -> text) and notes. ``progress``, when given, is called before each
    measurement (every lowp configuration, then every baseline) with (its number from 1, the
    number of measurements, what is measured)."""
    if target is not None:
        count = sum(p.numel() for p in target.parameters())
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count: expected a positive int, got {count!r}")
    cls = lowp_optimizer(optimizer)
    probe_count = sum(p.numel() for p in probe_model(torch.float32).parameters())
    reference = next(b for b in BASELINES if b.name == REFERENCE).footprint.total(with_grads)
    sources = {1: f"measured now: lowp.optim.{cls.__name__} with its defaults on the demo model ({probe_count:,} "
                  f"parameters) in that configuration (block-scaled states: codes for every tensor, or with a "
                  f"model its own shapes laid out on the meta device), one step, nbytes of weights, gradients and "
                  f"every tensor in optimizer.state, per parameter"}
    rows = []
    notes: list[str] = []

    def configuration(i: int, n: int, name: str) -> None:
        if progress is not None:
            progress(i, n + len(BASELINES), f"measuring {name}")

    measured = lowp_footprints(optimizer, target, configuration)
    for m in measured:
        weight = DTYPE_NAMES[m.weight_dtype]
        states = m.state_dtype if isinstance(m.state_dtype, str) else DTYPE_NAMES[m.state_dtype]
        name = configuration_name(cls, m.weight_dtype, m.mode, m.state_dtype)
        rows.append(_row(name, "lowp", m.footprint, count, with_grads, reference, 1, m.footprint,
                         {"weight_dtype": weight, "mode": m.mode, "state_dtype": states}))
        shapes = "measured on the demo model's shapes; give --model for another's"
        if target is not None:
            shapes = (f"computed for {model or 'the model'}'s own shapes by the optimizer's init_state on the "
                      f"meta device")
        note = None
        if isinstance(m.state_dtype, str):
            note = ("parameters below coded_min_numel (4096 elements by default) keep 16-bit states, so the block-"
                    "scaled rows depend on the model's shapes: they are " +
                    (shapes if target is not None else "codes for every tensor, a large model's bytes (its tensors "
                     "below 4096 elements hold about 0.1% of its parameters); give --model for a model's own"))
        elif not m.per_element:
            note = (f"{cls.__name__}'s states are not shaped like its weights (factored), so its bytes per "
                    f"parameter depend on the matrices' shapes: the lowp rows are {shapes}")
        if note is not None and note not in notes:
            notes.append(note)
    for i, baseline in enumerate(BASELINES, start=2):
        if progress is not None:
            progress(len(measured) + i - 1, len(measured) + len(BASELINES), f"measuring {baseline.name}")
        sources[i] = baseline.source
        rows.append(_row(baseline.name, "baseline", baseline.footprint, count, with_grads, reference, i,
                         measure_baseline(baseline), {"weight_dtype": None, "mode": None, "state_dtype": None}))
    rows.sort(key=lambda r: (r["bytes_per_param"], r["name"]))
    return {"optimizer": cls.__name__, "params": count, "model": model, "model_description": model_description,
            "grads": with_grads, "reference": REFERENCE, "probe_params": probe_count, "rows": rows,
            "sources": {str(k): v for k, v in sources.items()}, "notes": notes}


def _short(value: float) -> float:
    return float(f"{value:.4g}")


def format_report(report: dict[str, Any]) -> str:
    """``report`` (:func:`build_report`) as an aligned text table with its footnotes."""
    from lowp.report import text_table

    grads = report["grads"]
    headers = ["configuration", "weights", "states", "extra", *(["grads"] if grads else []), "B/param",
               "total GiB", "vs torch fp32 AdamW", "measured B/param", "source"]
    rows = []
    for r in report["rows"]:
        measured = r["measured_bytes_per_param"]
        rows.append([r["name"], _short(r["weights"]), _short(r["states"]), _short(r["extra"]),
                     *([_short(r["grads"])] if grads else []), _short(r["bytes_per_param"]), _short(r["total_gib"]),
                     f"{r['vs_torch_fp32_adamw']:.3f}x", None if measured is None else _short(measured),
                     f"[{r['source']}]"])
    what = f"{report['params']:,} parameters"
    if report["model"]:
        described = report["model_description"] or ""
        what += f" ({described})" if report["model"] in described else f" ({report['model']}: {described})"
    lines = [f"lowp memory: {report['optimizer']} on {what}; bytes per parameter of weights + optimizer states + "
             f"extra precision{' + gradients' if grads else ''}", "", text_table(headers, rows), ""]
    lines.append("extra: compensation/remainder buffers, fp32 master weights or error terms. measured B/param: the "
                 "library's optimizer stepped once on the demo model here ('-': not installed or not measurable); "
                 "it exceeds the documented figure where small tensors keep unquantized states. Activations and "
                 "temporaries are not counted.")
    lines += [f"[{k}] {v}" for k, v in report["sources"].items()]
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)
