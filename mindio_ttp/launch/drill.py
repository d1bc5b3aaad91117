"""ttprun's side of the fire drill (the fault itself: mindio_ttp/drill.py): say at start what
will happen, and afterwards whether the job came through and whether the result checks out.

The drill strikes right after its rank's update of iteration N, so N is the newest iteration
every survivor holds. The job came through when either

* an in-memory recovery committed at iteration N (a recovery commits only once every rank,
  the replacement included, holds N and every refilled copy passed its hash check), or
* the dying checkpoint of iteration N was written, its manifest verifies (every file's digest,
  and its MAC with ``TTP_CHECKPOINT_KEY``) and it is marked latest.

Anything else (a checkpoint of another iteration, a refusal, nothing at all) is said as a
failed drill, with what happened instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from mindio_ttp import config
from mindio_ttp.config import Outcome
from mindio_ttp.drill import ENV, FIRED_FILE, DrillSpec, random_rank
from mindio_ttp.launch.outcome import Ending


def fixed_world(nnodes: str, nproc_per_node: str) -> Optional[int]:
    """The job's world size when the arguments fix it (N or N:N nodes, a number of ranks)."""
    low, _, high = str(nnodes).partition(":")
    if (high and high != low) or not low.isdigit() or not str(nproc_per_node).isdigit():
        return None
    return int(low) * int(nproc_per_node)


def announce(spec: DrillSpec, world: Optional[int], env: Dict[str, str]) -> List[str]:
    """ttprun's lines at start: a drill must never go unnoticed."""
    if spec.rank is not None:
        who = f"rank {spec.rank}"
    elif world is not None:
        who = f"rank {random_rank(config.auth_key_from_env(env), world)} (picked at random)"
    else:
        who = "a random rank (it names itself in its log)"
    return [f"DRILL (--drill {spec.text()}): {who} will be {spec.what()} on purpose right "
            f"after the update of iteration {spec.iteration}, to show what this job does after "
            "a real fault; nothing is provoked without --drill",
            "DRILL: afterwards ttprun says whether the job recovered in memory or wrote the "
            "dying checkpoint, and whether the result checks out"]


def spec_from_env(env: Dict[str, str]) -> Optional[DrillSpec]:
    text = env.get(ENV)
    if not text:
        return None
    try:
        return DrillSpec.from_env(text)[0]
    except ValueError:
        return None


def fired(run_dir: Path) -> Optional[Dict[str, Any]]:
    try:
        return json.loads((Path(run_dir) / FIRED_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def verify_checkpoint(path: Optional[str]) -> Tuple[bool, str]:
    """(verifies, what was checked): the checkpoint's own manifest, file by file."""
    if not path:
        return False, "the flow named no checkpoint directory"
    where = Path(path)
    megatron = where / "ttp_manifest.json"
    if megatron.is_file():
        from mindio_ttp.faulttime import manifest

        try:
            doc = json.loads(manifest.read_capped(megatron, manifest.MAX_MANIFEST_BYTES))
            layout = manifest.ParallelLayout(**{k: int(v) for k, v in doc["layout"].items()})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return False, f"{megatron} cannot be read ({exc})"
        why = manifest.verify(where, layout)
        if why is not None:
            return False, why
        return True, (f"its manifest verifies: the digests of all {len(doc['files'])} files "
                      "match")
    toy = where / "manifest.json"
    if toy.is_file():
        from mindio_ttp.faulttime import digest

        try:
            doc = json.loads(toy.read_text(encoding="utf-8"))
            files = doc["files"]
            for name, entry in files.items():
                algo = next(a for a in sorted(digest.ALGOS) if a in entry)
                file = where / name
                if file.stat().st_size != entry["bytes"] or \
                        digest.of_file(file, algo) != entry[algo]:
                    return False, f"{file} fails its {algo} digest"
        except (OSError, ValueError, KeyError, TypeError, StopIteration, LookupError) as exc:
            return False, f"{toy} cannot be checked ({type(exc).__name__}: {exc})"
        return True, f"its manifest verifies: the digests of all {len(files)} files match"
    return False, f"{where} has no manifest"


def verdict(spec: DrillSpec, run_dir: Path, ending: Ending) -> Tuple[List[str], Dict[str, Any]]:
    """The drill's result lines and the outcome file's "drill" entry."""
    n = spec.iteration
    shot = fired(run_dir)
    record: Dict[str, Any] = {"spec": spec.text(), "fired": shot, "passed": False,
                              "result": "", "detail": ""}
    recovered = [r for r in ending.recoveries if r["iteration"] == n]
    flow = ending.flow
    if recovered:
        r = recovered[0]
        wrong = shot is not None and shot.get("rank") not in r["replaced"]
        record.update(result="recovered in memory", passed=not wrong, detail=(
            f"recovery {r['recovery_id']} committed at iteration {n}, replacing rank(s) "
            f"{r['replaced']}: every rank holds iteration {n}, the newest consistent one, and "
            "every refilled copy passed its hash check (a recovery commits only then); no "
            "iteration lost" + (f"; but the drill struck rank {shot.get('rank')}, which was "
                                "not replaced" if wrong else "")))
    elif flow is not None and flow.outcome is Outcome.SAVED:
        ok, checked = verify_checkpoint(flow.checkpoint)
        newest = flow.step == n
        record.update(result="wrote the dying checkpoint",
                      passed=ok and newest and flow.marked_latest)
        parts = [f"iteration {flow.step} in {flow.checkpoint or 'the checkpoint directory'}",
                 checked if ok else f"it does NOT verify: {checked}"]
        parts.append(f"{flow.step} is the newest consistent iteration (the drill struck right "
                     f"after the update of iteration {n}, so every survivor holds it)" if newest
                     else f"but the newest consistent iteration is {n} (the drill struck right "
                     f"after its update), not {flow.step}")
        parts.append("marked latest" if flow.marked_latest else
                     f"NOT marked latest (latest names the newer iteration {flow.latest})")
        record["detail"] = "; ".join(parts)
    elif flow is not None:
        record.update(result=f"neither recovered nor saved ({flow.outcome.value})",
                      detail=flow.reason)
    elif shot is None and not ending.recoveries:
        record.update(result="did not fire", detail=(
            f"no rank of this node reached iteration {n} (the run ended first, or it started "
            "past it: see the armed rank's DRILL lines)" if ending.exit_code == 0 else
            "the job stopped before the drill, or on another node without a recovery or a "
            "checkpoint this node saw"))
    else:
        record.update(result="neither recovered nor saved", detail=(
            "the drill fired, but no recovery committed and no dying checkpoint was recorded "
            "on this node: see the workers' log lines"))
    verdict_word = "PASSED" if record["passed"] else "FAILED"
    lines = [f"DRILL RESULT: {verdict_word}: the job {record['result']}"
             + (f": {record['detail']}" if record["detail"] else "")]
    return lines, record


def drop_inherited(env: Dict[str, str]) -> Optional[str]:
    """A ``TTP_DRILL`` ttprun did not set (left in a shell): removed, and said."""
    if env.pop(ENV, None) is None:
        return None
    return (f"{ENV} is set in the environment: ignored and not passed on (a drill runs only "
            "with `ttprun --drill`)")
