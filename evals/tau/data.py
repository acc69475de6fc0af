"""Finding a domain's files under a tau2 data root and loading them.

A data root is a folder holding ``tau2/domains/<name>/`` (tau2-bench's ``data`` folder, or
``shared/anchors``). It comes from the caller (``--data-dir``) or, failing that, the
``TAU2_DATA_DIR`` environment variable, as in tau2.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from closedloop.evals.tau.data_model import Task
from closedloop.evals.tau.domains.base import TauDB
from closedloop.evals.tau.domains.registry import Domain, available_domains, get_domain
from closedloop.evals.tau.environment import Environment
from closedloop.evals.tau.tau2_source import find_tau2_source, read_tool_docstrings

__all__ = ["DATA_DIR_ENV", "TauDataError", "resolve_data_root", "TaskSet", "DomainData", "load_domain"]

DATA_DIR_ENV = "TAU2_DATA_DIR"


class TauDataError(FileNotFoundError):
    """The data root, a domain folder or one of its files is missing or malformed."""


def resolve_data_root(data_dir: str | Path | None = None, domain: str | None = None) -> Path:
    """``data_dir``, else ``$TAU2_DATA_DIR``, else the data the ``domain`` ships with (if any)."""
    raw = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV)
    if raw is None and domain is not None:
        raw = get_domain(domain).bundled_data
    if raw is None:
        shipped = [n for n in available_domains() if _ships_data(n)]
        raise TauDataError(f"no τ data root: pass data_dir (--data-dir) or set {DATA_DIR_ENV} to a folder "
                           f"containing tau2/domains/<name>/" + (f" (domains that ship their data, usable "
                                                                f"without one: {', '.join(shipped)})" if shipped
                                                               else ""))
    root = Path(raw).expanduser()
    if not (root / "tau2" / "domains").is_dir():
        raise TauDataError(f"{root} is not a τ data root: {root / 'tau2' / 'domains'} does not exist")
    return root


def _ships_data(name: str) -> bool:
    try:
        return get_domain(name).bundled_data is not None
    except Exception:  # noqa: BLE001 - a broken plugin is left out of a hint, not fatal to it
        return False


@dataclass
class TaskSet:
    """Tasks of one split, with the content hash of the file they came from."""

    domain: str
    split: str | None
    tasks: list[Task]
    sha256: str
    path: Path

    def __len__(self) -> int:
        return len(self.tasks)

    def by_id(self) -> dict[str, Task]:
        return {t.id: t for t in self.tasks}


def _find(folder: Path, stems: tuple[str, ...]) -> Path | None:
    for stem in stems:
        for ext in (".json", ".toml"):
            if (folder / f"{stem}{ext}").is_file():
                return folder / f"{stem}{ext}"
    return None


@dataclass
class DomainData:
    """One domain's code and files; makes fresh environments and loads task splits."""

    domain: Domain
    folder: Path
    options: dict = field(default_factory=dict)  # the domain's documented deviations from tau2, all off by default
    descriptions: dict = field(default_factory=dict)  # tool name -> docstring from a tau2 checkout
    user_descriptions: dict = field(default_factory=dict)
    _db_raw: dict | None = field(default=None, repr=False)
    _user_db_raw: dict | None = field(default=None, repr=False)
    _db_sha: str | None = field(default=None, repr=False)
    _policy_cache: str | None = field(default=None, repr=False)
    _pristine: TauDB | None = field(default=None, repr=False)  # shared, never written (see make_environment)
    _pristine_hash: str | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.domain.name

    @property
    def policy(self) -> str:
        if self.domain.policy_text is not None:
            return self.domain.policy_text(self.folder)
        path = self.folder / self.domain.policy_file
        if not path.is_file():
            raise TauDataError(f"policy file {path} is missing")
        return path.read_text()

    def _load_db(self, model: type[TauDB], stem: str, cache_attr: str) -> TauDB:
        path = _find(self.folder, (stem,))
        if path is None:
            raise TauDataError(f"{self.folder} has no {stem}.json or {stem}.toml")
        if path.suffix == ".toml":
            return model.load(path)
        # The parsed JSON is kept and validated anew per environment: validation builds new
        # containers all the way down, so environments never share mutable state, and it is
        # about twice as fast as re-parsing the file.
        raw = getattr(self, cache_attr)
        if raw is None:
            raw = json.loads(path.read_bytes())
            setattr(self, cache_attr, raw)
        return model.model_validate(raw)

    @property
    def cache_key(self) -> tuple[str, str]:
        """Names this data for caches of derived states (gold replays): folder and DB content."""
        if self._db_sha is None:
            path = _find(self.folder, ("db",))
            self._db_sha = hashlib.sha256(path.read_bytes()).hexdigest() if path is not None else ""
        return (str(self.folder.resolve()), self._db_sha)

    def make_environment(self) -> Environment:
        """A fresh environment on the pristine DB.

        A JSON DB of a single-DB domain is validated once and shared by every environment until
        that environment first writes (a mutating tool, an init action, an assertion, ``env.db``):
        then it gets its own copy, validated anew from the parsed file. Most episodes and every
        read-only replay never pay for a copy, which is the larger part of the CPU an episode
        costs on the retail DB. Other DBs (TOML, dual control) are parsed per environment."""
        path = _find(self.folder, ("db",))
        shareable = (path is not None and path.suffix == ".json" and self.domain.user_db_model is None
                     and getattr(self.domain, "sync_tools", None) is None)
        if not shareable:
            db = self._load_db(self.domain.db_model, "db", "_db_raw")
            user_db = None
            if self.domain.user_db_model is not None:
                user_db = self._load_db(self.domain.user_db_model, "user_db", "_user_db_raw")
            return Environment(self.domain, db, user_db=user_db, policy=self._policy_text(), options=self.options,
                               descriptions=self.descriptions or None,
                               user_descriptions=self.user_descriptions or None)
        if self._pristine is None:
            self._pristine = self._load_db(self.domain.db_model, "db", "_db_raw")
        return Environment(self.domain, self._pristine, policy=self._policy_text(), options=self.options,
                           descriptions=self.descriptions or None, user_descriptions=self.user_descriptions or None,
                           copy_db=lambda: self._load_db(self.domain.db_model, "db", "_db_raw"),
                           shared_hash=self._shared_hash)

    def _shared_hash(self) -> str:
        if self._pristine_hash is None:
            assert self._pristine is not None
            self._pristine_hash = self._pristine.get_hash()
        return self._pristine_hash

    def _policy_text(self) -> str:
        if self._policy_cache is None:
            self._policy_cache = self.policy if (self.folder / self.domain.policy_file).is_file() else ""
        return self._policy_cache

    def _marks(self, requestor: str) -> dict[str, dict]:
        kit = self.domain.user_toolkit if requestor == "user" else self.domain.toolkit
        marks = getattr(kit, "tool_marks", None)
        return marks() if marks is not None else {}

    def is_mutating_tool(self, name: str, requestor: str = "assistant") -> bool:
        """From the toolkit class: no environment is built."""
        return bool(self._marks(requestor).get(name, {}).get("mutates"))

    def tool_types(self) -> dict[str, str]:
        """tau2 ``get_tool_types`` over agent and user tools."""
        kinds = {n: m["kind"] for n, m in self._marks("assistant").items()}
        if self.domain.user_toolkit is not None:
            kinds.update({n: m["kind"] for n, m in self._marks("user").items()})
        return kinds

    def environment_factory(self) -> Callable[[], Environment]:
        return self.make_environment

    def splits(self, task_file: str = "tasks.json") -> dict[str, list[str]]:
        split_path = self.folder / f"split_{task_file}"
        if not split_path.is_file():
            return {}
        return json.loads(split_path.read_text())

    def load_tasks(self, split: str | None = "base", *, task_file: str = "tasks.json",
                   task_ids: list[str] | None = None) -> TaskSet:
        """Tasks of a split (``base`` = all tasks when the split file does not define it)."""
        path = self.folder / task_file
        if not path.is_file():
            raise TauDataError(f"task file {path} is missing")
        raw = path.read_bytes()
        digest = hashlib.sha256(raw).hexdigest()
        data = json.loads(raw)
        if not isinstance(data, list):
            raise TauDataError(f"{path} must hold a JSON list of tasks, got {type(data).__name__}")
        tasks = [Task.model_validate(t) for t in data]
        for t in tasks:
            t._source_sha256 = digest
        if split is not None:
            splits = self.splits(task_file)
            if split in splits:
                wanted = set(splits[split])
                missing = wanted - {t.id for t in tasks}
                if missing:
                    raise TauDataError(f"split {split!r} names tasks absent from {path}: {sorted(missing)[:5]}")
                tasks = [t for t in tasks if t.id in wanted]
            elif split != "base":
                raise TauDataError(f"no split {split!r} in {path.parent / ('split_' + task_file)}; "
                                   f"available: {sorted(splits) or ['base']}")
        if task_ids is not None:
            by_id = {t.id: t for t in tasks}
            unknown = [i for i in task_ids if i not in by_id]
            if unknown:
                raise TauDataError(f"unknown task ids {unknown}")
            tasks = [by_id[i] for i in task_ids]
        return TaskSet(self.name, split, tasks, digest, path)


def load_domain(name: str, data_dir: str | Path | None = None, *, options: dict | None = None,
                tau2_source: bool = True) -> DomainData:
    """A domain's code and data. ``options`` switch on documented deviations from tau2 (see the
    domain's toolkit and :class:`~closedloop.evals.tau.environment.Environment`); with
    ``tau2_source`` the tool descriptions come from a tau2 checkout when one is found
    (:mod:`~closedloop.evals.tau.tau2_source`)."""
    root = resolve_data_root(data_dir, name)
    folder = root / "tau2" / "domains" / name
    domain = get_domain(name)
    if not folder.is_dir():
        raise TauDataError(f"no data for domain {name!r}: {folder} does not exist")
    data = DomainData(domain, folder, options=dict(options or {}))
    src = find_tau2_source(root) if tau2_source else None
    if src is not None:
        data.descriptions = read_tool_docstrings(src, name, "tools")
        if domain.user_toolkit is not None:
            data.user_descriptions = read_tool_docstrings(src, name, "user_tools")
    return data
