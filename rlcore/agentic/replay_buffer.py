"""Decoupled rollout and training: a staleness-bounded replay buffer and a producer thread.

Why decouple: in a synchronous loop the trainer idles while the engine generates and the
engine idles while the trainer updates. Letting a producer keep generating with the weights it
has (version v) while the trainer learns version v+1 keeps both busy, at the price of training on
samples from a slightly older policy. Two things keep that price bounded:

1. Staleness: every row remembers the ``policy_version`` that generated it; rows more than
   ``max_staleness`` versions behind the current policy are dropped (and counted), never trained on.
   ``max_staleness=0`` is on-policy training.
2. Importance sampling: the sampled rows' ``rollout_log_probs`` are the behaviour policy's. A recipe
   computes the current policy's log-probs for exactly those rows and reweights the loss by the
   truncated ratio pi_current / pi_behaviour::

       batch = loop.pop_batch(n)                                  # or buffer.sample(n, version, rng)
       batch = batch.union(actor.compute_log_prob(batch))         # old_log_probs = current policy
       ... rewards, advantages ...
       actor.update_policy(batch)         # with actor.use_rollout_is=True the actor applies
                                          # compute_is_weights(old_log_probs, rollout_log_probs)

   ``importance_weights`` below is that same computation for a recipe that builds its own loss
   (pass the result as ``is_weights``) or logs how off-policy its batches are: fresh rows get
   weights of 1, stale rows do not.

Rows of different batches rarely share a width (prompt lengths and, for multi-turn rollouts,
response lengths vary), so the buffer pads on insertion (prompt side on the left, response side on
the right, the ``rlcore.protocol`` layout) and trims all-padding columns from what it returns.
Only ``meta_info["temperature"]`` is kept (it gives the log-probs their meaning, so every batch in
one buffer must share it); per-batch metrics are not row data.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from rlcore.protocol import DataProto
from rlcore.trainer import core_algos

_FULL_KEYS = ("input_ids", "attention_mask", "position_ids")  # prompt ++ response
_TOKEN_KEYS = ("prompts", "responses", "input_ids")  # padded with the pad token, the rest with 0


def _widths(data: DataProto) -> tuple[int, int]:
    t_r = data.batch["responses"].shape[1]
    return data.batch["input_ids"].shape[1] - t_r, t_r


def pad_rollout(data: DataProto, t_p: int, t_r: int, pad_token_id: int) -> DataProto:
    """``data`` with prompt width ``t_p`` and response width ``t_r`` (smaller values crop padding)."""
    p0, r0 = _widths(data)
    dp, dr = t_p - p0, t_r - r0
    if dp == dr == 0:
        return data
    tensors = {}
    for key, value in data.batch.items():
        fill = pad_token_id if key in _TOKEN_KEYS else 0
        if value.ndim == 1:
            tensors[key] = value
        elif value.ndim != 2:
            raise ValueError(f"batch[{key!r}] has shape {tuple(value.shape)}; the buffer pads only (B,) or (B, T)")
        elif key == "prompts":
            tensors[key] = F.pad(value, (dp, 0), value=fill)
        elif key in _FULL_KEYS:
            tensors[key] = F.pad(value, (dp, dr), value=fill)
        elif value.shape[1] == r0:
            tensors[key] = F.pad(value, (0, dr), value=fill)
        else:
            raise ValueError(f"batch[{key!r}] has width {value.shape[1]}: neither the response width {r0} "
                             f"nor a prompt/full-sequence key {('prompts', *_FULL_KEYS)}")
    return DataProto.from_dict(tensors, data.non_tensor_batch, data.meta_info)


def _trim(data: DataProto, pad_token_id: int) -> DataProto:
    """Drop prompt columns that are padding in every row, and response columns likewise."""
    t_p, _ = _widths(data)
    mask = data.batch["attention_mask"].bool()
    prompt_used = mask[:, :t_p].any(0).nonzero()
    response_used = mask[:, t_p:].any(0).nonzero()
    new_p = t_p - int(prompt_used[0]) if len(prompt_used) else 0
    new_r = int(response_used[-1]) + 1 if len(response_used) else 1
    return pad_rollout(data, new_p, new_r, pad_token_id)


class ReplayBuffer:
    """Rows in insertion order (FIFO beyond ``capacity``), each tagged with its ``policy_version``.

    Not thread-safe by itself: ``AsyncRolloutLoop`` guards it for a producer thread.
    """

    def __init__(self, capacity: int, max_staleness: int, pad_token_id: int = 0) -> None:
        if capacity < 1 or max_staleness < 0:
            raise ValueError(f"need capacity >= 1 and max_staleness >= 0, got {capacity}, {max_staleness}")
        self.capacity, self.max_staleness, self.pad_token_id = capacity, max_staleness, pad_token_id
        self._data: DataProto | None = None
        self.temperature: float | None = None
        self.num_added = self.num_dropped_stale = self.num_evicted = 0

    def __len__(self) -> int:
        return 0 if self._data is None else len(self._data)

    def add(self, batch: DataProto, policy_version: int) -> None:
        """Append rollout rows generated by policy ``policy_version``; evict the oldest beyond capacity."""
        required = ("input_ids", "attention_mask", "responses")
        if batch.batch is None or any(k not in batch.batch.keys() for k in required):
            raise KeyError(f"ReplayBuffer.add needs a rollout batch with keys {list(required)}")
        if "policy_version" in batch.non_tensor_batch:
            raise ValueError("batch already has a 'policy_version' column: it was added to a buffer before")
        temperature = float(batch.meta_info.get("temperature", 1.0))
        if self.temperature is not None and temperature != self.temperature:
            raise ValueError(f"batch temperature {temperature} differs from the buffer's {self.temperature}: "
                             "rollout_log_probs of different temperatures cannot share one batch")
        new = DataProto(batch=batch.batch, meta_info={"temperature": temperature},
                        non_tensor_batch={**batch.non_tensor_batch,
                                          "policy_version": np.full(len(batch), policy_version, dtype=np.int64)})
        if self._data is not None:
            if set(new.batch.keys()) != set(self._data.batch.keys()):
                raise KeyError(f"batch keys {sorted(new.batch.keys())} differ from the buffer's "
                               f"{sorted(self._data.batch.keys())}")
            (p0, r0), (p1, r1) = _widths(self._data), _widths(new)
            t_p, t_r = max(p0, p1), max(r0, r1)
            new = DataProto.concat([pad_rollout(self._data, t_p, t_r, self.pad_token_id),
                                    pad_rollout(new, t_p, t_r, self.pad_token_id)])
        self._data, self.temperature = new, temperature
        self.num_added += len(batch)
        overflow = len(self._data) - self.capacity
        if overflow > 0:
            self._data = self._data[overflow:]
            self.num_evicted += overflow

    def drop_stale(self, current_version: int) -> int:
        """Remove rows more than ``max_staleness`` versions behind ``current_version``; how many went."""
        if self._data is None:
            return 0
        versions = self._data.non_tensor_batch["policy_version"]
        if (versions > current_version).any():
            raise ValueError(f"rows from policy version {versions.max()} are newer than the current version "
                             f"{current_version}: the version bookkeeping is wrong")
        keep = current_version - versions <= self.max_staleness
        dropped = int((~keep).sum())
        if dropped:
            self._data = self._data[keep]
            self.num_dropped_stale += dropped
        return dropped

    def sample(self, n: int, current_version: int, rng: np.random.Generator) -> DataProto:
        """``n`` distinct fresh rows drawn uniformly; they stay in the buffer (replay)."""
        self._require(n, current_version)
        return _trim(self._data[rng.choice(len(self), size=n, replace=False)], self.pad_token_id)

    def pop_batch(self, n: int, current_version: int) -> DataProto:
        """The ``n`` oldest fresh rows, removed from the buffer (each row trained on once)."""
        self._require(n, current_version)
        out, self._data = self._data[:n], self._data[n:]
        return _trim(out, self.pad_token_id)

    def _require(self, n: int, current_version: int) -> None:
        self.drop_stale(current_version)
        if not 0 < n <= len(self):
            raise ValueError(f"asked for {n} rows but the buffer holds {len(self)} fresh rows "
                             f"(version {current_version}, max_staleness {self.max_staleness})")


def importance_weights(batch: DataProto, current_log_probs: torch.Tensor, cap: float = 2.0,
                       level: str = "token") -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated IS weights pi_current / pi_behaviour for buffer rows (see the module docstring)."""
    weights, metrics = core_algos.compute_is_weights(
        old_log_prob=current_log_probs, rollout_log_probs=batch.batch["rollout_log_probs"],
        response_mask=batch.batch["response_mask"], cap=cap, level=level)
    return weights, metrics


