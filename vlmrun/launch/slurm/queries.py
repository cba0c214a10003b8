"""SLURM queries: one runner for the command-line tools and a pure parser for each of their outputs."""

from __future__ import annotations

import re
import subprocess

from vlmrun.config.cluster import parse_time_limit

LIVE = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "RESIZING")


def run_tool(cmd: list[str], timeout: float = 30) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a SLURM command; 127 when it is missing, 124 on timeout."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr
    except FileNotFoundError:
        return 127, "", f"{cmd[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, "", f"{cmd[0]}: timed out after {timeout:g}s"


SQUEUE_FORMAT = "%i|%T|%r|%M|%l|%N"
# what every SLURM client prints when slurmctld does not answer (sbatch, squeue, sinfo, scontrol)
_UNREACHABLE = ("Unable to contact slurm controller", "Socket timed out on send/recv")


def controller_unreachable(text: str) -> bool:
    """True when a SLURM command's output says it could not reach the controller."""
    return any(s.casefold() in text.casefold() for s in _UNREACHABLE)


def parse_ping(rc: int, text: str) -> str | None:
    """`scontrol ping` -> None when a controller answers ('... is UP'), else what it said, in one line."""
    if " is UP" in text:
        return None
    said = " ".join(line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("*"))
    return said or f"scontrol ping exited {rc} without a word"


def parse_squeue(text: str) -> dict[str, dict]:
    """`squeue -h -o '%i|%T|%r|%M|%l|%N'` -> job id -> {state, reason, elapsed, time_limit, nodes}."""
    out = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 6:
            out[parts[0]] = dict(zip(("state", "reason", "elapsed", "time_limit", "nodes"), parts[1:], strict=True))
    return out


def parse_scontrol_job(text: str) -> dict[str, str]:
    """`scontrol show job -o ID` -> its Key=Value fields (values end at the next ' Key=')."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return dict(re.findall(r"(\w[\w:/]*)=(.*?)(?= \w[\w:/]*=|$)", line))


def parse_sacct(text: str) -> dict[str, dict]:
    """`sacct -n -P -X -o JobID,State,ExitCode,Elapsed` -> job id -> {state, exit_code, elapsed}.

    Without accounting sacct prints "Slurm accounting storage is disabled" (exit 0): that parses to {}.
    """
    out = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[0]:
            state = parts[1].split()[0] if parts[1] else ""  # "CANCELLED by 0" -> CANCELLED
            out[parts[0]] = {"state": state, "exit_code": parts[2], "elapsed": parts[3]}
    return out


def slurm_state(job_id: str) -> dict | None:
    """SLURM's view of `job_id` (`source`: squeue, scontrol or sacct), or None when SLURM no longer knows it."""
    rc, out, _ = run_tool(["squeue", "-h", "-j", job_id, "-o", SQUEUE_FORMAT])
    if rc == 0 and job_id in (live := parse_squeue(out)):
        return live[job_id] | {"source": "squeue"}
    rc, out, _ = run_tool(["scontrol", "show", "job", "-o", job_id])
    info = parse_scontrol_job(out) if rc == 0 else {}
    if info.get("JobState"):
        return {
            "state": info["JobState"],
            "reason": info.get("Reason", ""),
            "elapsed": info.get("RunTime", ""),
            "exit_code": info.get("ExitCode", ""),
            "restarts": int(info.get("Restarts", 0) or 0),
            "source": "scontrol",
        }
    rc, out, _ = run_tool(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State,ExitCode,Elapsed"])
    row = parse_sacct(out).get(job_id) if rc == 0 else None
    return row | {"source": "sacct"} if row else None


def is_live(job_id: str) -> bool:
    rc, out, _ = run_tool(["squeue", "-h", "-j", job_id, "-o", SQUEUE_FORMAT])
    return rc == 0 and job_id in parse_squeue(out)


def queue_state(job_id: str) -> str | None:
    """squeue's state of `job_id`; None once it left the queue; 'UNKNOWN' while squeue cannot answer."""
    rc, out, err = run_tool(["squeue", "-h", "-j", job_id, "-o", SQUEUE_FORMAT])
    if rc != 0:
        return None if "Invalid job id" in err else "UNKNOWN"
    return (parse_squeue(out).get(job_id) or {}).get("state")


def parse_sinfo(text: str) -> list[dict]:
    """`sinfo -h -N -o '%N|%P|%c|%m|%G|%l'` -> one dict per (node, partition)."""
    rows = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 6:
            continue
        node, part, cpus, mem, gres, limit = parts
        rows.append(
            {
                "node": node,
                "partition": part.rstrip("*"),
                "default": part.endswith("*"),
                "cpus": int(cpus.rstrip("+") or 0),
                "mem_mb": int(re.sub(r"\D", "", mem) or 0),
                "gpus": gres_gpus(gres),
                "max_minutes": parse_limit(limit),
            }
        )
    return rows


def gres_gpus(gres: str) -> int:
    """GPUs in a sinfo %G string: 'gpu:8', 'gpu:a100:4(S:0-1),gpu:v100:2' -> 8, 6; '(null)' -> 0."""
    return sum(int(m) for m in re.findall(r"gpu(?::[^:,(]+)?:(\d+)", gres))


def parse_limit(text: str) -> int | None:
    """sinfo %l ('infinite', '1-00:00:00', '4:00:00', '30:00') -> minutes; None when unlimited."""
    if text in ("infinite", "UNLIMITED", "n/a", ""):
        return None
    return parse_time_limit(text)
