"""Runs plans on the CPU: each launch calls its kernel's NumPy twin on NumPy buffers."""

from __future__ import annotations

import inspect

import numpy as np

from .. import ops
from ..ops.rows import STATE_LEN, STATE_TOKEN
from ..plan import Buffer, Launch, Plan, Ref
from ..sampling import drawn



class NumpyBackend:
    device = "cpu"
    asynchronous = False  # every call returns with its work done: nothing to gain from queuing ahead
    arch = None  # the twins run any kernel choice

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}
        self._twins: dict = {}
        self._tokens: dict = {}  # slot -> the token launch_step(..., slot) sampled
        self._fetched: dict = {}  # slot -> the copy of the buffer a step fetched (see CudaBackend.fetched)

    def allocate(self, buffers: list[Buffer]) -> None:
        for b in buffers:
            self.arrays[b.name] = np.zeros(b.shape, dtype=b.dtype)

    def bind(self, name: str, array: np.ndarray) -> None:
        """Use a host array as a buffer without copying (weights from the checkpoint's mmap)."""
        self.arrays[name] = array

    def set(self, name: str, array, row: int = 0) -> None:
        array = np.asarray(array)
        self.arrays[name][row:row + len(array)] = array

    def read(self, name: str) -> np.ndarray:
        return self.arrays[name].copy()

    def _twin(self, launch: Launch):
        key = (launch.spec.source, launch.spec.name)
        if key not in self._twins:
            fn = ops.twin(*key)
            self._twins[key] = (fn, "grid" in inspect.signature(fn).parameters)
        return self._twins[key]

    def _arg(self, arg):
        if isinstance(arg, Ref):
            return arg.of(self.arrays[arg.name])
        return arg.item()  # np.int32 / np.float32 -> Python number

    def run(self, plan: Plan) -> None:
        # The twins compute what the GPU computes, where an overflow is an inf and inf - inf a NaN without a word:
        # NumPy's warnings about them would reach the user as noise. The sampler says it once, where it matters
        # ("no token can be drawn").
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            for launch in plan.launches:
                fn, wants_grid = self._twin(launch)
                args = [self._arg(a) for a in launch.args]
                fn(*args, grid=launch.grid) if wants_grid else fn(*args)

    replay = run  # no graphs on the CPU: a decode step is just run

    def synchronize(self) -> None:
        """Every call returns with its work done."""

    def read_token(self, seq: int = 0) -> int:
        """The token sampled last for the sequence in slot `seq` (its state[TOKEN])."""
        return drawn(self._state_token(seq))

    def _state_token(self, seq: int) -> int:
        return int(self.arrays["state"].reshape(-1, STATE_LEN)[seq, STATE_TOKEN])

    def launch_step(self, plan: Plan, slot: int, fetch: str | None = None, seq: int = 0) -> None:
        self.run(plan)
        self._tokens[slot] = self._state_token(seq)
        if fetch is not None:
            self._fetched[slot] = self.read(fetch)

    def token(self, slot: int) -> int:
        """The token launch_step(..., slot) sampled (its sequence's), or slot 0's state where none was launched."""
        return drawn(self._tokens.pop(slot)) if slot in self._tokens else self.read_token()

    def fetched(self, slot) -> np.ndarray:
        return self._fetched[slot]

    def mask_rows(self, slot: int, rows: int) -> np.ndarray:
        """The mask rows [rows, words] of `slot` for the host to fill (here the buffer itself: see CudaBackend)."""
        return self.arrays["masks"][slot, :rows]

    def upload_masks(self, slot: int, rows: int) -> None:
        """The rows mask_rows(slot, rows) gave are filled (nothing to copy on the CPU)."""

    def verify(self, plan: Plan, ids, fetch: str | None = None, sample: Plan | None = None,
               between=None) -> list[int]:
        """Run a verify step over the token rows `ids` (the last sampled token, then the drafts); the tokens
        it accepted. `fetch`: a buffer to copy out after it, for fetched("verify"). `sample`: the step is `plan`
        (its launches before the sample kernel), then between(), then `sample` (plan.split_at_sample)."""
        self.set("verify_ids", np.asarray(ids, dtype=np.int32))
        self.run(plan)
        if sample is not None:
            between()
            self.run(sample)
        if fetch is not None:
            self._fetched["verify"] = self.read(fetch)
        out = self.arrays["verify_out"]
        *drafts, last = (int(t) for t in out[1:1 + int(out[0])])
        return [*drafts, drawn(last)]
