"""What the tests of training stacks on 2 processes share: their configurations and seeds, one
launcher that fails on a hang or an abort, the workers' command line, and a per-rank snapshot
of a model's weights and its lowp optimizer's states."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
#: the seed the lowp optimizers are built with; the resumed runs use the other one
SEED, OTHER_SEED = 1234, 999
#: what a rank prints when it dies at exit (docs/distributed.md, "Ending a run cleanly")
ABORTS = ("terminate called", "SIGABRT", "core dumped")
FAST = ("defaults", "exact8-codes")
SLOW = ("stochastic", "defaults@full", "exact8-codes@full")
#: the configurations whose steps draw random bits (their bits depend on the seed)
RANDOM = ("stochastic", "exact8-codes")
#: environment a parent launcher may have set; the stack under test must see none of it
LAUNCH_ENV = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
              "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED")


def clean_env(drop_prefixes: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment without :data:`LAUNCH_ENV` (and variables starting with
    ``drop_prefixes``), with one OpenMP thread and the project and its tests importable."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV and not k.startswith(drop_prefixes or ("\0",))}
    env.update(OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH")])))
    return env


def run_launch(command: list[str], env: dict[str, str], cwd: Path, phase: str, timeout: float) -> str:
    """Run ``command`` in a session of its own and return its output; fail on a non-zero exit,
    an abort, a process group left referenced by lowp's ``shutdown()``, or a hang (the whole
    session is killed)."""
    proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)     # every rank is in the launcher's session
        output, _ = proc.communicate()
        pytest.fail(f"{phase}: no end after {timeout} s\n{output[-4000:]}")
    assert proc.returncode == 0, output[-6000:]
    assert not [a for a in ABORTS if a in output], output[-4000:]
    assert "still referenced after destroy_process_group" not in output, output[-4000:]   # lowp's shutdown()
    return output


def worker_arguments(configs: dict[str, Any], both: str, control: str) -> argparse.Namespace:
    """The command line of a stack's worker script (``both`` and ``control`` describe what its
    ``--phase both`` and ``--control`` do there)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--phase", choices=["first", "resume", "both"], required=True, help=both)
    ap.add_argument("--configs", default=",".join(configs))
    ap.add_argument("--seed", type=int, required=True, help="the seed the lowp optimizers are built with")
    ap.add_argument("--control", action="store_true", help=control)
    return ap.parse_args()


def local_snapshot(model: torch.nn.Module, opt: Any) -> dict[str, Any]:
    """This rank's weights and states of ``model`` and its lowp optimizer ``opt`` (local shards,
    copied), with the seed, the skip counters and whether every parameter is sharded."""
    from torch.distributed.tensor import DTensor

    def local(t: Any) -> Any:
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone() if torch.is_tensor(t) else t

    out: dict[str, Any] = {"seed": opt.seed, "skipped_params": opt.skipped_params, "skipped_steps": opt.skipped_steps,
                           "sharded": all(isinstance(p, DTensor) for p in model.parameters())}
    for name, p in model.named_parameters():
        out[name] = local(p)
        for key, value in opt.state[p].items():
            out[f"{name}/{key}"] = local(value)
    return out
