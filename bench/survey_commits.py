"""Which Megatron-LM commits `ttp-patch apply --allow-modified` patches, builds and trains.

For every commit reachable from REF with a committer date in [SINCE, UNTIL] (the default range is
2022-10-01 .. 2023-06-30; `--first-parent` restricts it to the main line's merge commits), the
four target files' blob ids form a key: commits with the same key have byte-identical targets,
so only one commit per key is checked out (into a temp `git clone --shared` of REPO, which is
never written) and run through the real CLI, as a user would:

    ttp-patch apply DIR --allow-modified --device cpu;  ttp-patch verify DIR;
    python -m py_compile <the four files>;  ttp-patch revert DIR (must give HEAD back exactly)

Counts are per commit (each inherits its key's result) and per distinct key. Besides the CLI
runs, every edit is assessed in-process on each key's HEAD bytes, so the table can say, per
anchor, the first commit after the pin where it is not found exactly once.

With `--train`, every commit that applies and compiles is also trained through a fault
(bench/survey_train.py: tiny GPT, 4 CPU ranks under ttprun, rank 1 SIGKILLed in iteration 5),
once per distinct *code*: the tree of `megatron/` and the blob of `pretrain_gpt.py`, all the
Python a run executes from the checkout. Two more columns: the optimizer was built (Megatron's
"... scheduler are built" line), and the dying checkpoint of step 4 was written and verified.
That takes one job per code (about 250 over the default range; 10-60 s each on 2 cores), so
each result is appended to `--train-cache` as it comes and a rerun skips what it holds.

    python bench/survey_commits.py REPO [--ref main] [--since 2022-10-01] [--until 2023-06-30]
        [--train --train-cache train.json] [--out docs/commit-survey.md] [--json results.json]

REPO is a Megatron-LM clone or bare mirror with the history (e.g. a `git clone --bare`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from patcher.edits import ALL_EDITS, TARGET_FILES, State
from patcher.engine import assess_module, parse
from patcher.errors import PatchError
from patcher.launch_script import EXAMPLE
from patcher.options import Device, Options
from patcher.pin import PINNED_BLOBS, PINNED_COMMIT
from patcher.prerequisites import DISTRIB_OPTIMIZER

sys.path.insert(0, str(Path(__file__).resolve().parent))
from survey_train import TrainResult, train_one  # noqa: E402

Key = Tuple[Optional[str], ...]
Code = Tuple[Optional[str], Optional[str]]  # tree id of megatron/, blob id of pretrain_gpt.py
TIMEOUT_S = 300  # one CLI command on one checkout; a real one takes seconds


@dataclass
class Commit:
    sha: str
    date: str  # committer date, ISO 8601
    subject: str
    key: Key
    after_pin: bool = False  # 285068c is one of its ancestors (it is not 285068c)
    main_line: bool = False  # on REF's first-parent chain
    code: Code = (None, None)


@dataclass
class Result:
    """One distinct set of target blobs, as the CLI saw it."""

    first: str  # the commit checked out for it (the oldest with this key)
    applied: bool = False
    verified: bool = False
    compiled: bool = False
    reverted: bool = False
    pinned: bool = False  # all four blobs are 285068c's
    differing: List[str] = field(default_factory=list)
    apply_error: str = ""
    edits: Dict[str, str] = field(default_factory=dict)  # edit id -> state or "error: ..."

    @property
    def anchors_ok(self) -> int:
        """Edits whose anchor the unpatched files offer exactly once (state "missing")."""
        return sum(1 for v in self.edits.values() if v == State.MISSING.value)

    @property
    def all_anchors(self) -> bool:
        return self.anchors_ok == len(ALL_EDITS)

    @property
    def builds(self) -> bool:
        """Applies and compiles: apply, verify and py_compile of the four files all pass."""
        return self.applied and self.verified and self.compiled

    seconds: float = 0.0


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "--git-dir", str(repo), *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    ).stdout


def git_dir(repo: Path) -> Path:
    out = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--absolute-git-dir"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return Path(out)


def list_commits(
    repo: Path, ref: str, since: str, until: str, first_parent: bool
) -> List[Commit]:
    """Oldest first. Dates are whole days, UTC, both ends included."""
    args = ["log", "--format=%H%x00%cI%x00%s", f"--since={since}T00:00:00Z"]
    args += [f"--until={until}T23:59:59Z", "--date-order", "--reverse"]
    if first_parent:
        args.append("--first-parent")
    descendants = set(  # not `PIN..REF`: that also holds old branches merged later
        git(repo, "rev-list", "--ancestry-path", f"{PINNED_COMMIT}..{ref}").split()
    )
    main_line = set(git(repo, "rev-list", "--first-parent", ref).split())
    commits = []
    for line in git(repo, *args, ref).splitlines():
        sha, date, subject = line.split("\0", 2)
        commits.append(
            Commit(sha, date, subject, blob_key(repo, sha), sha in descendants, sha in main_line,
                   code_key(repo, sha))
        )
    return commits


def code_key(repo: Path, sha: str) -> Code:
    """What a training run executes from the checkout: megatron/'s tree, pretrain_gpt.py's blob."""
    out = git(repo, "ls-tree", sha, "--", "megatron", "pretrain_gpt.py")
    found = {line.split("\t", 1)[1]: line.split()[2] for line in out.splitlines()}
    return found.get("megatron"), found.get("pretrain_gpt.py")


# apply also reads the example launch script (it derives its own from it) and the optimizer
# ReplicatedOptimizer subclasses (patcher/prerequisites.py)
KEYED = [*TARGET_FILES, EXAMPLE, DISTRIB_OPTIMIZER]


def blob_key(repo: Path, sha: str) -> Key:
    """The blob ids of the files apply reads: the four targets, then the two it checks."""
    out = git(repo, "ls-tree", sha, "--", *KEYED)
    found = {line.split("\t", 1)[1]: line.split()[2] for line in out.splitlines()}
    return tuple(found.get(p) for p in KEYED)


def cli(*args: str, cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "patcher", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=cwd,
    )


def assess_edits(work: Path) -> Dict[str, str]:
    """Each edit's state on the checked-out (unpatched) bytes: where anchors are and are not."""
    out: Dict[str, str] = {}
    opts = Options(device=Device.CPU, port=None)
    for path in TARGET_FILES:
        ids = [e.id for e in ALL_EDITS if e.file == path]
        try:
            results = assess_module(path, parse(path, (work / path).read_bytes()), opts)
        except (OSError, PatchError) as exc:
            why = exc.message if isinstance(exc, PatchError) else f"{path} is missing"
            out.update({i: f"error: {why}"[:200] for i in ids})
            continue
        for edit, res in results:
            out[edit.id] = res.state.value if res.state is not State.DRIFTED else (
                f"drifted: {res.detail}"
            )
    return out


