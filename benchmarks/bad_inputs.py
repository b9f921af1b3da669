"""The bad-input table of issues 16 and 25: every case that used to be accepted silently,
refused only late, answered with a traceback or that destroyed files, run through the real
command line, with its exit status, seconds to fail, whether a traceback was printed and the
message.

    .venv/bin/python benchmarks/bad_inputs.py [WORKDIR] [--only 25]

Prints a Markdown table (case, exit, seconds, traceback, message). Each case is a fresh process
on a 16×16 Aliev–Panfilov problem; the resume, dataset and file cases first make the run,
dataset or user folder they would damage and say "[FILES CHANGED]" if anything of it changed.
The user systems of the issue's cases are in benchmarks/bad_user_system.py.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
TINY = ["system.grid.shape=[16,16]", "+system.options.initial=blobs", "simulate.n_frames=5",
        "simulate.steps_per_frame=10", "adjoint=store_all", "run.progress=false",
        "run.plots=false"]
ADAM = ["optim=adam", "optim.steps=6", "fit.params=[k,a]"]
SIMPLE = {
    "optim.lr=-1": ["optim=adam", "optim.lr=-1"],
    "optim.clip=-1": ["optim=adam", "optim.clip=-1"],
    "optim.lr=nan": ["optim=adam", "optim.lr=nan"],
    "regularization.params=-1": ["regularization.params=-1"],
    "optim.steps=0": ["optim.steps=0"],
    "fit.params=[]": ["fit.params=[]"],
    "observe.field_weights.w=2 (unknown field)": ["+observe.field_weights.w=2"],
    "optim.max_nan_failures=-1": ["optim.max_nan_failures=-1"],
    "optim.warmup_steps=500 > optim.steps=300": ["optim=adam", "optim.warmup_steps=500"],
    "observe.stride=0": ["observe.stride=0"],
    "fit.perturb.low=2 > high=1": ["fit.perturb.low=2", "fit.perturb.high=1"],
    "fit.perturb.low=-1": ["fit.perturb.low=-1"],
    "run.checkpoint_every=0": ["run.checkpoint_every=0"],
}
# Legal but almost certainly wrong: a warning, and the run goes on (one step here).
WARNED = {
    "system.grid.shape=[3,3] with the spiral": ["system.grid.shape=[3,3]",
                                                "~system.options.initial", "optim.steps=1"],
    "run.checkpoint_every=1": [*ADAM, "optim.steps=2", "run.checkpoint_every=1"],
}


def run(args: list[str], cwd: Path, env: dict[str, str] | None = None,
        ) -> tuple[int, float, str]:
    started = time.perf_counter()
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600,
                          env=None if env is None else {**os.environ, **env})
    return done.returncode, time.perf_counter() - started, done.stdout + done.stderr


def message(output: str, warning: bool = False) -> str:
    lines = [x.strip() for x in output.splitlines() if x.strip()]
    if warning:
        found = [x for x in lines if "[WARNING]" in x and "backend" not in x]
        return re.sub(r"^\[.*?\]\[.*?\]\[WARNING\] - ", "", found[0]) if found else "(none)"
    one_line = [x for x in lines if re.match(r"^pdefit-[a-z]+: error: ", x)]
    if one_line:
        return one_line[-1]
    errors = [x for x in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", x)]
    return errors[-1] if errors else (lines[-1] if lines else "")


def traceback_shown(output: str) -> str:
    return "yes" if "Traceback (most recent call last)" in output else "no"


def checksum(path: Path) -> str:
    """Of every file under ``path`` (names and bytes), or of ``path`` itself."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def fit(run_dir: Path, *overrides: str) -> list[str]:
    return [str(BIN / "pdefit-fit"), f"run.dir={run_dir}", *TINY, *overrides]


def table(work: Path) -> list[tuple[str, int, float, str, str]]:
    rows = []
    for case, overrides in SIMPLE.items():
        code, seconds, out = run(fit(work / "x", *overrides), work)
        rows.append((case, code, seconds, traceback_shown(out), message(out)))
    for case, overrides in WARNED.items():
        code, seconds, out = run(fit(work / f"w{len(rows)}", *overrides), work)
        rows.append((case + " (warning)", code, seconds, traceback_shown(out),
                     message(out, warning=True)))

    # Resume of a finished run with changed settings; the run must stay untouched.
    done = work / "done"
    assert run(fit(done, *ADAM), work)[0] == 0
    data = (done / "data.zarr" / "zarr.json").stat().st_mtime_ns
    for case, overrides in {"resume with simulate.seed=1": ["simulate.seed=1"],
                            "resume with optim=lbfgs": ["optim=lbfgs"],
                            "resume with fit.params=[k]": ["fit.params=[k]"]}.items():
        code, seconds, out = run(fit(done, *ADAM, *overrides), work)
        untouched = (done / "data.zarr" / "zarr.json").stat().st_mtime_ns == data
        rows.append((case, code, seconds, traceback_shown(out),
                     message(out) + ("" if untouched else "  [DATA CHANGED]")))
    code, seconds, out = run(fit(done, *ADAM, "optim.steps=9"), work)
    rows.append(("resume with optim.steps 6 → 9 (allowed)", code, seconds, traceback_shown(out),
                 message(out, warning=False) if code else "continued to step 9"))
    code, seconds, out = run([str(BIN / "pdefit-evaluate"), str(done), "evaluate.horizon=-1"],
                             work)
    rows.append(("pdefit-evaluate evaluate.horizon=-1", code, seconds, traceback_shown(out),
                 message(out)))

    # Damaged datasets (frames_per_shard=2: shards hold frames 0-1, 2-3, 4).
    pristine = work / "pristine.zarr"
    code, _, out = run([str(BIN / "pdefit-simulate"), f"simulate.output={pristine}",
                        "simulate.frames_per_shard=2", *TINY[:4]], work)
    assert code == 0, out[-2000:]
    for case, damage, extra in (
            ("truncated shard", "truncate", []),
            ("deleted shard", "delete", []),
            ("deleted shard, observe.nan=mask (warning)", "delete", ["observe.nan=mask",
                                                                     "optim.steps=1"])):
        path = work / f"{damage}-{len(rows)}.zarr"
        shutil.copytree(pristine, path)
        shard = path / "u" / "c" / "0" / "2" / "0" / "0"
        if damage == "truncate":
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        else:
            shard.unlink()
        code, seconds, out = run(fit(work / f"d{len(rows)}", f"data.path={path}", *extra), work)
        rows.append((case, code, seconds, traceback_shown(out),
                     message(out, warning="warning" in case)))
    return rows


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    only_25 = "--only" in sys.argv
    work = Path(args[0]) if args else Path(tempfile.mkdtemp(prefix="bad-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = [] if only_25 else table(work)
    from bad_inputs_25 import table_25  # beside this script

    rows += table_25(work, fit, run, message, traceback_shown, checksum, TINY, ADAM)
    print("| case | exit | seconds | traceback | message |\n|---|---|---|---|---|")
    for case, code, seconds, shown, text in rows:
        text = text.replace("|", "\\|")
        print(f"| {case} | {code} | {seconds:.1f} | {shown} | {text[:300]} |")


if __name__ == "__main__":
    main()
