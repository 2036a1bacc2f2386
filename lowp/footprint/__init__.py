"""Memory footprint of optimizers, per parameter: what lowp allocates (measured on a real model
after a step, :mod:`lowp.footprint.measure`), named baselines from other libraries with their
sources (:mod:`lowp.footprint.baselines`) and parameter counts of named models
(:mod:`lowp.footprint.models`). ``lowp memory`` prints them, with progress lines on stderr while it
measures (:mod:`lowp.progress`, which ``lowp doctor --model`` uses too)."""