def check_one(work: Path, commit: Commit) -> Result:
    t0 = time.monotonic()
    subprocess.run(
        ["git", "-C", str(work), "checkout", "-q", "-f", "--detach", commit.sha],
        check=True,
        capture_output=True,
        timeout=TIMEOUT_S,
    )
    subprocess.run(["git", "-C", str(work), "clean", "-q", "-fdx"], check=True, timeout=60)
    res = Result(first=commit.sha)
    res.differing = [p for p, b in zip(TARGET_FILES, commit.key) if b != PINNED_BLOBS[p]]
    res.pinned = not res.differing
    res.edits = assess_edits(work)
    applied = cli("apply", str(work), "--allow-modified", "--device", "cpu")
    res.applied = applied.returncode == 0
    if not res.applied:
        res.apply_error = " ".join(applied.stderr.split())[:600]
    else:
        res.verified = cli("verify", str(work)).returncode == 0
        compiled = subprocess.run(
            [sys.executable, "-m", "py_compile", *(str(work / p) for p in TARGET_FILES)],
            capture_output=True,
            timeout=TIMEOUT_S,
        )
        res.compiled = compiled.returncode == 0
        reverted = cli("revert", str(work))
        status = subprocess.run(
            ["git", "-C", str(work), "status", "--porcelain"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        # py_compile's __pycache__ is untracked noise, not ours
        dirty = [ln for ln in status.splitlines() if "__pycache__" not in ln]
        res.reverted = reverted.returncode == 0 and not dirty
    res.seconds = round(time.monotonic() - t0, 1)
    return res


def survey(repo: Path, commits: Sequence[Commit], log=print) -> Dict[Key, Result]:
    results: Dict[Key, Result] = {}
    with tempfile.TemporaryDirectory(prefix="ttp-survey-") as tmp:
        work = Path(tmp) / "Megatron-LM"
        subprocess.run(
            ["git", "clone", "-q", "--shared", "--no-checkout", str(repo), str(work)],
            check=True,
            timeout=TIMEOUT_S,
        )
        for c in commits:
            if c.key in results:
                continue
            results[c.key] = check_one(work, c)
            r = results[c.key]
            log(
                f"{c.sha[:10]} {c.date[:10]} applied={r.applied} verified={r.verified} "
                f"compiled={r.compiled} reverted={r.reverted} {r.seconds}s "
                f"{r.apply_error[:160]}"
            )
    return results


def _code_id(code: Code) -> str:
    return f"{code[0]}:{code[1]}"


def train_all(
    repo: Path, commits: Sequence[Commit], results: Dict[Key, Result], cache: Optional[Path],
    log=print,
) -> Dict[Code, TrainResult]:
    """One training run per distinct code among the commits that apply and compile (the
    oldest commit of each), results kept in `cache` (JSON) as they come."""
    known: Dict[str, dict] = {}
    if cache is not None and cache.exists():
        known = json.loads(cache.read_text())
    out: Dict[Code, TrainResult] = {}
    todo = [c for c in commits if results[c.key].builds]
    codes = len({c.code for c in todo})
    for c in todo:
        if c.code in out:
            continue
        cid = _code_id(c.code)
        if cid in known:
            out[c.code] = TrainResult(**known[cid])
            continue
        with tempfile.TemporaryDirectory(prefix="ttp-survey-train-") as tmp:
            r = train_one(repo, c.sha, Path(tmp))
        out[c.code], known[cid] = r, asdict(r)
        if cache is not None:
            tmp_path = cache.with_name(cache.name + ".tmp")
            tmp_path.write_text(json.dumps(known, indent=1))
            os.replace(tmp_path, cache)
        log(f"train {len(out)}/{codes} {c.sha[:10]} {c.date[:10]} built={r.optimizer_built} "
            f"passed={r.passed} {r.wall_s}s {'' if r.passed else r.error[-200:]}")
    return out


def _when(iso: str) -> dt.datetime:
    return dt.datetime.fromisoformat(iso)


def pin_date(repo: Path) -> str:
    return git(repo, "log", "-1", "--format=%cI", PINNED_COMMIT).strip()


def first_anchor_losses(
    commits: Sequence[Commit], results: Dict[Key, Result]
) -> List[Tuple[str, str, str]]:
    """(edit id, oldest descendant of the pin where it is not applicable, its state there)."""
    out = []
    for edit in ALL_EDITS:
        for c in commits:
            if not c.after_pin:
                continue
            state = results[c.key].edits.get(edit.id, "")
            if state != State.MISSING.value:
                out.append((edit.id, c.sha, state))
                break
    return out


def render(
    repo_name: str,
    ref: str,
    since: str,
    until: str,
    commits: Sequence[Commit],
    results: Dict[Key, Result],
    pin_when: str,
    elapsed: float,
    trained: Optional[Dict[Code, TrainResult]] = None,
) -> str:
    main = [c for c in commits if c.main_line]
    after = [c for c in commits if c.after_pin]

    def count(attr: str, subset: Sequence[Commit] = commits) -> int:
        return sum(1 for c in subset if getattr(results[c.key], attr))

    def count_keys(attr: str, subset: Sequence[Commit] = commits) -> int:
        return sum(1 for r in {c.key: results[c.key] for c in subset}.values() if getattr(r, attr))

    def row(label: str, attr: str) -> str:
        cells = [f"{count(attr, sub)} ({count_keys(attr, sub)})" for sub in (commits, main, after)]
        return f"| {label} | " + " | ".join(cells) + " |"

    n, k = len(commits), len(results)
    k4 = len({c.key[: len(TARGET_FILES)] for c in commits})
    refused = [c for c in after if not results[c.key].applied]
    first_after = refused[0] if refused else None
    pin_at = _when(pin_when)
    before = [c for c in commits if not results[c.key].applied and _when(c.date) < pin_at]
    last_before = before[-1] if before else None
    lines = [
        f"# Commit survey: `ttp-patch apply --allow-modified` over Megatron-LM {since} .. {until}",
        "",
        *(_three_columns(commits, results, trained) if trained is not None else []),
        f"Run {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} by "
        f"`bench/survey_commits.py` on {repo_name}, ref `{ref}`: every commit reachable from it "
        f"with a committer date in the range: {n} commits, {k4} distinct sets of the four target "
        f"blobs, {k} once the two files apply also reads (the example launch script "
        f"`{EXAMPLE}` and `{DISTRIB_OPTIMIZER}`) are counted; one checkout per set "
        f"({elapsed:.0f} s in all). Pinned commit 285068c is dated {pin_when[:10]}.",
        "",
        "Commits (distinct sets of the 4 targets + the 2 files read in parentheses); "
        "*main line*: on the first-parent chain of the ref; *after 285068c*: 285068c is an "
        "ancestor.",
        "",
        "| | all in range | main line | after 285068c |",
        "|---|---:|---:|---:|",
        f"| in range | {n} ({k}) | {len(main)} ({len({c.key for c in main})}) | "
        f"{len(after)} ({len({c.key for c in after})}) |",
        row("targets byte-identical to 285068c's", "pinned"),
        row(f"all {len(ALL_EDITS)} anchors found exactly once (in-process, unpatched files)",
            "all_anchors"),
        row("`apply --allow-modified --device cpu` exit 0", "applied"),
        row("then `verify` exit 0", "verified"),
        row("then `py_compile` of the 4 files", "compiled"),
        row("then `revert` gives HEAD back exactly", "reverted"),
        "",
    ]
    if first_after is not None:
        lines += [
            f"Oldest commit after 285068c (a descendant) that apply refuses: `{first_after.sha}` "
            f"({first_after.date[:10]}, \"{first_after.subject}\"):",
            "",
            f"> {results[first_after.key].apply_error}",
            "",
        ]
    else:
        lines += ["No descendant of 285068c in the range is refused.", ""]
    if last_before is not None:
        lines += [
            f"Last commit before 285068c that apply refuses: `{last_before.sha}` "
            f"({last_before.date[:10]}).",
            "",
        ]
    losses = first_anchor_losses(commits, results)
    lines += [
        "Per edit, the oldest descendant of 285068c whose unpatched files do not offer the "
        "anchor exactly once (in-process assessment of each set of blobs):",
        "",
        "| edit | first commit | date | state there |",
        "|---|---|---|---|",
    ]
    dates = {c.sha: c.date[:10] for c in commits}
    lost = {e for e, _, _ in losses}
    for edit, sha, state in losses:
        lines.append(f"| `{edit}` | `{sha[:12]}` | {dates[sha]} | {state[:150]} |")
    for edit in ALL_EDITS:
        if edit.id not in lost:
            lines.append(f"| `{edit.id}` | none in range | | |")
    lines += [
        "",
        "Every distinct set, oldest first (commits: how many in the range share it):",
        "",
        "| first commit | date | after pin | commits | targets differing from 285068c | anchors "
        "| applied | verified | compiled | reverted | refusal |",
        "|---|---|---|---:|---|---:|---|---|---|---|---|",
    ]
    per_key: Dict[Key, int] = {}
    for c in commits:
        per_key[c.key] = per_key.get(c.key, 0) + 1
    short = {p: p.rsplit("/", 1)[-1] for p in TARGET_FILES}
    for c in commits:
        r = results[c.key]
        if r.first != c.sha:
            continue
        diff = ", ".join(short[p] for p in r.differing) or "none"
        err = r.apply_error.replace("|", "\\|")[:160]
        lines.append(
            f"| `{c.sha[:12]}` | {c.date[:10]} | {'yes' if c.after_pin else 'no'} | "
            f"{per_key[c.key]} | {diff} | {r.anchors_ok}/{len(ALL_EDITS)} | "
            f"{'yes' if r.applied else 'no'} | {'yes' if r.verified else '-'} | "
            f"{'yes' if r.compiled else '-'} | {'yes' if r.reverted else '-'} | {err} |"
        )
    return "\n".join(lines) + "\n"


def _three_columns(
    commits: Sequence[Commit], results: Dict[Key, Result], trained: Dict[Code, TrainResult]
) -> List[str]:
    """The summary: per commit, how far it gets (each column needs the one before)."""

    def stages(c: Commit) -> Tuple[bool, bool, bool]:
        builds = results[c.key].builds
        run = trained.get(c.code) if builds else None
        built = run is not None and run.optimizer_built
        return builds, built, built and run is not None and run.passed

    subsets = [
        ("all in range", commits),
        ("main line (first parent)", [c for c in commits if c.main_line]),
        ("after 285068c (descendants)", [c for c in commits if c.after_pin]),
    ]
    lines = [
        "Commits (distinct codes, `megatron/` + `pretrain_gpt.py`, in parentheses) that get "
        "this far; each column needs the one before:",
        "",
        "| commits | in range | applies and compiles | builds the optimizer | trains through a "
        "fault |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, subset in subsets:
        cells = [f"{len(subset)} ({len({c.code for c in subset})})"]
        for i in range(3):
            got = [c for c in subset if stages(c)[i]]
            cells.append(f"{len(got)} ({len({c.code for c in got})})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    why: Dict[str, List[Commit]] = {}
    for c in commits:
        builds, built, passed = stages(c)
        if builds and not passed:
            run = trained[c.code]
            stage = "optimizer not built" if not built else "no dying checkpoint"
            why.setdefault(f"{stage}: {run.error.splitlines()[-1] if run.error else '?'}",
                           []).append(c)
    if why:
        lines += [
            "",
            "Why the others stop (the error the job printed first; the oldest commit of each):",
            "",
            "| stops at | commits (codes) | oldest | dates |",
            "|---|---:|---|---|",
        ]
        for reason, cs in sorted(why.items(), key=lambda kv: -len(kv[1])):
            text = reason.replace("|", "\\|")[:220]
            lines.append(f"| {text} | {len(cs)} ({len({c.code for c in cs})}) | "
                         f"`{cs[0].sha[:12]}` | {cs[0].date[:10]} .. {cs[-1].date[:10]} |")
    return lines + [""]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("repo", type=Path, help="a Megatron-LM clone or bare mirror with its history")
    p.add_argument("--ref", default="main")
    p.add_argument("--since", default="2022-10-01")
    p.add_argument("--until", default="2023-06-30")
    p.add_argument("--first-parent", action="store_true", help="the main line's merges only")
    p.add_argument("--out", type=Path, help="write the Markdown table here")
    p.add_argument("--json", type=Path, help="write every commit's and key's result here")
    p.add_argument("--name", default="NVIDIA/Megatron-LM", help="how the table names the repo")
    p.add_argument("--train", action="store_true",
                   help="also train every distinct code through a fault (hours on 2 cores)")
    p.add_argument("--train-cache", type=Path,
                   help="JSON of finished training runs: kept up to date, reused on a rerun")
    args = p.parse_args(argv)
    repo = git_dir(args.repo)
    t0 = time.monotonic()
    commits = list_commits(repo, args.ref, args.since, args.until, args.first_parent)
    keys = {c.key for c in commits}
    print(f"{len(commits)} commits, {len(keys)} distinct blob sets", file=sys.stderr)
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    results = survey(repo, commits, log=say)
    trained = train_all(repo, commits, results, args.train_cache, say) if args.train else None
    text = render(
        args.name, args.ref, args.since, args.until, commits, results, pin_date(repo),
        time.monotonic() - t0, trained,
    )
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    if args.json:
        doc = {
            "commits": [asdict(c) for c in commits],
            "results": {",".join(str(b) for b in k): asdict(r) for k, r in results.items()},
            "trained": {_code_id(k): asdict(r) for k, r in (trained or {}).items()},
        }
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
