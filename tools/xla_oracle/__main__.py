"""``python -m tools.xla_oracle``: compile every configuration not yet in results/.

    python -m tools.xla_oracle                 # every config whose result is missing or stale
    python -m tools.xla_oracle --only T1,T3    # just these
    python -m tools.xla_oracle --force --only T1
    python -m tools.xla_oracle --jobs 2        # two compiles at once
    python -m tools.xla_oracle --list          # the configs, resolved, and their cache state
    python -m tools.xla_oracle --table         # rewrite the table in docs/xla-oracle.md
    python -m tools.xla_oracle --refresh-inventory  # parse the committed HLO files again

``make oracle`` (and ``make oracle ONLY=<id>``) runs it in its own environment
(``.venv-oracle``, the project with the ``tpu-compile`` extra). Each config compiles in its
own process; a result is kept while its cache key (the resolved spec, the jax / jaxlib /
libtpu / optax versions and the reference's ``MODEL_VERSION``) is unchanged.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tools.xla_oracle.compile_one import compile_in_child
from tools.xla_oracle.inventory import op_inventory
from tools.xla_oracle.record import GIB, build_result, device_peak_bytes, judge_peak, parse_oom
from tools.xla_oracle.record import versions as installed_versions
from tools.xla_oracle.spec import (
    HLO_CACHE,
    HLO_DIR,
    RESULTS,
    ROOT,
    OracleConfigError,
    cache_key,
    load_configs,
    resolve,
)

DOC = ROOT / "docs" / "xla-oracle.md"
TABLE_BEGIN = "<!-- oracle-table:begin (python -m tools.xla_oracle --table) -->"
TABLE_END = "<!-- oracle-table:end -->"


def _missing_tools() -> str | None:
    """A plain sentence when jax, libtpu or optax is not installed, else None."""
    missing = [m for m in ("jax", "libtpu", "optax") if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (f"xla_oracle: {', '.join(missing)} not installed in {sys.executable}; the oracle "
            "compiles for TPUs with libtpu (Google's, under its own terms): run `make oracle`, "
            "which installs the 'tpu-compile' extra into .venv-oracle, or `pip install "
            "'tpu-pod-emulator[tpu-compile]'` (Linux x86-64 / aarch64, Python >= 3.11)")


def _axes(mesh: dict[str, Any]) -> str:
    parts = [f"{k} {v}" for k, v in mesh["ici"].items()]
    parts += [f"dcn {k} {v}" for k, v in mesh["dcn"].items()]
    return ", ".join(parts) or "-"


def _cached(spec: dict[str, Any], key: str) -> bool:
    path = RESULTS / f"{spec['id']}.json"
    if not path.exists():
        return False
    try:
        return json.loads(path.read_text()).get("cache_key") == key
    except (OSError, ValueError):
        return False


def _summary(result: dict[str, Any]) -> str:
    peak = result["peak_bytes_per_device"]
    hbm = result["hbm_bytes_per_device"] / GIB
    seconds = result["compile"].get("compile_seconds")
    took = f" (compile {seconds:.0f} s)" if seconds else ""
    if peak is not None:
        verdict = "fits" if result["fits"] else "does NOT fit"
        return f"{verdict}: {peak / GIB:.2f} GiB of {hbm:.2f} GiB{took}"
    if result["fits"] is False:
        oom = result["compile"]["oom"] or {}
        need = oom.get("required_bytes")
        shown = (f", {oom.get('required_of')} need {need / GIB:.2f} GiB of "
                 f"{oom['available_bytes'] / GIB:.2f}" if need else "")
        return f"does NOT fit (XLA: RESOURCE_EXHAUSTED{shown}){took}"
    return f"no verdict: {str(result['compile']['error'])[:200]}"


def run(only: list[str] | None, force: bool, timeout_s: float, jobs: int = 1) -> int:
    configs = load_configs()
    ids = list(configs)
    if only:
        unknown = [i for i in only if i not in configs]
        if unknown:
            print(f"xla_oracle: --only: unknown ids {unknown}; known: {', '.join(ids)}",
                  file=sys.stderr)
            return 2
        ids = only
    note = _missing_tools()
    if note:
        print(note, file=sys.stderr)
        return 2
    versions = installed_versions()
    print(f"xla_oracle: jax {versions['jax']}, libtpu {versions['libtpu']}, "
          f"optax {versions['optax']}; {len(ids)} configs; results in "
          f"{RESULTS.relative_to(ROOT)}/", flush=True)
    todo = []
    for cid in ids:
        try:
            spec = resolve(cid, configs[cid])
        except OracleConfigError as err:
            print(f"xla_oracle: {err}", file=sys.stderr)
            return 2
        key = cache_key(spec, versions)
        if not force and _cached(spec, key):
            continue
        todo.append((spec, key))
    print(f"xla_oracle: {len(ids) - len(todo)} cached, {len(todo)} to compile"
          f"{f', {jobs} at a time' if jobs > 1 else ''}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def one(n: int, spec: dict[str, Any], key: str) -> None:
        if not force and _cached(spec, key):  # another run finished it meanwhile
            return
        slices = f" x {spec['slices']}" if spec["slices"] > 1 else ""
        with lock:
            print(f"[{n}/{len(todo)}] {spec['id']}: {spec['slice']}{slices}"
                  f" {{{_axes(spec['mesh'])}}}, {spec['per_device_batch']:g} x "
                  f"{spec['sequence_length']}, remat {spec['model']['remat']} "
                  f"(started {time.strftime('%H:%M:%S')})", flush=True)
        outcome, hlo = compile_in_child(spec, timeout_s)
        inventory = op_inventory(hlo) if hlo else None
        hlo_file = None
        if hlo:
            # committed for the configs marked hlo (the calibration rows); the others kept
            # in a local, ignored cache so that --refresh-inventory can parse them again
            keep = bool(configs[spec["id"]].get("hlo"))
            folder = HLO_DIR if keep else HLO_CACHE
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{spec['id']}.hlo.txt.gz"
            with gzip.open(path, "wt", compresslevel=9) as fh:
                fh.write(hlo)
            hlo_file = str(path.relative_to(ROOT)) if keep else None
        result = build_result(spec, outcome, inventory, key, hlo_file)
        (RESULTS / f"{spec['id']}.json").write_text(json.dumps(result, indent=1) + "\n")
        with lock:
            print(f"    {spec['id']}: {_summary(result)}", flush=True)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for future in [pool.submit(one, n, spec, key)
                       for n, (spec, key) in enumerate(todo, start=1)]:
            future.result()
    return 0


def list_configs() -> int:
    configs = load_configs()
    versions = installed_versions()
    for cid, entry in configs.items():
        try:
            spec = resolve(cid, entry)
        except OracleConfigError as err:
            print(f"{cid}: ERROR {err}")
            continue
        state = "cached" if _cached(spec, cache_key(spec, versions)) else "to compile"
        print(f"{cid}: {spec['slice']} x{spec['slices']} {{{_axes(spec['mesh'])}}} "
              f"{spec['per_device_batch']:g} x {spec['sequence_length']} "
              f"remat {spec['model']['remat']} era {spec['model']['era']}: {state}")
    return 0


def _note(result: dict[str, Any]) -> str:
    note = (f"calibration row {result['calibration']}, as published"
            if result.get("calibration") else str(result.get("note") or ""))
    if result["fits"] is None:
        note += f"; {result.get('fits_reason')}"
    if result.get("cache_key") and not _current(result):
        note += "; stale: its configuration changed, `make oracle` compiles it again"
    return note


def _current(result: dict[str, Any]) -> bool:
    """Whether a result's cache key is still its configuration's."""
    try:
        spec = resolve(result["id"], load_configs()[result["id"]])
    except (KeyError, OracleConfigError):
        return False
    return cache_key(spec, result.get("versions") or {}) == result["cache_key"]


def table_rows() -> list[str]:
    """The docs table: one row per result in configs.yaml order."""
    rows = ["| id | slice | mesh | B x T | remat | XLA peak GiB | HBM GiB | fits | note |",
            "|---|---|---|---|---|---|---|---|---|"]
    for cid in load_configs():
        path = RESULTS / f"{cid}.json"
        if not path.exists():
            rows.append(f"| {cid} | | | | | not compiled yet | | | |")
            continue
        r = json.loads(path.read_text())
        peak = r["peak_bytes_per_device"]
        if peak is None and r["fits"] is False:
            oom = r["compile"].get("oom") or {}
            need = oom.get("required_bytes")
            shown = (f"> HBM ({oom.get('required_of')}: {need / GIB:.1f})" if need
                     else "> HBM")
        else:
            shown = f"{peak / GIB:.2f}" if peak is not None else "-"
            if peak is not None and device_peak_bytes(r) is None:
                shown += " (host memory included)"
        fits = {True: "yes", False: "**no**", None: "?"}[r["fits"]]
        sl = r["slice"] + (f" x {r['slices']}" if r["slices"] > 1 else "")
        rows.append(f"| {cid} | {sl} | {_axes(r['mesh'])} | {r['per_device_batch']:g} x "
                    f"{r['sequence_length']} | {r['remat']} | {shown} | "
                    f"{r['hbm_bytes_per_device'] / GIB:.1f} | {fits} | {_note(r)} |")
    return rows


def write_table() -> int:
    text = DOC.read_text()
    if TABLE_BEGIN not in text or TABLE_END not in text:
        print(f"xla_oracle: {DOC.relative_to(ROOT)} has no table markers", file=sys.stderr)
        return 2
    head, rest = text.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    DOC.write_text(head + TABLE_BEGIN + "\n" + "\n".join(table_rows()) + "\n" + TABLE_END + tail)
    print(f"xla_oracle: wrote the table of {DOC.relative_to(ROOT)}")
    return 0


def refresh_inventories() -> int:
    """Parse the committed HLO of every result that has one again (after a change to the
    inventory parser; no compile), and judge each compiled peak against the HBM the chip
    preset now says XLA makes available (``device_hbm_bytes``)."""
    from chip import get_chip_spec
    from pod.config.mesh import device_hbm_bytes

    for path in sorted(RESULTS.glob("*.json")):
        result = json.loads(path.read_text())
        hbm = int(device_hbm_bytes(get_chip_spec(result["chip"])))
        peak = result.get("peak_bytes_per_device")
        verdict = (judge_peak(peak, hbm, result.get("memory"))
                   if result["compile"].get("ok") and peak is not None else None)
        if result.get("hbm_bytes_per_device") != hbm or (
                verdict and verdict != (result["fits"], result["fits_reason"])):
            result["hbm_bytes_per_device"] = hbm
            if verdict:
                result["fits"], result["fits_reason"] = verdict
            path.write_text(json.dumps(result, indent=1) + "\n")
        source = (ROOT / result["hlo_file"] if result.get("hlo_file")
                  else HLO_CACHE / f"{result['id']}.hlo.txt.gz")
        error = result["compile"].get("error")
        if error and "RESOURCE_EXHAUSTED" in error:
            vmem = "in memory space vmem" in error
            result["compile"]["oom"] = None if vmem else parse_oom(error)
            if vmem:
                result["fits"] = None
                result["fits_reason"] = ("not decided: a Pallas kernel's scratch ran out of "
                                         "VMEM (the reference's flash block sizes), before any "
                                         "HBM verdict")
            path.write_text(json.dumps(result, indent=1) + "\n")
        if not source.exists():
            continue
        with gzip.open(source, "rt") as fh:
            result["inventory"] = op_inventory(fh.read())
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"xla_oracle: {result['id']}: inventory parsed again from "
              f"{source.relative_to(ROOT)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.xla_oracle", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated config ids")
    parser.add_argument("--force", action="store_true", help="compile even if cached")
    parser.add_argument("--list", action="store_true", help="list the configs and exit")
    parser.add_argument("--table", action="store_true", help="rewrite the docs table")
    parser.add_argument("--refresh-inventory", action="store_true",
                        help="parse the HLO files and XLA's messages again and judge the "
                             "peaks against the presets' HBM (no compile)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="compiles at once (each its own process; default 1)")
    parser.add_argument("--timeout", type=float, default=7200.0,
                        help="seconds one compile may take (default 7200)")
    args = parser.parse_args(argv)
    if args.list:
        return list_configs()
    if args.table:
        return write_table()
    if args.refresh_inventory:
        return refresh_inventories()
    only = [i.strip() for i in args.only.split(",") if i.strip()] or None
    return run(only, args.force, args.timeout, args.jobs)


if __name__ == "__main__":
    raise SystemExit(main())
