"""The default mode's decisions: whether to fuse, and with which kernel configuration, read from a shipped
table of the project's own measurements, with no timing, no candidate compile and no nested Inductor compile
at compile time.

A table (``tables/<family>.json``, one per GPU family: ``family``) holds the entries that measured decisions
(``mode="max-autotune"`` or ``config.tuning.measure = True``) wrote to the tuning cache on that GPU, over the
benchmarks' grid of shapes (benchmarks/build_decision_table.py makes it from a cache file): per site the fused
and unfused times, host times, training-step times and the configuration that was fastest. A query is answered
from the points with the same *signature*, the decision key without its row count M (every width, dtype and
flag equal): between two measured row counts the times are interpolated as a power of M (log-log, the way
a GEMM's and a norm's times scale between the memory- and compute-bound ends of a roofline); above the largest
measured M the largest point's verdict holds (more rows only amortize the host cost); below the smallest, or
at widths never measured, nothing is fused and the reason says so. Conservative: a site is fused only where
both bracketing points and the interpolated times all win by the decision's margin (decide.py's rules, the
training step's too), and it runs the configuration measured at the nearer point.

This module reads files and does arithmetic; it imports no kernel module.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Optional

import torch

__all__ = ["family", "lookup", "signature", "table_for"]

TABLES = Path(__file__).parent / "tables"
TABLE_VERSION = 1


def family(device: torch.device) -> Optional[str]:
    """The table family of a CUDA device: "h100" or "h200" (the GPUs measured), None for any other."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    for fam in ("H100", "H200"):
        if fam in name:
            return fam.lower()
    return None


@functools.lru_cache(maxsize=None)
def _load(fam: str) -> Optional[dict]:
    path = TABLES / f"{fam}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if data.get("version") != TABLE_VERSION:
        return None
    by_sig: dict = {}
    for p in data.get("points", []):
        by_sig.setdefault(p["signature"], []).append(p)
    for pts in by_sig.values():
        pts.sort(key=lambda p: p["M"])
    return {**data, "by_signature": by_sig}


def table_for(device: torch.device) -> Optional[dict]:
    """The loaded table of ``device``'s family, or None (an unknown GPU, or no table shipped for it)."""
    fam = family(device)
    return None if fam is None else _load(fam)


def _plain(v):
    """A key part as JSON would give it back (tuples as lists, torch objects as str)."""
    return json.loads(json.dumps(v, default=str))


def signature(parts) -> tuple[Optional[str], Optional[int]]:
    """(the key's signature, its row count M) from the decision key's parts after the device with the
    measurement context (``(*key[2:], *context)``, or the same read back from the cache's JSON): every ``["rows", M]`` marker (``measure.spec(..., rows=True)``)
    becomes ``["rows", "M"]`` and every float (a norm's eps, which does not change a kernel's speed) "eps".
    (None, None) for a key with no row count, or with two different ones, or a bucket key."""
    rows: set = set()

    def walk(v):
        if isinstance(v, list):
            if len(v) == 2 and v[0] == "rows" and isinstance(v[1], int):
                rows.add(v[1])
                return ["rows", "M"]
            if v and v[0] == "rows~":
                rows.add(None)
            return [walk(x) for x in v]
        if isinstance(v, float):
            return "eps"
        return v

    sig = walk(_plain(list(parts)))
    if len(rows) != 1 or None in rows:
        return None, None
    return json.dumps(sig, separators=(",", ":")), rows.pop()


def _interp(lo: dict, hi: dict, m: int, name: str) -> Optional[float]:
    a, b = lo.get(name), hi.get(name)
    if not (isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > 0 and b > 0):
        return None
    if lo["M"] == hi["M"]:
        return float(a)
    s = math.log(b / a) / math.log(hi["M"] / lo["M"])
    return float(a) * (m / lo["M"]) ** s


def lookup(key: tuple, device: torch.device, context: tuple = ()) -> tuple[Optional[list], str]:
    """The table's points for ``key`` (a decision key, with the measurement ``context`` of this compile:
    measure._context) on ``device``: ([lo, hi, estimate], "") where lo and hi bracket the key's M
    (the same point twice at a measured M or above the largest) and ``estimate`` is a point (a dict) of the interpolated
    times and the nearer point's configuration; (None, why not) where the table cannot answer."""
    table = table_for(device)
    if table is None:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        return None, f"no decision table for {name}"
    sig, m = signature((*key[2:], *context))
    if sig is None:
        return None, "a row count the table cannot read (dynamic or bucketed)"
    pts = table["by_signature"].get(sig)
    if not pts:
        return None, f"no measured point of this form and these widths in the {table['family']} table"
    if m < pts[0]["M"]:
        return None, f"M = {m} is below the {table['family']} table's smallest measured M ({pts[0]['M']})"
    lo = max((p for p in pts if p["M"] <= m), key=lambda p: p["M"])
    above = [p for p in pts if p["M"] >= m]
    hi = min(above, key=lambda p: p["M"]) if above else lo
    near = lo if hi is lo or abs(math.log(m / lo["M"])) <= abs(math.log(hi["M"] / m)) else hi
    mm = min(m, hi["M"])
    est = dict(near)
    est["M"] = m
    for name in ("t_fused_ms", "t_unfused_ms", "t_fused_step_ms", "t_unfused_step_ms"):
        est[name] = _interp(lo, hi, mm, name)
    for name, pick in (("h_fused_us", max), ("h_unfused_us", min)):  # host times do not scale with M
        vals = [p.get(name) for p in (lo, hi) if isinstance(p.get(name), (int, float))]
        est[name] = pick(vals) if vals else None
    return [lo, hi, est], ""


def measured_by(device: torch.device) -> str:
    """The table's provenance for the report: its GPU, versions and date."""
    t = table_for(device)
    if t is None:
        return "no table"
    return f"{t['family']} table ({t.get('gpu')}, torch {t.get('torch')}, triton {t.get('triton')}, {t.get('date')})"


def _measured(device: torch.device, name: str) -> Optional[float]:
    """A positive figure the table was measured with (its top-level ``name``), or None."""
    t = table_for(device)
    v = t.get(name) if t else None
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


def copy_gbps(device: torch.device) -> Optional[float]:
    """The copy bandwidth measured with the table (the unfused norm's speed), or None."""
    return _measured(device, "copy_gbps")


def unfused_host_us(device: torch.device) -> Optional[float]:
    """The bare unfused pair's host time per call measured with the table (``measure.unfused_host_us``), or
    None: the table's points carry host times of that machine, so their floor comes from it too."""
    return _measured(device, "unfused_host_us")
