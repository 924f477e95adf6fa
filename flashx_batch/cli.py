"""The Hydra command line: `python -m flashx_batch conf=NAME key=value ...` (README "Commands";
docs/batch_jobs.md for presets, Hydra settings and exit codes).

Thin on purpose: Hydra composes the preset, `to_job_config` turns it into a `JobConfig`, and
`runner.run` does the work. This is the only module (with `config.compose_job`) that knows Hydra.

Hydra settings (see `config.register_configs`): no working-directory change, no `.hydra/` copy,
no log file — `dry_run` writes nothing and `output.dir` holds only the job layout. Under `-m`, each
run writes to `<output.dir>/<the swept keys of that run>` (e.g. `runtime.max_batch_size=4`), and
Hydra's `multirun.yaml` lands in `<output.dir>` itself.

Exit codes: a composition error (unknown key, bad value, unknown preset) is a bad job → 2, not
Hydra's 1; a multirun exits with the most severe code of its runs, and a SIGINT / SIGTERM stops
the sweep (130 / 143) instead of moving on to the next point.
"""

from __future__ import annotations

import logging
import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from flashx_batch.config import PRIMARY_CONFIG, check_override_keys, quote_overrides, register_configs, to_job_config
from flashx_batch.errors import ConfigError
from flashx_batch.storage import is_remote

log = logging.getLogger(__name__)
_codes: list[int] = []  # one per run Hydra launched in this process
_swept: set[str] = set()  # keys swept on the command line (`key=a,b`), found in main()


def _sweep_subdir(*, _root_: DictConfig) -> str:
    """`hydra.sweep.subdir`: only the swept keys of this run, so every point gets a short, distinct dir."""
    swept = _swept | set(OmegaConf.select(_root_, "hydra.sweeper.params", default=None) or {})
    task = OmegaConf.select(_root_, "hydra.overrides.task", default=None) or []
    parts = [o for o in task if o.split("=", 1)[0].lstrip("+~") in swept]
    name = ",".join(parts).replace(os.sep, "_")
    return name or f"run{OmegaConf.select(_root_, 'hydra.job.num', default=0)}"


def _find_swept(args: list[str]) -> set[str]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides([a for a in args if "=" in a and not a.startswith("-")])
    except Exception:  # Hydra reports malformed overrides itself, with a better message
        return set()
    return {o.key_or_group for o in parsed if o.is_sweep_override()}


def _severity(code: int) -> float:
    """Order for combining multirun codes: bad job > failure > try later > interrupted > ok."""
    return {0: 0, 130: 1, 143: 1, 75: 1.5, 1: 2, 2: 3}.get(code, 2)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


@hydra.main(version_base="1.3", config_path=".", config_name=PRIMARY_CONFIG)
def _entry(cfg: DictConfig) -> int:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    setup_logging(str(cfg.get("log_level", "INFO")))
    try:
        job = to_job_config(cfg)
    except ConfigError as exc:
        log.error("%s", exc)
        _codes.append(2)
        return 2
    if hc.mode == RunMode.MULTIRUN:
        if is_remote(job.output.dir):  # Hydra makes its sweep dirs local paths: keep the URI, add the point's name
            job.output.dir = f"{job.output.dir.rstrip('/')}/{os.path.basename(hc.runtime.output_dir)}"
            log.info("sweep point -> %s (Hydra's multirun.yaml stays in the local %s)", job.output.dir,
                     os.path.dirname(hc.runtime.output_dir))
        else:
            job.output.dir = hc.runtime.output_dir  # = <output.dir>/<swept keys> (sweep settings)
    from flashx_batch.runner import run

    code = run(job)
    _codes.append(code)
    if code in (130, 143) and hc.mode == RunMode.MULTIRUN:
        raise SystemExit(code)  # a signal stops the whole sweep, not just this point of it
    return code


def main() -> None:
    """Console entry point (`python -m flashx_batch`, `flashx-batch`)."""
    register_configs()
    OmegaConf.register_new_resolver("fx_sweep_subdir", _sweep_subdir, replace=True)
    sys.argv[1:] = quote_overrides(sys.argv[1:])  # `data.path=s3://lake/day=1/` as typed
    try:
        check_override_keys(sys.argv[1:])
    except ConfigError as exc:  # Hydra would suggest `+key=`, which fails too: name the setting meant
        setup_logging("INFO")
        log.error("%s", exc)
        sys.exit(2)
    _codes.clear()
    _swept.clear()
    _swept.update(_find_swept(sys.argv[1:]))
    try:
        _entry()
    except SystemExit as exc:
        # Hydra exits 1 for its own errors (unknown key, missing preset, bad override) before any
        # run starts: for us that is a bad job.
        if not _codes and exc.code not in (0, None):
            sys.exit(2)
        if not _codes:
            raise
        if exc.code in (130, 143):  # a sweep stopped by a signal says so, whatever its earlier points did
            sys.exit(exc.code)
    if not _codes and any(a in ("--cfg", "-c", "--info", "-i", "--help", "-h", "--hydra-help") for a in sys.argv[1:]):
        sys.exit(0)  # Hydra printed the config, info or help it was asked for: no job ran, none failed
    sys.exit(max(_codes, key=_severity) if _codes else 2)