class AsyncRolloutLoop:
    """A producer thread: prompt batches -> ``rollout.generate_sequences`` -> buffer, while the driver trains.

    ``rollout`` is a rollout worker group (``LocalWorkerGroup`` or ``RayWorkerGroup`` of
    ``RolloutWorker``); ``prompts`` an iterable of prompt DataProtos (e.g.
    ``DataProto.from_dict(*batch)`` for each batch of a ``PromptLoader``). With a Ray group the
    generation runs in the rollout actors while the driver thread trains; in-process it runs in the
    producer thread (torch releases the GIL in its kernels).

    Version bookkeeping is exact: a generation and a weight update never overlap (one lock), so the
    version a row is tagged with is the version of every weight that produced it. The producer waits
    while the buffer holds ``capacity`` fresh rows, so it runs at most one buffer ahead.
    """

    def __init__(self, rollout: Any, prompts: Iterable[DataProto], buffer: ReplayBuffer, version: int = 0) -> None:
        self.rollout, self.buffer, self.version = rollout, buffer, version
        self._prompts = iter(prompts)
        self._cond = threading.Condition()
        self._weights_lock = threading.Lock()
        self._stop = self._finished = False
        self._error: BaseException | None = None
        self.rollout_metrics: dict[str, float] = {}  # "rollout/*" of the latest generation (its speed)
        self._thread = threading.Thread(target=self._produce, name="rollout-producer", daemon=True)

    def start(self) -> "AsyncRolloutLoop":
        self._thread.start()
        return self

    def __enter__(self) -> "AsyncRolloutLoop":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop after the generation in flight (if any); the buffer keeps what was produced."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    def _produce(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stop and self._full():
                        self._cond.wait()
                    if self._stop:
                        return
                prompts = next(self._prompts, None)
                if prompts is None:
                    return
                with self._weights_lock:
                    version = self.version
                    out = self.rollout.generate_sequences(prompts)
                with self._cond:
                    self.buffer.add(out, version)
                    self.rollout_metrics = {k: v for k, v in out.meta_info.items() if k.startswith("rollout/")}
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the driver in pop_batch
            self._error = exc
        finally:
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def _full(self) -> bool:
        self.buffer.drop_stale(self.version)
        return len(self.buffer) >= self.buffer.capacity

    def pop_batch(self, n: int, timeout: float | None = None) -> DataProto:
        """Wait for ``n`` rows fresh at the current version and take the oldest of them."""
        if n > self.buffer.capacity:
            raise ValueError(f"pop_batch({n}) can never be served by a buffer of capacity {self.buffer.capacity}")

        def ready() -> bool:
            self.buffer.drop_stale(self.version)
            return len(self.buffer) >= n or self._finished

        with self._cond:
            if not self._cond.wait_for(ready, timeout):
                raise TimeoutError(f"no {n} fresh rows after {timeout} s (buffer holds {len(self.buffer)})")
            if self._error is not None:
                raise RuntimeError(f"the rollout producer failed: {self._error!r}") from self._error
            if len(self.buffer) < n:
                raise RuntimeError(f"the producer has finished (prompts ran out or stop() was called) with "
                                   f"{len(self.buffer)} fresh rows left; {n} asked for")
            batch = self.buffer.pop_batch(n, self.version)
            self._cond.notify_all()  # room again: the producer may sample the next batch now
            return batch

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the producer between two generations, e.g. to validate on the same engine."""
        with self._weights_lock:
            yield

    def publish_weights(self, state_dict: Any, version: int) -> None:
        """Load new policy weights into the rollout (after the generation in flight) as ``version``.

        ``state_dict``: what ``rollout.update_weights`` takes (a dict, or the non-blocking future of
        the actor group's ``get_full_state_dict``).
        """
        if version <= self.version:
            raise ValueError(f"policy versions must increase: {version} after {self.version}")
        with self._weights_lock:
            self.rollout.update_weights(state_dict)
            with self._cond:
                self.version = version
                self._cond.notify_all()
