"""A sweep's Optuna study and its storage: the sweep folder (``study.journal``, ``sweep.json`` and one run
folder per trial), or an RDB storage (``--storage URL``) that workers on several machines share.

Trials are Optuna trials; each one's run folder, devices, host and worker pid are its user attributes.
A trial whose worker process is gone (a kill -9) is still RUNNING in the storage: ``recover_lost``
records it FAIL (``lost``) and enqueues its parameters again, so the sweep re-runs them."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from multilane.engine.errors import UserError
from multilane.engine.sweep.optuna_lib import journal_storage, optuna, rdb_storage
from multilane.engine.sweep.recovery import asking, fail_and_requeue, recover_lost, worker_identity
from multilane.engine.sweep.sampling import enqueue_grid, make_pruner, make_sampler
from multilane.engine.sweep.spec import SPEC_ATTR, SweepSpec
from multilane.engine.sweep.storage_guard import (
    NotThereYet,
    check_journal,
    check_sqlite,
    has_secret,
    redact,
    sqlite_path,
    write_private,
)

SAY_EVERY_S = 10.0  # a waiting worker says how long it has waited this often
SPEC_WAIT_S = 15.0  # a study with no sweep settings: made this moment (they come next), or no sweep's

JOURNAL = "study.journal"
SWEEP_JSON = "sweep.json"
STORAGE_URL = ".storage-url"  # the storage URL when it holds a password: mode 0600 (sweep.json shows it as ***)


class Sweep:
    """One sweep: its folder on this machine (trial run folders go there), its spec and its study."""

    def __init__(self, folder: Path, spec: SweepSpec, study: Any, storage_url: str | None) -> None:
        self.folder = folder
        self.spec = spec
        self.study = study
        self.storage_url = storage_url

    # -- opening -------------------------------------------------------------------------------------
    @classmethod
    def create(cls, spec: SweepSpec, sweeps_dir: str | Path, storage_url: str | None = None) -> Sweep:
        """A new sweep folder ``<sweeps_dir>/<timestamp>-<name>`` and its study (in the folder's journal, or at ``storage_url``)."""
        root = Path(sweeps_dir).expanduser()
        rdb = _storage(root, storage_url, must_exist=False) if storage_url else None  # a bad URL: one line, no folder
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"--sweeps-dir {root}: cannot create it ({e.strerror or e})") from None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for i in range(1000):
            folder = root / (f"{stamp}-{spec.name}" if i == 0 else f"{stamp}-{spec.name}-{i + 1}")
            try:
                folder.mkdir()
                break
            except FileExistsError:
                continue
        else:
            raise UserError(f"--sweeps-dir {root}: too many sweeps named {spec.name!r} this second")
        storage = rdb if rdb is not None else journal_storage(str(folder / JOURNAL))
        mod = optuna()
        try:
            study = mod.create_study(
                study_name=spec.name,
                storage=storage,
                direction=spec.direction,
                sampler=make_sampler(spec),
                pruner=make_pruner(spec),
            )
        except mod.exceptions.DuplicatedStudyError:
            folder.rmdir()
            raise UserError(f"--storage already holds a study named {spec.name!r}; pick another --name") from None
        if spec.sampler == "grid":
            enqueue_grid(study, spec)
        study.set_user_attr(SPEC_ATTR, spec.to_dict())  # last: a worker waits for it, so it finds the grid queued
        if has_secret(storage_url):  # the URL's password: a file of its owner's eyes only, from its first byte
            write_private(folder / STORAGE_URL, (str(storage_url) + "\n").encode())
        shown = redact(storage_url) if storage_url else None
        (folder / SWEEP_JSON).write_text(
            json.dumps({"study": spec.name, "storage": shown, **spec.to_dict()}, indent=2) + "\n"
        )
        return cls(folder, spec, study, storage_url)

    @classmethod
    def open(cls, folder: str | Path) -> Sweep:
        """Reopen a sweep folder (``--resume``): its study from its journal or the storage it names."""
        path = Path(folder).expanduser()
        try:
            saved = json.loads((path / SWEEP_JSON).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UserError(f"--resume {path}: not a sweep folder (no {SWEEP_JSON})") from None
        except (OSError, ValueError) as e:
            raise UserError(f"--resume {path}: {SWEEP_JSON} cannot be read ({e})") from None
        if not isinstance(saved, dict):
            raise UserError(f"--resume {path}: {SWEEP_JSON} is not a sweep's description")
        url = saved.get("storage")
        if (path / STORAGE_URL).is_file():  # the URL with its password, which sweep.json shows as ***
            try:
                url = (path / STORAGE_URL).read_text(encoding="utf-8").strip()
            except OSError as e:
                raise UserError(f"--resume {path}: {STORAGE_URL} cannot be read ({e.strerror or e})") from None
        return cls.join(url, str(saved.get("study")), path)

    @classmethod
    def join(
        cls, storage_url: str | None, study_name: str, folder: str | Path, wait_s: float = 0.0, say: Any = None
    ) -> Sweep:
        """The study ``study_name`` (``sweep-worker``): its spec read from the storage; trial folders go in
        ``folder``. What may still appear (a database file in a folder that exists, a study in a storage
        that holds none yet: a worker started with, or before, its sweep) is waited for up to ``wait_s``
        seconds, said to ``say`` as it starts and every ``SAY_EVERY_S`` seconds with the time waited; what
        cannot appear (its folder missing, a storage holding other studies but not this one) is refused
        at once (storage_guard, ``_join``)."""
        t0 = time.monotonic()
        next_say = 0.0
        while True:
            try:
                return cls._join(storage_url, study_name, folder)
            except NotThereYet as e:
                waited = time.monotonic() - t0
                limit = min(wait_s, e.most_s) if e.most_s is not None else wait_s
                if waited >= limit:
                    raise UserError(e.given_up(waited)) from None
                if say is not None and waited >= next_say:
                    say(
                        f"{'waiting' if not next_say else 'still waiting'} for {e}: {waited:.0f} s of "
                        f"{limit:.0f} s (--wait S sets the limit; Ctrl+C gives up)"
                    )
                    next_say += SAY_EVERY_S
                time.sleep(min(1.0, max(0.0, limit - waited)))

    @classmethod
    def _join(cls, storage_url: str | None, study_name: str, folder: str | Path) -> Sweep:
        path = Path(folder).expanduser()
        storage = _storage(path, storage_url, must_exist=True)
        mod = optuna()
        try:
            probe = mod.load_study(study_name=study_name, storage=storage)
        except KeyError:
            held = sorted(s.study_name for s in storage.get_all_studies())
            if held:  # a storage in use: a study missing from it is a wrong --study, not one on its way
                shown = ", ".join(repr(n) for n in held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
                raise UserError(
                    f"--study {study_name!r}: the storage holds no study of that name (it holds {shown})"
                ) from None
            raise NotThereYet(f"a study named {study_name!r} (the storage holds no study yet)") from None
        if SPEC_ATTR not in probe.user_attrs:  # made a moment ago: its spec comes next (or it is no sweep's)
            raise NotThereYet(
                f"the sweep's settings in study {study_name!r}",
                most_s=SPEC_WAIT_S,
                gone=f"--study {study_name!r} holds no Multilane sweep's settings: not a Multilane sweep's study",
            )
        spec = SweepSpec.from_dict(probe.user_attrs[SPEC_ATTR] or {})
        study = mod.load_study(
            study_name=study_name, storage=storage, sampler=make_sampler(spec), pruner=make_pruner(spec)
        )
        path.mkdir(parents=True, exist_ok=True)
        return cls(path, spec, study, storage_url)

    # -- asking ---------------------------------------------------------------------------------------
    def ask(self, worker: str | None = None, target: int | None = None) -> tuple[Any, dict[str, Any]] | None:
        """A new trial for this process to run: asked of the study, who runs it recorded, its parameters
        suggested (by a sampler seeded from the study's seed and the trial's number). With ``target``:
        None once the study's trials done and running reach it, counted under the same lock as the ask,
        so that two workers of one machine never both take the last trial (workers on other machines
        count through the storage alone: each may start one more than the target asks)."""
        with asking():  # recover_lost never sees the trial between the ask and who runs it
            if target is not None:
                c = self.counts()
                if c["done"] + c["running"] >= target:
                    return None
            trial = self.study.ask()
            for k, v in worker_identity(worker).items():
                trial.set_user_attr(k, v)
        return trial, {p.key: p.suggest(trial) for p in self.spec.params}

    # -- counting and recovery ------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """Trials by how far they got: ``done`` (complete, pruned, failed on their own), ``running``, ``lost``."""
        ts = optuna().trial.TrialState
        c = {"done": 0, "running": 0, "lost": 0, "waiting": 0}
        for t in self.study.get_trials(deepcopy=False):
            if t.state == ts.RUNNING:
                c["running"] += 1
            elif t.state == ts.WAITING:
                c["waiting"] += 1
            elif t.state == ts.FAIL and t.user_attrs.get("lost"):
                c["lost"] += 1
            else:
                c["done"] += 1
        return c

    def recover_lost(self) -> list[int]:
        """``recovery.recover_lost`` on this sweep: its lost trials re-queued. Returns their numbers."""
        return recover_lost(self)

    def fail_and_requeue(self, trial: Any, why: str, killed: bool = False) -> None:
        """``recovery.fail_and_requeue``: a trial that did not end on its own, re-queued."""
        fail_and_requeue(self, trial, why, killed)


def _storage(folder: Path, storage_url: str | None, must_exist: bool) -> Any:
    """The study's storage, checked first (storage_guard): a torn journal tail cut back, a file that is
    no Optuna storage refused in one line."""
    if storage_url:
        db = sqlite_path(storage_url)
        if db is not None:
            check_sqlite(db, must_exist)
        return rdb_storage(storage_url)
    check_journal(folder / JOURNAL)
    return journal_storage(str(folder / JOURNAL))
