"""The one object a checkpoint holds for the run's batch: what a resume needs beyond weights.

:class:`RunState` gathers the session's state (the batch state, the probe result, the noise
scale's averages), the run's shape (world size, dataset size, sequence length) and a fingerprint
of the settings that change what is trained, and captures every rank's random generators for a
step checkpoint. The fingerprint is recorded with each checkpoint, and a resumed run whose
trained settings differ from the ones that wrote it is refused (:meth:`RunState.check_resume`):
it would train something other than what it logs.
"""

import json
import os
import re
from typing import Any, Dict, List, Mapping, Optional

from adaptive_batch.distributed import RankGroup, check_same_world_size
from adaptive_batch.errors import ConfigError
from adaptive_batch.files import content_digest
import adaptive_batch.logs as logs
from adaptive_batch.rng import rng_state, set_rng_state
from adaptive_batch.run.options import AdaptiveBatchOptions
from adaptive_batch.run.session import BatchSession
from adaptive_batch.schedule.growth import RECORDED_SINCE, same_setting_recorded

RUN_STATE_KEY = "adaptive_batch_run"
# What sets what fits, not what a step trains: the memory budget, and the recipes' activation
# checkpointing and offloading. With a fixed global batch they set only how each step is split
# into micro-batches, so a resumed run may change them and probe again.
BUDGET_KEYS = frozenset({"max_memory", "memory_safety_margin", "enable_activation_checkpointing",
                         "enable_activation_offloading"})
RNG_KEY = "rng_state"
VERSION = 1


# A setting under a key named like these that names a file or directory that exists is
# fingerprinted by what it holds: a run moved to another folder resumes, and one whose data
# was regenerated there does not.
_PATH_KEY = re.compile(r"(^|_)(path|dir|file|files|source)$")


def fingerprint(settings: Mapping[str, Any]) -> Dict[str, str]:
    """Each setting as canonical JSON, so that two runs' settings compare key by key and a
    difference can be shown as it was written; local paths as their content."""
    return {
        key: json.dumps(_by_content(key, value), sort_keys=True, default=str) for key, value in sorted(settings.items())
    }


