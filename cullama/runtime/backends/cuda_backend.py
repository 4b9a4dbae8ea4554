"""Runs plans on the GPU with CuPy: kernels from the registry, the decode step as one CUDA graph.

The decode step is captured once, on its first replay, and replayed at every position after that:
its kernels read the position from device memory, so nothing is recompiled, re-captured or copied
per token except the 4-byte sampled token id read back into pinned memory.

With `overlap` on (CULLAMA_OVERLAP=1, or set_overlap), the kernels of every plan (the captured decode
step, and the prefill chunks launched eagerly) are linked by programmatic dependent launch
(backends/pdl.py): each kernel of plan.OVERLAP_SAFE but a plan's first may start while the one before
it finishes, streaming its weights until its pdl_wait(). Off by default until measured.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from ..ops.rows import STATE_LEN, STATE_TOKEN
from ..plan import OVERLAP_SAFE, VERIFY_ROWS, Buffer, Plan, Ref
from ..registry import KernelLoader
from ..sampling import drawn



class CudaBackend:
    device = "cuda"
    asynchronous = True  # launches return before the GPU has run them

    def __init__(self, overlap: bool | None = None):
        from ..device import import_cupy

        cupy = import_cupy()  # its kernel cache under cullama's
        import cupyx

        self.cp = cupy
        self.loader = KernelLoader()
        self.stream = cupy.cuda.Stream(non_blocking=True)  # graphs cannot be captured on the legacy stream
        self.arrays: dict = {}
        self.graphs: dict[str, object] = {}  # plan name -> its captured graph
        self._graph_plans: dict[str, Plan] = {}  # plan name -> the plan its graph was captured from
        self._prepared: dict[int, tuple[Plan, list[tuple]]] = {}  # id(plan) -> (plan, its launches)
        self._smem_allowed: dict[int, int] = {}  # id(kernel) -> the dynamic shared memory it may use
        self._calls: dict[int, tuple[Plan, list]] = {}  # id(plan) -> (plan, its launches as callables)
        # [3] int32, pinned: the sampled ids land here. Slots 0 and 1 for launch_step (a step queued ahead
        # must not overwrite the id of the step before it), 2 for read_token.
        self._tokens = cupyx.empty_pinned((3,), dtype=np.int32)
        self._token_ready = [cupy.cuda.Event(disable_timing=True) for _ in range(2)]
        # pinned: a verify step's token rows on their way in, its verdict (n, then n ids) on its way out
        self._verify_ids = cupyx.empty_pinned((VERIFY_ROWS,), dtype=np.int32)
        self._verify_out = cupyx.empty_pinned((VERIFY_ROWS + 1,), dtype=np.int32)
        self._fetch_host: dict = {}  # slot (0, 1, "verify") -> pinned memory the step's `fetch` buffer lands in
        self._mask_host = None  # pinned [slots, VERIFY_ROWS, words]: the mask rows on their way in (made on first use)
        self._mask_sent: dict[int, object] = {}  # slot -> the event after its last mask copy
        self.overlap = False
        self._pdl = None  # the PdlLauncher, made on first use
        self.set_overlap(os.environ.get("CULLAMA_OVERLAP", "0") == "1" if overlap is None else overlap)

    def allocate(self, buffers: list[Buffer]) -> None:
        """Zeroed device arrays for `buffers`. A name already allocated gets new memory: every captured graph and
        every launch resolved before holds the old address, so they are all dropped (rebuilt on next use)."""
        if any(b.name in self.arrays for b in buffers):
            self.graphs.clear()
            self._graph_plans.clear()
            self._prepared.clear()
            self._calls.clear()
        with self.stream:  # the zero-fill is ordered before this stream's copies and kernels
            for b in buffers:  # zeroed: padding in the weights and the KV cache must read as 0
                self.arrays[b.name] = self.cp.zeros(b.shape, dtype=b.dtype)

    def set(self, name: str, array, row: int = 0) -> None:
        array = np.ascontiguousarray(array, dtype=self.arrays[name].dtype)
        self.arrays[name][row:row + len(array)].set(array, stream=self.stream)

    def read(self, name: str) -> np.ndarray:
        out = self.arrays[name].get(stream=self.stream)
        self.stream.synchronize()
        return out

    def _arg(self, arg):
        if isinstance(arg, Ref):
            return arg.of(self.arrays[arg.name])
        return arg

    @property
    def arch(self) -> str:
        return self.loader.arch

    def _kernel(self, spec, smem: int):
        """A loaded kernel, allowed `smem` bytes of dynamic shared memory (beyond 48 KB the driver must be
        asked first, once per kernel)."""
        fn = self.loader.function(spec)
        if smem > self._smem_allowed.get(id(fn), 48 * 1024):
            from .func_attr import allow_dynamic_shared
            allow_dynamic_shared(fn, smem)
            self._smem_allowed[id(fn)] = smem
        return fn

    def prepared(self, plan: Plan) -> list[tuple]:
        """(kernel, grid, block, args, smem) per launch, resolved once per plan: a prefill chunk of
        LLaMA-2-7B is ~300 launches, and resolving their buffer views again at every prompt costs
        milliseconds of host time on the time to first token."""
        entry = self._prepared.get(id(plan))
        if entry is None or entry[0] is not plan:  # the plan is kept in the entry, so its id stays unique
            if len(self._prepared) >= 128:
                self._prepared.clear()
            launches = [(self._kernel(l.spec, l.smem), l.grid, (l.block, 1, 1),
                         tuple(self._arg(a) for a in l.args), l.smem) for l in plan.launches]
            entry = self._prepared[id(plan)] = (plan, launches)
        return entry[1]

    def calls(self, plan: Plan) -> list:
        """The plan's launches as callables on this backend's stream, built once per plan and overlap mode:
        with overlap, every OVERLAP_SAFE kernel but the first is a programmatic dependent launch (the
        first waits for whatever came before the plan: host copies, the previous plan)."""
        entry = self._calls.get(id(plan))
        if entry is None or entry[0] is not plan:
            if len(self._calls) >= 128:
                self._calls.clear()
            calls = []
            for i, ((fn, grid, block, args, smem), launch) in enumerate(zip(self.prepared(plan), plan.launches)):
                if self.overlap and i > 0 and launch.spec.name in OVERLAP_SAFE:
                    calls.append(self._pdl.prepare(fn, grid, block, args, self.stream.ptr, smem))
                else:
                    calls.append(functools.partial(fn, grid, block, args, shared_mem=smem))
            entry = self._calls[id(plan)] = (plan, calls)
        return entry[1]

    def run(self, plan: Plan) -> None:
        with self.stream:
            for call in self.calls(plan):
                call()

    def set_overlap(self, on: bool) -> None:
        """Link the captured decode step's kernels by programmatic dependent launch (sm_90 and newer;
        elsewhere this stays off). Graphs already captured are dropped and re-captured on next replay."""
        from . import pdl

        on = bool(on) and pdl.supported(self.loader.arch)
        if on and self._pdl is None:
            self._pdl = pdl.PdlLauncher()
        if on != self.overlap:
            self.overlap = on
            self.graphs.clear()
            self._graph_plans.clear()
            self._calls.clear()

    def replay(self, plan: Plan) -> None:
        """Run the plan as one CUDA graph, captured on its first replay (and again for another plan of the
        same name). A launch that fails during the capture raises its own error, not the capture's."""
        graph = self.graphs.get(plan.name)
        if graph is None or self._graph_plans.get(plan.name) is not plan:
            calls = self.calls(plan)  # compile and load every kernel before capturing
            self.stream.synchronize()
            with self.stream:  # a RawKernel launches on the current stream
                self.stream.begin_capture()
                try:
                    for call in calls:  # the first node waits for everything before the graph
                        call()
                except BaseException:
                    self._abandon_capture()
                    raise
                graph = self.stream.end_capture()
            self.graphs[plan.name], self._graph_plans[plan.name] = graph, plan
        graph.launch(stream=self.stream)

    def _abandon_capture(self) -> None:
        """End a capture that a failed launch broke. CUDA then reports the capture invalidated: that says
        nothing the launch's own error does not, so it is dropped and the stream is left out of capture mode."""
        try:
            self.stream.end_capture()
        except Exception:
            pass

    def _copy_token(self, slot: int, seq: int = 0) -> None:
        """Queue the copy of state[seq][TOKEN] (the sequence in slot `seq`) into pinned slot `slot` on the stream."""
        state = self.arrays["state"]
        at = 4 * (seq * STATE_LEN + STATE_TOKEN)
        self.cp.cuda.runtime.memcpyAsync(self._tokens.ctypes.data + 4 * slot, state.data.ptr + at, 4,
                                         self.cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)

    def read_token(self, seq: int = 0) -> int:
        self._copy_token(2, seq)
        self.stream.synchronize()
        return drawn(int(self._tokens[2]))

    def launch_step(self, plan: Plan, slot: int, fetch: str | None = None, seq: int = 0) -> None:
        """Replay the step and queue the copy of its sampled id into slot `slot` (0 or 1); returns at once.
        `fetch`: also queue the copy of that (small) buffer, read by fetched(slot) once token(slot) returned:
        a step queued behind this one overwrites the buffer, not this step's copy."""
        self.replay(plan)
        self._copy_token(slot, seq)
        if fetch is not None:
            self._queue_fetch(slot, fetch)
        self._token_ready[slot].record(self.stream)

    def token(self, slot: int) -> int:
        """The id that launch_step(..., slot) sampled, once its copy has landed (waits for that only)."""
        self._token_ready[slot].synchronize()
        return drawn(int(self._tokens[slot]))

    def _queue_fetch(self, slot, name: str) -> None:
        """Queue the copy of buffer `name` into the slot's pinned memory (made on first use, or for a new shape)."""
        source = self.arrays[name]
        host = self._fetch_host.get(slot)
        if host is None or host.shape != source.shape or host.dtype != source.dtype:
            import cupyx

            host = self._fetch_host[slot] = cupyx.empty_pinned(source.shape, dtype=source.dtype)
        runtime = self.cp.cuda.runtime
        runtime.memcpyAsync(host.ctypes.data, source.data.ptr, source.nbytes, runtime.memcpyDeviceToHost,
                            self.stream.ptr)

    def fetched(self, slot) -> np.ndarray:
        """A copy of the buffer the last launch_step(..., slot, fetch) or verify(..., fetch) (slot "verify")
        fetched; call after token(slot) (verify waits by itself)."""
        return self._fetch_host[slot].copy()

    def mask_rows(self, slot: int, rows: int) -> np.ndarray:
        """Pinned host rows [rows, words] for slot `slot`'s mask rows 0..rows-1, to fill and then upload_masks(slot,
        rows): the grammar writes into them directly. Waits for the slot's last copy out of them (long done: a step
        reads its token after its copy)."""
        if self._mask_host is None:
            import cupyx

            device = self.arrays["masks"]
            self._mask_host = cupyx.empty_pinned(device.shape, dtype=device.dtype)
        sent = self._mask_sent.get(slot)
        if sent is not None:
            sent.synchronize()
        return self._mask_host[slot, :rows]

    def upload_masks(self, slot: int, rows: int) -> None:
        """Queue the copy of slot `slot`'s filled mask rows 0..rows-1 onto the device (before the sample kernel that
        reads them: the stream keeps the order)."""
        runtime, device = self.cp.cuda.runtime, self.arrays["masks"]
        nbytes = rows * device.shape[2] * 4
        runtime.memcpyAsync(device[slot].data.ptr, self._mask_host[slot].ctypes.data, nbytes,
                            runtime.memcpyHostToDevice, self.stream.ptr)
        event = self._mask_sent.get(slot)
        if event is None:
            event = self._mask_sent[slot] = self.cp.cuda.Event(disable_timing=True)
        event.record(self.stream)

    def verify(self, plan: Plan, ids, fetch: str | None = None, sample: Plan | None = None,
               between=None) -> list[int]:
        """A verify step (its graph, captured by plan name on first use) over the token rows `ids` (the last
        sampled token, then the drafts): the ids go in and the verdict comes back through pinned memory, a few
        bytes each way, around one graph replay; returns the accepted tokens. `fetch`: a buffer copied out
        with the verdict, for fetched("verify"). `sample`: the step is the graph of `plan` (its launches before
        the sample kernel), between() on the host while it runs (a constrained step's masks: upload_masks), then
        the graph of `sample` (plan.split_at_sample)."""
        runtime = self.cp.cuda.runtime
        rows = len(ids)
        self._verify_ids[:rows] = ids
        runtime.memcpyAsync(self.arrays["verify_ids"].data.ptr, self._verify_ids.ctypes.data, 4 * rows,
                            runtime.memcpyHostToDevice, self.stream.ptr)
        self.replay(plan)
        if sample is not None:
            between()
            self.replay(sample)
        runtime.memcpyAsync(self._verify_out.ctypes.data, self.arrays["verify_out"].data.ptr, 4 * (rows + 1),
                            runtime.memcpyDeviceToHost, self.stream.ptr)
        if fetch is not None:
            self._queue_fetch("verify", fetch)
        self.stream.synchronize()
        *drafts, last = (int(t) for t in self._verify_out[1:1 + int(self._verify_out[0])])
        return [*drafts, drawn(last)]

    def synchronize(self) -> None:
        self.stream.synchronize()