def _by_content(key: str, value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _by_content(str(k), v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_by_content(key, v) for v in value]
    if isinstance(value, str) and _PATH_KEY.search(key) and value and os.path.exists(value):
        return {"content": content_digest(value)}
    return value


def _same_record(key: str, saved: Optional[str], now: Optional[str]) -> bool:
    """Two fingerprints of a setting, as
    :func:`~adaptive_batch.schedule.growth.same_setting_recorded` compares them."""
    if saved == now or saved is None or now is None:
        return saved == now
    return same_setting_recorded(key, json.loads(saved), json.loads(now))


class RunState:
    """What a resumed run needs of the batch side, as one stateful object.

    Args:
        session: the run's batch decisions (batch state, probe result, noise scale): a
            :class:`~adaptive_batch.run.session.BatchSession`, or the controller over one.

        settings: the settings that change what is trained (see
            :func:`adaptive_batch.torchtune.config.trained_settings`), fingerprinted.
        resumed_by: what resumed the run, for the refusal's line (a recipe's key).
        fresh_start: how to train from the start instead, for the same line.

    Raises:
        TypeError: for anything else, when built (not at the first checkpoint).
    """

    def __init__(self, session: Any, *, settings: Mapping[str, Any], resumed_by: str = "resume_from_checkpoint=True",
                 fresh_start: str = "start a new output_dir") -> None:
        # The session, or what adapts it (a controller, ``AdaptiveBatch``'s): its decisions.
        self.session: BatchSession = getattr(session, "session", session)
        if not isinstance(self.session, BatchSession):
            raise TypeError(f"RunState takes a BatchSession or its controller, not {type(session).__name__}.")
        self._settings = dict(settings)
        self._resumed_by, self._fresh_start = resumed_by, fresh_start
        self._fingerprint: Optional[Dict[str, str]] = None
        self.saved: Optional[Dict[str, Any]] = None  # what the checkpoint resumed from recorded

    @property
    def fingerprint(self) -> Dict[str, str]:
        """The settings' fingerprint, taken when first asked for (a resume's check, the first
        checkpoint): by then the run has written the data its settings name."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self._settings)
        return self._fingerprint

    def state_dict(self) -> Dict[str, Any]:
        """The session's state under its keys, and the run's shape and fingerprint."""
        session = self.session
        return {
            **session.state_dict(),
            RUN_STATE_KEY: {
                "version": VERSION,
                "world_size": session.ranks.world_size,
                "dataset_size": session.dataset_size,
                "seq_len": session.max_seq_len,
                "fingerprint": dict(self.fingerprint),
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Takes the session's state and keeps the recorded shape and fingerprint."""
        self.session.load_state_dict(dict(state))
        self.saved = state.get(RUN_STATE_KEY)

    def changed_settings(self) -> List[str]:
        """The settings whose fingerprint differs from the checkpoint's (empty when it recorded
        none)."""
        if not self.saved:
            return []
        before = self.saved.get("fingerprint", {})
        defaults = AdaptiveBatchOptions.defaults()
        return sorted(
            key for key in set(before) | set(self.fingerprint)
            if not _same_record(key, before.get(key), self.fingerprint.get(key))
            and not self._newer_key_at_default(key, before, defaults)
        )

    def _newer_key_at_default(self, key: str, before: Mapping[str, str], defaults: Mapping[str, Any]) -> bool:
        """A setting the checkpoint's version did not have, left unset or at its default now:
        that run trained as its default does. One recorded only since (what fits beside the
        budget) is not compared: what that run had is not known."""
        if key in before or key not in self.fingerprint:
            return False
        if key in RECORDED_SINCE:
            return True
        return self.fingerprint[key] in (fingerprint({key: None})[key], fingerprint({key: defaults.get(key)})[key])

    def check_resume(self) -> None:
        """Refuses a resumed run that would train something else than the run that wrote the
        checkpoint: another number of ranks, or a changed trained setting (the first, by name).
        A checkpoint that recorded no fingerprint (written before it was kept) is not checked.
        A changed memory budget (:data:`BUDGET_KEYS`) with a fixed global batch is taken: the
        session probes the micro-batch again, and each step trains the same samples.

        Raises:
            ConfigError: naming the setting, its saved and its new value, and the fix.
        """
        if not self.saved:
            return
        world = self.session.ranks.world_size
        check_same_world_size(self.saved.get("world_size", world), world, "the checkpoint")
        changed, before = self.changed_settings(), self.saved.get("fingerprint", {})
        global_batch = self.session.options.global_batch.global_batch_size
        if changed and set(changed) <= BUDGET_KEYS and global_batch is not None:
            moves = ", ".join(f"{k} {before.get(k, 'unset')} -> {self.fingerprint[k]}" for k in changed)
            with logs.lines_to(self.session.log, self.session.warn):  # where the session's lines go
                logs.info(
                    f"Resumed run: {moves}; each step still trains global_batch_size={global_batch} samples: "
                    "probing the micro-batch again."
                )
            self.session.probe_again()
            return
        if changed:
            key = changed[0]
            more = f" (and {', '.join(changed[1:])})" if len(changed) > 1 else ""
            budget = (
                " (the batch probed under it; with a global_batch_size it may change: it sets the micro-batch alone)"
                if set(changed) <= BUDGET_KEYS else ""
            )
            raise ConfigError(
                f"{self._resumed_by}: {key} was {before.get(key, 'unset')} in the run that wrote the "
                f"checkpoint and is {self.fingerprint.get(key, 'unset')} now{more}; it changes what is trained{budget}: "
                f"put it back to resume, or {self._fresh_start}."
            )

    @property
    def rng(self) -> "RanksRNG":
        """Every rank's random generators, as a stateful object of their own (a step
        checkpoint's position; an epoch checkpoint starts its next epoch from the seed)."""
        return RanksRNG(self.session.ranks)


class RanksRNG:
    """The random generators of every rank (Python, NumPy, torch, CUDA), one capture
    (:func:`adaptive_batch.rng.rng_state`) per rank.

    Args:
        ranks: the data-parallel ranks.
    """

    def __init__(self, ranks: RankGroup) -> None:
        self.ranks = ranks

    def state_dict(self) -> List[Dict[str, Any]]:
        """Every rank's generators, gathered (each rank calls it; rank 0 saves them)."""
        return self.ranks.gather(rng_state())

    def load_state_dict(self, states: List[Dict[str, Any]]) -> None:
        """This rank's generators from what :meth:`state_dict` gathered."""
        set_rng_state(states[self.ranks.rank])
